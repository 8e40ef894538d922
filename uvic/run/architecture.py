"""The architecture and noise schedule a weights file records, and which model to build for
it (`resolve_model`, for sampling, FID, autoguidance and the attention analysis alike).

A checkpoint is built as stored; a `--set model.*` or `diffusion.*` that differs is
refused unless `--model-from-config`, and a file that records nothing (a released
`nnet_ema.pth`) is built from the config (docs/sampling.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from uvic.config import Config, ConfigError, DiffusionConfig, ModelConfig, from_dict, load_config
from uvic.config.models import MODE_LETTERS, resolve_attention
from uvic.run.folder import RunFolder
from uvic.run.weights import CheckpointError

MODEL_METADATA_KEY = "uvic.model"  # safetensors metadata: the model config, as JSON
DIFFUSION_METADATA_KEY = "uvic.diffusion"  # and the diffusion settings trained under


# model.* fields that choose how the same function is computed: taken from the given config
RUNTIME_MODEL_FIELDS = ("attention_backend", "grad_checkpointing")


# model.* fields that fix what a model takes and returns (same noise, same contexts)
INPUT_MODEL_FIELDS = ("img_size", "in_chans", "num_classes", "clip_dim", "num_clip_token")


def model_metadata(model: ModelConfig, diffusion: DiffusionConfig | None = None
                   ) -> dict[str, str]:
    """Safetensors metadata recording the model config of the weights in the file and,
    given, the diffusion settings they were trained under
    (`save_safetensors(..., metadata=model_metadata(cfg.model, cfg.diffusion))`), read
    back by `stored_model_config` and `stored_diffusion_config`."""
    meta = {MODEL_METADATA_KEY: json.dumps(dataclasses.asdict(model), sort_keys=True)}
    if diffusion is not None:
        meta[DIFFUSION_METADATA_KEY] = json.dumps(dataclasses.asdict(diffusion), sort_keys=True)
    return meta


@dataclass(frozen=True)
class ModelChoice:
    """How the model of a weights file is chosen (`resolve_model`).

    set_keys: the `model.*` fields the user set explicitly (`model_keys(--set values)`):
    one that differs from the checkpoint's is refused. from_config: build the given
    config's model (and sample with its diffusion settings) even where the checkpoint
    records others (`--model-from-config`). config_name: how notes and errors name the
    given config (its path). diffusion_keys: the `diffusion.*` fields set explicitly.
    """

    set_keys: tuple[str, ...] = ()
    from_config: bool = False
    config_name: str = "the config"
    diffusion_keys: tuple[str, ...] = ()

    @classmethod
    def from_overrides(cls, overrides: Sequence[str], from_config: bool = False,
                       config_name: str = "the config") -> ModelChoice:
        """The choice of a command line: its `--set` values, flag and `--config` path."""
        return cls(tuple(model_keys(overrides)), from_config, str(config_name),
                   tuple(model_keys(overrides, "diffusion")))


@dataclass(frozen=True)
class ResolvedModel:
    """The model config to build for a weights file, where it came from, and one line
    stating the architecture and its source (printed once per checkpoint); the diffusion
    settings to sample it with (None: the given config's)."""

    model: ModelConfig
    source: str
    note: str
    diffusion: DiffusionConfig | None = None

    def applied(self, cfg: Config) -> Config:
        """`cfg` with this checkpoint's model and diffusion settings."""
        return dataclasses.replace(cfg, model=self.model,
                                   diffusion=self.diffusion or cfg.diffusion)


def model_keys(overrides: Sequence[str], section_name: str = "model") -> list[str]:
    """The `model.*` (or `section_name.*`) fields named by `section.field=value`
    overrides, e.g. ["attention"]."""
    keys = []
    for item in overrides:
        section, _, name = item.split("=", 1)[0].strip().partition(".")
        if section == section_name and name and name not in keys:
            keys.append(name)
    return keys


def stored_model_config(path: str | Path) -> tuple[ModelConfig, str] | None:
    """The model config the weights at `path` were trained with, and where it was found.

    A `.safetensors` file: its `uvic.model` metadata, else `config.json` in its folder (a
    run folder beside its `ema.safetensors`, or a `checkpoints/step_N/` folder), else the
    run folder's above `checkpoints/step_N/`. None for other formats (a released
    `nnet_ema.pth` records no config) and for a file with none of these. A stored config
    that cannot be read is a ConfigError naming it.
    """
    return _stored(path, "model", MODEL_METADATA_KEY)


def stored_diffusion_config(path: str | Path) -> tuple[DiffusionConfig, str] | None:
    """The diffusion settings the weights at `path` were trained under, and where they
    were found: its `uvic.diffusion` metadata, else the `config.json` beside it or of its
    run (files written before the metadata held it), as `stored_model_config`."""
    return _stored(path, "diffusion", DIFFUSION_METADATA_KEY)


def _stored(path: str | Path, section: str, key: str) -> tuple[object, str] | None:
    path = Path(path)
    if path.suffix.lower() != ".safetensors":
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            stored = (f.metadata() or {}).get(key)
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from err
    if stored is not None:
        source = f"metadata of {path}"
        try:
            data = json.loads(stored)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{source}: {key} is not JSON ({err})") from err
        return getattr(from_dict({section: data}, source=source), section), source
    # its own folder's, then (a checkpoint's file) its run's
    for saved in dict.fromkeys([path.parent / RunFolder.CONFIG,
                                RunFolder.of_weights(path).config]):
        if saved.is_file():
            return getattr(load_config(saved), section), str(saved)
    return None


def describe_model(model: ModelConfig) -> str:
    """A short account of an architecture: attention (per block: S softmax, C cog,
    E expressive, G sigmoid), depth, width, image and patch size."""
    modes = _field_value(model, "attention")
    pattern = f" ({''.join(MODE_LETTERS[m] for m in modes)})" if isinstance(modes, list) else ""
    return (f"attention {model.attention}{pattern}, depth {model.depth}, embed_dim "
            f"{model.embed_dim}, {model.img_size}x{model.img_size}x{model.in_chans} in "
            f"patches of {model.patch_size}")


def model_differences(a: ModelConfig, b: ModelConfig) -> list[str]:
    """The architecture fields (all but RUNTIME_MODEL_FIELDS) where `a` and `b` differ;
    attention patterns are compared block by block ("uvit" = "softmax,softmax,...")."""
    names = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in RUNTIME_MODEL_FIELDS]
    return [name for name in names if _field_value(a, name) != _field_value(b, name)]


def _field_value(model: ModelConfig, name: str) -> object:
    if name == "attention":
        with contextlib.suppress(ValueError):
            return resolve_attention(model.attention, model.depth)
    return getattr(model, name)


def _values(model: ModelConfig | DiffusionConfig, keys: Sequence[str],
            section: str = "model") -> str:
    return ", ".join(f"{section}.{k}={getattr(model, k)!r}" for k in keys)


def resolve_model(cfg: Config, ckpt: str | Path, choice: ModelChoice | None = None
                  ) -> ResolvedModel:
    """The model config to build for the weights `ckpt` under `cfg`: the checkpoint's
    stored one (with cfg's RUNTIME_MODEL_FIELDS), or cfg's
    for a file without one or under `choice.from_config`; likewise its diffusion settings.

    Raises ConfigError, one line, when a `model.*` field in `choice.set_keys` (or a
    `diffusion.*` one in `choice.diffusion_keys`) differs from the checkpoint's, naming
    the keys, both values and both sources.
    """
    choice = choice or ModelChoice()
    given, name = cfg.model, choice.config_name
    if not Path(ckpt).is_file():
        raise CheckpointError(f"checkpoint not found: {ckpt}")
    stored = stored_model_config(ckpt)
    schedule = _Schedule.of(cfg.diffusion, ckpt, choice)
    if stored is None:
        return ResolvedModel(given, name, f"{ckpt}: {describe_model(given)}, from {name} "
                                          "(the file records no model config)"
                             + schedule.note(name), schedule.diffusion)
    saved, source = stored
    diffs = model_differences(given, saved)
    if choice.from_config:
        note = f"{ckpt}: {describe_model(given)}, from {name} (--model-from-config)"
        if diffs or schedule.diffs:
            note += (f"; the checkpoint's own ({source}) has "
                     + ", ".join(filter(None, [_values(saved, diffs), schedule.stored_values()])))
        return ResolvedModel(given, name, note)
    conflicts = [k for k in choice.set_keys if k in diffs]
    if conflicts:
        raise ConfigError(
            f"refusing to build {ckpt} with {_values(given, conflicts)} (--set): it was "
            f"trained with {_values(saved, conflicts)} ({source}); drop the --set to use "
            "the checkpoint's model, or pass --model-from-config to build the config's")
    schedule.refuse_conflicts(ckpt)
    model = dataclasses.replace(saved, **{k: getattr(given, k) for k in RUNTIME_MODEL_FIELDS})
    note = f"{ckpt}: {describe_model(model)}, from {source}"
    if diffs or schedule.diffs:
        listed = ", ".join(filter(None, [_values(given, diffs), schedule.given_values()]))
        note += f"; {name} has {listed}, not used for this checkpoint"
    if schedule.diffs and schedule.source != source:
        note += f" (diffusion.* from {schedule.source})"
    return ResolvedModel(model, source, note, schedule.diffusion)


@dataclass(frozen=True)
class _Schedule:
    """The diffusion settings stored with a checkpoint, against the given config's."""

    given: DiffusionConfig
    stored: DiffusionConfig | None
    source: str
    diffs: tuple[str, ...]
    choice: ModelChoice

    @classmethod
    def of(cls, given: DiffusionConfig, ckpt: str | Path, choice: ModelChoice) -> _Schedule:
        found = stored_diffusion_config(ckpt)
        if found is None:
            return cls(given, None, "", (), choice)
        stored, source = found
        diffs = tuple(f.name for f in dataclasses.fields(DiffusionConfig)
                      if getattr(given, f.name) != getattr(stored, f.name))
        return cls(given, stored, source, diffs, choice)

    @property
    def diffusion(self) -> DiffusionConfig | None:
        """What to sample with: the stored settings (None: the given config's)."""
        return None if self.choice.from_config else self.stored

    def given_values(self) -> str:
        return _values(self.given, self.diffs, "diffusion")

    def stored_values(self) -> str:
        return _values(self.stored, self.diffs, "diffusion") if self.stored else ""

    def note(self, name: str) -> str:
        """The differences, for a file that records no model config."""
        if not self.diffs:
            return ""
        return f"; diffusion.* from {self.source}: {name} has {self.given_values()}, not used"

    def refuse_conflicts(self, ckpt: str | Path) -> None:
        conflicts = [k for k in self.choice.diffusion_keys if k in self.diffs]
        if conflicts and not self.choice.from_config:
            raise ConfigError(
                f"refusing to sample {ckpt} with {_values(self.given, conflicts, 'diffusion')} "
                f"(--set): it was trained with {_values(self.stored, conflicts, 'diffusion')} "
                f"({self.source}); drop the --set to use the checkpoint's diffusion settings, "
                "or pass --model-from-config to use the config's")


def check_same_inputs(models: Mapping[str, ModelConfig]) -> None:
    """Refuse (ConfigError, one line) models that do not take the same inputs
    (INPUT_MODEL_FIELDS): sampled from the same noise or guiding each other, they must."""
    (first, a), *others = models.items()
    for other, b in others:
        diffs = [k for k in INPUT_MODEL_FIELDS if getattr(a, k) != getattr(b, k)]
        if diffs:
            raise ConfigError(f"{first} and {other} take different inputs ({_values(a, diffs)} "
                              f"vs {_values(b, diffs)}); they cannot share the same noise")
