"""The rules on `train.*` and `optim.*` values: loop lengths, precision, threads, compile mode,
post-hoc EMA profiles, optimizer, LR schedule. Read by `uvic.config.validation` (the
trainer validates its config before any step); no torch here.
"""

from __future__ import annotations

import math

from uvic.config import OptimConfig, TrainConfig, require

MIXED_PRECISIONS = ("", "no", "fp16", "bf16")  # "": the launcher's
LR_SCHEDULES = ("constant", "cosine")  # after warm-up (uvic.training.optim)
# train.compile (uvic.training.compile): torch.compile's modes, and "off"
TRAIN_COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune",
                 "max-autotune-no-cudagraphs")
# The largest relative standard deviation of a power-function EMA profile with exponent
# gamma > 0: gamma = 0 is the plain average of the whole run, sigma_rel = sqrt(1/12).
# (uvic.training.posthoc_ema; EDM2, Karras et al. 2024)
SIGMA_REL_MAX = math.sqrt(1.0 / 12.0)


def compile_mode(value: bool | str, key: str = "train.compile") -> str:
    """The compile mode `value` names: one of TRAIN_COMPILE_MODES. A bool, as configs and runs
    from before the modes hold it, reads true = "default", false = "off"; anything else is
    a ConfigError naming `key` and the allowed values."""
    if isinstance(value, bool):
        return "default" if value else "off"
    require([(value in TRAIN_COMPILE_MODES, f"{key}={value!r} must be one of "
              f"{', '.join(TRAIN_COMPILE_MODES)} (or true = default, false = off)")])
    return value


THREADS_AUTO = "auto"  # train.threads chosen at start (uvic.cli.threads.choose_threads)


def threads_value(value: int | str, what: str | None = None) -> int | str:
    """`value` as train.threads holds it: "auto" or a whole number >= 1 (digits in text, as
    a flag gives them, read as that number); else a ConfigError starting with `what`
    (default: the key and value)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    ok = value == THREADS_AUTO or (type(value) is int and value >= 1)
    what = what or f"train.threads={value!r}"
    require([(ok, f"{what} must be {THREADS_AUTO!r} or a whole number >= 1")])
    return value


def check_train(t: TrainConfig) -> None:
    """The rules on `train.*` values."""
    require([
        (t.grad_accum >= 1, f"train.grad_accum={t.grad_accum} must be >= 1"),
        (t.batch_size >= 1, f"train.batch_size={t.batch_size} must be >= 1"),
        (t.max_steps >= 0, f"train.max_steps={t.max_steps} must be >= 0"),
        (0.0 <= t.ema_decay <= 1.0, f"train.ema_decay={t.ema_decay} must be in [0, 1]"),
        (t.keep_last >= 1, f"train.keep_last={t.keep_last} must be >= 1"),
        (all(k >= 1 for k in t.keep_steps),
         f"train.keep_steps={list(t.keep_steps)} must be steps >= 1"),
        (t.mixed_precision in MIXED_PRECISIONS,
         f"train.mixed_precision={t.mixed_precision!r} must be no, fp16, bf16 or empty "
         "(the launcher's)"),
        *[(getattr(t, k) >= 0, f"train.{k}={getattr(t, k)} must be >= 0 (0: never)")
          for k in ("log_every", "ckpt_every", "sample_every")],
        (t.n_grid >= 1 or t.sample_every == 0,
         f"train.n_grid={t.n_grid} must be >= 1 (or train.sample_every=0: no grids)"),
    ])
    compile_mode(t.compile)
    threads_value(t.threads)
    check_posthoc_ema(t)
    check_repa(t)


def check_repa(t: TrainConfig) -> None:
    """The rules on `train.repa_*` values (the block against the model's depth:
    `uvic.training.repa`)."""
    require([
        (t.repa_block >= 0, f"train.repa_block={t.repa_block} must be >= 0 (0: the first "
         "in-block)"),
        (t.repa_weight >= 0 and math.isfinite(t.repa_weight),
         f"train.repa_weight={t.repa_weight} must be >= 0"),
        (t.repa_projector_dim >= 1,
         f"train.repa_projector_dim={t.repa_projector_dim} must be >= 1"),
        (bool(t.repa_encoder) or not t.repa_encoder_weights,
         f"train.repa_encoder_weights={t.repa_encoder_weights!r} needs train.repa_encoder "
         "(the timm model name of those weights)"),
    ])


def check_sigma_rel(value: float, name: str) -> None:
    """A power-function EMA's sigma_rel must lie in (0, SIGMA_REL_MAX): a ConfigError
    whose message starts with `name` (the key and value, or the option) otherwise."""
    require([(0.0 < value < SIGMA_REL_MAX,
              f"{name}: sigma_rel {value} is not in (0, {SIGMA_REL_MAX:.4f}), the range of "
              "a power-function EMA's relative standard deviation (EDM2 uses 0.05 and 0.10)")])


def check_posthoc_ema(t: TrainConfig) -> None:
    """The rules on `train.posthoc_ema_*`: distinct sigma_rel values in range, a snapshot
    interval >= 1 and a bound >= 0 (0: keep every snapshot)."""
    stds = list(t.posthoc_ema_stds)
    for value in stds:
        check_sigma_rel(value, f"train.posthoc_ema_stds={stds}")
    tags = [snapshot_tag(s) for s in stds]
    require([
        (len(set(tags)) == len(tags), f"train.posthoc_ema_stds={stds} repeats a profile "
         "(values equal to 4 decimals name the same snapshot files)"),
        (t.posthoc_ema_every >= 1,
         f"train.posthoc_ema_every={t.posthoc_ema_every} must be >= 1 (steps between snapshots)"),
        (t.posthoc_ema_keep >= 0,
         f"train.posthoc_ema_keep={t.posthoc_ema_keep} must be >= 0 (0: keep every snapshot)"),
    ])


def snapshot_tag(sigma_rel: float) -> str:
    """How a snapshot file names its profile: `std0.050` (4 decimals where 3 do not do)."""
    text = f"{sigma_rel:.3f}"
    return f"std{text}" if float(text) == sigma_rel else f"std{sigma_rel:.4f}"


def check_optim(o: OptimConfig) -> None:
    """The rules on `optim.*` values."""
    require([
        (o.lr > 0 and math.isfinite(o.lr), f"optim.lr={o.lr} must be > 0"),
        (all(0.0 <= b < 1.0 for b in o.betas), f"optim.betas={o.betas} must be in [0, 1)"),
        (o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay} must be >= 0"),
        (o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps} must be >= 0"),
        (o.grad_clip >= 0, f"optim.grad_clip={o.grad_clip} must be >= 0"),
        (o.lr_schedule in LR_SCHEDULES,
         f"optim.lr_schedule={o.lr_schedule!r} must be one of {LR_SCHEDULES}"),
    ])


def warmup_warning(o: OptimConfig, max_steps: int) -> str | None:
    """One line when the LR warm-up is not shorter than the run (None otherwise): the LR
    warms up for the whole run, and a cosine decay never starts. A warning, not an error:
    a short check run of a longer config (train.max_steps=2) means it."""
    if o.warmup_steps <= 0 or max_steps <= 0 or o.warmup_steps < max_steps:
        return None
    last = o.lr * max_steps / o.warmup_steps  # the LR at step s: lr * s / warmup_steps
    decay = ", and the cosine decay never starts" if o.lr_schedule == "cosine" else ""
    return (f"optim.warmup_steps={o.warmup_steps} is not shorter than the run "
            f"(train.max_steps={max_steps}): the LR warms up for the whole run, reaching "
            f"{last:.3g} at its last step (optim.lr={o.lr:g} at step {o.warmup_steps}){decay}"
            " (fine for a short check run; for a real one set optim.warmup_steps below "
            "train.max_steps)")
