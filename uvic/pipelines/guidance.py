"""The guidance of `UViTPipeline.__call__`: its scale from either convention, the null class
of class-conditional guidance, the guidance interval and autoguidance by the pipeline's
guide, each defaulting to the pipeline's config (what `uvic-export` recorded of the run's
`sample` section)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from uvic.config import null_to_inf
from uvic.config.sampling import interval_rules


def resolve(config: Any, clip_dim: int, cond: dict[str, Any], guidance_scale: float | None,
            cfg_scale: float | None, interval: Sequence[float] | None) -> dict[str, Any]:
    """`sample_images`' guidance arguments for a call given these arguments, defaulting to
    the pipeline's `config`; `cond` (the call's conditioning) gets the null class when
    class labels are guided."""
    s = guidance_scale_of(config.cfg_scale, clip_dim, guidance_scale, cfg_scale,
                          conditional=bool(cond))
    if s != 0.0 and "y" in cond:
        cond["uncond_y"] = null_class(config.null_class, s)
    return {"cfg_scale": s,
            "guidance_interval": guidance_interval(interval, default=config.guidance_interval)}


def guidance_scale_of(default: float | None, clip_dim: int, guidance_scale: float | None,
                   cfg_scale: float | None, conditional: bool) -> float:
    """The release's s from either convention (diffusers' g = s + 1), else the pipeline's
    `default` (None: the release's, guided text-to-image, unguided otherwise)."""
    if guidance_scale is not None and cfg_scale is not None:
        raise ValueError("give guidance_scale (diffusers' g) or cfg_scale (the release's "
                         "s = g - 1), not both")
    if cfg_scale is not None:
        s = float(cfg_scale)
    elif guidance_scale is not None:
        s = float(guidance_scale) - 1.0
    else:
        s = default
        if s is None:
            s = 1.0 if clip_dim > 0 else 0.0
        s = float(s) if conditional else 0.0
    if s != 0.0 and not conditional:
        raise ValueError(f"guidance (cfg_scale={s}, guidance_scale={s + 1}) needs a "
                         "conditional model; this U-ViT is unconditional")
    return s


def null_class(null: int | None, s: float) -> int:
    """The class id guided away from (the release's ImageNet models: the last one)."""
    if null is None:
        raise ValueError(f"guidance (cfg_scale={s}) of a class-conditional model needs "
                         "its null class: set the pipeline's null_class "
                         "(uvic-export --null-class), or guidance_scale=1")
    return null


def guidance_interval(given: Sequence[float] | None, key: str = "guidance_interval",
                      default: Sequence[float] | None = None) -> tuple[float, ...]:
    """The noise levels (low, high] guided (`uvic.diffusion.guidance_interval`): `given`,
    else `default`; () (or None) guides every step; a high of None (JSON's null, as
    model_index.json writes inf) is inf. A bad one is refused in one line."""
    chosen = given if given is not None else default or ()
    interval = tuple(float(v) for v in null_to_inf(chosen))
    for ok, message in interval_rules(interval, key):
        if not ok:
            raise ValueError(message)
    return interval


# The model fields a guide must share with the sampled model: what both are given.
INPUTS = ("img_size", "in_chans", "num_classes", "clip_dim", "num_clip_token")


def check_guide(transformer: Any, guide: Any, scale: float | None) -> None:
    """A pipeline's autoguidance: a nonzero default scale needs a guide, and a guide takes
    the sampled model's inputs; else a one-line ValueError."""
    if scale and guide is None:
        raise ValueError(f"autoguidance_scale={scale} needs its guide (the weaker model)")
    if guide is not None:
        differ = [f"{k} {transformer.config[k]} vs {guide.config[k]}" for k in INPUTS
                  if transformer.config.get(k) != guide.config.get(k)]
        if differ:
            raise ValueError(f"the guide takes other inputs than the transformer ("
                             f"{', '.join(differ)})")


def autoguidance(config: Any, guide: Any, given: float | None) -> dict[str, Any]:
    """`sample_images`' autoguidance arguments: the scale `given`, else the pipeline's
    (`config.autoguidance_scale`; None: off), and the guide when it is on."""
    s = float(given if given is not None else getattr(config, "autoguidance_scale", None) or 0)
    if s != 0.0 and guide is None:
        raise ValueError(f"autoguidance_scale={s} needs a guide: this pipeline has none "
                         "(uvic-export saves the run's sample.autoguidance_ckpt)")
    return {"guide": guide if s != 0.0 else None, "autoguidance_scale": s}
