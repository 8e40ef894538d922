"""How a run may use its folder: the checks and repairs of a start, the config.json it keeps,
and the one-line account of a checkpoint write that failed. Each function returns a
message or raises OSError (a resume under a changed model or seed: ConfigError), which
the trainer turns into its one-line errors.

A run's `config.json` is the config the run is at now, with what each resume changed
listed under `resumes`, oldest first; `config_history` undoes them (docs/training.md).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from torch import nn

from uvic.config import (
    RESUMES_KEY,
    Config,
    ConfigError,
    from_dict,
    load_config,
    to_dict,
)
from uvic.config.compare import config_changes, config_diff
from uvic.files import truncate_log, write_json
from uvic.run.folder import RunFolder

try:  # safetensors reports a full disk as its own error
    from safetensors import SafetensorError
except ImportError:  # pragma: no cover - older safetensors
    SafetensorError = RuntimeError


def fresh_start_problem(run: RunFolder, resume: str | None, overwrite: bool) -> str | None:
    """Why a start from step 0 into `run` would overwrite a previous run (None: fine).

    `--resume latest` without a checkpoint may restart a run killed before its first
    checkpoint (config.json, log lines), never one that exported weights or finished;
    `overwrite` allows any fresh start.
    """
    found = run.previous_outputs()
    if resume is not None:
        found = [name for name in found if name in (run.EMA, run.SUMMARY)]
    if not found or overwrite:
        return None
    latest = run.latest_checkpoint()
    what = (f"already has checkpoints (latest {latest.name})" if latest is not None
            else f"already holds a previous run ({', '.join(found)})")
    return (f"{run.root} {what}; pass --resume latest to continue it, --overwrite to "
            "replace it, or set train.output_dir to a new folder")


def prepare_run_dir(run: RunFolder, cfg: Config, resumes: list[dict[str, Any]], step: int,
                    overwrite: bool, say: Callable[[str], None]) -> None:
    """The run folder before the first step (main process): leftovers of a write or
    deletion a kill cut short removed, a previous run's outputs removed (`overwrite`),
    config.json written (`cfg` and its resume history), log.jsonl cut back to `step`,
    ema.safetensors equal to the latest checkpoint's. Raises OSError when the folder
    cannot be written."""
    run.remove_leftovers()  # first: frees the space a kill left taken
    if overwrite:
        run.clear_outputs()
    save_run_config(cfg, run.config, resumes)
    # drop the lines of steps that will be redone (or cut short by a kill)
    truncate_log(run.log, step)
    if run.sync_ema():
        say(f"note: {run.ema} was behind the latest checkpoint (a kill during "
            "its export); refreshed")


def save_run_config(cfg: Config, path: Path, resumes: list[dict[str, Any]]) -> None:
    """Write a run's config.json: `cfg` and, under `resumes`, what each resume changed."""
    write_json(path, {**to_dict(cfg), RESUMES_KEY: resumes})


def read_run_config(path: Path) -> tuple[Config, list[dict[str, Any]]]:
    """A run's (or checkpoint's) config.json: the config and its resume history (oldest
    first; none in a file written before histories were kept)."""
    cfg = load_config(path)
    resumes = json.loads(path.read_text()).get(RESUMES_KEY, [])
    if not (isinstance(resumes, list) and all(
            isinstance(r, dict) and isinstance(r.get("step"), int)
            and isinstance(r.get("changes"), dict) for r in resumes)):
        raise ConfigError(f"{path}: {RESUMES_KEY} must be a list of {{step, changes, time}}")
    return cfg, resumes


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


def resume_record(step: int, changes: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
    """The history entry of a resume at `step` that changed `changes` (key -> old, new)."""
    return {"step": step, "changes": {key: list(pair) for key, pair in changes.items()},
            "time": datetime.now(UTC).isoformat(timespec="seconds")}


def config_history(path: Path) -> list[tuple[int, Config]]:
    """Every config a run ran with, oldest first, each with the step after which it ran:
    `[(0, original), (step of the first resume that changed something, the config from
    then on), ...]`; the last is the file's own config. The original is the file's config
    with each recorded change undone, newest first."""
    cfg, resumes = read_run_config(path)
    values = to_dict(cfg)
    history = [(resumes[-1]["step"] if resumes else 0, cfg)]
    for index in range(len(resumes) - 1, -1, -1):
        for key, (old, _new) in resumes[index]["changes"].items():
            section, _, name = key.rpartition(".")
            (values[section] if section else values)[name] = old
        since = resumes[index - 1]["step"] if index else 0
        history.insert(0, (since, from_dict(values, source=str(path))))
    return history


def checkpoint_bytes(run: RunFolder, model: nn.Module) -> int:
    """Size of the latest checkpoint, else 4 float32 copies of the weights (model, EMA,
    two Adam moments)."""
    latest = run.latest_checkpoint()
    if latest is not None:
        return sum(f.stat().st_size for f in latest.rglob("*") if f.is_file())
    return 4 * sum(p.numel() * p.element_size() for p in model.parameters())


def write_failure(err: Exception, tmp: Path, run: RunFolder, needed: int) -> str | None:
    """One line for a failed checkpoint write into `tmp`: the path, why, and (disk full)
    the space a checkpoint needs; None if `err` is not a write failure (a bug: keep its
    traceback).

    torch.save reports a full disk as "unexpected pos" (RuntimeError) and safetensors
    as SafetensorError, so a full disk is also recognised by the space left.
    """
    if isinstance(err, OSError):
        where, why = err.filename or tmp, err.strerror or str(err)
    elif shutil.disk_usage(tmp.parent if tmp.parent.exists() else run.root).free < needed:
        where, why = tmp, os.strerror(errno.ENOSPC)
    elif isinstance(err, SafetensorError):
        where, why = tmp, str(err).strip().splitlines()[0]
    else:
        return None
    message = f"cannot write checkpoint {where}: {why}"
    if why == os.strerror(errno.ENOSPC):
        message += f" (a checkpoint needs about {needed / 2**20:.0f} MiB)"
    latest = run.latest_checkpoint()
    return message + (f"; the last good checkpoint {latest} is kept" if latest else "")
