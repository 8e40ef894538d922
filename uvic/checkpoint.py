"""Model weights and training checkpoints on disk.

Weights: load `.pth`/`.pt` (incl. the released `nnet_ema.pth`) and `.safetensors`, save
`.safetensors` atomically. Checkpoints: the `checkpoints/step_N/` folders of a run (listed,
resolved for `--resume`, committed by an atomic rename, pruned safely), and the training
step a weights file belongs to.

Loading is strict by default and every mismatch is reported by name: missing keys,
unexpected keys and shape mismatches. Prefixes added by wrappers (`_orig_mod.` from
torch.compile, `module.` from DistributedDataParallel) are stripped from the file's keys,
and the target model is unwrapped the same way.

A checkpoint carries its architecture. Weights are read together with the model config
they were trained with (`stored_model_config`): the `uvic.model` entry of the
safetensors metadata (written into every weights file a run exports, `model_metadata`,
so a file copied out of its run folder still knows it), else the `config.json` of the
file's folder (a `checkpoints/step_N/` folder holds one), else that of its run folder
(above `checkpoints/step_N/`). `resolve_model` decides what to build, for sampling, FID,
autoguidance and the attention analysis alike:

* a checkpoint with a stored model config is built as stored; a given config's `model.*`
  is only a template there, and where it differs the one-line note says so;
* a `model.*` value the user set explicitly (`--set model.attention=uvic`) that differs
  from the stored one is refused with one line naming the key, both values and both
  sources, unless `ModelChoice.from_config` (`--model-from-config`) builds the config's
  model instead;
* a file without a stored config (a released `nnet_ema.pth`) is built from the config.

`model.attention_backend` and `model.grad_checkpointing` choose how the same function
is computed, not which function: they always come from the given config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from uvic.config import (
    Config,
    ConfigError,
    ModelConfig,
    config_changes,
    config_diff,
    from_dict,
    load_config,
)
from uvic.files import atomic_write, fsync, fsync_tree

# Keys under which training scripts commonly nest a state dict.
WRAPPER_KEYS = ("state_dict", "model", "ema", "model_ema", "nnet_ema", "nnet", "module")
WRAPPER_PREFIXES = ("_orig_mod.", "module.")
_MAX_LISTED = 20
CHECKPOINT_PREFIX = "step_"  # checkpoints/step_000123/
TRAINER_STATE = "trainer_state.json"  # in every complete checkpoint folder
RUN_EMA = "ema.safetensors"  # a run's EMA weights, at its root and in every checkpoint
# What a run writes into its folder (besides the lock): a fresh start refuses to overwrite it.
RUN_OUTPUTS = ("checkpoints", RUN_EMA, "log.jsonl", "summary.json", "samples", "tensorboard",
               "config.json")
# besides a checkpoint or run folder path; "latest-or-new" starts the run if it has no
# checkpoint yet, the others refuse
RESUME_CHOICES = ("latest", "latest-intact", "latest-or-new")
MODEL_METADATA_KEY = "uvic.model"  # safetensors metadata: the model config, as JSON
# model.* fields that choose how the same function is computed: taken from the given config
RUNTIME_MODEL_FIELDS = ("attention_backend", "grad_checkpointing")
# model.* fields that fix what a model takes and returns (same noise, same contexts)
INPUT_MODEL_FIELDS = ("img_size", "in_chans", "num_classes", "clip_dim", "num_clip_token")


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable, or does not fit the model."""


@dataclass
class LoadResult:
    """Keys that did not match (empty lists after a strict load)."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module inside torch.compile / DistributedDataParallel wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
            model = model.module
        else:
            return model


def strip_prefixes(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Remove leading `_orig_mod.` / `module.` (in any combination) from every key."""
    out = {}
    for key, value in state_dict.items():
        name = key
        while name.startswith(WRAPPER_PREFIXES):
            name = name.split(".", 1)[1]
        if name in out:
            raise CheckpointError(f"key {key!r} collides with another key after stripping "
                                  f"wrapper prefixes {WRAPPER_PREFIXES}")
        out[name] = value
    return out


def read_state_dict(path: str | Path, key: str | None = None) -> dict[str, Tensor]:
    """Tensors stored in `path` (.pth/.pt via torch.load(weights_only=True), or .safetensors).

    A `.pth` holding a dict that nests the state dict under one of WRAPPER_KEYS is
    unwrapped when that is unambiguous; pass `key` to pick one explicitly.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        try:
            obj: object = load_file(str(path), device="cpu")
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from err
    elif suffix in (".pth", ".pt", ".bin", ".ckpt"):
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # pickle/zip errors have many types
            msg = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise CheckpointError(f"{path}: torch.load failed ({msg})") from err
    else:
        raise CheckpointError(f"{path}: unknown checkpoint format {suffix!r} "
                              "(expected .pth, .pt or .safetensors)")
    return strip_prefixes(_select_state_dict(obj, path, key))


def _select_state_dict(obj: object, path: Path, key: str | None) -> Mapping[str, Tensor]:
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{path}: holds a {type(obj).__name__}, not a state dict")
    if key is not None:
        if key not in obj:
            raise CheckpointError(f"{path}: no key {key!r}; top-level keys: {sorted(obj)[:20]}")
        obj = obj[key]
        if not isinstance(obj, Mapping):
            raise CheckpointError(f"{path}: {key!r} holds a {type(obj).__name__}, "
                                  "not a state dict")
    elif not all(isinstance(v, Tensor) for v in obj.values()):
        nested = [k for k in WRAPPER_KEYS if isinstance(obj.get(k), Mapping)]
        if len(nested) > 1:
            raise CheckpointError(f"{path}: holds several state dicts {nested}; "
                                  "choose one with key=...")
        if not nested:
            raise CheckpointError(f"{path}: not a plain state dict and none of "
                                  f"{list(WRAPPER_KEYS)} holds one; top-level keys: "
                                  f"{sorted(map(str, obj))[:20]}")
        obj = obj[nested[0]]
    bad = [k for k, v in obj.items() if not isinstance(v, Tensor)]
    if bad:
        raise CheckpointError(f"{path}: entry {bad[0]!r} is a {type(obj[bad[0]]).__name__}, "
                              "not a tensor")
    return obj


def load_weights(
    model: nn.Module, path: str | Path, strict: bool = True, key: str | None = None,
) -> LoadResult:
    """Load `path` into `model` (in place); strict: every key and shape must match.

    Raises CheckpointError naming missing/unexpected keys and shape mismatches. With
    strict=False, matching tensors are loaded and the unmatched keys are returned.
    """
    target = unwrap_model(model)
    loaded = read_state_dict(path, key)
    expected = target.state_dict()
    missing = [k for k in expected if k not in loaded]
    unexpected = [k for k in loaded if k not in expected]
    shapes = [
        f"{k}: file {tuple(loaded[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items() if k in loaded and loaded[k].shape != v.shape
    ]
    problems = []
    if shapes:
        problems.append("shape mismatch " + _listing(shapes))
    if strict and missing:
        problems.append("missing keys " + _listing(missing))
    if strict and unexpected:
        problems.append("unexpected keys " + _listing(unexpected))
    if problems:
        raise CheckpointError(f"{path} does not fit {type(target).__name__}: "
                              + "; ".join(problems))
    target.load_state_dict({k: v for k, v in loaded.items() if k in expected}, strict=False)
    return LoadResult(missing=missing, unexpected=unexpected)


def save_safetensors(
    model_or_state_dict: nn.Module | Mapping[str, Tensor], path: str | Path,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write weights to `path` as safetensors, atomically (`uvic.files.atomic_write`).

    Keys are saved without wrapper prefixes so the file loads into the plain model.
    """
    path = Path(path)
    if isinstance(model_or_state_dict, nn.Module):
        state = unwrap_model(model_or_state_dict).state_dict()
    else:
        state = model_or_state_dict
    state = strip_prefixes(state)
    bad = [k for k, v in state.items() if not isinstance(v, Tensor)]
    if bad:
        raise CheckpointError(f"cannot save {path}: entry {bad[0]!r} is not a tensor")
    meta = None
    if metadata is not None:
        bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise CheckpointError(f"cannot save {path}: metadata {bad[0]!r} must map str to str")
        meta = dict(metadata)
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    with atomic_write(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)


def model_metadata(model: ModelConfig) -> dict[str, str]:
    """Safetensors metadata recording the model config of the weights in the file
    (`save_safetensors(..., metadata=model_metadata(cfg.model))`), read back by
    `stored_model_config`."""
    return {MODEL_METADATA_KEY: json.dumps(dataclasses.asdict(model), sort_keys=True)}


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    more = f", ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    return f"({len(names)}): {shown}{more}"


# --------------------------------------------------------------------------- architectures


@dataclass(frozen=True)
class ModelChoice:
    """How the model of a weights file is chosen (`resolve_model`).

    set_keys: the `model.*` fields the user set explicitly (`model_keys(--set values)`):
    one that differs from the checkpoint's is refused. from_config: build the given
    config's model even where the checkpoint records another (`--model-from-config`).
    config_name: how notes and errors name the given config (its path).
    """

    set_keys: tuple[str, ...] = ()
    from_config: bool = False
    config_name: str = "the config"

    @classmethod
    def from_overrides(cls, overrides: Sequence[str], from_config: bool = False,
                       config_name: str = "the config") -> ModelChoice:
        """The choice of a command line: its `--set` values, flag and `--config` path."""
        return cls(tuple(model_keys(overrides)), from_config, str(config_name))


@dataclass(frozen=True)
class ResolvedModel:
    """The model config to build for a weights file, where it came from, and one line
    stating the architecture and its source (printed once per checkpoint)."""

    model: ModelConfig
    source: str
    note: str


def model_keys(overrides: Sequence[str]) -> list[str]:
    """The `model.*` fields named by `section.field=value` overrides, e.g. ["attention"]."""
    keys = []
    for item in overrides:
        section, _, name = item.split("=", 1)[0].strip().partition(".")
        if section == "model" and name and name not in keys:
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
    path = Path(path)
    if path.suffix.lower() != ".safetensors":
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            stored = (f.metadata() or {}).get(MODEL_METADATA_KEY)
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from err
    if stored is not None:
        source = f"metadata of {path}"
        try:
            data = json.loads(stored)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{source}: {MODEL_METADATA_KEY} is not JSON ({err})") from err
        return from_dict({"model": data}, source=source).model, source
    folders = [path.parent]
    if path.parent.parent.name == "checkpoints":
        folders.append(path.parent.parent.parent)
    for folder in folders:
        saved = folder / "config.json"
        if saved.is_file():
            return load_config(saved).model, str(saved)
    return None


def describe_model(model: ModelConfig) -> str:
    """A short account of an architecture: attention (per block: S softmax, C cog,
    E expressive), depth, width, image and patch size."""
    modes = _field_value(model, "attention")
    pattern = f" ({''.join(m[0].upper() for m in modes)})" if isinstance(modes, list) else ""
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
        from uvic.uvit import resolve_attention  # here: uvit imports the kernels

        with contextlib.suppress(ValueError):
            return resolve_attention(model.attention, model.depth)
    return getattr(model, name)


def _values(model: ModelConfig, keys: Sequence[str]) -> str:
    return ", ".join(f"model.{k}={getattr(model, k)!r}" for k in keys)


def resolve_model(cfg: Config, ckpt: str | Path, choice: ModelChoice | None = None
                  ) -> ResolvedModel:
    """The model config to build for the weights `ckpt` under `cfg` (rules in the module
    docstring): the checkpoint's stored one (with cfg's RUNTIME_MODEL_FIELDS), or cfg's
    for a file without one or under `choice.from_config`.

    Raises ConfigError, one line, when a `model.*` field in `choice.set_keys` differs from
    the checkpoint's, naming the keys, both values and both sources.
    """
    choice = choice or ModelChoice()
    given, name = cfg.model, choice.config_name
    if not Path(ckpt).is_file():
        raise CheckpointError(f"checkpoint not found: {ckpt}")
    stored = stored_model_config(ckpt)
    if stored is None:
        return ResolvedModel(given, name, f"{ckpt}: {describe_model(given)}, from {name} "
                                          "(the file records no model config)")
    saved, source = stored
    diffs = model_differences(given, saved)
    if choice.from_config:
        note = f"{ckpt}: {describe_model(given)}, from {name} (--model-from-config)"
        if diffs:
            note += f"; the checkpoint's own ({source}) has {_values(saved, diffs)}"
        return ResolvedModel(given, name, note)
    conflicts = [k for k in choice.set_keys if k in diffs]
    if conflicts:
        raise ConfigError(
            f"refusing to build {ckpt} with {_values(given, conflicts)} (--set): it was "
            f"trained with {_values(saved, conflicts)} ({source}); drop the --set to use "
            "the checkpoint's model, or pass --model-from-config to build the config's")
    model = dataclasses.replace(saved, **{k: getattr(given, k) for k in RUNTIME_MODEL_FIELDS})
    note = f"{ckpt}: {describe_model(model)}, from {source}"
    if diffs:
        note += f"; {name} has {_values(given, diffs)}, not used for this checkpoint"
    return ResolvedModel(model, source, note)


def check_same_inputs(models: Mapping[str, ModelConfig]) -> None:
    """Refuse (ConfigError, one line) models that do not take the same inputs
    (INPUT_MODEL_FIELDS): sampled from the same noise or guiding each other, they must."""
    (first, a), *others = models.items()
    for other, b in others:
        diffs = [k for k in INPUT_MODEL_FIELDS if getattr(a, k) != getattr(b, k)]
        if diffs:
            raise ConfigError(f"{first} and {other} take different inputs ({_values(a, diffs)} "
                              f"vs {_values(b, diffs)}); they cannot share the same noise")


# --------------------------------------------------------------------------- run checkpoints


def checkpoint_name(step: int) -> str:
    """Folder name of the checkpoint of `step` (also the name of its sample grid)."""
    return f"{CHECKPOINT_PREFIX}{step:06d}"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run (`checkpoints/step_N/` with a trainer state), oldest first.

    Folders still being written (`.tmp`) or deleted are ignored.
    """
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        number = path.name[len(CHECKPOINT_PREFIX):]
        if (path.name.startswith(CHECKPOINT_PREFIX) and number.isdigit()
                and (path / TRAINER_STATE).is_file()):
            found.append((int(number), path))
    return [path for _, path in sorted(found)]


def resolve_resume(run_dir: str | Path, resume: str | None,
                   skipped: list[str] | None = None) -> Path | None:
    """The checkpoint folder to resume from: None (fresh), "latest", "latest-intact" (the
    newest checkpoint whose files all read back; each one passed over is appended to
    `skipped` with the reason), "latest-or-new" (as "latest", or None if the run has no
    checkpoint yet), a checkpoint folder, or a run folder (its latest checkpoint).

    "latest" and "latest-intact" refuse a run without checkpoints (CheckpointError naming
    the folder: a mistyped folder must not start a new run); "latest", "latest-or-new" and
    a path refuse a checkpoint with an unreadable file (naming the file and the
    "latest-intact" way out).
    """
    if resume is None:
        return None
    if resume in RESUME_CHOICES:
        checkpoints = list_checkpoints(run_dir)
        if not checkpoints and resume != "latest-or-new":
            raise CheckpointError(f"--resume {resume}: no checkpoint in {run_dir} to resume "
                                  "(check train.output_dir; --resume latest-or-new starts a "
                                  "new run where there is none)")
    else:
        path = Path(resume)
        checkpoints = [path] if (path / TRAINER_STATE).is_file() else list_checkpoints(path)
        if not checkpoints:
            raise CheckpointError(f"--resume {resume}: not a checkpoint folder (no "
                                  f"{TRAINER_STATE}) nor a run folder with checkpoints")
    for newest_first, checkpoint in enumerate(reversed(checkpoints)):
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            return checkpoint
        if resume != "latest-intact":
            older = [c.name for c in checkpoints[:len(checkpoints) - newest_first - 1]]
            fallback = ("--resume latest-intact falls back to the newest intact one" if
                        resume in RESUME_CHOICES else "pass an older checkpoint folder")
            way_out = (f"; {fallback} (of {', '.join(older)})" if older
                       else "; no older checkpoint to fall back to")
            raise CheckpointError(f"cannot resume from {problem}{way_out}")
        if skipped is not None:
            skipped.append(f"skipped {checkpoint.name}: {problem}")
    if checkpoints:
        raise CheckpointError(f"--resume {resume}: no intact checkpoint in {run_dir} (newest: "
                              f"{checkpoint_problem(checkpoints[-1])})")
    return None


def checkpoint_problem(checkpoint: Path) -> str | None:
    """None if every file of `checkpoint` reads back, else "<file>: <what is wrong>".

    Cheap structural checks, no tensors built: a safetensors file must be as long as its
    header says; the torch.save files (optimizer, scheduler, RNG, EMA) are zip archives
    whose every member must match its CRC; JSON files must parse.
    """
    for path in sorted(checkpoint.iterdir()):
        if not path.is_file():
            continue
        try:
            if path.suffix == ".safetensors":
                _check_safetensors(path)
            elif path.suffix == ".json":
                json.loads(path.read_text())
            elif path.suffix in (".bin", ".pkl", ".pt", ".pth"):
                _check_zip(path)
        except (ValueError, OSError, zipfile.BadZipFile) as err:
            return f"{path}: truncated or corrupt ({err})"
    return None


def _check_safetensors(path: Path) -> None:
    """Header readable and the file exactly as long as the tensors it declares."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{size} bytes, shorter than a safetensors header")
        header_len = int.from_bytes(head, "little")
        if header_len > size - 8:
            raise ValueError(f"header of {header_len} bytes in a {size}-byte file")
        header = json.loads(f.read(header_len))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
              default=0)
    if size != 8 + header_len + end:
        raise ValueError(f"{size} bytes, the header declares {8 + header_len + end}")


def _check_zip(path: Path) -> None:
    """A torch.save archive: central directory present and every member's CRC right."""
    with zipfile.ZipFile(path) as archive:
        bad = archive.testzip()
    if bad is not None:
        raise ValueError(f"member {bad} fails its CRC check")


def resume_config_path(checkpoint: Path) -> Path:
    """The config.json a checkpoint was written with: its own, else its run folder's."""
    for path in (checkpoint / "config.json", checkpoint.parent.parent / "config.json"):
        if path.is_file():
            return path
    raise CheckpointError(f"cannot resume from {checkpoint}: no config.json in it or its "
                          "run folder")


def check_resume_config(checkpoint: Path, saved: Config,
                        cfg: Config) -> dict[str, tuple[Any, Any]]:
    """Refuse to resume `checkpoint` (written with `saved`) under a different model or
    train.seed (ConfigError naming the fields); returns every other changed field,
    "section.field" -> (old, new), which the resume applies (the trainer sets the new
    optim values on the restored optimizer) and records in config.json."""
    diffs = config_changes(saved, cfg, "model")
    if diffs:
        raise ConfigError(f"refusing to resume from {checkpoint}: the model differs from "
                          f"the checkpoint's ({'; '.join(diffs)})")
    if saved.train.seed != cfg.train.seed:
        # The seed fixed the initial weights and fixes the data order and noise: a run
        # continued under another seed would be recorded as a run that never happened.
        raise ConfigError(f"refusing to resume from {checkpoint}: train.seed={cfg.train.seed} "
                          f"but the run was started with train.seed={saved.train.seed}")
    return config_diff(saved, cfg)


def commit_checkpoint(tmp: Path, final: Path) -> None:
    """Make the complete folder `tmp` the checkpoint `final`: flush, rename, flush the rename."""
    fsync_tree(tmp)
    remove_tree(final)  # only if a previous run wrote this same step
    os.replace(tmp, final)
    fsync(final.parent)  # make the rename itself durable


def remove_tree(path: Path) -> None:
    """Rename out of the checkpoint namespace first, then delete (safe if killed midway)."""
    if not path.exists():
        return
    doomed = path.with_name(path.name + ".deleting")
    if doomed.exists():
        shutil.rmtree(doomed)
    os.replace(path, doomed)
    shutil.rmtree(doomed)


def remove_leftovers(run_dir: Path) -> None:
    """Delete checkpoint folders whose write or deletion a kill cut short, and the
    temporary files of an EMA export a kill cut short (`uvic.files.atomic_write` names)."""
    for pattern in (f"{CHECKPOINT_PREFIX}*.tmp", f"{CHECKPOINT_PREFIX}*.deleting"):
        for leftover in (run_dir / "checkpoints").glob(pattern):
            shutil.rmtree(leftover)
    for leftover in run_dir.glob(f".{RUN_EMA}.tmp*"):
        leftover.unlink()


def sync_run_ema(run_dir: Path) -> bool:
    """Make `<run>/ema.safetensors` a copy of the latest checkpoint's EMA if it is not one
    (a kill between a checkpoint's rename and the EMA export leaves it one behind).
    Returns True when it was refreshed."""
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        return False
    source, target = checkpoints[-1] / RUN_EMA, run_dir / RUN_EMA
    if target.is_file() and same_file_content(source, target):
        return False
    with atomic_write(target) as tmp:
        shutil.copyfile(source, tmp)
    return True


def same_file_content(a: Path, b: Path) -> bool:
    """Whether two files hold the same bytes (sizes first, then SHA-256)."""
    return a.stat().st_size == b.stat().st_size and file_sha256(a) == file_sha256(b)


def previous_run_outputs(run_dir: Path) -> list[str]:
    """The names of RUN_OUTPUTS present in `run_dir` (a previous run's results)."""
    return [name for name in RUN_OUTPUTS if (run_dir / name).exists()]


def clear_run_outputs(run_dir: Path) -> None:
    """Delete a previous run's outputs (RUN_OUTPUTS) from `run_dir`: `--overwrite`."""
    for name in previous_run_outputs(run_dir):
        path = run_dir / name
        if path.is_dir():
            remove_tree(path)
        else:
            path.unlink()


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file (identifies a checkpoint in results and sample folders)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def checkpoint_step(ckpt: str | Path) -> int | None:
    """Training step of a weights file if known: `trainer_state.json` beside it, the
    checkpoint `checkpoints/step_N/` holding the same file (a run's top-level
    ema.safetensors), or a `step_N` in its folder or file name."""
    ckpt = Path(ckpt)
    state = ckpt.parent / TRAINER_STATE
    if state.is_file():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            return int(json.loads(state.read_text())["step"])
    size, digest = ckpt.stat().st_size, None
    for other in reversed(list_checkpoints(ckpt.parent)):
        copy = other / ckpt.name
        if not copy.is_file() or copy.stat().st_size != size:
            continue
        digest = digest or file_sha256(ckpt)
        if file_sha256(copy) == digest:
            return checkpoint_step(copy)
    match = re.search(r"step[_-]?(\d+)", ckpt.parent.name + "/" + ckpt.stem)
    return int(match.group(1)) if match else None
