"""The periodic sample grids of a training run: fixed noise (and prompts, VAE) prepared once."""

from __future__ import annotations

import torch
from accelerate.utils import broadcast_object_list

from uvic.config import Config
from uvic.sampling.generate import SampleGrid
from uvic.training.launch import TrainError


def prepare_grid(cfg: Config, device: torch.device, is_main: bool) -> SampleGrid | None:
    """The grid's fixed inputs, built on the main process (None with train.sample_every 0).

    Loading errors are shared with every process so that all of them stop together.
    """
    if cfg.train.sample_every <= 0:
        return None
    grid, error = None, None
    if is_main:
        try:
            t = cfg.train
            grid = SampleGrid(cfg, device, t.seed, t.n_grid)
        except (OSError, ValueError, RuntimeError) as err:
            error = f"sample grid: {err} (or disable the grids with --set train.sample_every=0)"
    error = broadcast_object_list([error])[0]
    if error is not None:
        raise TrainError(error)
    return grid
