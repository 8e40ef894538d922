"""Stopping a run on a signal: SIGINT (Ctrl-C) and SIGTERM (what a cluster scheduler, and
Accelerate's launcher on its own interrupt, send before they kill a job).

A signal does not stop a process where it happens to be: the handler only records it, and
the training loop asks `StopSignals.agreed()` once per step whether to stop. With several
processes the answer must be the same on all of them, at the same step, because the
checkpoint that follows is written by every process in step. So each process posts its
own flag in an asynchronous all-reduce (max, over a small gloo group, on the CPU: no GPU
synchronisation) at every step and reads the previous step's result: all processes stop
after the same step, one step after the first of them saw the signal, whichever process
that was.

Further signals while the run is stopping are ignored: Accelerate's launcher forwards the
interrupt it receives itself, so each process of a Ctrl-C under the launcher gets SIGINT
twice within milliseconds, and the second must not cut the checkpoint short. The launcher
kills its processes 30 s after forwarding the signal (SIGKILL ends a run at once, losing
the steps since the last checkpoint, like any kill). After the processes stop, the
launcher prints a traceback of its own signal: the run's last line above it says what was
saved.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType

import torch
import torch.distributed as dist
from accelerate import Accelerator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The run stopped on a signal after saving its checkpoint; `signum` names the signal
    (the command exits with 128 + signum, as a process killed by it would)."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum


class StopSignals:
    """Records SIGINT/SIGTERM while the loop runs (a context manager) and says, the same on
    every process, after which step to stop (`agreed`)."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.received = 0  # the first signal number seen by this process, 0 for none
        self.previous: dict[int, object] = {}
        self.group = None
        self.pending: tuple[dist.Work, torch.Tensor] | None = None
        if accelerator.num_processes > 1:
            # every process creates the group (a collective call), in the same order
            self.group = dist.new_group(backend="gloo")

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # else Python refuses
            for signum in SIGNALS:
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        if kind is None and self.pending is not None:
            self.pending[0].wait()  # every process posted it: completes at once

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = self.received or signum

    def agreed(self) -> int:
        """The signal all processes stop on after this step (0: go on). Called once per
        step by every process."""
        if self.group is None:
            return self.received
        agreed = 0
        if self.pending is not None:
            work, flag = self.pending
            work.wait()
            agreed = int(flag.item())
        flag = torch.tensor([self.received], dtype=torch.int64)
        self.pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group,
                                        async_op=True), flag)
        return agreed
