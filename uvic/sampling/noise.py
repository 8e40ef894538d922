"""Per-sample noise for sampling: sample i of a run seeded with `seed` draws its initial
noise (and, for stochastic samplers, every step's noise) from `SampleGenerator(seed, i)`,
so it is the same image whatever the batch size, the number of processes or the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


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
