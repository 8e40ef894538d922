"""The training loop: one loop for every dataset and model, run through Accelerate.

    accelerate launch scripts/train.py --config configs/cifar10_uvic.py [--set k=v ...]
    accelerate launch scripts/train.py --config configs/cifar10_uvic.py --resume latest

Objective (REFERENCE.md section 3): draw a noise level and noise with the run's schedule
(`uvic.diffusion.Diffusion.training_inputs`, the same object the sampler is built from),
predict the noise, mean squared error. Text-to-image runs replace each caption's context
by the empty-prompt context with probability `diffusion.p_uncond` (classifier-free
guidance). Optimiser and EMA follow the U-ViT release: AdamW on all parameters (its
optimizer ignores the model's `no_weight_decay()`), LR warm-up `min(step / warmup, 1)`
from step 0, EMA started as an exact copy and updated after every optimizer step.

Exact resumption. Everything random in a step is a pure function of the seed and the
position in the run, so a killed run continued from its last checkpoint reaches the same
weights as an uninterrupted one:
* the order of the data is a permutation drawn from (seed, epoch) (`EpochSampler`), and a
  resumed run skips the batches of the current epoch that were already used;
* the global random generators are seeded from (seed, epoch, index) around each item
  (`SeededItems`), so item randomness (CIFAR-10 and Shapes flips; MS-COCO caption choice
  and latent sampling when data.num_workers=0 -- in workers `MSCOCOFeatures` draws from its
  own per-worker generator) is the same whatever the worker or process;
* the noise, noise level and caption dropping of optimizer step s, micro-batch m, on
  process r come from a generator seeded with (seed, r, s, m).
Checkpoints hold the model, EMA, optimizer, LR schedule, grad scaler (Accelerate's
`save_state`) and the data position (`trainer_state.json`). They are written to
`step_XXXXXX.tmp/` and renamed when complete, so a half-written one is never picked up.

Precision, accumulation and the seed come from the config (`train.*`), not from
`accelerate launch` flags. With several nodes, `train.output_dir` must be on a filesystem
they share.

Run folder (`train.output_dir`):
    config.json            resolved config
    log.jsonl              one line per log step: step, loss, lr, grad_norm, images/s, time
    tensorboard/           the same scalars for TensorBoard
    samples/step_*.png     sample grids of the EMA model with fixed noise (and prompts)
    checkpoints/step_*/    the last `train.keep_last` checkpoints
    ema.safetensors        EMA weights of the latest checkpoint (what sampling loads)
    summary.json           written at the end: steps, final loss, time per step, images/s
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    ProjectConfiguration,
    broadcast_object_list,
    set_seed,
)
from diffusers.optimization import get_cosine_schedule_with_warmup
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Sampler
from tqdm.auto import tqdm

from uvic.autoencoder import load_vae
from uvic.checkpoint import save_safetensors
from uvic.config import Config, ConfigError, load_config, save_config, to_dict
from uvic.data import build_dataset, load_empty_context, load_sample_prompts
from uvic.diffusion import Diffusion
from uvic.ema import EMA
from uvic.sampling import (
    guidance_scale,
    is_latent,
    make_noise,
    sample_generators,
    sample_images,
    save_grid,
    to_pixels,
)
from uvic.uvit import build_model

CHECKPOINT_PREFIX = "step_"
TRAINER_STATE = "trainer_state.json"
# If set, every process appends the per-sample sums of its batches to
# $UVIC_TRAIN_DEBUG_DIR/data_rank{r}.jsonl (used by the tests to check the data sharding).
DEBUG_ENV = "UVIC_TRAIN_DEBUG_DIR"

# Tags that keep the seed streams of different purposes apart.
_DATA_STREAM, _NOISE_STREAM = 1, 2


class TrainError(RuntimeError):
    """The run cannot start or continue (diverged, run folder in the way, ...)."""


# --------------------------------------------------------------------------- seeds


def derive_seed(*keys: int) -> int:
    """A 63-bit seed that is a pure function of the integers `keys` (numpy SeedSequence)."""
    state = np.random.SeedSequence([int(k) for k in keys]).generate_state(1, dtype=np.uint64)
    return int(state[0]) >> 1


@contextlib.contextmanager
def seeded_global_rngs(seed: int) -> Iterator[None]:
    """Seed Python's, NumPy's and torch's global CPU generators, restore them on exit.

    (`torch.default_generator` rather than `torch.manual_seed`, which also seeds every
    CUDA device and costs ~100x more per item.)
    """
    py_state, np_state = random.getstate(), np.random.get_state()
    torch_state = torch.get_rng_state()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)


# --------------------------------------------------------------------------- data order


class EpochSampler(Sampler[tuple[int, int]]):
    """Shuffles all indices once per epoch with a permutation drawn from (seed, epoch).

    Yields `(epoch, index)` so that `SeededItems` can seed each item's randomness; set the
    epoch with `set_epoch` (Accelerate's prepared loader forwards its own `set_epoch`).
    """

    def __init__(self, num_items: int, seed: int) -> None:
        self.num_items, self.seed, self.epoch = num_items, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_items

    def __iter__(self) -> Iterator[tuple[int, int]]:
        g = torch.Generator().manual_seed(derive_seed(self.seed, _DATA_STREAM, self.epoch))
        for index in torch.randperm(self.num_items, generator=g).tolist():
            yield self.epoch, index


class SeededItems(Dataset):
    """Wraps a dataset: item `(epoch, index)` is `dataset[index]` computed with the global
    random generators seeded from (seed, epoch, index), so augmentations are reproducible
    in any worker or process and after a resume."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> dict[str, Tensor]:
        epoch, index = key
        with seeded_global_rngs(derive_seed(self.seed, _DATA_STREAM, epoch, index)):
            item = self.dataset[index]
        if not isinstance(item, dict) or "x" not in item:
            raise TypeError(f"{type(self.dataset).__name__}[{index}] must be a dict with key "
                            f"'x', got {type(item).__name__}")
        return item


# --------------------------------------------------------------------------- objective


def diffusion_loss(
    model: nn.Module,
    diffusion: Diffusion,
    batch: dict[str, Tensor],
    generator: torch.Generator,
    *,
    empty_context: Tensor | None = None,
    p_uncond: float = 0.0,
) -> Tensor:
    """Noise-prediction MSE of `model` on `batch` ({"x", optional "context", "y"}).

    With a "context" and p_uncond > 0, each sample's context is replaced by
    `empty_context` (L, D) with probability p_uncond (drawn from `generator` first).
    """
    x0 = batch["x"]
    kwargs: dict[str, Tensor] = {}
    context = batch.get("context")
    if context is not None:
        if p_uncond > 0:
            if empty_context is None:
                raise ValueError("p_uncond > 0 needs the empty-prompt context")
            drop = torch.rand(x0.shape[0], generator=generator, device=x0.device) < p_uncond
            empty = empty_context.to(device=context.device, dtype=context.dtype)
            context = torch.where(drop[:, None, None], empty[None], context)
        kwargs["context"] = context
    if batch.get("y") is not None:
        kwargs["y"] = batch["y"]
    x_t, net_t, noise = diffusion.training_inputs(x0, generator)
    pred = model(x_t, net_t, **kwargs)
    return F.mse_loss(pred.float(), noise.float())


def warmup_constant(warmup_steps: int):
    """LR factor of the release: min(step / warmup_steps, 1) (step counts from 0)."""

    def factor(step: int) -> float:
        return min(step / warmup_steps, 1.0) if warmup_steps > 0 else 1.0

    return factor


# --------------------------------------------------------------------------- checkpoints


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run (`checkpoints/step_N/` with a trainer state), oldest first.

    Folders still being written (`.tmp`) or deleted are ignored.
    """
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        number = path.name[len(CHECKPOINT_PREFIX):]
        if (path.name.startswith(CHECKPOINT_PREFIX) and number.isdigit()
                and (path / TRAINER_STATE).is_file()):
            found.append((int(number), path))
    return [path for _, path in sorted(found)]


def resolve_resume(run_dir: str | Path, resume: str | None) -> Path | None:
    """The checkpoint folder to resume from: None (fresh), "latest" (None if the run has no
    checkpoint yet), a checkpoint folder, or a run folder (its latest checkpoint)."""
    if resume is None:
        return None
    if resume == "latest":
        checkpoints = list_checkpoints(run_dir)
        return checkpoints[-1] if checkpoints else None
    path = Path(resume)
    if (path / TRAINER_STATE).is_file():
        return path
    checkpoints = list_checkpoints(path)
    if checkpoints:
        return checkpoints[-1]
    raise TrainError(f"--resume {resume}: not a checkpoint folder (no {TRAINER_STATE}) nor a "
                     "run folder with checkpoints")


def _config_differences(saved: dict[str, Any], current: dict[str, Any], section: str) -> list[str]:
    keys = sorted(set(saved) | set(current))
    return [f"{section}.{k}: {saved.get(k)!r} in the checkpoint vs {current.get(k)!r} now"
            for k in keys if saved.get(k) != current.get(k)]


def _fsync(path: Path) -> None:
    """Flush one file or folder entry to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """Flush every file under `folder` to disk (so a renamed checkpoint is complete)."""
    for path in folder.rglob("*"):
        if path.is_file():
            _fsync(path)


def _remove_tree(path: Path) -> None:
    """Rename out of the checkpoint namespace first, then delete (safe if killed midway)."""
    if not path.exists():
        return
    doomed = path.with_name(path.name + ".deleting")
    if doomed.exists():
        shutil.rmtree(doomed)
    os.replace(path, doomed)
    shutil.rmtree(doomed)


# --------------------------------------------------------------------------- trainer


def train(cfg: Config, resume: str | None = None) -> Path:
    """Train the model of `cfg` (fresh, or continuing from `resume`: "latest", a checkpoint
    folder or a run folder); returns the run folder `cfg.train.output_dir`."""
    return Trainer(cfg, resume).fit()


class Trainer:
    """State of one training run; `fit()` runs the loop. See the module docstring."""

    def __init__(self, cfg: Config, resume: str | None = None) -> None:
        _check_train_config(cfg)
        self.cfg = cfg
        self.run_dir = Path(cfg.train.output_dir).resolve()
        t = cfg.train

        # ---- Accelerate: processes, precision, accumulation, logging, checkpoint folders
        self.accelerator = Accelerator(
            mixed_precision=t.mixed_precision,
            gradient_accumulation_plugin=GradientAccumulationPlugin(
                num_steps=t.grad_accum, sync_with_dataloader=False),
            log_with="tensorboard",
            project_config=ProjectConfiguration(
                project_dir=str(self.run_dir), logging_dir=str(self.run_dir / "tensorboard"),
                automatic_checkpoint_naming=False),
            # LambdaLR counts optimizer steps; Accelerate would otherwise step it once per
            # process per optimizer step.
            step_scheduler_with_optimizer=False,
            dataloader_config=DataLoaderConfiguration(non_blocking=True),  # pinned -> async
            dynamo_backend="inductor" if t.compile else "no",
        )
        acc = self.accelerator
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if acc.num_processes != world:
            # e.g. `accelerate launch --multi_gpu` without GPUs: N independent copies would
            # write the same run folder.
            raise TrainError(f"launched as {world} processes (WORLD_SIZE) but Accelerate runs "
                             f"{acc.num_processes} ({acc.distributed_type}); without GPUs set "
                             "ACCELERATE_USE_CPU=1 for multi-process CPU training (gloo)")
        self.is_main = acc.is_main_process
        self.device = acc.device
        processes = acc.num_processes * t.grad_accum
        if t.batch_size % processes:
            raise ConfigError(f"train.batch_size={t.batch_size} is not divisible by "
                              f"{acc.num_processes} processes x train.grad_accum={t.grad_accum}")
        self.batch_per_process = t.batch_size // processes

        # ---- where to start: fresh, or a checkpoint (refuse model changes)
        self.resume_from = resolve_resume(self.run_dir, resume)
        if resume == "latest" and self.resume_from is None and acc.is_main_process:
            tqdm.write(f"no checkpoint in {self.run_dir}: starting from scratch")
        if self.resume_from is None:
            existing = list_checkpoints(self.run_dir)
            if existing:
                raise TrainError(f"{self.run_dir} already has checkpoints (latest "
                                 f"{existing[-1].name}); pass --resume latest to continue or "
                                 "set train.output_dir to a new folder")
        else:
            self._check_resume_config(self.resume_from)

        # ---- data, model, objective, optimizer
        dataset = build_dataset(cfg, "train")
        self.num_items = len(dataset)
        self.sampler = EpochSampler(self.num_items, t.seed)
        loader = DataLoader(
            SeededItems(dataset, t.seed), batch_size=self.batch_per_process,
            sampler=self.sampler, drop_last=True, num_workers=cfg.data.num_workers,
            persistent_workers=cfg.data.num_workers > 0,
            pin_memory=self.device.type == "cuda",
        )
        self._check_context(loader.dataset)
        try:
            self.diffusion = Diffusion(cfg.diffusion)
        except ValueError as err:  # a bad diffusion.* value, named in the message
            raise ConfigError(str(err)) from err
        self.empty_context = None
        if cfg.model.clip_dim > 0 and cfg.diffusion.p_uncond > 0:
            self.empty_context = load_empty_context(cfg).to(self.device)

        set_seed(t.seed)  # the initial weights depend on the seed only
        try:
            model = build_model(cfg.model)
        except ValueError as err:  # a bad model.* value, named in the message
            raise ConfigError(str(err)) from err
        self.ema = EMA(model, t.ema_decay).to(self.device)  # exact copy at step 0
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr,
                                      betas=tuple(cfg.optim.betas),
                                      weight_decay=cfg.optim.weight_decay)
        if cfg.optim.lr_schedule == "cosine":
            lr_scheduler = get_cosine_schedule_with_warmup(
                optimizer, cfg.optim.warmup_steps, t.max_steps)
        elif cfg.optim.lr_schedule == "constant":
            lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer, warmup_constant(cfg.optim.warmup_steps))
        else:
            raise ConfigError(f"optim.lr_schedule={cfg.optim.lr_schedule!r} must be constant "
                              "or cosine")
        self.model, self.optimizer, self.loader, self.lr_scheduler = acc.prepare(
            model, optimizer, loader, lr_scheduler)
        if len(self.loader) == 0:
            raise ConfigError(f"data: {self.num_items} items is less than one batch of "
                              f"{self.batch_per_process} per process x {acc.num_processes} "
                              f"processes (train.batch_size={t.batch_size})")
        acc.register_for_checkpointing(self.ema)
        self.noise_generator = torch.Generator(device=self.device)

        # ---- position in the run
        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.train_time = 0.0  # seconds spent in training steps, over all sessions
        if self.resume_from is not None:
            self._load_checkpoint(self.resume_from)
        self.last_saved = self.step if self.resume_from is not None else -1

        # ---- logging and sample-grid assets
        self._prepare_run_dir()
        self._prepare_grid()
        if self.is_main:
            acc.init_trackers(cfg.name, config=_flat_config(cfg))

    # ------------------------------------------------------------------ setup helpers

    def _check_resume_config(self, checkpoint: Path) -> None:
        saved_path = checkpoint / "config.json"
        if not saved_path.is_file():
            saved_path = checkpoint.parent.parent / "config.json"
        if not saved_path.is_file():
            raise TrainError(f"cannot resume from {checkpoint}: no config.json in it or its run "
                             "folder")
        saved, current = to_dict(load_config(saved_path)), to_dict(self.cfg)
        diffs = _config_differences(saved["model"], current["model"], "model")
        if diffs:
            raise ConfigError(f"refusing to resume from {checkpoint}: the model differs from "
                              f"the checkpoint's ({'; '.join(diffs)})")
        for section in ("data", "diffusion", "optim"):  # allowed, but said out loud
            for change in _config_differences(saved[section], current[section], section):
                self._print(f"note: resuming with a changed setting, {change}")

    def _check_context(self, dataset: SeededItems) -> None:
        """Text-conditional: the items' context must have the model's token count and width
        (build_dataset checks the image shape and width already)."""
        m = self.cfg.model
        if m.clip_dim <= 0:
            return
        item = dataset[(0, 0)]
        got = tuple(item["context"].shape) if "context" in item else None
        if got != (m.num_clip_token, m.clip_dim):
            raise ConfigError(f"data.name={self.cfg.data.name} gives context of shape {got} but "
                              f"model.num_clip_token/clip_dim expect "
                              f"{(m.num_clip_token, m.clip_dim)}")

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

    def _prepare_run_dir(self) -> None:
        """config.json, log.jsonl cut back to the resumed step, and the leftovers of a
        checkpoint write or deletion cut short by a kill removed (main process)."""
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(self.cfg, self.run_dir / "config.json")
            checkpoints = self.run_dir / "checkpoints"
            for pattern in (f"{CHECKPOINT_PREFIX}*.tmp", f"{CHECKPOINT_PREFIX}*.deleting"):
                for leftover in checkpoints.glob(pattern):
                    shutil.rmtree(leftover)
            log = self.run_dir / "log.jsonl"
            if log.is_file():  # drop lines of steps that will be redone (or cut by a kill)
                keep = [line for line in log.read_text().splitlines()
                        if (step := _log_step(line)) is not None and step <= self.step]
                tmp = log.with_suffix(".jsonl.tmp")
                tmp.write_text("".join(line + "\n" for line in keep))
                os.replace(tmp, log)
        self.accelerator.wait_for_everyone()

    def _prepare_grid(self) -> None:
        """Fixed noise (and prompts, VAE) for the periodic sample grids, on the main process.

        Loading errors are shared with every process so that all of them stop together.
        """
        self.grid: dict[str, Any] | None = None
        if self.cfg.train.sample_every <= 0:
            return
        error = None
        if self.is_main:
            try:
                self.grid = self._grid_assets()
            except (OSError, ValueError, RuntimeError) as err:
                error = f"sample grid: {err} (or disable the grids with --set train.sample_every=0)"
        error = broadcast_object_list([error])[0]
        if error is not None:
            raise TrainError(error)

    def _grid_assets(self) -> dict[str, Any]:
        cfg, m = self.cfg, self.cfg.model
        n = cfg.train.n_grid
        assets: dict[str, Any] = {"vae": None, "context": None, "uncond": None, "captions": None}
        if m.clip_dim > 0:
            prompts, contexts = load_sample_prompts(cfg)
            n = min(n, len(prompts))
            assets["captions"] = prompts[:n]
            assets["context"] = contexts[:n].to(self.device)
            assets["uncond"] = load_empty_context(cfg).to(self.device)
        if is_latent(cfg):
            assets["vae"] = load_vae(cfg.data.vae, self.device)
        # Sample i of the grid is sample i of `scripts/sample.py` with the same seed.
        generators = sample_generators(cfg.train.seed, range(n))
        assets["noise"] = make_noise((m.in_chans, m.img_size, m.img_size), generators,
                                     self.device)
        return assets

    def _print(self, message: str) -> None:
        if self.is_main:
            tqdm.write(message)

    # ------------------------------------------------------------------ loop

    def fit(self) -> Path:
        """Train up to `train.max_steps`, checkpoint, write summary.json; returns run_dir."""
        t = self.cfg.train
        start_step, start_time = self.step, time.perf_counter()
        batches = self._batches()
        loss_sum = torch.zeros((), device=self.device)  # since the last log, on device
        loss_steps = 0
        self.window_start, window_steps = time.perf_counter(), 0  # throughput window
        self.last_loss: float | None = None
        grad_norm: Tensor | None = None
        bar = tqdm(total=t.max_steps, initial=self.step, disable=not self.is_main,
                   desc=self.cfg.name, dynamic_ncols=True)
        try:
            while self.step < t.max_steps:
                log_now = _every(self.step + 1, t.log_every) or self.step + 1 == t.max_steps
                loss, norm = self._train_step(batches, want_grad_norm=log_now)
                self.step += 1
                loss_sum += loss
                loss_steps += 1
                window_steps += 1
                grad_norm = norm if norm is not None else grad_norm
                bar.update(1)

                if log_now:
                    elapsed = time.perf_counter() - self.window_start
                    self._log(loss_sum, loss_steps, grad_norm, elapsed, window_steps, bar)
                    self.train_time += elapsed
                    loss_sum.zero_()
                    loss_steps, window_steps = 0, 0
                    self.window_start = time.perf_counter()
                pause = time.perf_counter()
                if _every(self.step, t.ckpt_every):
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
            self.accelerator.end_training()  # flush and close TensorBoard
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

    def _train_step(
        self, batches: Iterator[dict[str, Tensor]], want_grad_norm: bool
    ) -> tuple[Tensor, Tensor | None]:
        """One optimizer step over `train.grad_accum` micro-batches.

        Returns the mean loss (a device tensor: no host sync) and the gradient norm (only
        when clipping or asked for).
        """
        acc, t = self.accelerator, self.cfg.train
        clip = self.cfg.optim.grad_clip
        total = torch.zeros((), device=self.device)
        grad_norm = None
        for micro in range(t.grad_accum):
            batch = next(batches)
            self._debug_batch(batch, micro)
            self.noise_generator.manual_seed(
                derive_seed(t.seed, _NOISE_STREAM, acc.process_index, self.step, micro))
            with acc.accumulate(self.model):
                loss = diffusion_loss(self.model, self.diffusion, batch, self.noise_generator,
                                      empty_context=self.empty_context,
                                      p_uncond=self.cfg.diffusion.p_uncond)
                acc.backward(loss)
                if acc.sync_gradients and (clip > 0 or want_grad_norm):
                    grad_norm = acc.clip_grad_norm_(self.model.parameters(),
                                                    clip if clip > 0 else math.inf)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            total += loss.detach()
        if not acc.sync_gradients:
            raise RuntimeError("internal: optimizer step ended without gradient sync")
        self.lr_scheduler.step()
        self.ema.update(self.model)
        return total / t.grad_accum, grad_norm

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

    def _debug_batch(self, batch: dict[str, Tensor], micro: int) -> None:
        folder = os.environ.get(DEBUG_ENV)
        if not folder:
            return
        sums = batch["x"].double().flatten(1).sum(1).tolist()
        path = Path(folder) / f"data_rank{self.accelerator.process_index}.jsonl"
        with open(path, "a") as f:
            f.write(json.dumps({"step": self.step, "micro": micro, "epoch": self.epoch,
                                "sums": sums}) + "\n")

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
        """Write checkpoints/step_N atomically, export ema.safetensors, prune old ones."""
        self._check_finite(loss_sum, loss_steps)
        acc = self.accelerator
        root = self.run_dir / "checkpoints"
        final = root / f"{CHECKPOINT_PREFIX}{self.step:06d}"
        tmp = final.with_name(final.name + ".tmp")
        if self.is_main and tmp.exists():
            shutil.rmtree(tmp)  # left by a killed run
        acc.wait_for_everyone()
        acc.save_state(str(tmp))  # model, optimizer, LR schedule, scaler, RNG states, EMA
        acc.wait_for_everyone()
        if self.is_main:
            save_safetensors(self.ema.model, tmp / "ema.safetensors")
            save_config(self.cfg, tmp / "config.json")
            state = {
                "step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                "num_processes": acc.num_processes, "batch_per_process": self.batch_per_process,
                "grad_accum": self.cfg.train.grad_accum,
                "images_seen": self.step * self.cfg.train.batch_size,
                # training time so far, including the current (unlogged) window
                "train_time_s": self.train_time + time.perf_counter() - self.window_start,
            }
            (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=2) + "\n")
            _fsync_tree(tmp)
            _remove_tree(final)  # only if a previous run wrote this same step
            os.replace(tmp, final)
            _fsync(root)  # make the rename itself durable
            save_safetensors(self.ema.model, self.run_dir / "ema.safetensors")
            for old in list_checkpoints(self.run_dir)[:-max(self.cfg.train.keep_last, 1)]:
                _remove_tree(old)
        acc.wait_for_everyone()
        self.last_saved = self.step

    # ------------------------------------------------------------------ samples

    def _sample_grid(self) -> None:
        """Sample the EMA model from the fixed noise into samples/step_N.png (main process)."""
        if self.is_main and self.grid is not None:
            s, g = self.cfg.sample, self.grid
            with self.accelerator.autocast():
                x0 = sample_images(
                    self.ema.model, self.diffusion, g["noise"], context=g["context"],
                    uncond_context=g["uncond"], cfg_scale=guidance_scale(self.cfg),
                    scheduler=s.scheduler, steps=s.steps, order=s.order)
            images = to_pixels(self.cfg, x0, vae=g["vae"])
            save_grid(images, self.run_dir / "samples" / f"{CHECKPOINT_PREFIX}{self.step:06d}.png",
                      captions=g["captions"])
        self.accelerator.wait_for_everyone()

    def _write_summary(self, start_step: int, wall_time: float) -> None:
        if not self.is_main:
            return
        steps = self.step - start_step
        step_time = self.train_time / self.step if self.step else float("nan")
        summary = {
            "steps": self.step,
            "steps_this_session": steps,
            "final_loss": self.last_loss,
            "mean_step_time_s": step_time,
            "images_per_s": self.cfg.train.batch_size / step_time if self.step else float("nan"),
            "wall_time_s": wall_time,
            "num_processes": self.accelerator.num_processes,
            "global_batch": self.cfg.train.batch_size,
            "resumed_from": str(self.resume_from) if self.resume_from else None,
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


# --------------------------------------------------------------------------- helpers


def _log_step(line: str) -> int | None:
    """Step of one log.jsonl line; None for a line cut short by a kill."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def _every(step: int, interval: int) -> bool:
    return interval > 0 and step % interval == 0


def _check_train_config(cfg: Config) -> None:
    t = cfg.train
    checks = [
        (t.grad_accum >= 1, f"train.grad_accum={t.grad_accum} must be >= 1"),
        (t.batch_size >= 1, f"train.batch_size={t.batch_size} must be >= 1"),
        (t.max_steps >= 0, f"train.max_steps={t.max_steps} must be >= 0"),
        (0.0 <= t.ema_decay <= 1.0, f"train.ema_decay={t.ema_decay} must be in [0, 1]"),
        (t.keep_last >= 1, f"train.keep_last={t.keep_last} must be >= 1"),
        (t.mixed_precision in ("no", "fp16", "bf16"),
         f"train.mixed_precision={t.mixed_precision!r} must be no, fp16 or bf16"),
        (0.0 <= cfg.diffusion.p_uncond < 1.0,
         f"diffusion.p_uncond={cfg.diffusion.p_uncond} must be in [0, 1)"),
        (cfg.optim.grad_clip >= 0, f"optim.grad_clip={cfg.optim.grad_clip} must be >= 0"),
        (cfg.data.num_workers >= 0, f"data.num_workers={cfg.data.num_workers} must be >= 0"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def _flat_config(cfg: Config) -> dict[str, Any]:
    """section/field -> value with scalars only (TensorBoard's hparams)."""
    flat = {}
    for section, values in to_dict(cfg).items():
        if isinstance(values, dict):
            for key, value in values.items():
                ok = isinstance(value, int | float | str | bool)
                flat[f"{section}/{key}"] = value if ok else str(value)
        else:
            flat[section] = values
    return flat
