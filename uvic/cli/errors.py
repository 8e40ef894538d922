"""The one error path of the programs: a failure is one line on stderr, the last one shown,
also under a launcher (`accelerate launch`, torchrun) that reports the failed process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

# Errors whose message names the file, key or value at fault: a program ends on one with
# that line. "module:Class" names a class of a module that may not be loaded (then the
# error cannot be one of its).
EXPECTED = (ValueError, FileNotFoundError, "uvic.training.launch:TrainError")
Kinds = Sequence[type[BaseException] | str]


def first_line(err: Exception) -> str:
    """The first line of an error's message (its type's name if it has none)."""
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def report_error(line: str) -> None:
    """Print the one-line error on stderr. Under torch's elastic launcher (`accelerate
    launch --multi_gpu`, torchrun), which gives each process an error file and ends a
    failed launch with a report of them, write it there too, and print it from rank 0
    only: the report shows every process's line, stderr shows it once. Under a launcher
    that reports a failure after it (`after_launcher`), the line is printed after that."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # the launcher shows a plain-string "message" as it is
        with contextlib.suppress(OSError):
            Path(error_file).write_text(json.dumps({"message": line,
                                                    "timestamp": int(time.time())}))
    if (not error_file or int(os.environ.get("RANK", "0")) == 0) and not after_launcher(line):
        print(line, file=sys.stderr)


# The error line once the launcher (process argv[1]) has ended (gone, or a zombie not yet
# reaped): run by a process of its own, which waits for it (at most a minute) and writes
# to the stderr they share.
_PRINT_AFTER = """import sys, time
pid, end = sys.argv[1], time.monotonic() + 60
while time.monotonic() < end:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] in "ZX":
                break
    except (OSError, IndexError):
        break
    time.sleep(0.02)
sys.stderr.write(sys.argv[2] + "\\n")
"""
LAUNCHERS = ("accelerate", "torchrun", "accelerate.commands.launch", "torch.distributed.run")


def reporting_launcher() -> int | None:
    """The process id of the launcher that started this process and prints a failure
    report of its own when this one fails (`accelerate launch` but not `--quiet`,
    torchrun), else None; read from /proc (elsewhere: None)."""
    pid = os.getppid()
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    head = [Path(w).name if "/" in w else w for w in words[:3]]
    if not any(name in LAUNCHERS for name in head):
        return None
    script = next((i for i, w in enumerate(words) if i > 0 and w.endswith(".py")), len(words))
    quiet = {"-q", "--quiet"} & set(words[:script])
    return None if quiet else pid


def after_launcher(line: str) -> bool:
    """Under a launcher that ends a failed launch with its own report (a traceback of the
    failed process, tens of lines), have `line` printed after that report, so that the
    one-line error is the last thing shown; False (nothing done) without one."""
    pid = reporting_launcher()
    if pid is None:
        return False
    try:
        subprocess.Popen([sys.executable, "-c", _PRINT_AFTER, str(pid), line],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         start_new_session=True)
    except OSError:
        return False
    return True


def _is_one_of(err: BaseException, kinds: Kinds) -> bool:
    """Whether `err` is of one of `kinds` (classes, or "module:Class" of loaded modules)."""
    for kind in kinds:
        if isinstance(kind, str):
            module, _, name = kind.partition(":")
            kind = getattr(sys.modules.get(module), name, None)
        if isinstance(kind, type) and isinstance(err, kind):
            return True
    return False


def run_reported(body: Callable[[], int | None], expected: Kinds = EXPECTED, *,
                 stopped: Kinds = (KeyboardInterrupt,), resume_note: str = "",
                 status: int = 2) -> int:
    """Run a program's body and return its exit status: an expected error ends it with its
    one line and `status` (or the error's own `exit_status`), a stop by signal (the run
    saved its work first) with 128 + its number, after `resume_note`; others propagate."""
    try:
        return body() or 0
    except BaseException as err:
        if _is_one_of(err, stopped):
            signum = getattr(err, "signum", signal.SIGINT)
            if resume_note:
                print(f"stopped by {signal.Signals(signum).name}: {resume_note}",
                      file=sys.stderr)
            return 128 + signum
        if not isinstance(err, Exception) or not _is_one_of(err, expected):
            raise
        report_error(f"error: {first_line(err)}")
        return getattr(err, "exit_status", status)
