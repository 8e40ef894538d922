"""CPU threads per process of the heavy commands (`--threads`, config key `train.threads`):
a whole number, or "auto", chosen at start (`choose_threads`). Light (no torch at module
level): the setting is checked before torch loads, and applied once it has."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from uvic.config.training import THREADS_AUTO, threads_value

KEY = "train.threads"
# Where a launcher says how many processes it runs on this machine (torchrun's and
# Accelerate's LOCAL_WORLD_SIZE; MPI launchers', as Accelerate reads them).
LOCAL_SIZE_ENV = ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                  "MV2_COMM_WORLD_LOCAL_SIZE")
HELP = ("CPU threads per process: a whole number, or auto (OMP_NUM_THREADS when set, else "
        "the cores this process may use that are free at start, shared by the command's "
        f"processes on this machine); overrides {KEY} (default: the config's, auto)")


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    """`--threads auto|N` (into `args.threads`, text; None: the config's `train.threads`)."""
    parser.add_argument("--threads", metavar="auto|N", help=HELP)


def threads_overrides(args: argparse.Namespace) -> list[str]:
    """`--threads` as a config override, to come after `--set` (the flag wins); a bad value
    is a ConfigError naming the flag."""
    if args.threads is None:
        return []
    return [f"{KEY}={threads_value(args.threads, f'--threads {args.threads}:')}"]


def auto_threads(usable: int, processes: int = 1, load: float = 0.0,
                 machine: int | None = None) -> int:
    """The "auto" rule: free = `usable` cores (affinity) less round(load x usable / machine),
    the 1-minute load spread over the `machine`'s cores (default usable), >= 1; threads =
    free // `processes` (the command's on this machine), >= 1: processes x threads <= usable."""
    return max(1, free_cores(usable, load, machine) // max(1, processes))


def free_cores(usable: int, load: float = 0.0, machine: int | None = None) -> int:
    """The free cores of `auto_threads`'s rule."""
    machine = max(machine or usable, usable)
    return max(1, usable - math.floor(load * usable / machine + 0.5))


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; all of them where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def local_processes(env: Mapping[str, str]) -> int:
    """The processes a launcher runs on this machine (`LOCAL_SIZE_ENV`), else 1."""
    for name in LOCAL_SIZE_ENV:
        if env.get(name, "").strip().isdigit() and int(env[name]) >= 1:
            return int(env[name])
    return 1


def one_minute_load() -> float:
    """The machine's 1-minute load average (0 where the system does not say)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


@dataclass(frozen=True)
class ThreadChoice:
    """The threads per process a command runs with, and why."""

    threads: int
    why: str

    def line(self) -> str:
        """`threads: 2 per process (auto: 2 of 2 cores free at start, 1 process)`."""
        return f"threads: {self.threads} per process ({self.why})"


def choose_threads(setting: int | str, processes: int | None = None,
                   env: Mapping[str, str] | None = None, usable: int | None = None,
                   load: float | None = None, machine: int | None = None) -> ThreadChoice:
    """A number as it is; "auto": OMP_NUM_THREADS when set (by the user or a launcher:
    `accelerate launch` sets it), else `auto_threads` on this machine. Every input the
    system gives can be passed instead (tests)."""
    setting = threads_value(setting)
    if setting != THREADS_AUTO:
        return ThreadChoice(int(setting), f"{KEY}={setting}")
    env = os.environ if env is None else env
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) >= 1:
        return ThreadChoice(int(omp), f"auto: OMP_NUM_THREADS={omp}")
    usable = usable_cores() if usable is None else usable
    load = one_minute_load() if load is None else load
    machine = (os.cpu_count() or usable) if machine is None else machine
    processes = local_processes(env) if processes is None else processes
    threads = auto_threads(usable, processes, load, machine)
    free = free_cores(usable, load, machine)
    return ThreadChoice(threads, f"auto: {free} of {usable} cores free at start, "
                        f"{processes} process{'es' * (processes != 1)}")


def apply_threads(choice: ThreadChoice) -> None:
    """Set torch's thread count to the choice's (imports torch)."""
    import torch

    torch.set_num_threads(choice.threads)
