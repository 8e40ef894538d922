"""Resumable feature extraction: preallocated ``.npy`` arrays filled chunk by chunk.

A chunk is committed by flushing the arrays, then atomically rewriting ``progress.json``,
so a process killed at any moment leaves every committed chunk intact and a restart redoes
only the others. A restart with other settings (the fingerprint) is refused, naming the
setting: one folder never mixes two extractions.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from uvic.data.base import DatasetError
from uvic.files import atomic_write, write_json

# {"fingerprint": {...settings...}, "num_chunks": K, "done_chunks": [...],
#  "skipped": [{"index": row, "file": ..., "error": ...}, ...], "complete": bool}
PROGRESS_FILE = "progress.json"


def as_list(batch: list[Any]) -> list[Any]:
    """A DataLoader `collate_fn` that keeps a batch as the list of its items (images of
    different sizes, or failed reads, stay apart)."""
    return batch


def write_npy(path: Path, array: np.ndarray) -> None:
    """Save `array` to `path` atomically (a killed run never leaves half a file)."""
    with atomic_write(path, suffix=".npy") as tmp:
        np.save(tmp, array)


def check_same(path: Path, old: dict[str, Any], new: dict[str, Any]) -> None:
    """Refuse settings that differ from those recorded in `path`, naming the first key."""
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            raise DatasetError(
                f"{path} was written with {key}={old.get(key)!r}, now {key}={new.get(key)!r}; "
                "use another --out folder or delete it")


class ChunkedArrays:
    """The arrays of one extraction folder and its progress record.

    `arrays` maps file names to (dtype, shape), rows first. On a fresh start (no
    ``progress.json``), `write_static` writes the folder's other files, then the arrays are
    allocated and an empty progress record written; on a restart the fingerprint must match
    and the arrays are reopened for writing.
    """

    def __init__(self, folder: str | Path, fingerprint: dict[str, Any], num_rows: int,
                 chunk_size: int, arrays: dict[str, tuple[str, tuple[int, ...]]],
                 write_static: Callable[[], None]) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.num_rows, self.chunk_size = num_rows, chunk_size
        self.num_chunks = -(-num_rows // chunk_size)
        self.progress_path = self.folder / PROGRESS_FILE
        if self.progress_path.is_file():
            self.state = json.loads(self.progress_path.read_text())
            check_same(self.progress_path, self.state["fingerprint"], fingerprint)
            mode = "r+"
        else:
            write_static()
            self.state = {"fingerprint": fingerprint, "num_chunks": self.num_chunks,
                          "done_chunks": [], "skipped": [], "complete": False}
            mode = "w+"
        self.arrays = {name: self._open(name, dtype, shape, mode)
                       for name, (dtype, shape) in arrays.items()}
        if mode == "w+":
            write_json(self.progress_path, self.state, indent=1)

    def _open(self, name: str, dtype: str, shape: tuple[int, ...], mode: str) -> np.ndarray:
        path = self.folder / name
        try:
            array = np.lib.format.open_memmap(path, mode=mode, dtype=dtype, shape=shape)
        except (OSError, ValueError) as err:
            raise DatasetError(f"cannot reopen {path} to resume ({err}); delete "
                               f"{self.folder} and extract again") from err
        if array.shape != tuple(shape) or array.dtype != np.dtype(dtype):
            raise DatasetError(f"{path} holds {array.dtype} {array.shape}, expected {dtype} "
                               f"{tuple(shape)}; delete {self.folder} and extract again")
        return array

    @property
    def complete(self) -> bool:
        return bool(self.state["complete"])

    def pending(self, max_chunks: int | None = None) -> list[int]:
        """The chunks not committed yet, in order (at most `max_chunks`)."""
        done = set(self.state["done_chunks"])
        return [c for c in range(self.num_chunks) if c not in done][:max_chunks]

    def rows(self, chunk: int) -> range:
        """The rows of `chunk`."""
        return range(chunk * self.chunk_size, min((chunk + 1) * self.chunk_size, self.num_rows))

    def commit(self, chunk: int, skipped: Sequence[dict[str, Any]] = ()) -> None:
        """Flush the arrays, then record `chunk` as done (with the rows it skipped)."""
        for array in self.arrays.values():
            array.flush()
        self.state["done_chunks"] = sorted({*self.state["done_chunks"], chunk})
        self.state["skipped"] = self.state["skipped"] + list(skipped)
        self.state["complete"] = len(self.state["done_chunks"]) == self.num_chunks
        write_json(self.progress_path, self.state, indent=1)
