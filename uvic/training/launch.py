"""How a training run is launched: Accelerate's settings for the run (torch.compile
included: `uvic.training.compile`), the refusal of a launch that asked for several
processes but got one, the facts of the launch (processes, devices, precision, compile
mode) that a run prints at start and records in summary.json and every checkpoint's
trainer state, and the run folder's lock, taken before anything else.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    ProjectConfiguration,
    broadcast_object_list,
    gather_object,
)
from tqdm.auto import tqdm

from uvic.config import TrainConfig
from uvic.config.training import compile_mode
from uvic.run.folder import RunFolder
from uvic.run.lock import RunLock, RunLockError
from uvic.training.compile import compile_note, compile_settings, dynamo_kwargs


class TrainError(RuntimeError):
    """The run cannot start or continue (diverged, run folder in the way, ...)."""


# Several training processes on CPUs (gloo), as the README documents it: Accelerate's
# multi-process launcher, told by ACCELERATE_USE_CPU=1 to use the CPU.
CPU_LAUNCH = "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N"


def make_accelerator(t: TrainConfig, run: RunFolder) -> Accelerator:
    """Accelerate for this run: processes, precision, accumulation, trackers, folders.

    Precision: train.mixed_precision when set (a launcher setting that disagrees is named
    in a note), else the launcher's (`accelerate launch --mixed_precision`, `accelerate
    config`), which Accelerate reads from ACCELERATE_MIXED_PRECISION. Compile:
    train.compile (`uvic.training.compile`; a note when its CUDA graphs cannot run here).

    A launch that asked for several processes but runs this one alone is refused (one
    line, before any work): N copies of one process that do not see each other (WORLD_SIZE
    above Accelerate's count: `--multi_gpu` without GPUs), or `accelerate launch` with
    `--num_processes N` that started one process (its simple launcher, e.g. with `--cpu`:
    it sets MASTER_ADDR for N > 1 but starts one process). Refused rather than run: the
    run would not be the launched one (N times the per-process batch and the time).
    """
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION")
    acc = Accelerator(
        mixed_precision=t.mixed_precision or None,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=t.grad_accum, sync_with_dataloader=False),
        log_with=[name.strip() for name in t.log_with.split(",") if name.strip()] or None,
        project_config=ProjectConfiguration(
            project_dir=str(run.root), logging_dir=str(run.tensorboard),
            automatic_checkpoint_naming=False),
        # LambdaLR counts optimizer steps; Accelerate would otherwise step it once per
        # process per optimizer step.
        step_scheduler_with_optimizer=False,
        dataloader_config=DataLoaderConfiguration(non_blocking=True),  # pinned -> async
        **dynamo_kwargs(t.compile),  # torch.compile at prepare (uvic.training.compile)
    )
    if compile_settings(acc) != compile_mode(t.compile):
        raise TrainError(f"train.compile={compile_mode(t.compile)} but this process's Accelerate "
                         f"state, set up by an earlier Accelerator, compiles "
                         f"{compile_settings(acc)}: train in a new process")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if acc.num_processes != world:
        # e.g. `accelerate launch --multi_gpu` without GPUs: N independent copies would
        # write the same run folder.
        raise TrainError(f"launched as {world} processes (WORLD_SIZE={world}) but Accelerate "
                         f"finds no GPU for them and runs each alone "
                         f"({acc.distributed_type.value}); for several CPU processes run "
                         f"{CPU_LAUNCH} scripts/train.py ...")
    if (acc.num_processes == 1 and "ACCELERATE_USE_CPU" in os.environ
            and _set_by_launcher("MASTER_ADDR")):
        raise TrainError("accelerate launch was asked for several processes but started only "
                         "this one (its one-process launcher, used with --cpu, ignores "
                         "--num_processes); for N CPU processes run "
                         f"{CPU_LAUNCH} scripts/train.py ...")
    note = compile_note(t.compile, acc.device.type)
    if note is not None and acc.is_main_process:
        tqdm.write(note)
    if t.mixed_precision and launcher and launcher != t.mixed_precision and acc.is_main_process:
        tqdm.write(f"note: train.mixed_precision={t.mixed_precision} overrides the launcher's "
                   f"--mixed_precision {launcher}; set train.mixed_precision= (empty) to "
                   "follow the launcher")
    return acc


def _set_by_launcher(name: str) -> bool:
    """Whether the environment variable `name` was set by the program that started this
    process: set here but not in the parent's environment (Linux /proc); where that cannot
    be read, whether it is set. (A user's own MASTER_ADDR is then no launcher's.)"""
    if name not in os.environ:
        return False
    try:
        parent = Path(f"/proc/{os.getppid()}/environ").read_bytes().split(b"\0")
    except OSError:
        return True
    return not any(entry.startswith(f"{name}=".encode()) for entry in parent)


def launch_facts(acc: Accelerator, t: TrainConfig) -> dict[str, Any]:
    """How this run runs: processes, distributed type and backend, every process's device
    (gathered, in rank order) and the precision with where it came from."""
    device = str(acc.device) if acc.device.type != "cpu" else "cpu"  # gloo: all "cpu:0"
    if acc.device.type == "cuda":
        device += f" ({torch.cuda.get_device_name(acc.device)})"
    return {
        "num_processes": acc.num_processes,
        "distributed_type": acc.distributed_type.value,
        "backend": acc.state.backend,
        "devices": gather_object([device]),
        "mixed_precision": acc.mixed_precision,
        "precision_from": "train.mixed_precision" if t.mixed_precision else "launcher",
        "compile": compile_settings(acc),
    }


def describe_launch(facts: dict[str, Any]) -> str:
    """One line, e.g. "launch: 2 processes (MULTI_CPU, gloo) on 2 x cpu; mixed precision no
    (train.mixed_precision)", and "; compiled (reduce-overhead)" when compiled."""
    n = facts["num_processes"]
    kind = facts["distributed_type"] if facts["distributed_type"] != "NO" else None
    how = ", ".join(x for x in (kind, facts["backend"]) if x)
    kinds = Counter(re.sub(r":\d+", "", device) for device in facts["devices"])
    on = ", ".join(kind if count == 1 else f"{count} x {kind}" for kind, count in kinds.items())
    return (f"launch: {n} process{'es' if n > 1 else ''}{f' ({how})' if how else ''} on {on}; "
            f"mixed precision {facts['mixed_precision']} ({facts['precision_from']})"
            + (f"; compiled ({facts['compile']})" if facts.get("compile", "off") != "off" else ""))


def lock_run_folder(acc: Accelerator, run: RunFolder) -> RunLock:
    """Take the run folder's lock on the main process (every process stops together, with
    the one line naming the holder, if another run holds it)."""
    lock, error = run.lock(), None
    if acc.is_main_process:
        try:
            lock.acquire()
        except RunLockError as err:
            error = str(err)
    error = broadcast_object_list([error])[0]
    if error is not None:
        raise TrainError(error)
    return lock
