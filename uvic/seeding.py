"""Seeds and data order: everything random in training and sampling is a pure function of
the run's seed and a position, so runs resume exactly and samples do not depend on batching.

Training (see `uvic.train`):
* the order of the data is a permutation drawn from (seed, epoch) (`EpochSampler`), and a
  resumed run skips the batches of the current epoch that were already used;
* the global random generators are seeded from (seed, epoch, index) around each item
  (`SeededItems`), so item randomness (flips, caption choice) is the same whatever the
  worker or process;
* the noise, noise level and caption dropping of optimizer step s, micro-batch m, on
  process r come from a generator seeded with `noise_seed(seed, r, s, m)`.

Sampling: sample i of a run seeded with `seed` draws from `SampleGenerator(seed, i)`, so it
is the same image whatever the batch size, the number of processes or the device.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

# Tags that keep the seed streams of different purposes apart.
_DATA_STREAM, _NOISE_STREAM = 1, 2


def derive_seed(*keys: int) -> int:
    """A 63-bit seed that is a pure function of the integers `keys` (numpy SeedSequence)."""
    state = np.random.SeedSequence([int(k) for k in keys]).generate_state(1, dtype=np.uint64)
    return int(state[0]) >> 1


def noise_seed(seed: int, rank: int, step: int, micro: int) -> int:
    """Seed of the training noise of optimizer step `step`, micro-batch `micro`, process `rank`."""
    return derive_seed(seed, _NOISE_STREAM, rank, step, micro)


@contextlib.contextmanager
def seeded_global_rngs(seed: int) -> Iterator[None]:
    """Seed Python's, NumPy's and torch's global CPU generators, restore them on exit.

    (`torch.default_generator` rather than `torch.manual_seed`, which also seeds every
    CUDA device and costs ~100x more per item.)
    """
    py_state, np_state = random.getstate(), np.random.get_state()
    torch_state = torch.get_rng_state()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)


# --------------------------------------------------------------------------- data order


class EpochSampler(Sampler[tuple[int, int]]):
    """Shuffles all indices once per epoch with a permutation drawn from (seed, epoch).

    Yields `(epoch, index)` so that `SeededItems` can seed each item's randomness; set the
    epoch with `set_epoch` (Accelerate's prepared loader forwards its own `set_epoch`).
    """

    def __init__(self, num_items: int, seed: int) -> None:
        self.num_items, self.seed, self.epoch = num_items, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_items

    def __iter__(self) -> Iterator[tuple[int, int]]:
        g = torch.Generator().manual_seed(derive_seed(self.seed, _DATA_STREAM, self.epoch))
        for index in torch.randperm(self.num_items, generator=g).tolist():
            yield self.epoch, index


class SeededItems(Dataset):
    """Wraps a dataset: item `(epoch, index)` is `dataset[index]` computed with the global
    random generators seeded from (seed, epoch, index), so augmentations are reproducible
    in any worker or process and after a resume."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> dict[str, Tensor]:
        epoch, index = key
        with seeded_global_rngs(derive_seed(self.seed, _DATA_STREAM, epoch, index)):
            item = self.dataset[index]
        if not isinstance(item, dict) or "x" not in item:
            raise TypeError(f"{type(self.dataset).__name__}[{index}] must be a dict with key "
                            f"'x', got {type(item).__name__}")
        return item


def seeded_loader(dataset: Dataset, seed: int, batch_size: int, num_workers: int = 0,
                  pin_memory: bool = False) -> DataLoader:
    """The training loader: items in the order of `EpochSampler`, each computed under
    `SeededItems`; the last incomplete batch of an epoch is dropped."""
    return DataLoader(SeededItems(dataset, seed), batch_size=batch_size,
                      sampler=EpochSampler(len(dataset), seed), drop_last=True,
                      num_workers=num_workers, persistent_workers=num_workers > 0,
                      pin_memory=pin_memory)


# --------------------------------------------------------------------------- samples


class SampleGenerator(torch.Generator):
    """The random source of sample `index` of a run seeded with `seed`.

    Why not `torch.Generator().manual_seed(f(seed, index))`: torch's CPU generator
    (mt19937) keeps only the low 32 bits of a seed, so packing (seed, index) into 64 bits
    makes every seed give the same images, and hashing into 32 bits makes some of 50,000
    samples share their noise. So the initial noise comes from NumPy's PCG64 seeded with
    SeedSequence([seed, index]) (128-bit state, see `make_noise`); this torch generator,
    seeded from the same sequence, only feeds the step noise of stochastic schedulers.
    """

    def __new__(cls, seed: int, index: int) -> SampleGenerator:
        return super().__new__(cls)  # torch.Generator's constructor only takes a device

    def __init__(self, seed: int, index: int) -> None:
        # one 32-bit word each, so SeedSequence([seed, index]) is unambiguous
        if not 0 <= seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {seed}")
        if not 0 <= index < 2**32:
            raise ValueError(f"sample index must be in [0, 2**32), got {index}")
        super().__init__()
        self.sample_seed, self.sample_index = int(seed), int(index)
        sequence = np.random.SeedSequence([self.sample_seed, self.sample_index])
        self.manual_seed(int(sequence.generate_state(1, np.uint64)[0]))

    def initial_noise(self, shape: Sequence[int]) -> torch.Tensor:
        """x_T of this sample, float32 standard normal of `shape`, on the CPU."""
        rng = np.random.Generator(
            np.random.PCG64(np.random.SeedSequence([self.sample_seed, self.sample_index]))
        )
        return torch.from_numpy(rng.standard_normal(tuple(shape), dtype=np.float32))


def sample_generators(seed: int, indices: Sequence[int]) -> list[torch.Generator]:
    """One `SampleGenerator` per sample index: sample i of a run is the same image
    whatever the batch size, the number of processes, the device or a resumed run."""
    return [SampleGenerator(seed, int(i)) for i in indices]


def make_noise(
    shape: Sequence[int], generators: Sequence[torch.Generator], device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Initial noise x_T of shape (len(generators), *shape): drawn on the CPU, then moved,
    so the same seed gives the same images on every device. Plain torch generators are
    accepted too (their first draw)."""
    noise = [
        g.initial_noise(shape) if isinstance(g, SampleGenerator)
        else torch.randn(tuple(shape), generator=g)
        for g in generators
    ]
    return torch.stack(noise).to(device)


# --------------------------------------------------------------------------- test hook

# If set, every training process appends the per-sample sums of its batches to
# $UVIC_TRAIN_DEBUG_DIR/data_rank{r}.jsonl (the tests check the data sharding with it).
DEBUG_ENV = "UVIC_TRAIN_DEBUG_DIR"


def record_batches(
    batches: Iterator[dict[str, Tensor]], rank: int, grad_accum: int, position: Callable[[], dict]
) -> Iterator[dict[str, Tensor]]:
    """`batches` unchanged; with $UVIC_TRAIN_DEBUG_DIR set, each batch's per-sample sums are
    appended there with `position()` (step, epoch) and the micro-batch index."""
    folder = os.environ.get(DEBUG_ENV)
    if not folder:
        yield from batches
        return
    path = Path(folder) / f"data_rank{rank}.jsonl"
    for count, batch in enumerate(batches):
        sums = batch["x"].double().flatten(1).sum(1).tolist()
        with open(path, "a") as f:
            f.write(json.dumps({**position(), "micro": count % grad_accum, "sums": sums}) + "\n")
        yield batch
