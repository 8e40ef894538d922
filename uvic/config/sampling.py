"""The rules on `sample.*` values, the precisions and compile modes sampling runs in,
what a model's conditioning allows (guidance, and the class labels it may be given), and
the autoguidance guide a training run's samples will need.

Read by `uvic.sampling.generate`, `uvic.sampling.labels`, `uvic.evaluation.protocols`, by
`uvic.config.validation` and by the CLI (`--precision` choices); no torch here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

from uvic.config import Config, ConfigError, SampleConfig, require
from uvic.config.diffusion import check_scheduler

PRECISIONS = ("fp32", "fp16", "bf16")  # `--precision`: autocast dtype on CUDA (fp32: none)
# Class-conditional data whose FID labels follow the training set's class frequencies (the
# U-ViT release's `ImageNet.sample_label`: torch.multinomial of the per-class image counts);
# on other data (the latent features: `ImageNet256Features.sample_label`) they are uniform.
FREQUENCY_LABEL_DATA = ("imagenet",)
# `sample.compile`: off, or a torch.compile mode for the network call (uvic.sampling.compiled)
COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune")


def compile_rule(mode: str) -> tuple[bool, str]:
    """The rule on `sample.compile` (checked by `check_sample` before a run and by
    `uvic.sampling.compiled.compile_network` where it is used): (holds, message)."""
    return (mode in COMPILE_MODES,
            f"sample.compile={mode!r} must be one of {', '.join(COMPILE_MODES)}")


def check_sample(sample: SampleConfig) -> None:
    """The rules on `sample.*` values (the sampler is first used hours into a run: check
    its settings before the first training step)."""
    require([
        (sample.steps >= 1, f"sample.steps={sample.steps} must be >= 1"),
        (sample.batch_size >= 1, f"sample.batch_size={sample.batch_size} must be >= 1"),
        (sample.decode_batch_size >= 1,
         f"sample.decode_batch_size={sample.decode_batch_size} must be >= 1"),
        (math.isfinite(sample.cfg_scale), f"sample.cfg_scale={sample.cfg_scale} must be finite"),
        (math.isfinite(sample.autoguidance_scale),
         f"sample.autoguidance_scale={sample.autoguidance_scale} must be finite"),
        (sample.autoguidance_scale == 0 or sample.autoguidance_ckpt,
         f"sample.autoguidance_scale={sample.autoguidance_scale} needs "
         "sample.autoguidance_ckpt (the weaker model's weights)"),
        compile_rule(sample.compile),
        (sample.precision in PRECISIONS,
         f"sample.precision={sample.precision!r}: expected one of {', '.join(PRECISIONS)}"),
    ])
    require(interval_rules(sample.guidance_interval, "sample.guidance_interval"))
    check_scheduler(sample.scheduler, sample.order)


def interval_rules(interval: Sequence[float], key: str) -> list[tuple[bool, str]]:
    """The rules on a guidance interval (low, high] of noise levels sigma, as (holds,
    message) pairs naming `key`: empty (guidance everywhere), or two numbers with
    0 <= low < high (high may be inf). Read by `check_sample` and the pipeline."""
    values = tuple(interval)
    shown = f"{key}={list(values)}"
    if not values:
        return []
    if len(values) != 2:
        return [(False, f"{shown} must be two noise levels, low,high (or empty: guidance at "
                        "every step)")]
    low, high = values
    return [
        (not (math.isnan(low) or math.isnan(high)), f"{shown}: NaN is no noise level"),
        (low >= 0 and math.isfinite(low), f"{shown}: low={low} must be finite and >= 0"),
        (low < high, f"{shown}: low={low} must be below high={high}"),
    ]


def guidance_interval(cfg: Config) -> tuple[float, ...]:
    """The guidance interval a run samples under: `sample.guidance_interval` when some
    guidance is on (`effective_cfg_scale` or autoguidance), else () (nothing to limit)."""
    guided = effective_cfg_scale(cfg) != 0 or cfg.sample.autoguidance_scale != 0
    return tuple(cfg.sample.guidance_interval) if guided else ()


def passes_per_eval(cfg_guided: bool, autoguided: bool) -> int:
    """Network passes (rows through a network) one guided evaluation of an image costs: 1,
    x 2 with classifier-free guidance (conditional and unconditional rows), x 2 with
    autoguidance (its guide is a second network). The one rule of the cost estimates."""
    return (2 if cfg_guided else 1) * (2 if autoguided else 1)


def guide_path(step: int) -> str:
    """`sample.autoguidance_ckpt` of the run's own EMA at `step` (relative to the run
    folder: `uvic.run.folder.RunFolder`'s checkpoint layout)."""
    return f"checkpoints/step_{step:06d}/ema.safetensors"


def own_guide_step(cfg: Config) -> int | None:
    """The step whose checkpoint of this run autoguidance guides with (a step in
    train.keep_steps named by `guide_path`), or None: autoguidance off, or a guide file
    from elsewhere."""
    s = cfg.sample
    if s.autoguidance_scale == 0:
        return None
    return next((n for n in cfg.train.keep_steps if s.autoguidance_ckpt == guide_path(n)), None)


def short_run_guide(cfg: Config) -> tuple[Config, str | None]:
    """`cfg` without autoguidance when the run ends at or before its guide's step (a short
    try of a longer config: the guide is never written, or is the final model), and the
    one-line note that says so and how to keep it; (`cfg`, None) otherwise. Applied by the
    trainer, `uvic-quickstart` and `uvic-compare` before they check the guide."""
    step, t = own_guide_step(cfg), cfg.train
    if step is None or step < t.max_steps:
        return cfg, None
    dropped = dataclasses.replace(cfg, sample=dataclasses.replace(cfg.sample,
                                                                  autoguidance_scale=0.0))
    interval = ""
    if cfg.sample.guidance_interval and guidance_interval(dropped) == ():  # nothing to limit
        dropped = dataclasses.replace(dropped, sample=dataclasses.replace(
            dropped.sample, guidance_interval=()))
        interval = ", no guidance interval"
    when = "at" if step == t.max_steps else "before"
    earlier = max(1, t.max_steps // 3)
    keep = (f"guide with an earlier step, e.g. --set 'train.keep_steps=[{earlier}]' --set "
            f"sample.autoguidance_ckpt={guide_path(earlier)}" if t.max_steps >= 2
            else "train at least 2 steps and guide with an earlier one")
    return dropped, (f"train.max_steps={t.max_steps} ends {when} step {step}, whose EMA is "
                     f"the autoguidance guide (sample.autoguidance_ckpt): sampling unguided "
                     f"(sample.autoguidance_scale=0{interval}); to keep autoguidance, {keep}")


def check_guide(cfg: Config) -> None:
    """The autoguidance model a run's samples will need must come to exist, and be an
    earlier model than the sampled one (guided by itself, a model's eps does not change:
    twice the sampling time for nothing). Checked before training, not hours later when
    the run is sampled: a checkpoint of the run (`checkpoints/step_N/ema.safetensors`,
    relative to the run folder) must be one it keeps (N in train.keep_steps), below
    train.max_steps; any other file must exist now. (A run that ends at or before its own
    guide drops it first, with a note: `short_run_guide`.)"""
    s, t = cfg.sample, cfg.train
    if s.autoguidance_scale == 0:
        return
    step = own_guide_step(cfg)
    fix = ("point it at checkpoints/step_N/ema.safetensors for a step N in train.keep_steps "
           "below train.max_steps, or set sample.autoguidance_scale=0")
    if step is None:
        if (Path(t.output_dir) / s.autoguidance_ckpt).is_file():  # absolute, or in the run
            return
        raise ConfigError(
            f"sample.autoguidance_ckpt={s.autoguidance_ckpt!r} is neither a checkpoint this "
            f"run keeps (train.keep_steps={list(t.keep_steps)}, train.max_steps="
            f"{t.max_steps}) nor an existing file; " + fix)
    if step >= t.max_steps:
        final = "is the final model" if step == t.max_steps else "would never be written"
        raise ConfigError(
            f"sample.autoguidance_ckpt={s.autoguidance_ckpt!r} (step {step}) {final} with "
            f"train.max_steps={t.max_steps}: a model guided by itself samples as unguided, "
            "at twice the cost; " + fix)


def interval_text(interval: Sequence[float]) -> str:
    """A guidance interval in words: `on sigma in (0.3, 2.33]` ("" for none)."""
    if not interval:
        return ""
    low, high = interval
    return f"on sigma in ({low:g}, {high:g}]"


def check_guidance_interval(cfg: Config) -> None:
    """Refuse (ConfigError, one line) a `sample.guidance_interval` under which nothing is
    guided: it would change nothing, and a result would not be what was asked for."""
    s = cfg.sample
    require([(not s.guidance_interval or guidance_interval(cfg) != (),
              f"sample.guidance_interval={list(s.guidance_interval)} but nothing is guided: "
              f"sample.cfg_scale={s.cfg_scale:g} on a model that is {conditioning(cfg)}, "
              f"sample.autoguidance_scale={s.autoguidance_scale:g} (drop the interval)")])


def real_classes(cfg: Config) -> int:
    """How many classes a label may name: model.num_classes, less the classifier-free null
    class (the last id) when the model was trained with one (diffusion.p_uncond > 0); 0
    for a model without class labels."""
    m = cfg.model
    if m.num_classes <= 0:
        return 0
    return m.num_classes - 1 if cfg.diffusion.p_uncond > 0 else m.num_classes


def can_guide(cfg: Config) -> bool:
    """Whether classifier-free guidance applies: a text-conditional model, or a
    class-conditional one trained with a null class to guide against."""
    m = cfg.model
    return m.clip_dim > 0 or (m.num_classes > 0 and cfg.diffusion.p_uncond > 0)


def effective_cfg_scale(cfg: Config) -> float:
    """The guidance s of `eps = c + s (c - u)` for this config: `sample.cfg_scale` for
    text-conditional models and for class-conditional ones trained with a null class
    (`can_guide`), 0 for the others. (diffusers' `guidance_scale` is s + 1.) The one rule
    of sampling and of the protocol a result records."""
    return cfg.sample.cfg_scale if can_guide(cfg) else 0.0


def conditioning(cfg: Config) -> str:
    """The model's conditioning in words, naming the fields that say so."""
    m = cfg.model
    if m.clip_dim > 0:
        return f"text-conditional (model.clip_dim={m.clip_dim})"
    if m.num_classes > 0:
        null = ("with" if cfg.diffusion.p_uncond > 0 else "without") + " a null class"
        return (f"class-conditional (model.num_classes={m.num_classes}, {null}: "
                f"diffusion.p_uncond={cfg.diffusion.p_uncond:g})")
    return f"unconditional (model.num_classes={m.num_classes}, model.clip_dim={m.clip_dim})"


def check_guidance(cfg: Config, given: str | None) -> None:
    """Refuse (ValueError, one line) a guidance scale set explicitly (`given`: how, e.g.
    `--cfg-scale 0.4`) for a model that cannot be guided (`can_guide`): it would be
    ignored, and the samples would not be what was asked for."""
    if given and not can_guide(cfg):
        raise ValueError(f"{given}: guidance needs a text-conditional model or a "
                         f"class-conditional one trained with a null class; {cfg.name} is "
                         f"{conditioning(cfg)} (drop the option, or set it to 0)")


def fid_label_draw(cfg: Config) -> str:
    """How FID draws the class of each sample, as the release does ("" for a model without
    class labels): in the training set's class frequencies (`FREQUENCY_LABEL_DATA`) or
    uniformly (`uvic.sampling.labels.FIDLabels` draws them)."""
    k = real_classes(cfg)
    return label_draw(k, cfg.data.name in FREQUENCY_LABEL_DATA) if k else ""


def label_draw(classes: int, by_frequency: bool) -> str:
    """The words a protocol records for a draw of labels over `classes` classes."""
    if by_frequency:
        return f"{classes} classes in training-set frequencies"
    return f"uniform over {classes} classes"
