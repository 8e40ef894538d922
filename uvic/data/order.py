"""Data order for training: what a step sees is a function of the run's seed and its position,
so a resumed run continues exactly and every process sees its own share. The order is a
permutation drawn from (seed, epoch) (`EpochSampler`), and the global generators are seeded
from (seed, epoch, index) around each item (`SeededItems`), so flips and caption choice do
not depend on the worker or process.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from uvic.seeds import _DATA_STREAM, derive_seed, seeded_global_rngs


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
                      pin_memory=pin_memory, worker_init_fn=leave_signals_to_the_trainer)


def leave_signals_to_the_trainer(worker_id: int) -> None:
    """DataLoader workers ignore SIGINT and SIGTERM, which a terminal and a scheduler send
    to every process of a job: the training process stops them once it has saved its
    checkpoint (`uvic.training.stop`), where a worker killed by the signal would end the
    run with a DataLoader error first. (A worker still exits when its parent does.)"""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
