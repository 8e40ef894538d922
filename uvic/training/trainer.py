"""The training loop: one loop for every dataset and model, run through Accelerate.

    accelerate launch scripts/train.py --config configs/cifar10_uvic.py [--resume latest]

Each step predicts the noise (or, with `diffusion.objective="velocity"`, a velocity) under
the run's schedule, plus REPA's loss with `train.repa_encoder`. Everything random in a step
is a function of the seed and the step (`uvic.data.order`), so a resumed run reaches the
weights of an uninterrupted one; docs/training.md has the run folder's rules.
"""

from __future__ import annotations

import json
import math
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import set_seed
from torch import Tensor
from tqdm.auto import tqdm

from uvic.config import Config, ConfigError
from uvic.config.compare import flat_dict
from uvic.config.diffusion import check_scheduler_loads
from uvic.config.training import warmup_warning
from uvic.config.validation import start_config
from uvic.data.datasets import build_dataset, load_empty_context
from uvic.data.order import seeded_loader
from uvic.diffusion.schedule import Diffusion, diffusion_loss
from uvic.models.uvit import build_model
from uvic.run.folder import RunFolder
from uvic.run.prepare import prepare_run_dir
from uvic.sampling.images import save_grid
from uvic.seeds import noise_seed
from uvic.training.checkpoints import Position, find_start, restore, save_checkpoint
from uvic.training.ema import EMA
from uvic.training.grid import prepare_grid
from uvic.training.launch import (
    TrainError,
    describe_launch,
    launch_facts,
    lock_run_folder,
    make_accelerator,
)
from uvic.training.optim import apply_optim_config, make_optimizer
from uvic.training.posthoc_ema import posthoc_ema_for
from uvic.training.repa import build_repa
from uvic.training.stop import Interrupted, StopSignals
from uvic.training.summary import logged_loss, write_summary


def train(cfg: Config, resume: str | None = None, overwrite: bool = False) -> Path:
    """Train the model of `cfg` (fresh, or continuing from `resume`: "latest",
    "latest-intact", "latest-or-new", a checkpoint folder or a run folder); returns the run
    folder `cfg.train.output_dir`. A fresh start into a folder holding a previous run is
    refused unless `overwrite` (which deletes that run's outputs first)."""
    return Trainer(cfg, resume, overwrite).fit()


# --------------------------------------------------------------------------- trainer


class Trainer:
    """State of one training run; `fit()` runs the loop."""

    def __init__(self, cfg: Config, resume: str | None = None, overwrite: bool = False) -> None:
        cfg, guide_note = start_config(cfg)
        check_scheduler_loads(cfg.sample.scheduler)  # its sample grids need it hours in
        self.cfg = cfg
        if overwrite and resume is not None:
            raise ConfigError(f"--overwrite replaces a run and --resume {resume} continues "
                              "it: pass one of them")
        self.overwrite = overwrite
        self.run = RunFolder(Path(cfg.train.output_dir).resolve())
        self.accelerator = make_accelerator(cfg.train, self.run)
        self.is_main, self.device = self.accelerator.is_main_process, self.accelerator.device
        self.launch = launch_facts(self.accelerator, cfg.train)
        self._print(describe_launch(self.launch))
        if guide_note is not None:
            self._print(f"note: {guide_note}")
        self.lock = lock_run_folder(self.accelerator, self.run)
        try:
            self._setup(resume)
        except BaseException:
            self.lock.release()  # a refused start leaves the folder as it was
            raise

    def _setup(self, resume: str | None) -> None:
        """Everything but the lock: checks, model, optimizer, data, resume, run folder."""
        cfg, t, acc = self.cfg, self.cfg.train, self.accelerator
        if t.batch_size % (acc.num_processes * t.grad_accum):
            raise ConfigError(f"train.batch_size={t.batch_size} is not divisible by "
                              f"{acc.num_processes} processes x train.grad_accum={t.grad_accum}")
        self.batch_per_process = t.batch_size // (acc.num_processes * t.grad_accum)
        self.start = find_start(self.run, cfg, resume, self.overwrite, self._print)
        self.resume_from = self.start.checkpoint
        warning = warmup_warning(cfg.optim, t.max_steps)
        if warning is not None and not self.start.nothing_to_train:
            self._print(f"warning: {warning}")

        self.diffusion = Diffusion(cfg.diffusion)
        self.empty_context = None
        if cfg.model.clip_dim > 0 and cfg.diffusion.p_uncond > 0:
            self.empty_context = load_empty_context(cfg.data).to(self.device)
        self.null_class = cfg.model.num_classes - 1 if cfg.model.num_classes > 0 else None
        set_seed(t.seed)  # the initial weights depend on the seed only
        try:
            model = build_model(cfg.model)
        except ValueError as err:  # a bad model.* value, named in the message
            raise ConfigError(str(err)) from err
        self.ema = EMA(model, t.ema_decay).to(self.device)  # exact copy at step 0
        self.phema = posthoc_ema_for(cfg, model, self.run, self.resume_from, acc, self._print)
        self.repa = build_repa(cfg, model, self.device)  # train.repa_* (off: nothing)
        optimizer, lr_scheduler = make_optimizer(self.repa.trained(model), cfg.optim, t.max_steps)
        dataset = build_dataset(cfg, "train")  # checks that the items fit the model
        self.num_items = len(dataset)
        loader = seeded_loader(dataset, t.seed, self.batch_per_process, cfg.data.num_workers,
                               pin_memory=self.device.type == "cuda")
        self.model, self.optimizer, self.loader, self.lr_scheduler = acc.prepare(
            model, optimizer, loader, lr_scheduler)
        self.repa.prepare(acc)
        if len(self.loader) == 0:
            raise ConfigError(f"data: {self.num_items} items is less than one batch of "
                              f"{self.batch_per_process} per process x {acc.num_processes} "
                              f"processes (train.batch_size={t.batch_size})")
        acc.register_for_checkpointing(self.ema, *filter(None, [self.phema]))
        self.noise_generator = torch.Generator(device=self.device)

        # position in the run; train_time: seconds spent in training steps, all sessions
        position = Position()
        if self.resume_from is not None:
            position = restore(acc, self.resume_from, self.batch_per_process, self._print)
            # Accelerate's wrappers hold the torch optimizer and schedule
            apply_optim_config(self.optimizer.optimizer, self.lr_scheduler.scheduler,
                               cfg.optim)
        self.step, self.epoch = position.step, position.epoch
        self.batch_in_epoch, self.train_time = position.batch_in_epoch, position.train_time
        self.last_saved = self.step if self.resume_from is not None else -1
        # the newest checkpoint known to be finite: the one resumed from (checked by
        # `RunFolder.resolve_resume`) or the last one saved (checked before)
        self.last_good: Path | None = self.resume_from
        if self.is_main:
            try:
                prepare_run_dir(self.run, *self.start.recorded, self.step, self.overwrite,
                                self._print)
            except OSError as err:
                where = err.filename or self.run.root
                raise TrainError(f"cannot write to the run folder: {where} "
                                 f"({err.strerror or err})") from err
        acc.wait_for_everyone()
        self.grid = prepare_grid(cfg, self.device, self.is_main)
        if self.is_main and not self.start.nothing_to_train:
            acc.init_trackers(cfg.name, config=flat_dict(cfg))

    # ------------------------------------------------------------------ loop

    def fit(self) -> Path:
        """Train up to `train.max_steps`, checkpoint, write summary.json; returns the run
        folder. On SIGINT/SIGTERM every process stops after the same step, saves its
        checkpoint and raises `Interrupted` (`uvic.training.stop`)."""
        start_step, start_time = self.step, time.perf_counter()
        bar = tqdm(total=self.cfg.train.max_steps, initial=self.step, disable=not self.is_main,
                   desc=self.cfg.name, dynamic_ncols=True)
        try:
            with StopSignals(self.accelerator) as signals:  # recorded until the end
                stop = self._train(signals, bar)
                self._finish(start_step, time.perf_counter() - start_time, stop)
        finally:
            bar.close()
            self.accelerator.end_training()  # flush and close the trackers
            self.lock.release()
        return self.run.root

    def _train(self, signals: StopSignals, bar: tqdm) -> int:
        """The steps up to train.max_steps, or up to the step after which every process
        agrees to stop on a signal; returns that signal (0: none)."""
        t, acc, clip = self.cfg.train, self.accelerator, self.cfg.optim.grad_clip
        batches = self._batches()
        self.unlogged_loss = torch.zeros((), device=self.device)  # summed, on device
        self.unlogged_steps = window_steps = 0
        self.window_start = time.perf_counter()  # throughput window
        # the loss of the current step, if logged (a resume at a logged step)
        self.last_loss = logged_loss(self.run, self.step) if self.is_main else None
        grad_norm: Tensor | None = None
        while self.step < t.max_steps:
            log_now = _every(self.step + 1, t.log_every) or self.step + 1 == t.max_steps
            # One optimizer step over train.grad_accum micro-batches. The noise of
            # micro-batch m comes from (seed, process, step, m): exact resumption.
            step_loss = torch.zeros((), device=self.device)  # on device: no host sync
            for micro in range(t.grad_accum):
                batch = next(batches)
                self.noise_generator.manual_seed(
                    noise_seed(t.seed, acc.process_index, self.step, micro))
                with acc.accumulate(self.model, *self.repa.modules):
                    loss = diffusion_loss(self.model, self.diffusion, batch,
                                          self.noise_generator,
                                          empty_context=self.empty_context,
                                          p_uncond=self.cfg.diffusion.p_uncond,
                                          null_class=self.null_class)
                    acc.backward(self.repa.add(loss, batch))
                    if acc.sync_gradients and (clip > 0 or log_now):
                        grad_norm = acc.clip_grad_norm_(self.repa.parameters(self.model),
                                                        clip if clip > 0 else math.inf)
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                step_loss += loss.detach()
            if not acc.sync_gradients:
                raise RuntimeError("internal: optimizer step ended without gradient sync")
            self.lr_scheduler.step()
            self.ema.update(self.model)
            self.step += 1
            self.unlogged_loss += step_loss / t.grad_accum
            self.unlogged_steps += 1
            if self.phema is not None:  # and its snapshots (of finite weights only), when due
                self.phema.update(self.model, before_save=self._check_finite)
            window_steps += 1
            bar.update(1)

            # Log (mean loss since the last log; stops on NaN), checkpoint, sample grid.
            if log_now:
                elapsed = time.perf_counter() - self.window_start
                self._log(grad_norm, elapsed, window_steps, bar)
                self.train_time += elapsed
                self.unlogged_loss.zero_()
                self.unlogged_steps = window_steps = 0
                self.window_start = time.perf_counter()
            pause = time.perf_counter()
            if _every(self.step, t.ckpt_every) or self.step in t.keep_steps:
                self._save_checkpoint()
            if _every(self.step, t.sample_every):
                self._sample_grid()
            self.window_start += time.perf_counter() - pause  # saving/sampling: not training
            stop = signals.agreed()
            if stop and self.step < t.max_steps:
                return stop
        return 0

    def _finish(self, start_step: int, wall_time: float, stop: int) -> None:
        """What every process does when the steps end (each takes part in the checkpoint
        and the grid's synchronisation): the checkpoint of the last step unless it has one;
        then, at train.max_steps, the grid of the final EMA weights and summary.json; on a
        signal, `Interrupted` naming the checkpoint to continue from."""
        if self.last_saved != self.step:
            self._save_checkpoint()
        if stop:
            message = (f"stopped by {signal.Signals(stop).name} at step {self.step}; saved "
                       f"{self.last_good} (continue with --resume latest)")
            self._print(message)
            raise Interrupted(stop, message)
        t = self.cfg.train
        if self.step > start_step and t.sample_every > 0 and not _every(self.step,
                                                                         t.sample_every):
            self._sample_grid()  # a grid of the final EMA weights
        self._write_summary(start_step, wall_time)

    def _batches(self) -> Iterator[dict[str, Tensor]]:
        """Batches forever, epoch after epoch, from the current data position."""
        while True:
            self.loader.set_epoch(self.epoch)
            loader = self.loader
            if self.batch_in_epoch:
                loader = self.accelerator.skip_first_batches(self.loader, self.batch_in_epoch)
            for batch in loader:
                self.batch_in_epoch += 1
                yield batch
            self.epoch += 1
            self.batch_in_epoch = 0

    # ------------------------------------------------------------------ logging

    def _log(self, grad_norm: Tensor | None, elapsed: float, steps: int, bar: tqdm) -> None:
        """Mean loss over processes and steps since the last log; stop on NaN/inf."""
        loss = (self.accelerator.reduce(self.unlogged_loss, reduction="mean").item()
                / max(self.unlogged_steps, 1))
        images_per_s = steps * self.cfg.train.batch_size / max(elapsed, 1e-9)
        record = {"step": self.step, "loss": loss, "lr": self.lr_scheduler.get_last_lr()[0],
                  "grad_norm": grad_norm.item() if grad_norm is not None else None,
                  "images_per_s": images_per_s, "time": time.time(),
                  **self.repa.log(self.accelerator)}
        self.last_loss = loss
        if self.is_main:
            with open(self.run.log, "a") as f:
                f.write(json.dumps(record) + "\n")
            self.accelerator.log({k: v for k, v in record.items()
                                  if k not in ("step", "time") and v is not None}, step=self.step)
            bar.set_postfix(loss=f"{loss:.4f}", img_s=f"{images_per_s:.0f}")
        if not math.isfinite(loss):
            self._diverged(f"loss is {loss} at step {self.step}")

    def _diverged(self, what: str) -> None:
        last = self.last_good
        kept = f"the last good checkpoint {last} is kept" if last else "no checkpoint yet"
        raise TrainError(f"{what}; stopping ({kept}; try a lower optim.lr or "
                         "optim.grad_clip > 0)")

    def _print(self, message: str) -> None:
        if self.is_main:
            tqdm.write(message)

    # ------------------------------------------------------------------ checkpoints

    def _check_finite(self) -> None:
        """Never save NaN/inf (checkpoints, post-hoc EMA snapshots): the loss, every weight."""
        if self.unlogged_steps:
            loss = (self.accelerator.reduce(self.unlogged_loss, reduction="mean").item()
                    / self.unlogged_steps)
            if not math.isfinite(loss):
                self._diverged(f"loss is {loss} (mean of steps "
                               f"{self.step - self.unlogged_steps + 1}-{self.step})")
        held = [self.model, self.ema.model, *(self.phema.profiles if self.phema else ())]
        if not torch.stack([p.isfinite().all() for m in held for p in m.parameters()]).all().item():
            self._diverged(f"non-finite weights at step {self.step}")

    def _save_checkpoint(self) -> None:
        """The checkpoint of the current step (`uvic.training.checkpoints.save_checkpoint`),
        never of NaN/inf weights."""
        self._check_finite()
        save_checkpoint(self.accelerator, self.run, self.cfg, self.step, self.model,
                        self.ema.model, self.start.recorded, self._trainer_state)
        self.last_saved, self.last_good = self.step, self.run.checkpoint(self.step)

    def _trainer_state(self) -> dict[str, Any]:
        """What a checkpoint records of the run besides Accelerate's state (trainer_state.json)."""
        acc = self.accelerator
        return {
            "step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
            "num_processes": acc.num_processes, "batch_per_process": self.batch_per_process,
            "launch": self.launch,
            "grad_accum": self.cfg.train.grad_accum,
            "images_seen": self.step * self.cfg.train.batch_size,
            # training time so far, including the current (unlogged) window
            "train_time_s": self.train_time + time.perf_counter() - self.window_start,
        }

    # ------------------------------------------------------------------ samples

    def _sample_grid(self) -> None:
        """Sample the EMA model from the fixed noise into samples/step_N.png (main process)."""
        if self.is_main and self.grid is not None:
            images = self.grid.sample(self.ema.model, self.diffusion, self.accelerator.autocast())
            save_grid(images, self.run.sample_grid(self.step), captions=self.grid.captions)
        self.accelerator.wait_for_everyone()

    def _write_summary(self, start_step: int, wall_time: float) -> None:
        if self.is_main:
            write_summary(self.run, self.step, start_step, self.train_time, self.last_loss, {
                "wall_time_s": wall_time, "num_processes": self.accelerator.num_processes,
                "global_batch": self.cfg.train.batch_size,
                "resumed_from": str(self.resume_from) if self.resume_from else None,
                "launch": self.launch})


# --------------------------------------------------------------------------- helpers


def _every(step: int, interval: int) -> bool:
    return interval > 0 and step % interval == 0
