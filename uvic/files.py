"""Writing files so that a kill never leaves a half-written one: the one atomic-write helper.

Every file a run, an evaluation or the feature extraction writes (configs, checkpoints,
JSON results, sample PNGs, statistics, logs) goes through `atomic_write`: the content is
written to a hidden temporary name in the same folder and renamed onto the final name,
which is atomic on POSIX filesystems. Readers see the old file or the new one, never a
truncated one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from uvic.config import Config, to_dict


@contextlib.contextmanager
def atomic_write(path: str | Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside `path`; when the block ends without error, rename it
    onto `path`. On error the temporary file is removed and `path` is untouched.

    `suffix` ends the temporary name, for writers that append their own extension
    (`np.save` adds ".npy" and `np.savez` ".npz" unless the name already ends with it).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}{suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp)
        else:
            tmp.unlink(missing_ok=True)


def write_text(path: str | Path, text: str) -> Path:
    """Write `text` to `path` atomically; returns the path."""
    with atomic_write(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def write_json(path: str | Path, obj: Any, indent: int = 2, **kwargs: Any) -> Path:
    """Write `obj` as indented JSON (with a final newline) to `path` atomically."""
    return write_text(path, json.dumps(obj, indent=indent, **kwargs) + "\n")


def save_config(cfg: Any, path: str | Path) -> Path:
    """Write a config (a `uvic.config.Config`, as `to_dict` gives it: strict JSON, or any
    dataclass) as JSON, atomically; a run's own config.json, with its resume history, is
    `uvic.run.prepare.save_run_config`."""
    return write_json(path, to_dict(cfg) if isinstance(cfg, Config) else dataclasses.asdict(cfg))


def fsync(path: str | Path) -> None:
    """Flush one file or folder entry to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: str | Path) -> None:
    """Flush every file under `folder` to disk (so a folder renamed into place is complete)."""
    for path in Path(folder).rglob("*"):
        if path.is_file():
            fsync(path)


def truncate_log(path: str | Path, last_step: int) -> None:
    """Keep the lines of a JSON-lines log (`log.jsonl`) whose "step" is <= `last_step`;
    a line cut short by a kill is dropped too. No file: nothing to do."""
    path = Path(path)
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines()
            if (step := _line_step(line)) is not None and step <= last_step]
    write_text(path, "".join(line + "\n" for line in keep))


def _line_step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None
