"""Optimizer and learning-rate schedule of a training run, and what a resume changes.

AdamW on every parameter (the release's), with a warm-up then a constant LR (the
release's, `optim.lr_schedule="constant"`) or a cosine decay to 0 at `train.max_steps`
(diffusers' schedule, `"cosine"`). A resume builds the schedule from the current config;
`schedule_change` says in one line what that changes. A warm-up not shorter than the run
is one warning line when training starts (`uvic.config.training.warmup_warning`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from diffusers.optimization import get_cosine_schedule_with_warmup

from uvic.config import OptimConfig


def make_optimizer(model: torch.nn.Module, optim: OptimConfig,
                   max_steps: int) -> tuple[torch.optim.Optimizer,
                                            torch.optim.lr_scheduler.LambdaLR]:
    """AdamW on all parameters (the release ignores the model's `no_weight_decay()`) and its
    LR schedule (uvic.config.training checks the name)."""
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


def lr_multiplier(optim: OptimConfig, max_steps: int) -> Callable[[int], float]:
    """The LR factor of step s that `make_optimizer`'s schedule applies (built by it, on a
    throwaway parameter)."""
    _, schedule = make_optimizer(torch.nn.Linear(1, 1), optim, max_steps)
    return schedule.lr_lambdas[0]


def schedule_change(old: OptimConfig, old_max_steps: int, new: OptimConfig,
                    new_max_steps: int, step: int) -> str | None:
    """One line for a resume at `step` whose config changes the LR schedule from `step`
    on (LR, warm-up, schedule, or the cosine's horizon train.max_steps): what changed, the
    LR at `step` under the old schedule, and what the LR does from here on. None when
    the schedule is the same (a constant LR does not depend on train.max_steps)."""
    fields = {"optim.lr": (old.lr, new.lr), "optim.lr_schedule": (old.lr_schedule, new.lr_schedule),
              "optim.warmup_steps": (old.warmup_steps, new.warmup_steps)}
    if "cosine" in (old.lr_schedule, new.lr_schedule):
        fields["train.max_steps"] = (old_max_steps, new_max_steps)
    changed = [f"{key} {a} -> {b}" for key, (a, b) in fields.items() if a != b]
    if not changed:
        return None
    before = old.lr * lr_multiplier(old, old_max_steps)(step)
    return (f"the LR schedule changes at step {step} ({', '.join(changed)}): LR {before:.3g} "
            f"at step {step} under the old one; from here on "
            f"{describe_lr(new, new_max_steps, step)}")


def describe_lr(optim: OptimConfig, max_steps: int, step: int) -> str:
    """What the LR does from `step` to `max_steps`, in words (a warm-up that outlasts the
    run is said to end with it: nothing after it runs)."""
    cosine = optim.lr_schedule == "cosine"
    factor = lr_multiplier(optim, max_steps)
    then = f"cosine decay to 0 at step {max_steps}" if cosine else f"constant {optim.lr:.3g}"
    if step < optim.warmup_steps and optim.warmup_steps >= max_steps:
        then = (f"warm-up toward {optim.lr:.3g} (at step {optim.warmup_steps}) until the run "
                f"ends: {optim.lr * factor(max_steps):.3g} at step {max_steps}"
                + (", no cosine decay" if cosine else ""))
    elif step < optim.warmup_steps:
        then = f"warm-up to {optim.lr:.3g} at step {optim.warmup_steps}, then {then}"
    elif not cosine:
        return then
    return f"{optim.lr * factor(step):.3g} at step {step}, {then}"
