"""One run of `uvic-compare`: train it (resumed), then evaluate it at every step of the grid
from the checkpoints the run kept (`train.keep_steps` holds the grid).

Each evaluation is one file, <out>/evals/<run>/step_<N>.json; a rerun skips a step whose
file names the same checkpoint (SHA-256), settings and metrics. The held-out MSE and the
samples draw their noise from the run's seed, so seed s of every variant is paired.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from uvic.config import Config
from uvic.evaluation.fid import evaluate
from uvic.evaluation.heldout import heldout_loss, real_images
from uvic.evaluation.protocols import protocol_of
from uvic.evaluation.quality import quality_figures
from uvic.experiments.compare_plan import QUALITY, SAMPLED
from uvic.experiments.quickstart_steps import make_deterministic
from uvic.experiments.runner import Job, run_train
from uvic.files import write_json
from uvic.run.folder import RunFolder
from uvic.run.weights import file_sha256
from uvic.sampling.assets import to_pixels
from uvic.sampling.generate import distributed_state
from uvic.sampling.load import load_model
from uvic.training.stop import Interrupted


class RunStopped(Exception):
    """A run stopped on a signal with its checkpoint (`Interrupted`, which does not pickle,
    as a worker process can return it)."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(signum, message)
        self.signum, self.message = signum, message


@dataclass(frozen=True)
class EvalSettings:
    """What every evaluation of a comparison measures, and where its files go."""

    metrics: tuple[str, ...]
    grid: tuple[int, ...]
    heldout: int
    out: Path

    def record(self, cfg: Config) -> dict[str, Any]:
        """The settings a result depends on (a stored result with others is redone)."""
        sampled = any(m in SAMPLED for m in self.metrics)
        return {"heldout": self.heldout if "heldout_mse" in self.metrics else None,
                "samples": cfg.eval.n_samples if sampled else None,
                "protocol": protocol_of(cfg).label() if sampled else None}


def eval_file(out: Path, run: str, step: int) -> Path:
    return out / "evals" / run / f"step_{step:06d}.json"


def step_weights(run_dir: Path, step: int) -> Path:
    """The EMA weights of the run's checkpoint at `step`."""
    path = RunFolder(run_dir).checkpoint(step) / RunFolder.EMA
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no checkpoint of step {step} (the run did not keep "
                                "it: was the evaluation grid changed after training?)")
    return path


def _png_images(folder: Path, n: int) -> torch.Tensor:
    """Samples {i:06d}.png as images (n, 3, H, W) in [0, 1]."""
    arrays = [np.asarray(Image.open(folder / f"{i:06d}.png").convert("RGB")) for i in range(n)]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).double() / 255.0


def _sampled_metrics(cfg: Config, ckpt: Path, folder: Path, settings: EvalSettings,
                     reference: torch.Tensor | None) -> dict[str, Any]:
    """Stand-in FID, FID and the quality figures of one set of samples (made once, scored
    by each); also the protocols and the reference statistics' digests."""
    metrics, found = settings.metrics, {}
    samples = folder.with_name(folder.name + "_samples")
    features = (["projection"] if any(m in metrics for m in ("standin_fid", *QUALITY)) else [])
    features += ["inception"] if "fid" in metrics else []
    for feature in features:
        # each run's samples seeded by its training seed: the pairs share their noise
        scored = replace(cfg, eval=replace(cfg.eval, features=feature),
                         sample=replace(cfg.sample, seed=cfg.train.seed))
        result = evaluate(scored, ckpt, out_json=folder.with_name(f"{folder.name}_{feature}.json"),
                          samples_dir=samples, stats_dir=settings.out / "fid_stats",
                          num_workers=0, progress=False)
        if result:
            key = "fid" if feature == "inception" else "standin_fid"
            found[key] = result["fid"]
            found.setdefault("protocols", {})[key] = result["protocol"]["label"]
            found.setdefault("reference_digests", {})[key] = result["reference_digest"]
    if reference is not None and any(m in QUALITY for m in metrics) and distributed_state(
            ).is_main_process:
        images = _png_images(samples, cfg.eval.n_samples)
        found.update({k: v for k, v in quality_figures(images, reference).items()
                      if k in QUALITY})
    return found


def evaluate_step(cfg: Config, run_dir: Path, step: int, settings: EvalSettings,
                  heldout: torch.Tensor | None, reference: torch.Tensor | None) -> str:
    """One evaluation of the run at `step` (skipped when its file is current)."""
    ckpt = step_weights(run_dir, step)
    path = eval_file(settings.out, cfg.name, step)
    sha, wanted = file_sha256(ckpt), settings.record(cfg)
    if path.is_file():
        old = json.loads(path.read_text())
        if (old.get("checkpoint_sha256") == sha and old.get("settings") == wanted
                and all(m in old.get("metrics", {}) for m in settings.metrics)):
            return f"step {step}: done (skipped)"
    found: dict[str, Any] = {}
    if any(m in SAMPLED for m in settings.metrics):
        found = _sampled_metrics(cfg, ckpt, path.with_suffix(""), settings, reference)
    state = distributed_state()
    if not state.is_main_process:
        return f"step {step}: evaluated on the main process"
    if "heldout_mse" in settings.metrics and heldout is not None:
        model = load_model(cfg, ckpt, state.device)
        found["heldout_mse"] = heldout_loss(model, cfg.diffusion, heldout, seed=cfg.train.seed)
    extra = {k: found.pop(k) for k in ("protocols", "reference_digests") if k in found}
    write_json(path, {"run": cfg.name, "step": step, "seed": cfg.train.seed,
                      "checkpoint": str(ckpt), "checkpoint_sha256": sha, "settings": wanted,
                      "metrics": {m: found[m] for m in settings.metrics if m in found},
                      **extra})
    return f"step {step}: " + ", ".join(f"{m} {found[m]:.4g}" for m in settings.metrics
                                        if m in found)


@dataclass(frozen=True)
class CellTime:
    """A finished cell of a run: its evaluation step (None: the training), its seconds and
    whether it did work (False: found done and skipped)."""

    step: int | None
    seconds: float
    worked: bool


def train_and_evaluate(job: Job, settings: EvalSettings, threads: int | None,
                       on_cell: Callable[[str, CellTime], None] | None = None,
                       ) -> tuple[list[str], list[CellTime]]:
    """The run's whole job: train to train.max_steps (resumed), evaluate every grid step;
    returns its lines and its cells' times, each also given to `on_cell` when done.
    `threads`: a fixed torch thread count and deterministic kernels (None: leave both)."""
    if threads is not None:
        make_deterministic(threads)
    cfg = job.cfg
    lines: list[str] = []
    times: list[CellTime] = []

    def done(step: int | None, line: str, start: float) -> None:
        lines.append(f"{cfg.name}: {line}")
        times.append(CellTime(step, time.monotonic() - start, "skipped" not in line))
        if on_cell is not None:
            on_cell(lines[-1], times[-1])

    start = time.monotonic()
    try:
        done(None, run_train(job), start)
    except Interrupted as err:
        raise RunStopped(err.signum, str(err)) from None
    heldout = reference = None
    if "heldout_mse" in settings.metrics:
        heldout = real_images(cfg, "val", settings.heldout)
    if any(m in QUALITY for m in settings.metrics):
        reference = to_pixels(cfg, real_images(cfg, "train", cfg.eval.n_samples))
    for step in settings.grid:
        start = time.monotonic()
        done(step, evaluate_step(cfg, job.run_dir, step, settings, heldout, reference), start)
    return lines, times
