"""A training run's checkpoints: where a run starts (step 0, or a checkpoint to resume, with
the checks that keep the run folder truthful), restoring a checkpoint, and writing one
atomically (into `checkpoints/step_N.tmp/`, renamed when complete). A checkpoint holds
Accelerate's state (model, optimizer, LR schedule, grad scaler, RNG, EMA), the EMA weights,
the run's config and `trainer_state.json` (the data position).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from torch import nn

from uvic.config import Config
from uvic.files import write_json
from uvic.run.architecture import model_metadata
from uvic.run.folder import (
    RunFolder,
    commit_checkpoint,
    remove_tree,
    resume_config_path,
    trainer_state,
)
from uvic.run.prepare import (
    check_resume_config,
    checkpoint_bytes,
    fresh_start_problem,
    read_run_config,
    resume_record,
    save_run_config,
    write_failure,
)
from uvic.run.weights import save_safetensors
from uvic.training.launch import TrainError
from uvic.training.optim import schedule_change
from uvic.training.repa import check_resume as check_repa_resume

Say = Callable[[str], None]


@dataclass
class Start:
    """Where a run starts. checkpoint: the one to resume (None: step 0); recorded: what
    config.json records (the config and its resume history); nothing_to_train: a resume at
    train.max_steps, which keeps the run folder as it is."""

    checkpoint: Path | None
    recorded: tuple[Config, list[dict[str, Any]]]
    nothing_to_train: bool = False


def find_start(run: RunFolder, cfg: Config, resume: str | None, overwrite: bool,
               say: Say) -> Start:
    """The start of a run of `cfg` in `run` under `--resume resume`. Refuses to overwrite a
    previous run (unless `overwrite`), to resume with a different model or seed or below
    the checkpoint's step; the changes of a resume are said and added to the history."""
    skipped: list[str] = []
    start = run.resolve_resume(resume, skipped)
    for line in skipped:
        say(f"note: {line}")
    if start is None:
        if resume is not None:  # latest-or-new
            say(f"note: no checkpoint in {run.root}: starting a new run")
        problem = fresh_start_problem(run, resume, overwrite)
        if problem is not None:
            raise TrainError(problem)
        return Start(None, (cfg, []))
    step = trainer_state(start)["step"]
    max_steps = cfg.train.max_steps
    if max_steps < step:
        raise TrainError(f"train.max_steps={max_steps} is below step {step} of {start}: a "
                         f"resume cannot undo steps (set train.max_steps >= {step})")
    saved, resumes = read_run_config(resume_config_path(start))
    resumes = [r for r in resumes if r["step"] <= step]  # a run folder's, past `start`
    changes = check_resume_config(start, saved, cfg)
    # REPA's projector is in the checkpoint (or not)
    check_repa_resume(start, saved.train, cfg.train)
    if max_steps == step:  # nothing runs: no change takes effect, nothing is rewritten
        ignored = f" (ignored: {', '.join(changes)})" if changes else ""
        say(f"note: the run is at step {step} = train.max_steps: nothing to "
            f"train; its config.json and summary.json are kept{ignored}")
        return Start(start, (saved, resumes), nothing_to_train=True)
    for key, (old, new) in changes.items():  # applied, recorded and said out loud
        say(f"note: resuming with a changed setting, {key}: {old!r} in the "
            f"checkpoint vs {new!r} now")
    note = schedule_change(saved.optim, saved.train.max_steps, cfg.optim, max_steps, step)
    if note is not None:
        say(f"note: {note}")
    return Start(start, (cfg, resumes + ([resume_record(step, changes)] if changes else [])))


@dataclass
class Position:
    """Where a run is: optimizer steps done, epoch, batches used of the epoch, and the
    seconds spent in training steps over all sessions."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    train_time: float = 0.0


def restore(acc: Accelerator, checkpoint: Path, batch_per_process: int, say: Say) -> Position:
    """Load `checkpoint` into the prepared objects of `acc`; its position in the run. A
    checkpoint of another layout (processes x batch per process) continues at the same
    number of samples, in another order (said)."""
    acc.load_state(str(checkpoint))
    state = trainer_state(checkpoint)
    position = Position(state["step"], state["epoch"], state["batch_in_epoch"],
                        state.get("train_time_s", 0.0))
    layout = (acc.num_processes, batch_per_process)
    saved_layout = (state["num_processes"], state["batch_per_process"])
    if layout != saved_layout:
        # Same position in samples; the order within the epoch differs from the old run.
        used = position.batch_in_epoch * saved_layout[0] * saved_layout[1]
        position.batch_in_epoch = used // (layout[0] * layout[1])
        say(f"note: {saved_layout[0]} processes x {saved_layout[1]} per batch in the "
            f"checkpoint, {layout[0]} x {layout[1]} now: the data order after the "
            "resume differs from an uninterrupted run")
    say(f"resumed from {checkpoint} at step {position.step}")
    return position


def save_checkpoint(acc: Accelerator, run: RunFolder, cfg: Config, step: int, model: nn.Module,
                    ema_model: nn.Module, recorded: tuple[Config, list[dict[str, Any]]],
                    state: Callable[[], dict[str, Any]]) -> None:
    """Write the checkpoint of `step` atomically (every process takes part), export
    ema.safetensors, prune old checkpoints (train.keep_last, train.keep_steps).
    `recorded` is what its config.json holds, `state()` its trainer state.

    A write that fails (disk full, read-only folder) stops the run with one line naming
    the path; the half-written folder is removed and the last good checkpoint kept.
    """
    tmp, final = run.staging(step), run.checkpoint(step)
    try:
        _write_checkpoint(acc, run, cfg, tmp, final, ema_model, recorded, state)
    except Exception as err:  # torch.save and safetensors report a full disk oddly
        message = write_failure(err, tmp, run, checkpoint_bytes(run, model))
        if acc.is_main_process and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if message is None:
            raise
        raise TrainError(message) from err


def _write_checkpoint(acc: Accelerator, run: RunFolder, cfg: Config, tmp: Path, final: Path,
                      ema_model: nn.Module, recorded: tuple[Config, list[dict[str, Any]]],
                      state: Callable[[], dict[str, Any]]) -> None:
    if acc.is_main_process and tmp.exists():
        remove_tree(tmp)  # left by a killed run
    acc.wait_for_everyone()
    acc.save_state(str(tmp))  # model, optimizer, LR schedule, scaler, RNG states, EMA
    acc.wait_for_everyone()
    if acc.is_main_process:
        # the EMA files carry the model config and the diffusion settings (schedule,
        # objective): a copy out of the run still knows them
        metadata = model_metadata(cfg.model, cfg.diffusion)
        save_safetensors(ema_model, tmp / RunFolder.EMA, metadata=metadata)
        recorded_cfg, resumes = recorded
        save_run_config(recorded_cfg, tmp / RunFolder.CONFIG, resumes)
        write_json(tmp / RunFolder.TRAINER_STATE, state())
        commit_checkpoint(tmp, final)
        # a kill here leaves ema.safetensors one checkpoint behind: the next start of
        # the run copies it from the latest checkpoint (RunFolder.sync_ema)
        save_safetensors(ema_model, run.ema, metadata=metadata)
        run.prune(cfg.train.keep_last, cfg.train.keep_steps)
    acc.wait_for_everyone()

