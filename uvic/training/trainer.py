"""The training loop: one loop for every dataset and model, run through Accelerate.

    accelerate launch scripts/train.py --config configs/cifar10_uvic.py [--set k=v ...]
    accelerate launch scripts/train.py --config configs/cifar10_uvic.py --resume latest

Objective (docs/conventions.md): draw a noise level and noise with the run's schedule
(`uvic.diffusion.schedule.Diffusion.training_inputs`, the same object the sampler is built from),
predict the noise, mean squared error. Text-to-image runs replace each caption's context
by the empty-prompt context with probability `diffusion.p_uncond` (classifier-free
guidance). Optimiser and EMA follow the U-ViT release: AdamW on all parameters (its
optimizer ignores the model's `no_weight_decay()`), LR warm-up `min(step / warmup, 1)`
from step 0, EMA started as an exact copy and updated after every optimizer step.

Exact resumption: everything random in a step is a pure function of the seed and the
position in the run (`uvic.data.order`: data order, item augmentations, noise), so a killed
run continued from its last checkpoint reaches the same weights as an uninterrupted one.
Checkpoints hold the model, EMA, optimizer, LR schedule, grad scaler (Accelerate's
`save_state`) and the data position (`trainer_state.json`). They are written to
`step_XXXXXX.tmp/` and renamed when complete, so a half-written one is never picked up.

Precision: `train.mixed_precision` when set, else the launcher's (`accelerate launch
--mixed_precision`, `accelerate config`); accumulation and the seed come from the config.
Metrics go to `train.log_with` (an Accelerate tracker: tensorboard, wandb, ...). With
several nodes, `train.output_dir` must be on a filesystem they share. A run says at start
how many processes it runs, on which devices and in which precision ("launch: ...", also
in summary.json and every checkpoint's trainer state), and refuses a launch that asked for
several processes but got one (`make_accelerator`).

Run folder (`train.output_dir`):
    config.json            resolved config, and what each resume changed (uvic.run.prepare)
    log.jsonl              one line per log step: step, loss, lr, grad_norm, images/s, time
    tensorboard/           the same scalars for TensorBoard (the tracker's logging folder)
    samples/step_*.png     sample grids of the EMA model with fixed noise (and prompts)
    checkpoints/step_*/    the last `train.keep_last` checkpoints, and those of `train.keep_steps`
    ema.safetensors        EMA weights of the latest checkpoint (what sampling loads; the
                           model config in its metadata, as in each checkpoint's)
    summary.json           written at the end: steps, final loss, time per step, images/s,
                           processes, devices, precision
    .run.lock              held while a run uses the folder (`uvic.run.lock`)

Safety of the run folder: one run at a time (the lock); a fresh start over a previous run
is refused unless `overwrite`; "latest" without a checkpoint is refused ("latest-or-new"
starts the run); a resume refuses a changed model or seed and a train.max_steps below its
step, applies and records (config.json `resumes`) every other change, and names a change
of the LR schedule, so config.json describes what ran; a checkpoint with an unreadable file
is named ("latest-intact" skips it); a failed write (disk full, read-only) is one line.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import time
from collections import Counter
from collections.abc import Iterator
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
    set_seed,
)
from torch import Tensor
from tqdm.auto import tqdm

from uvic.config import Config, ConfigError, flat_dict
from uvic.data.datasets import build_dataset, load_empty_context
from uvic.data.order import record_batches, seeded_loader
from uvic.diffusion.schedule import Diffusion, diffusion_loss
from uvic.models.uvit import build_model
from uvic.run.files import write_json
from uvic.run.folder import (
    RUN_EMA,
    TRAINER_STATE,
    check_resume_config,
    checkpoint_name,
    commit_checkpoint,
    list_checkpoints,
    model_metadata,
    remove_tree,
    resolve_resume,
    resume_config_path,
)
from uvic.run.lock import RunLock, RunLockError
from uvic.run.prepare import (
    checkpoint_bytes,
    fresh_start_problem,
    prepare_run_dir,
    read_run_config,
    resume_record,
    save_run_config,
    write_failure,
)
from uvic.run.weights import save_safetensors
from uvic.sampling.generate import SampleGrid
from uvic.sampling.images import save_grid
from uvic.seeds import noise_seed
from uvic.training.ema import EMA
from uvic.training.optim import apply_optim_config, make_optimizer, schedule_change
from uvic.validation import validate


class TrainError(RuntimeError):
    """The run cannot start or continue (diverged, run folder in the way, ...)."""


def train(cfg: Config, resume: str | None = None, overwrite: bool = False) -> Path:
    """Train the model of `cfg` (fresh, or continuing from `resume`: "latest",
    "latest-intact", "latest-or-new", a checkpoint folder or a run folder); returns the run
    folder `cfg.train.output_dir`. A fresh start into a folder holding a previous run is
    refused unless `overwrite` (which deletes that run's outputs first)."""
    return Trainer(cfg, resume, overwrite).fit()


# --------------------------------------------------------------------------- setup

# Several training processes on CPUs (gloo), as the README documents it: Accelerate's
# multi-process launcher, told by ACCELERATE_USE_CPU=1 to use the CPU.
CPU_LAUNCH = "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N"


def make_accelerator(cfg: Config, run_dir: Path) -> Accelerator:
    """Accelerate for this run: processes, precision, accumulation, trackers, folders.

    Precision: train.mixed_precision when set (a launcher setting that disagrees is named
    in a note), else the launcher's (`accelerate launch --mixed_precision`, `accelerate
    config`), which Accelerate reads from ACCELERATE_MIXED_PRECISION.

    A launch that asked for several processes but runs this one alone is refused (one
    line, before any work): N copies of one process that do not see each other (WORLD_SIZE
    above Accelerate's count: `--multi_gpu` without GPUs), or `accelerate launch` with
    `--num_processes N` that started one process (its simple launcher, e.g. with `--cpu`:
    it sets MASTER_ADDR for N > 1 but starts one process). Refused rather than run: the
    run would not be the launched one (N times the per-process batch and the time).
    """
    t = cfg.train
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION")
    acc = Accelerator(
        mixed_precision=t.mixed_precision or None,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=t.grad_accum, sync_with_dataloader=False),
        log_with=[name.strip() for name in t.log_with.split(",") if name.strip()] or None,
        project_config=ProjectConfiguration(
            project_dir=str(run_dir), logging_dir=str(run_dir / "tensorboard"),
            automatic_checkpoint_naming=False),
        # LambdaLR counts optimizer steps; Accelerate would otherwise step it once per
        # process per optimizer step.
        step_scheduler_with_optimizer=False,
        dataloader_config=DataLoaderConfiguration(non_blocking=True),  # pinned -> async
        dynamo_backend="inductor" if t.compile else "no",
    )
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


def launch_facts(acc: Accelerator, cfg: Config) -> dict[str, Any]:
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
        "precision_from": "train.mixed_precision" if cfg.train.mixed_precision else "launcher",
    }


def describe_launch(facts: dict[str, Any]) -> str:
    """One line, e.g. "launch: 2 processes (MULTI_CPU, gloo) on 2 x cpu; mixed precision no
    (train.mixed_precision)"."""
    n = facts["num_processes"]
    kind = facts["distributed_type"] if facts["distributed_type"] != "NO" else None
    how = ", ".join(x for x in (kind, facts["backend"]) if x)
    kinds = Counter(re.sub(r":\d+", "", device) for device in facts["devices"])
    on = ", ".join(kind if count == 1 else f"{count} x {kind}" for kind, count in kinds.items())
    return (f"launch: {n} process{'es' if n > 1 else ''}{f' ({how})' if how else ''} on {on}; "
            f"mixed precision {facts['mixed_precision']} ({facts['precision_from']})")


# --------------------------------------------------------------------------- trainer


class Trainer:
    """State of one training run; `fit()` runs the loop. See the module docstring."""

    def __init__(self, cfg: Config, resume: str | None = None, overwrite: bool = False) -> None:
        self.cfg = validate(cfg)
        if overwrite and resume is not None:
            raise ConfigError(f"--overwrite replaces a run and --resume {resume} continues "
                              "it: pass one of them")
        self.overwrite = overwrite
        self.run_dir = Path(cfg.train.output_dir).resolve()
        self.accelerator = make_accelerator(cfg, self.run_dir)
        self.is_main, self.device = self.accelerator.is_main_process, self.accelerator.device
        self.launch = launch_facts(self.accelerator, cfg)
        self._print(describe_launch(self.launch))
        self.lock = self._lock_run_dir()
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
        # what config.json records: the config and its resume history (set by _find_start)
        self.recorded: tuple[Config, list[dict[str, Any]]] = (cfg, [])
        self.nothing_to_train = False  # a resume at train.max_steps: the folder is kept
        self.resume_from = self._find_start(resume)

        self.diffusion = Diffusion(cfg.diffusion)
        self.empty_context = None
        if cfg.model.clip_dim > 0 and cfg.diffusion.p_uncond > 0:
            self.empty_context = load_empty_context(cfg).to(self.device)
        set_seed(t.seed)  # the initial weights depend on the seed only
        try:
            model = build_model(cfg.model)
        except ValueError as err:  # a bad model.* value, named in the message
            raise ConfigError(str(err)) from err
        self.ema = EMA(model, t.ema_decay).to(self.device)  # exact copy at step 0
        optimizer, lr_scheduler = make_optimizer(model, cfg.optim, t.max_steps)
        dataset = build_dataset(cfg, "train")  # checks that the items fit the model
        self.num_items = len(dataset)
        loader = seeded_loader(dataset, t.seed, self.batch_per_process, cfg.data.num_workers,
                               pin_memory=self.device.type == "cuda")
        self.model, self.optimizer, self.loader, self.lr_scheduler = acc.prepare(
            model, optimizer, loader, lr_scheduler)
        if len(self.loader) == 0:
            raise ConfigError(f"data: {self.num_items} items is less than one batch of "
                              f"{self.batch_per_process} per process x {acc.num_processes} "
                              f"processes (train.batch_size={t.batch_size})")
        acc.register_for_checkpointing(self.ema)
        self.noise_generator = torch.Generator(device=self.device)

        # position in the run; train_time: seconds spent in training steps, all sessions
        self.step, self.epoch, self.batch_in_epoch, self.train_time = 0, 0, 0, 0.0
        if self.resume_from is not None:
            self._load_checkpoint(self.resume_from)
            # Accelerate's wrappers hold the torch optimizer and schedule
            apply_optim_config(self.optimizer.optimizer, self.lr_scheduler.scheduler,
                               cfg.optim)
        self.last_saved = self.step if self.resume_from is not None else -1
        if self.is_main:
            try:
                prepare_run_dir(self.run_dir, *self.recorded, self.step, self.overwrite,
                                self._print)
            except OSError as err:
                raise TrainError(f"cannot write to the run folder: "
                                 f"{err.filename or self.run_dir} ({err.strerror or err})") from err
        acc.wait_for_everyone()
        self.grid = self._prepare_grid()
        if self.is_main and not self.nothing_to_train:
            acc.init_trackers(cfg.name, config=flat_dict(cfg))

    # ------------------------------------------------------------------ loop

    def fit(self) -> Path:
        """Train up to `train.max_steps`, checkpoint, write summary.json; returns run_dir."""
        t, acc, clip = self.cfg.train, self.accelerator, self.cfg.optim.grad_clip
        start_step, start_time = self.step, time.perf_counter()
        batches = record_batches(self._batches(), acc.process_index, t.grad_accum,
                                 lambda: {"step": self.step, "epoch": self.epoch})
        loss_sum = torch.zeros((), device=self.device)  # since the last log, on device
        loss_steps = window_steps = 0
        self.window_start = time.perf_counter()  # throughput window
        self.last_loss: float | None = self._logged_loss()  # of the current step, if logged
        grad_norm: Tensor | None = None
        bar = tqdm(total=t.max_steps, initial=self.step, disable=not self.is_main,
                   desc=self.cfg.name, dynamic_ncols=True)
        try:
            while self.step < t.max_steps:
                log_now = _every(self.step + 1, t.log_every) or self.step + 1 == t.max_steps
                # One optimizer step over train.grad_accum micro-batches. The noise of
                # micro-batch m comes from (seed, process, step, m): exact resumption.
                step_loss = torch.zeros((), device=self.device)  # on device: no host sync
                for micro in range(t.grad_accum):
                    batch = next(batches)
                    self.noise_generator.manual_seed(
                        noise_seed(t.seed, acc.process_index, self.step, micro))
                    with acc.accumulate(self.model):
                        loss = diffusion_loss(self.model, self.diffusion, batch,
                                              self.noise_generator,
                                              empty_context=self.empty_context,
                                              p_uncond=self.cfg.diffusion.p_uncond)
                        acc.backward(loss)
                        if acc.sync_gradients and (clip > 0 or log_now):
                            grad_norm = acc.clip_grad_norm_(self.model.parameters(),
                                                            clip if clip > 0 else math.inf)
                        self.optimizer.step()
                        self.optimizer.zero_grad(set_to_none=True)
                    step_loss += loss.detach()
                if not acc.sync_gradients:
                    raise RuntimeError("internal: optimizer step ended without gradient sync")
                self.lr_scheduler.step()
                self.ema.update(self.model)
                self.step += 1
                loss_sum += step_loss / t.grad_accum
                loss_steps += 1
                window_steps += 1
                bar.update(1)

                # Log (mean loss since the last log; stops on NaN), checkpoint, sample grid.
                if log_now:
                    elapsed = time.perf_counter() - self.window_start
                    self._log(loss_sum, loss_steps, grad_norm, elapsed, window_steps, bar)
                    self.train_time += elapsed
                    loss_sum.zero_()
                    loss_steps = window_steps = 0
                    self.window_start = time.perf_counter()
                pause = time.perf_counter()
                if _every(self.step, t.ckpt_every) or self.step in t.keep_steps:
                    self._save_checkpoint(loss_sum, loss_steps)
                if _every(self.step, t.sample_every):
                    self._sample_grid()
                self.window_start += time.perf_counter() - pause  # saving/sampling: not training
            if self.last_saved != self.step:
                self._save_checkpoint(loss_sum, loss_steps)
            trained = self.step > start_step
            if trained and self.grid is not None and not _every(self.step, t.sample_every):
                self._sample_grid()  # a grid of the final EMA weights
            self._write_summary(start_step, time.perf_counter() - start_time)
        except KeyboardInterrupt:
            last = list_checkpoints(self.run_dir)
            self._print(f"interrupted at step {self.step}; last checkpoint: "
                        f"{last[-1] if last else 'none'} (continue with --resume latest)")
            raise
        finally:
            bar.close()
            acc.end_training()  # flush and close the trackers
            self.lock.release()
        return self.run_dir

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

    def _log(self, loss_sum: Tensor, loss_steps: int, grad_norm: Tensor | None,
             elapsed: float, steps: int, bar: tqdm) -> None:
        """Mean loss over processes and steps since the last log; stop on NaN/inf."""
        loss = self.accelerator.reduce(loss_sum, reduction="mean").item() / max(loss_steps, 1)
        images_per_s = steps * self.cfg.train.batch_size / max(elapsed, 1e-9)
        record = {
            "step": self.step,
            "loss": loss,
            "lr": self.lr_scheduler.get_last_lr()[0],
            "grad_norm": grad_norm.item() if grad_norm is not None else None,
            "images_per_s": images_per_s,
            "time": time.time(),
        }
        self.last_loss = loss
        if self.is_main:
            with open(self.run_dir / "log.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            self.accelerator.log({k: v for k, v in record.items()
                                  if k not in ("step", "time") and v is not None}, step=self.step)
            bar.set_postfix(loss=f"{loss:.4f}", img_s=f"{images_per_s:.0f}")
        if not math.isfinite(loss):
            self._diverged(f"loss is {loss} at step {self.step}")

    def _diverged(self, what: str) -> None:
        last = list_checkpoints(self.run_dir)
        kept = f"the last good checkpoint {last[-1]} is kept" if last else "no checkpoint yet"
        raise TrainError(f"{what}; stopping ({kept}; try a lower optim.lr or "
                         "optim.grad_clip > 0)")

    def _print(self, message: str) -> None:
        if self.is_main:
            tqdm.write(message)

    # ------------------------------------------------------------------ checkpoints

    def _check_finite(self, loss_sum: Tensor, loss_steps: int) -> None:
        """Never save NaN/inf: check the loss since the last log and every weight."""
        if loss_steps:
            loss = self.accelerator.reduce(loss_sum, reduction="mean").item() / loss_steps
            if not math.isfinite(loss):
                self._diverged(f"loss is {loss} (mean of steps {self.step - loss_steps + 1}-"
                               f"{self.step})")
        params = [*self.model.parameters(), *self.ema.model.parameters()]
        if not torch.stack([torch.isfinite(p).all() for p in params]).all().item():
            self._diverged(f"non-finite weights at step {self.step}")

    def _save_checkpoint(self, loss_sum: Tensor, loss_steps: int) -> None:
        """Write checkpoints/step_N atomically, export ema.safetensors, prune old ones.

        A write that fails (disk full, read-only folder) stops the run with one line naming
        the path; the half-written folder is removed and the last good checkpoint kept.
        """
        self._check_finite(loss_sum, loss_steps)
        final = self.run_dir / "checkpoints" / checkpoint_name(self.step)
        tmp = final.with_name(final.name + ".tmp")
        try:
            self._write_checkpoint(tmp, final)
        except Exception as err:  # torch.save and safetensors report a full disk oddly
            message = write_failure(err, tmp, self.run_dir,
                                    checkpoint_bytes(self.run_dir, self.model))
            if self.is_main and tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
            if message is None:
                raise
            raise TrainError(message) from err
        self.last_saved = self.step

    def _write_checkpoint(self, tmp: Path, final: Path) -> None:
        acc = self.accelerator
        if self.is_main and tmp.exists():
            remove_tree(tmp)  # left by a killed run
        acc.wait_for_everyone()
        acc.save_state(str(tmp))  # model, optimizer, LR schedule, scaler, RNG states, EMA
        acc.wait_for_everyone()
        if self.is_main:
            # the EMA files carry the model config: a copy out of the run still knows it
            save_safetensors(self.ema.model, tmp / "ema.safetensors",
                             metadata=model_metadata(self.cfg.model))
            recorded_cfg, resumes = self.recorded
            save_run_config(recorded_cfg, tmp / "config.json", resumes)
            write_json(tmp / TRAINER_STATE, {
                "step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                "num_processes": acc.num_processes, "batch_per_process": self.batch_per_process,
                "launch": self.launch,
                "grad_accum": self.cfg.train.grad_accum,
                "images_seen": self.step * self.cfg.train.batch_size,
                # training time so far, including the current (unlogged) window
                "train_time_s": self.train_time + time.perf_counter() - self.window_start,
            })
            commit_checkpoint(tmp, final)
            # a kill here leaves ema.safetensors one checkpoint behind: the next start of
            # the run copies it from the latest checkpoint (sync_run_ema)
            save_safetensors(self.ema.model, self.run_dir / RUN_EMA,
                             metadata=model_metadata(self.cfg.model))
            kept = {checkpoint_name(step) for step in self.cfg.train.keep_steps}
            rotating = [c for c in list_checkpoints(self.run_dir) if c.name not in kept]
            for old in rotating[:-max(self.cfg.train.keep_last, 1)]:
                remove_tree(old)
        acc.wait_for_everyone()

    # ------------------------------------------------------------------ samples

    def _sample_grid(self) -> None:
        """Sample the EMA model from the fixed noise into samples/step_N.png (main process)."""
        if self.is_main and self.grid is not None:
            images = self.grid.sample(self.ema.model, self.diffusion, self.accelerator.autocast())
            save_grid(images, self.run_dir / "samples" / f"{checkpoint_name(self.step)}.png",
                      captions=self.grid.captions)
        self.accelerator.wait_for_everyone()

    def _write_summary(self, start_step: int, wall_time: float) -> None:
        """summary.json of the run at its current step; a session that trained nothing
        keeps the summary a previous session wrote at this step."""
        if not self.is_main:
            return
        previous = self.run_dir / "summary.json"
        if self.step == start_step and previous.is_file():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                if json.loads(previous.read_text())["steps"] == self.step:
                    return
        step_time = self.train_time / self.step if self.step else float("nan")
        write_json(self.run_dir / "summary.json", {
            "steps": self.step,
            "steps_this_session": self.step - start_step,
            "final_loss": self.last_loss,
            "mean_step_time_s": step_time,
            "images_per_s": self.cfg.train.batch_size / step_time if self.step else float("nan"),
            "wall_time_s": wall_time,
            "num_processes": self.accelerator.num_processes,
            "global_batch": self.cfg.train.batch_size,
            "resumed_from": str(self.resume_from) if self.resume_from else None,
            "launch": self.launch,
        })

    def _logged_loss(self) -> float | None:
        """The loss log.jsonl holds for the current step (a resume at a logged step)."""
        path = self.run_dir / "log.jsonl"
        if not self.is_main or not path.is_file():
            return None
        lines = path.read_text().splitlines()
        with contextlib.suppress(ValueError, KeyError, TypeError, IndexError):
            record = json.loads(lines[-1])
            if record["step"] == self.step:
                return record["loss"]
        return None

    # ------------------------------------------------------------------ setup

    def _find_start(self, resume: str | None) -> Path | None:
        """The checkpoint to resume from (None: fresh); refuses to overwrite a run, to
        resume with a different model or seed or below the checkpoint's step; sets what
        config.json records (the changes of this resume added to the history)."""
        skipped: list[str] = []
        start = resolve_resume(self.run_dir, resume, skipped)
        for line in skipped:
            self._print(f"note: {line}")
        if start is None:
            if resume is not None:  # latest-or-new
                self._print(f"note: no checkpoint in {self.run_dir}: starting a new run")
            problem = fresh_start_problem(self.run_dir, resume, self.overwrite)
            if problem is not None:
                raise TrainError(problem)
            return None
        step = json.loads((start / TRAINER_STATE).read_text())["step"]
        max_steps = self.cfg.train.max_steps
        if max_steps < step:
            raise TrainError(f"train.max_steps={max_steps} is below step {step} of {start}: a "
                             f"resume cannot undo steps (set train.max_steps >= {step})")
        saved, resumes = read_run_config(resume_config_path(start))
        resumes = [r for r in resumes if r["step"] <= step]  # a run folder's, past `start`
        changes = check_resume_config(start, saved, self.cfg)
        if max_steps == step:  # nothing runs: no change takes effect, nothing is rewritten
            self.nothing_to_train, self.recorded = True, (saved, resumes)
            ignored = f" (ignored: {', '.join(changes)})" if changes else ""
            self._print(f"note: the run is at step {step} = train.max_steps: nothing to "
                        f"train; its config.json and summary.json are kept{ignored}")
            return start
        for key, (old, new) in changes.items():  # applied, recorded and said out loud
            self._print(f"note: resuming with a changed setting, {key}: {old!r} in the "
                        f"checkpoint vs {new!r} now")
        note = schedule_change(saved.optim, saved.train.max_steps, self.cfg.optim, max_steps,
                               step)
        if note is not None:
            self._print(f"note: {note}")
        self.recorded = (self.cfg, resumes + ([resume_record(step, changes)] if changes else []))
        return start

    def _load_checkpoint(self, checkpoint: Path) -> None:
        self.accelerator.load_state(str(checkpoint))
        state = json.loads((checkpoint / TRAINER_STATE).read_text())
        self.step, self.epoch = state["step"], state["epoch"]
        self.batch_in_epoch = state["batch_in_epoch"]
        self.train_time = state.get("train_time_s", 0.0)
        layout = (self.accelerator.num_processes, self.batch_per_process)
        saved_layout = (state["num_processes"], state["batch_per_process"])
        if layout != saved_layout:
            # Same position in samples; the order within the epoch differs from the old run.
            used = self.batch_in_epoch * saved_layout[0] * saved_layout[1]
            self.batch_in_epoch = used // (layout[0] * layout[1])
            self._print(f"note: {saved_layout[0]} processes x {saved_layout[1]} per batch in the "
                        f"checkpoint, {layout[0]} x {layout[1]} now: the data order after the "
                        "resume differs from an uninterrupted run")
        self._print(f"resumed from {checkpoint} at step {self.step}")

    def _lock_run_dir(self) -> RunLock:
        """Take the run folder's lock on the main process (every process stops together
        if it is held by another run)."""
        lock, error = RunLock(self.run_dir), None
        if self.is_main:
            try:
                lock.acquire()
            except RunLockError as err:
                error = str(err)
        error = broadcast_object_list([error])[0]
        if error is not None:
            raise TrainError(error)
        return lock

    def _prepare_grid(self) -> SampleGrid | None:
        """Fixed noise (and prompts, VAE) for the periodic sample grids, on the main process.

        Loading errors are shared with every process so that all of them stop together.
        """
        if self.cfg.train.sample_every <= 0:
            return None
        grid, error = None, None
        if self.is_main:
            try:
                t = self.cfg.train
                grid = SampleGrid(self.cfg, self.device, t.seed, t.n_grid)
            except (OSError, ValueError, RuntimeError) as err:
                error = f"sample grid: {err} (or disable the grids with --set train.sample_every=0)"
        error = broadcast_object_list([error])[0]
        if error is not None:
            raise TrainError(error)
        return grid


# --------------------------------------------------------------------------- helpers


def _every(step: int, interval: int) -> bool:
    return interval > 0 and step % interval == 0
