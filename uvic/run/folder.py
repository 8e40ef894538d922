"""A run folder (`train.output_dir`): `RunFolder` owns the path of everything in it, and
finds, checks and commits its checkpoints.

Checkpoints are written to `checkpoints/step_N.tmp/` and committed by an atomic rename
(`commit_checkpoint`), and folders are renamed out of the checkpoint namespace before they
are deleted (`remove_tree`), so a kill never leaves a folder that looks like a complete
checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from uvic.files import atomic_write, fsync, fsync_tree
from uvic.run.lock import RunLock
from uvic.run.weights import CheckpointError, file_sha256, nonfinite_entry, nonfinite_message

CHECKPOINT_PREFIX = "step_"  # checkpoints/step_000123/


# besides a checkpoint or run folder path; "latest-or-new" starts the run if it has no
# checkpoint yet, the others refuse
RESUME_CHOICES = ("latest", "latest-intact", "latest-or-new")


def checkpoint_name(step: int) -> str:
    """Folder name of the checkpoint of `step` (also the name of its sample grid)."""
    return f"{CHECKPOINT_PREFIX}{step:06d}"


class RunFolder:
    """The paths of one run folder, and what is done to the folder as a whole: its
    checkpoints listed and resolved for `--resume`, a previous run's outputs found or
    cleared, the leftovers of a kill removed."""

    CONFIG = "config.json"  # the run's config and what each resume changed (uvic.run.prepare)
    LOG = "log.jsonl"  # one line per log step: step, loss, lr, grad_norm, images/s, time
    SUMMARY = "summary.json"  # written at the end of a session
    SAMPLES = "samples"  # step_N.png: sample grids of the EMA model
    TENSORBOARD = "tensorboard"  # the tracker's logging folder
    # step_N/: Accelerate's state, trainer_state.json, config.json and ema.safetensors
    CHECKPOINTS = "checkpoints"
    EMA = "ema.safetensors"  # in each checkpoint, and the latest one's at the root
    TRAINER_STATE = "trainer_state.json"  # in every complete checkpoint: the data position
    POSTHOC_EMA = "posthoc_ema"  # snapshots of the post-hoc EMA profiles
    # what a run writes (besides the lock): a fresh start refuses to overwrite it
    OUTPUTS = (CHECKPOINTS, EMA, LOG, SUMMARY, SAMPLES, TENSORBOARD, CONFIG, POSTHOC_EMA)

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.root)!r})"

    @classmethod
    def of_checkpoint(cls, checkpoint: str | Path) -> RunFolder:
        """The run folder of the checkpoint folder `<run>/checkpoints/step_N`."""
        return cls(Path(checkpoint).parent.parent)

    @classmethod
    def of_weights(cls, path: str | Path) -> RunFolder:
        """The run a weights file belongs to: the run above `checkpoints/step_N/` for a
        checkpoint's file, else the file's own folder (a run's `ema.safetensors`)."""
        folder = Path(path).parent
        if folder.parent.name == cls.CHECKPOINTS:
            return cls.of_checkpoint(folder)
        return cls(folder)

    # ------------------------------------------------------------------ paths

    @property
    def config(self) -> Path:
        return self.root / self.CONFIG

    @property
    def log(self) -> Path:
        return self.root / self.LOG

    @property
    def summary(self) -> Path:
        return self.root / self.SUMMARY

    @property
    def samples(self) -> Path:
        return self.root / self.SAMPLES

    @property
    def tensorboard(self) -> Path:
        return self.root / self.TENSORBOARD

    @property
    def ema(self) -> Path:
        return self.root / self.EMA

    @property
    def posthoc_ema(self) -> Path:
        return self.root / self.POSTHOC_EMA

    @property
    def checkpoints_dir(self) -> Path:
        return self.root / self.CHECKPOINTS

    def checkpoint(self, step: int) -> Path:
        """The folder of the checkpoint of `step` (complete once it exists)."""
        return self.checkpoints_dir / checkpoint_name(step)

    def staging(self, step: int) -> Path:
        """Where the checkpoint of `step` is written before `commit_checkpoint` renames it."""
        final = self.checkpoint(step)
        return final.with_name(final.name + ".tmp")

    def sample_grid(self, step: int) -> Path:
        """The sample grid of `step`."""
        return self.samples / f"{checkpoint_name(step)}.png"

    def lock(self) -> RunLock:
        """The folder's lock (not yet taken): one run at a time."""
        return RunLock(self.root)

    # ------------------------------------------------------------------ checkpoints

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints (`checkpoints/step_N/` with a trainer state), oldest first.

        Folders still being written (`.tmp`) or deleted are ignored.
        """
        root = self.checkpoints_dir
        if not root.is_dir():
            return []
        found = []
        for path in root.iterdir():
            number = path.name[len(CHECKPOINT_PREFIX):]
            if (path.name.startswith(CHECKPOINT_PREFIX) and number.isdigit()
                    and (path / self.TRAINER_STATE).is_file()):
                found.append((int(number), path))
        return [path for _, path in sorted(found)]

    def latest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint, None before the first."""
        found = self.checkpoints()
        return found[-1] if found else None

    def resolve_resume(self, resume: str | None,
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
            checkpoints = self.checkpoints()
            if not checkpoints and resume != "latest-or-new":
                raise CheckpointError(f"--resume {resume}: no checkpoint in {self.root} to "
                                      "resume (check train.output_dir; --resume latest-or-new "
                                      "starts a new run where there is none)")
        else:
            path = Path(resume)
            checkpoints = ([path] if (path / self.TRAINER_STATE).is_file()
                           else RunFolder(path).checkpoints())
            if not checkpoints:
                raise CheckpointError(f"--resume {resume}: not a checkpoint folder (no "
                                      f"{self.TRAINER_STATE}) nor a run folder with checkpoints")
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
            raise CheckpointError(f"--resume {resume}: no intact checkpoint in {self.root} "
                                  f"(newest: {checkpoint_problem(checkpoints[-1])})")
        return None

    def prune(self, keep_last: int, keep_steps: tuple[int, ...] | list[int]) -> None:
        """Delete all but the newest `keep_last` (at least one) checkpoints, never those
        of `keep_steps`."""
        kept = {checkpoint_name(step) for step in keep_steps}
        rotating = [c for c in self.checkpoints() if c.name not in kept]
        for old in rotating[:-max(keep_last, 1)]:
            remove_tree(old)

    # ------------------------------------------------------------------ the folder as a whole

    def previous_outputs(self) -> list[str]:
        """The names of OUTPUTS present (a previous run's results)."""
        return [name for name in self.OUTPUTS if (self.root / name).exists()]

    def clear_outputs(self) -> None:
        """Delete a previous run's outputs (OUTPUTS): `--overwrite`."""
        for name in self.previous_outputs():
            path = self.root / name
            if path.is_dir():
                remove_tree(path)
            else:
                path.unlink()

    def remove_leftovers(self) -> None:
        """Delete checkpoint folders whose write or deletion a kill cut short, and the
        temporary files of an EMA export a kill cut short (`uvic.files.atomic_write`
        names)."""
        for pattern in (f"{CHECKPOINT_PREFIX}*.tmp", f"{CHECKPOINT_PREFIX}*.deleting"):
            for leftover in self.checkpoints_dir.glob(pattern):
                shutil.rmtree(leftover)
        for leftover in self.root.glob(f".{self.EMA}.tmp*"):
            leftover.unlink()

    def sync_ema(self) -> bool:
        """Make `ema.safetensors` a copy of the latest checkpoint's EMA if it is not one (a
        kill between a checkpoint's rename and the EMA export leaves it one behind).
        Returns True when it was refreshed."""
        latest = self.latest_checkpoint()
        if latest is None:
            return False
        source, target = latest / self.EMA, self.ema
        if target.is_file() and same_file_content(source, target):
            return False
        with atomic_write(target) as tmp:
            shutil.copyfile(source, tmp)
        return True


# --------------------------------------------------------------------------- one checkpoint


def trainer_state(checkpoint: Path) -> dict[str, Any]:
    """The `trainer_state.json` of a checkpoint folder (step, data position, launch)."""
    return json.loads((checkpoint / RunFolder.TRAINER_STATE).read_text())


def checkpoint_problem(checkpoint: Path) -> str | None:
    """None if every file of `checkpoint` reads back and holds finite values, else
    "<file>: <what is wrong>".

    Structure first: a safetensors file must be as long as its header says; the torch.save
    files (optimizer, scheduler, RNG, EMA) are zip archives whose every member must match
    its CRC; JSON files must parse. Then values: every floating-point tensor of the
    weights and optimizer files must be finite (a resume must never start from NaN).
    Files that hold more than tensors (Accelerate's RNG states) are checked for structure
    only.
    """
    for path in sorted(checkpoint.iterdir()):
        if not path.is_file():
            continue
        try:
            values: object = None
            if path.suffix == ".safetensors":
                _check_safetensors(path)
                values = load_file(str(path), device="cpu")
            elif path.suffix == ".json":
                json.loads(path.read_text())
            elif path.suffix in (".bin", ".pkl", ".pt", ".pth"):
                _check_zip(path)
                with contextlib.suppress(pickle.UnpicklingError):  # not tensors only
                    values = torch.load(path, map_location="cpu", weights_only=True)
        except (ValueError, OSError, zipfile.BadZipFile, SafetensorError) as err:
            return f"{path}: truncated or corrupt ({err})"
        bad = nonfinite_entry(values)
        if bad is not None:
            return f"{path}: {nonfinite_message(bad)}"
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
    for path in (checkpoint / RunFolder.CONFIG, RunFolder.of_checkpoint(checkpoint).config):
        if path.is_file():
            return path
    raise CheckpointError(f"cannot resume from {checkpoint}: no config.json in it or its "
                          "run folder")


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


def same_file_content(a: Path, b: Path) -> bool:
    """Whether two files hold the same bytes (sizes first, then SHA-256)."""
    return a.stat().st_size == b.stat().st_size and file_sha256(a) == file_sha256(b)


def checkpoint_step(ckpt: str | Path) -> int | None:
    """Training step of a weights file if known: `trainer_state.json` beside it, the
    checkpoint `checkpoints/step_N/` holding the same file (a run's top-level
    ema.safetensors), or a `step_N` in its folder or file name."""
    ckpt = Path(ckpt)
    state = ckpt.parent / RunFolder.TRAINER_STATE
    if state.is_file():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            return int(json.loads(state.read_text())["step"])
    size, digest = ckpt.stat().st_size, None
    for other in reversed(RunFolder(ckpt.parent).checkpoints()):
        copy = other / ckpt.name
        if not copy.is_file() or copy.stat().st_size != size:
            continue
        digest = digest or file_sha256(ckpt)
        if file_sha256(copy) == digest:
            return checkpoint_step(copy)
    match = re.search(r"step[_-]?(\d+)", ckpt.parent.name + "/" + ckpt.stem)
    return int(match.group(1)) if match else None
