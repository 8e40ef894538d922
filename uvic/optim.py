"""Optimizer and learning-rate schedule of a training run, and what a resume changes.

AdamW on every parameter (the release's), with a warm-up then a constant LR (the
release's, `optim.lr_schedule="constant"`) or a cosine decay to 0 at `train.max_steps`
(diffusers' schedule, `"cosine"`).
"""

from __future__ import annotations

import torch
from diffusers.optimization import get_cosine_schedule_with_warmup

from uvic.config import OptimConfig


def make_optimizer(model: torch.nn.Module, optim: OptimConfig,
                   max_steps: int) -> tuple[torch.optim.Optimizer,
                                            torch.optim.lr_scheduler.LambdaLR]:
    """AdamW on all parameters and its LR schedule (uvic.config.validate checks the name)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=tuple(optim.betas),
                                  weight_decay=optim.weight_decay)
    if optim.lr_schedule == "cosine":  # decays to 0 at train.max_steps
        schedule = get_cosine_schedule_with_warmup(optimizer, optim.warmup_steps, max_steps)
    else:  # "constant" after warm-up, as the release
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                     warmup_constant(optim.warmup_steps))
    return optimizer, schedule


def warmup_constant(warmup_steps: int):
    """LR factor of the release: min(step / warmup_steps, 1) (step counts from 0)."""

    def factor(step: int) -> float:
        return min(step / warmup_steps, 1.0) if warmup_steps > 0 else 1.0

    return factor


def apply_optim_config(optimizer: torch.optim.Optimizer,
                       lr_scheduler: torch.optim.lr_scheduler.LambdaLR,
                       optim: OptimConfig) -> None:
    """Set optim.lr, betas, weight_decay and warmup_steps on an optimizer and LR schedule
    restored from a checkpoint (which hold the values the run started with), so that a
    resume runs what config.json records. Unchanged values give the same numbers.

    The schedule's multiplier (warm-up, then constant or cosine) is the one the trainer
    built from the current config: a checkpoint stores no schedule function."""
    factor = lr_scheduler.lr_lambdas[0]
    lr_scheduler.base_lrs = [optim.lr] * len(optimizer.param_groups)
    for group in optimizer.param_groups:
        group.update(initial_lr=optim.lr, lr=optim.lr * factor(lr_scheduler.last_epoch),
                     betas=tuple(optim.betas), weight_decay=optim.weight_decay)
    lr_scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
