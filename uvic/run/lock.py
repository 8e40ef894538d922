"""One run per run folder: an exclusive lock held for the whole life of a training run.

Two runs started into the same `train.output_dir` would interleave their logs and
overwrite each other's checkpoints. The first run takes an exclusive `flock` on
`<run>/.run.lock` and writes who holds it (pid, host, start time) into it; a second run
fails to take the lock and is refused with a message naming the holder. The operating
system drops the lock when the holder exits, however it exits (even `kill -9`), so a
stale lock never blocks a resume.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".run.lock"


class RunLockError(RuntimeError):
    """The run folder is held by another run, or cannot be written."""


class RunLock:
    """Exclusive lock on a run folder; `acquire()` it, `release()` it when the run ends."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None
        self._created_dir = False

    def acquire(self) -> RunLock:
        """Take the lock (creating the run folder if needed) or raise RunLockError."""
        try:
            self._created_dir = not self.run_dir.exists()
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise RunLockError(f"cannot write to the run folder {self.run_dir} "
                               f"({err.strerror or err})") from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunLockError(f"{self.run_dir} is in use by another run ({holder}); wait for "
                               "it to end or set train.output_dir to another folder") from None
        self._fd = fd
        _write_holder(fd)
        return self

    def release(self) -> None:
        """Drop the lock. If acquiring it created the run folder and the folder holds
        nothing else, remove both (a run refused at start leaves no trace)."""
        if self._fd is None:
            return
        if self._created_dir and [p.name for p in self.run_dir.iterdir()] == [LOCK_FILE]:
            self.path.unlink()
            self.run_dir.rmdir()
        os.close(self._fd)
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def _write_holder(fd: int) -> None:
    """Record the holder in the lock file (for the refusal message of a second run)."""
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)


def _read_holder(fd: int) -> str:
    """"pid N on HOST since TIME" from the lock file, or "unknown holder"."""
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode())
        return f"pid {record['pid']} on {record['host']} since {record['since']}"
    except (ValueError, KeyError, TypeError, OSError):
        return "unknown holder"
