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
import json
import os
import re
import shutil
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from uvic.config import (
    Config,
    ConfigError,
    ModelConfig,
    config_changes,
    config_diff,
    from_dict,
    load_config,
)
from uvic.run.files import atomic_write, fsync, fsync_tree
from uvic.run.weights import CheckpointError, file_sha256

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


def model_metadata(model: ModelConfig) -> dict[str, str]:
    """Safetensors metadata recording the model config of the weights in the file
    (`save_safetensors(..., metadata=model_metadata(cfg.model))`), read back by
    `stored_model_config`."""
    return {MODEL_METADATA_KEY: json.dumps(dataclasses.asdict(model), sort_keys=True)}


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
        from uvic.models.uvit import resolve_attention  # here: uvit imports the kernels

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
    temporary files of an EMA export a kill cut short (`uvic.run.files.atomic_write` names)."""
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
