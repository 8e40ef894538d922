"""A uvic run, checkpoint or released U-ViT as a diffusers pipeline folder (`uvic-export`,
docs/diffusers.md): `export_source` finds a source's weights and config, `build_pipeline`
assembles its `UViTPipeline`, and `export` writes the folder.

The model is saved with `attention_backend="auto"` and no gradient checkpointing (how to
run it is the loader's choice). Samplers diffusers cannot load from a folder are saved as
`dpm_solver++` of the same order (velocity models: `FlowMatchEulerDiscreteScheduler`) and
stay one argument away: `pipe(..., sampler=...)`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from uvic.config import Config, load_config
from uvic.config.diffusion import FLOW_NAMED, RELEASE_FAST
from uvic.config.sampling import effective_cfg_scale, guidance_interval
from uvic.config.validation import validate
from uvic.diffusion.samplers import make_scheduler
from uvic.diffusion.schedule import Diffusion, schedule_settings
from uvic.models.autoencoder import load_vae
from uvic.models.uvit import UViT
from uvic.pipelines.pipeline_uvit import UViTPipeline
from uvic.run.architecture import ModelChoice, resolve_model
from uvic.run.folder import RunFolder
from uvic.sampling.assets import is_latent
from uvic.sampling.load import load_guide, load_model

# sample.scheduler values saved as dpm_solver++ (a velocity model's: as diffusers'
# FlowMatchEulerDiscreteScheduler; see the module docstring)
NOT_SAVED = (*RELEASE_FAST, "euler_maruyama", *FLOW_NAMED)
WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt")


class ExportError(ValueError):
    """The export source is not a run, a checkpoint or a released state dict, or the
    output folder is in the way; the message names the path."""


def export_source(source: str | Path, config: str | Path | None = None) -> tuple[Path, Path]:
    """(weights file, config file) of an export source, or ExportError: a run or checkpoint
    folder (its ema.safetensors and config.json), a .safetensors file (its config beside it,
    its run's, or `config`), or a released .pth state dict with `config`."""
    source = Path(source)
    if source.is_dir():
        weights = source / RunFolder.EMA
        if not weights.is_file():
            raise ExportError(f"{source} is not a uvic run or checkpoint folder (no "
                              f"{RunFolder.EMA}); give a run folder, a .safetensors "
                              "checkpoint or a released .pth with --config")
    elif source.is_file():
        if source.suffix.lower() not in WEIGHT_SUFFIXES:
            raise ExportError(f"{source} is not a checkpoint (.safetensors, or a released .pth "
                              "with --config) nor a run folder")
        weights = source
    else:
        raise ExportError(f"export source not found: {source}")
    if config is not None:
        return weights, Path(config)
    if weights.suffix.lower() != ".safetensors":
        raise ExportError(f"{source} records no model config (a released state dict): pass "
                          "--config with the config it was trained under, e.g. "
                          "configs/cifar10_uvit.py")
    # a checkpoint folder's own config.json, else its run's
    for folder in dict.fromkeys([weights.parent, RunFolder.of_weights(weights).root]):
        if (folder / RunFolder.CONFIG).is_file():
            return weights, folder / RunFolder.CONFIG
    raise ExportError(f"{source}: no config.json beside it or in its run folder, and the "
                      "weights record the model but not its noise schedule, VAE or text "
                      "encoder: pass --config")


def build_pipeline(cfg: Config, model: UViT, vae=None, null_class: int | None = None,
                   guide: UViT | None = None) -> tuple[UViTPipeline, str]:
    """The pipeline of `model` sampled under `cfg` (schedule, scheduler, VAE, text encoder,
    guidance, autoguidance by `guide`), and one line naming the scheduler saved. `vae`:
    the loaded VAE, else the config's `data.vae` is loaded for latent models. A config
    that autoguides needs its `guide` (`load_guide`): never dropped without a word."""
    diffusion = Diffusion(cfg.diffusion)
    s = cfg.sample
    if s.autoguidance_scale != 0 and guide is None:
        raise ExportError(f"sample.autoguidance_scale={s.autoguidance_scale:g} needs its guide "
                          f"({s.autoguidance_ckpt}); export unguided with --set "
                          "sample.autoguidance_scale=0")
    saved = ("FlowMatchEulerDiscreteScheduler" if cfg.diffusion.objective == "velocity"
             else "dpm_solver++")
    name = saved if s.scheduler in NOT_SAVED else s.scheduler
    kwargs = {} if s.scheduler in NOT_SAVED else s.scheduler_kwargs
    scheduler = make_scheduler(diffusion, name, s.order, s.steps, kwargs)
    note = f"scheduler: {type(scheduler).__name__} (sample.scheduler={s.scheduler!r})"
    if s.scheduler in NOT_SAVED:
        how = f"dpm_solver++ order {s.order}" if saved == "dpm_solver++" else saved
        note += (f", saved as {how}: sample with "
                 f"pipe(..., sampler={s.scheduler!r}) for the config's protocol")
    if is_latent(cfg.data) and vae is None:
        vae = load_vae(cfg.data.vae)
    text = cfg.model.clip_dim > 0
    pipe = UViTPipeline(
        transformer=model, scheduler=scheduler, vae=vae if is_latent(cfg.data) else None,
        diffusion=schedule_settings(cfg.diffusion),
        scale_factor=cfg.data.scale_factor if is_latent(cfg.data) else None,
        clip_model=_portable(cfg.data.clip_model) if text else None,
        clip_pretrained=_portable(cfg.data.clip_pretrained) if text else None,
        cfg_scale=effective_cfg_scale(cfg), null_class=null_class,
        guidance_interval=list(guidance_interval(cfg)) or None,
        guide=guide if s.autoguidance_scale != 0 else None,
        autoguidance_scale=s.autoguidance_scale or None)
    if s.autoguidance_scale != 0:
        note += (f"; autoguidance {s.autoguidance_scale:g} by the guide {s.autoguidance_ckpt} "
                 "(saved in guide/)")
    return pipe, note


def _portable(name: str) -> str:
    """An open_clip model name (`local-dir:FOLDER`) or weights file with a local path made
    absolute (the exported folder is loaded from anywhere); other names as they are."""
    schema = "local-dir:" if name.startswith("local-dir:") else ""
    local = Path(name.removeprefix(schema)).expanduser()
    if (schema and local.is_dir()) or (not schema and local.is_file()):
        return f"{schema}{local.resolve()}"
    return name


def export(
    source: str | Path, out: str | Path, *, config: str | Path | None = None,
    overrides: Sequence[str] = (), from_config: bool = False, null_class: int | None = None,
    say: Callable[[str], None] | None = None,
) -> Path:
    """Write the pipeline folder of `source` (`export_source`) to `out`, which must not
    exist or be empty; written to a temporary sibling and renamed, so a failed export
    leaves nothing. Returns `out`."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"refusing to write into {out}: it exists and is not an empty folder")
    weights, config_path = export_source(source, config)
    cfg = validate(load_config(config_path, list(overrides)))
    choice = ModelChoice.from_overrides(overrides, from_config, str(config_path))
    resolved = resolve_model(cfg, weights, choice)
    saved = {"attention_backend": "auto", "grad_checkpointing": False}  # the loader's choice
    runtime = dataclasses.replace(resolved.model, **saved)
    model = load_model(runtime, weights)
    if say is not None:
        say(resolved.note)
    sampled = dataclasses.replace(resolved.applied(cfg), model=runtime)
    guide = load_guide(sampled, weights, choice=choice, say=say, fields=saved)
    pipe, note = build_pipeline(sampled, model, null_class=null_class, guide=guide)
    tmp = out.with_name(f".{out.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        pipe.save_pretrained(tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    if say is not None:
        say(note)
    return out
