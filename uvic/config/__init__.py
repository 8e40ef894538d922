"""Typed run configuration: one `Config` fully describes a training/sampling/evaluation run.

Config files are Python modules in `configs/` that define `get_config() -> Config`.
Any field can be overridden from the command line with `--set section.field=value`
(for example `--set train.batch_size=64 --set model.attention=uvic`). Values are parsed
with the field's declared type; an unknown key or a value of the wrong type raises a
`ConfigError` naming the key. The resolved config is saved as JSON next to every run's
outputs and can be loaded back with `load_config("run/config.json")` (a run's config.json
also lists what each resume changed, under `resumes`: see `uvic.run.prepare`).

This package is the bottom layer (docs/architecture.md) and imports nothing above it: this
module, the schema; beside it the rules on values, one module per section's domain
(`uvic.config.models`, `.data`, `.diffusion`, `.sampling`, `.training`, `.evaluation`:
which names a field accepts, which numbers are in range), `uvic.config.validation.validate`,
which runs them all, and `uvic.config.compare`. None of them imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config file, key or value is wrong; the message names it."""


def require(checks: Iterable[tuple[bool, str]]) -> None:
    """Raise a ConfigError with the message of the first check that fails (the rules on
    values use it: `uvic.config.validation`)."""
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


# A run's config.json: the current config plus, under this key, the changes each resume
# made (uvic.run.prepare); loading the file as a config skips it.
RESUMES_KEY = "resumes"


# --------------------------------------------------------------------------- sections


@dataclass
class ModelConfig:
    """U-ViT / U-ViC architecture (names follow the U-ViT release)."""

    img_size: int = 32  # spatial size of the network input (pixels or latents)
    in_chans: int = 3
    patch_size: int = 2
    embed_dim: int = 512
    depth: int = 12
    num_heads: int = 8
    mlp_ratio: float = 4.0
    qkv_bias: bool = False
    mlp_time_embed: bool = False
    num_classes: int = -1  # > 0: class-conditional (label token); -1: none
    clip_dim: int = 0  # > 0: text-conditional with `num_clip_token` context tokens
    num_clip_token: int = 77
    conv: bool = True  # final 3x3 conv after unpatchify
    skip: bool = True  # long skips
    # Per-block attention: preset "uvit" (all softmax), "uvic" / "uvie" / "uvis" (cog /
    # expressive / sigmoid except in the first in-block and the last out-block), or a list
    # of depth + 1 modes ("softmax,cog,...": in_blocks, mid_block, out_blocks).
    attention: str = "uvit"
    attention_backend: str = "auto"  # auto | triton | torch | sdpa (softmax blocks only)
    grad_checkpointing: bool = False
    # Initial position embedding of the patch tokens (a learned parameter either way):
    # "normal" = trunc-normal(0.02), the release's; "sincos" = 2D sine-cosine code, for
    # runs too short to learn where patches are (the CPU quickstart).
    pos_embed_init: str = "normal"
    sigmoid_bias: float | None = None  # b of sigmoid(q.k / sqrt(d) + b); None: -log N tokens
    sigmoid_bias_learnable: bool = False  # one b per head and sigmoid block, learned from it


@dataclass
class DataConfig:
    """Which data the model learns and where it lives on disk."""

    name: str = "cifar10"  # cifar10 | mscoco | shapes | imagenet | imagenet_features | celeba
    # cifar10: torchvision root; mscoco, imagenet_features: feature folder; imagenet: the
    # ILSVRC-2012 root (train/<wnid>/*.JPEG); celeba: the folder of img_align_celeba/
    root: str = "data/cifar10"
    download: bool = False  # cifar10 only: let torchvision download it
    random_flip: bool = True
    num_workers: int = 4
    # shapes (the built-in quickstart dataset): number of images and generator seed
    num_images: int = 2048
    # latent scale factor of the Stable Diffusion KL-f8 VAE (the release's: mscoco 0.23010,
    # imagenet_features 0.18215)
    scale_factor: float = 0.23010
    # hub name, diffusers folder or LDM weights file (uvic.models.autoencoder.load_vae);
    # the default is the release's autoencoder_kl.pth (uvic.models.autoencoder.DEFAULT_VAE)
    vae: str = "CompVis/stable-diffusion-v1-4/vae"
    clip_model: str = "ViT-L-14-quickgelu"  # open_clip model name
    clip_pretrained: str = "openai"  # open_clip tag or a local checkpoint path


@dataclass
class DiffusionConfig:
    """Noise schedule and objective; the sampler is built from the same definition."""

    # "vp_continuous": beta(t) = beta_min + t (beta_max - beta_min), t ~ U(0, 1), net sees 999 t
    # "scaled_linear": discrete Stable-Diffusion betas, step n = k + 1 in {1..1000}
    schedule: str = "vp_continuous"
    beta_min: float = 0.1
    beta_max: float = 20.0
    beta_start: float = 0.00085
    beta_end: float = 0.012
    num_train_timesteps: int = 1000
    p_uncond: float = 0.1  # classifier-free training: caption -> empty context
    # > 0: Min-SNR-gamma loss weighting, each sample's noise MSE times min(SNR, gamma) / SNR
    # (less weight on the low-noise levels); 0: the plain noise MSE of the release.
    min_snr_gamma: float = 0.0


@dataclass
class OptimConfig:
    """AdamW with linear warm-up, then a constant (or cosine-decaying) learning rate."""

    lr: float = 2e-4
    betas: tuple[float, float] = (0.99, 0.999)
    weight_decay: float = 0.03
    warmup_steps: int = 2500
    grad_clip: float = 0.0  # 0: off (the release does not clip)
    # "constant" after warm-up (the release), or "cosine": decay to 0 at train.max_steps,
    # which gives short runs (the quickstart) a settled final model.
    lr_schedule: str = "constant"


@dataclass
class TrainConfig:
    """Loop length, precision, checkpointing and logging."""

    output_dir: str = "runs/default"
    batch_size: int = 128  # global batch (all processes, after accumulation)
    max_steps: int = 500_000
    grad_accum: int = 1
    # no | fp16 | bf16; "" (unset): the launcher's (`accelerate launch --mixed_precision`,
    # `accelerate config`)
    mixed_precision: str = ""
    ema_decay: float = 0.9999
    seed: int = 1234
    # torch.compile of the model through Accelerate (uvic.training.compile): off | default |
    # reduce-overhead (CUDA graphs) | max-autotune | max-autotune-no-cudagraphs. A bool
    # (configs and runs from before the modes) still reads: true = default, false = off.
    compile: bool | str = "off"
    log_every: int = 100
    sample_every: int = 10_000
    ckpt_every: int = 25_000
    keep_last: int = 3
    # Steps whose checkpoints are also written and never pruned, e.g. the early EMA
    # weights that `sample.autoguidance_ckpt` guides with: --set train.keep_steps=[1000]
    keep_steps: tuple[int, ...] = ()
    n_grid: int = 64  # images in the periodic sample grid
    log_with: str = "tensorboard"  # Accelerate tracker(s), comma-separated: wandb, all, ...


@dataclass
class SampleConfig:
    """DPM-Solver (or another diffusers scheduler) sampling."""

    # dpm_solver++ | dpm_solver | dpm_solver++_fast_time_uniform | dpm_solver_fast_logsnr |
    # euler_maruyama | a diffusers class name
    # (see uvic.diffusion.samplers)
    scheduler: str = "dpm_solver++"
    steps: int = 50
    order: int = 2
    # Extra scheduler constructor arguments (a JSON object on the command line), e.g.
    # --set 'sample.scheduler_kwargs={"use_lu_lambdas": false}'
    scheduler_kwargs: dict[str, Any] = field(default_factory=dict)
    cfg_scale: float = 1.0  # eps = c + s (c - u); diffusers' guidance_scale = s + 1
    # Autoguidance (Karras et al. 2024, "Guiding a diffusion model with a bad version of
    # itself"): eps = g + s (g - b), g the sampled model, b a weaker one of the same
    # architecture, e.g. an early EMA of the same run (train.keep_steps). 0: off.
    autoguidance_scale: float = 0.0
    # The weaker model's weights; a relative path is taken from the sampled checkpoint's
    # run folder (see uvic.sampling.load.load_guide).
    autoguidance_ckpt: str = ""
    batch_size: int = 500
    decode_batch_size: int = 50
    # torch.compile of the network call (static shapes: every call of a run sees one batch
    # size, the last batch padded): off | default | reduce-overhead (CUDA graphs on a GPU)
    # | max-autotune (see uvic.sampling.compiled)
    compile: str = "off"


@dataclass
class EvalConfig:
    """FID protocol."""

    n_samples: int = 50_000
    mode: str = "clean"  # clean | legacy_pytorch
    # clean-fid named statistics (dataset, resolution, split) or a local .npz path
    ref_stats: str = "cifar10"
    ref_split: str = "train"
    ref_res: int = 32
    ref_images: str = ""  # folder/source to build custom statistics from if needed
    inception_path: str = ""  # local Inception weights (clean-fid's inception-2015-12-05.pt)
    # inception: FID proper. projection: download-free stand-in features (fixed random
    # projection) to check the pipeline; its numbers are NOT comparable with Inception FID.
    features: str = "inception"
    captions: str = ""  # mscoco: val captions features used to draw prompts


@dataclass
class Config:
    """Everything about a run. Saved as `config.json` next to its outputs."""

    name: str = "default"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


# --------------------------------------------------------------------------- loading


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a `configs/*.py` module (calls its `get_config()`) or a saved `config.json`,
    then apply `section.field=value` overrides."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: not valid JSON ({err})") from err
        if isinstance(data, dict):  # a run's config.json: its resume history is no setting
            data = {k: v for k, v in data.items() if k != RESUMES_KEY}
        cfg = from_dict(data, source=str(path))
    elif path.suffix == ".py":
        spec = importlib.util.spec_from_file_location(f"uvic_config_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        assert spec.loader is not None
        spec.loader.exec_module(module)
        if not hasattr(module, "get_config"):
            raise ConfigError(f"{path}: defines no get_config()")
        cfg = module.get_config()
        if not isinstance(cfg, Config):
            raise ConfigError(f"{path}: get_config() must return uvic.config.Config")
    else:
        raise ConfigError(f"{path}: config must be a .py module or a saved .json")
    return apply_overrides(cfg, overrides)


def apply_overrides(cfg: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    """Apply `section.field=value` strings in order; returns a new Config."""
    cfg = dataclasses.replace(cfg)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        section_name, _, field_name = key.partition(".")
        if not field_name:  # top-level scalar like name=...
            section_name, field_name, target = "", section_name, cfg
        else:
            if section_name not in _field_types(Config):
                raise ConfigError(f"unknown config key {key!r} (no section {section_name!r})")
            target = dataclasses.replace(getattr(cfg, section_name))
            setattr(cfg, section_name, target)
        types_ = _field_types(type(target))
        if field_name not in types_:
            known = ", ".join(sorted(types_))
            where = section_name or "top level"
            raise ConfigError(f"unknown config key {key!r}; {where} has: {known}")
        if dataclasses.is_dataclass(types_[field_name]):
            raise ConfigError(f"config key {key!r} is a section; set one of its fields")
        setattr(target, field_name, parse_value(raw, types_[field_name], key))
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain JSON-able dict of a Config."""
    return dataclasses.asdict(cfg)


def from_dict(data: dict[str, Any], source: str = "config") -> Config:
    """Build a Config from a dict (e.g. a saved config.json); unknown keys are errors."""
    return _build(Config, data, prefix="", source=source)


# --------------------------------------------------------------------------- helpers


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _build(cls: type, data: dict[str, Any], prefix: str, source: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'config'} must be a mapping")
    types_ = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in types_:
            raise ConfigError(f"{source}: unknown config key {full!r}")
        tp = types_[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, prefix=f"{full}.", source=source)
        else:
            kwargs[key] = _check_type(value, tp, full, source)
    return cls(**kwargs)


def _check_type(value: Any, tp: Any, key: str, source: str = "config") -> Any:
    """Validate a JSON value against a field type (tuples arrive as lists)."""
    origin = typing.get_origin(tp)
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: any length
            if not isinstance(value, list | tuple):
                raise ConfigError(f"{source}: {key} must be a list, got {value!r}")
            return tuple(_check_type(v, args[0], key, source) for v in value)
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ConfigError(f"{source}: {key} must be a list of {len(args)} values")
        return tuple(_check_type(v, a, key, source) for v, a in zip(value, args))
    if float in (tp, *typing.get_args(tp)) and type(value) is int:  # float or float | None
        return float(value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key} must be a mapping, got {value!r}")
        return dict(value)
    if (tp in (int, float) and isinstance(value, bool)) or not isinstance(value, tp):
        raise ConfigError(
            f"{source}: {key} must be {_type_name(tp)}, got {type(value).__name__} {value!r}"
        )
    return value


def _type_name(tp: Any) -> str:
    """`int`, or `bool | str` for a union."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (types.UnionType, typing.Union) else ()
    return " | ".join(map(_type_name, args)) if args else getattr(tp, "__name__", str(tp))


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_value(raw: str, tp: Any, key: str) -> Any:
    """Parse a command-line string into the field type `tp`; errors name the key."""
    raw = raw.strip()
    origin = typing.get_origin(tp)
    try:
        if tp is bool:
            if raw.lower() in _TRUE:
                return True
            if raw.lower() in _FALSE:
                return False
            raise ValueError
        if tp is int:
            return int(raw.replace("_", ""))
        if tp is float:
            return float(raw)
        if tp is str:
            return raw
        if origin is dict:  # a JSON object
            value = json.loads(raw)
            if not isinstance(value, dict):
                raise ValueError
            return value
        if origin is tuple:
            parts = [p for p in raw.strip("()[]").split(",") if p.strip()]
            args = typing.get_args(tp)
            if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: any length
                return tuple(parse_value(p, args[0], key) for p in parts)
            if len(parts) != len(args):
                raise ValueError
            return tuple(parse_value(p, a, key) for p, a in zip(parts, args))
        if origin in (types.UnionType, typing.Union):  # the first member type that parses
            for member in typing.get_args(tp):
                with contextlib.suppress(ConfigError):
                    return parse_value(raw, member, key)
            raise ValueError
    except ValueError:
        raise ConfigError(f"config key {key!r} expects {_type_name(tp)}, got {raw!r}") from None
    raise ConfigError(f"config key {key!r} has a type overrides cannot set ({tp})")
