"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM (what a cluster scheduler, and Accelerate's
launcher on its own interrupt, send before they kill a job).

The handler only records the signal; the training loop asks `StopSignals.agreed()` once
per step, so every process stops after the same step and they write the checkpoint
together (docs/training.md). Further signals while stopping are ignored: under the
launcher each process gets a Ctrl-C twice.
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
        step by every process: each posts its flag in an asynchronous all-reduce (max, on a
        CPU gloo group, no GPU sync) and reads the previous step's, so all stop one step
        after the first signal."""
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
