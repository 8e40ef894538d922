"""Held-out error of the training objective: the plain noise MSE of a model (the EMA
weights) on held-out images, or under flow matching (`diffusion.objective="velocity"`) the
plain velocity MSE on the interpolant, with times and noise drawn from a fixed seed, so two
models scored with the same seed see exactly the same draws (the quickstart's table and
`uvic-compare`'s paired seeds). The two errors have different scales (a velocity target
e - x0 against the noise e) and never compare with each other.
"""

from __future__ import annotations

import dataclasses

import torch

from uvic.config import Config, DiffusionConfig
from uvic.data.datasets import build_dataset
from uvic.diffusion.schedule import Diffusion, diffusion_loss


def real_images(cfg: Config, split: str, n: int) -> torch.Tensor:
    """The first `n` images of a split in model space, without random flips."""
    unflipped = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, random_flip=False))
    dataset = build_dataset(unflipped, split=split)
    return torch.stack([dataset[i]["x"] for i in range(min(n, len(dataset)))])


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, diffusion: DiffusionConfig, x: torch.Tensor,
                 seed: int = 0) -> float:
    """Noise-prediction MSE (objective "velocity": velocity MSE) of `model` (the EMA
    weights) on held-out images `x`, with fixed t and noise (from `seed`) so models are
    scored on the same draws. Always the plain MSE (no `min_snr_gamma` weighting), so runs
    with different weightings compare."""
    plain = Diffusion(dataclasses.replace(diffusion, min_snr_gamma=0.0))
    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)
    total = 0.0
    for chunk in x.to(device).split(64):
        loss = diffusion_loss(model, plain, {"x": chunk}, generator)
        total += loss.item() * chunk.shape[0]
    return total / x.shape[0]
