"""Seeds: every random stream of a run is derived from the run's seed and a position
(`derive_seed`), so runs resume exactly and samples do not depend on batching. The
training noise, noise level and condition dropping of optimizer step s, micro-batch m,
on process r come from `noise_seed(seed, r, s, m)`; the data order and the per-sample
noise build on the same derivation (`uvic.data.order`, `uvic.sampling.noise`).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch

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
