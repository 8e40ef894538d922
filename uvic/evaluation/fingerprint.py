"""Fingerprints of what reference statistics were computed from, so that a cache is used only
for the data, feature extractor, mode and resolution it was built from.

For a folder of images: each image's relative path, size and modification time (one `stat`
a file); for a few large files (CIFAR-10's batches), their size, time and a hash of their
first and last MiB. The fingerprint is stored inside the statistics file, and its `digest`
in every FID result (`reference_digest`); `change` says in one line what differs.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

VERSION = 1  # of the fingerprint's layout: a new layout rebuilds every cache once
SAMPLE_BYTES = 1 << 20  # hashed at each end of a single file


def file_digest(path: str | Path) -> str:
    """Hash of a file's size and its first and last MiB: a cheap content identity for large
    files (an .npz's last MiB holds its zip directory, with the CRC of every array)."""
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(SAMPLE_BYTES))
        if size > SAMPLE_BYTES:
            f.seek(max(SAMPLE_BYTES, size - SAMPLE_BYTES))
            h.update(f.read())
    return h.hexdigest()[:16]


def files_source(root: str | Path, files: Iterable[str | Path], content: bool = False
                 ) -> dict[str, Any]:
    """Fingerprint of `files` under `root`: [relative path, size, mtime in ns] for each,
    sorted (with `content`, each file's `file_digest` too; a missing file: size None)."""
    root = Path(root)
    entries = []
    for path in map(Path, files):
        name = path.relative_to(root).as_posix()
        try:
            stat = path.stat()
        except FileNotFoundError:
            entries.append([name, None, None, *([None] if content else [])])
            continue
        entries.append([name, stat.st_size, stat.st_mtime_ns,
                        *([file_digest(path)] if content else [])])
    return {"kind": "files", "files": sorted(entries)}


def extractor_identity(feat_extractor: Callable | None, name: str,
                       weights: Path | None = None) -> dict[str, Any]:
    """The feature extractor: its name, and its weights (`file_digest` of the Inception
    weights file; a hash of a module's state dict, e.g. a stand-in's projection)."""
    identity: dict[str, Any] = {"name": name}
    if weights is not None:
        identity["weights"] = file_digest(weights) if weights.is_file() else None
    elif isinstance(feat_extractor, torch.nn.Module):
        h = hashlib.sha256()
        for key, value in sorted(feat_extractor.state_dict().items()):
            h.update(key.encode())
            h.update(value.detach().cpu().flatten().contiguous().view(torch.uint8).numpy())
        identity["weights"] = h.hexdigest()[:16]
    return identity


def digest(fingerprint: dict[str, Any]) -> str:
    """A short hash of a fingerprint (what a result records of its reference)."""
    text = json.dumps(fingerprint, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def encode(fingerprint: dict[str, Any]) -> np.ndarray:
    """The fingerprint as a uint8 array of UTF-8 JSON, to store in an .npz."""
    return np.frombuffer(json.dumps(fingerprint, separators=(",", ":")).encode(), np.uint8)


def stored(path: str | Path) -> dict[str, Any] | None:
    """The fingerprint stored in a statistics .npz, or None (built before uvic stored one,
    or not built by uvic). Raises OSError / ValueError on a file that is no .npz."""
    with np.load(path) as data:
        if "fingerprint" not in data.files:
            return None
        return json.loads(data["fingerprint"].tobytes())


def stale(path: str | Path, fingerprint: dict[str, Any]) -> str:
    """Why the statistics file at `path` does not fit `fingerprint` (see `change`), or ""
    when it was built from exactly that."""
    try:
        return change(stored(path), fingerprint) or ""
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        return f"unreadable ({err})"


def change(old: dict[str, Any] | None, new: dict[str, Any]) -> str | None:
    """What differs between the fingerprint statistics were built from (`old`) and the
    current one, in one line; None when they are the same."""
    if old is None:
        return "they record no fingerprint of their source (built by an older uvic)"
    if old == new:
        return None
    if old.get("version") != new.get("version"):
        return f"fingerprint layout {old.get('version')} -> {new.get('version')}"
    for key, what in (("features", "feature extractor"), ("mode", "mode"),
                      ("res", "resolution")):
        if old.get(key) != new.get(key):
            return f"{what} {old.get(key)} -> {new.get(key)}"
    return _source_change(old.get("source") or {}, new.get("source") or {})


def _source_change(old: dict[str, Any], new: dict[str, Any]) -> str:
    if old.get("kind") != "files" or new.get("kind") != "files":
        return f"source {json.dumps(old, sort_keys=True)} -> {json.dumps(new, sort_keys=True)}"
    before = {entry[0]: entry[1:] for entry in old["files"]}
    after = {entry[0]: entry[1:] for entry in new["files"]}
    changed = [name for name in after if name in before and before[name] != after[name]]
    added = [name for name in after if name not in before]
    removed = [name for name in before if name not in after]
    parts = []
    for label, names in (("changed", changed), ("added", added), ("removed", removed)):
        if names:
            first = names[0]
            if label == "changed":
                first += f" ({_entry_change(before[first], after[first])})"
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            parts.append(f"{label} {first}{more}")
    return (f"source files changed since they were built ({len(before)} -> {len(after)} "
            f"files): " + "; ".join(parts))


def _entry_change(old: list[Any], new: list[Any]) -> str:
    """How one file's [size, mtime_ns, (digest)] differ."""
    parts = []
    if old[0] != new[0]:
        parts.append(f"size {old[0]} -> {new[0]} bytes")
    if old[1] != new[1]:
        parts.append(f"modified {_time(old[1])} -> {_time(new[1])}")
    if old[2:] != new[2:]:
        parts.append("content differs")
    return ", ".join(parts)


def _time(mtime_ns: int | None) -> str:
    if mtime_ns is None:
        return "missing"
    return datetime.fromtimestamp(mtime_ns / 1e9, UTC).isoformat(timespec="microseconds")
