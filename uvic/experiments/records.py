"""What the benchmark commands (`uvic-bench-train`, `uvic-bench-sampling`) share: peak CUDA
memory readings, the run's environment and its JSON record file (schema:
kernels/results/README.md), written atomically (`uvic.files.write_json`), so that every
kind of record file says the same things the same way (`uvic-gpu-check` writes its rows
through it too).

Imports no torch at module level: the commands' `--help` stays light.
"""

from __future__ import annotations

import datetime
import platform
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from uvic.files import write_json

if TYPE_CHECKING:
    import torch

MIB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


def reset_peak_memory(device: torch.device) -> None:
    """Start a peak-memory window: on CUDA, wait for queued work and reset the allocator's
    peak; nothing elsewhere."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mib(device: torch.device) -> float | None:
    """Peak memory allocated since `reset_peak_memory(device)`, in MiB, once queued work is
    done (CUDA only; None elsewhere)."""
    import torch

    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / MIB


def peak_mib(fn: Callable[[], object], device: torch.device) -> float | None:
    """Peak memory allocated during one fn() (CUDA only: elsewhere fn is not run), in MiB."""
    if device.type != "cuda":
        return None
    reset_peak_memory(device)
    fn()
    return peak_memory_mib(device)


def error_line(err: BaseException, limit: int = 300) -> str:
    """An exception as one line: its type and the first line of its message."""
    return f"{type(err).__name__}: {err}".splitlines()[0][:limit]


def _git(*args: str) -> str | None:
    """Output of `git args` in the checkout this package runs from (None: not a checkout,
    or no git)."""
    try:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                              check=False)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def environment(device: torch.device) -> dict[str, Any]:
    """Device, versions, date (UTC) and git commit: what a record file's numbers depend on."""
    import torch

    try:
        import triton
        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or "cpu",
            "device_type": device.type, "python": platform.python_version(),
            "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            **git_state()}


def git_state() -> dict[str, Any]:
    """The checkout's commit and whether it has uncommitted changes (None: not a checkout)."""
    commit, status = _git("rev-parse", "HEAD"), _git("status", "--porcelain")
    return {"git_commit": commit, "git_dirty": None if status is None else bool(status)}


def default_out(kind: str, env: dict[str, Any]) -> Path:
    """kernels/results/<date>_<device>_<kind>.json on a GPU; a CPU run's figures are not
    timings and go to runs/bench/<kind>.json."""
    if env["device_type"] != "cuda":
        return Path("runs/bench") / f"{kind}.json"
    slug = re.sub(r"[^a-z0-9]+", "-", env["device"].lower()).strip("-")
    return REPO / "kernels" / "results" / f"{env['date'][:10]}_{slug}_{kind}.json"


def write_records(out: str | None, kind: str, env: dict[str, Any], facts: dict[str, Any],
                  records: list[dict[str, Any]], table: str) -> Path:
    """Write the record file {kind, environment, the run's `facts`, records, table} to `out`
    (None: `default_out`), say where, and return its path."""
    path = Path(out) if out else default_out(kind, env)
    write_json(path, {"kind": kind, **env, **facts, "records": records, "table": table})
    print(f"\nwrote {path}")
    return path
