"""The quickstart's steps (`uvic.cli.quickstart` is the program): train both models,
sample them, score the samples and the held-out images, draw and write the results.

`run(args)` runs them in order; each model's training and sampling is one job
(`train_and_sample`), run in a worker process of its own when models train at once.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from uvic.analysis import analyze, save_figures
from uvic.config import Config, TrainConfig, load_config
from uvic.config.validation import start_config
from uvic.evaluation.heldout import heldout_loss, real_images
from uvic.evaluation.quality import quality_figures
from uvic.experiments.progress import LogWatcher, StepClock
from uvic.experiments.quickstart_report import (
    guide_record,
    objective_name,
    plot_losses,
    read_log,
    write_report,
)
from uvic.files import save_config, write_json
from uvic.presets import QUICKSTART_MODELS as MODELS
from uvic.presets import QUICKSTART_PRESETS, preset_path
from uvic.run.folder import RunFolder
from uvic.sampling.assets import to_pixels
from uvic.sampling.generate import sample_checkpoint
from uvic.sampling.images import save_comparison_grid
from uvic.sampling.load import load_model
from uvic.training.trainer import train


def build_config(args: argparse.Namespace) -> Config:
    """The quickstart config with the preset and the user's overrides applied (without
    autoguidance, said in a note, for a run that ends before its guide)."""
    preset = args.preset
    if preset == "auto":
        preset = "gpu" if torch.cuda.is_available() else "cpu"
    cfg, note = start_config(load_config(preset_path(QUICKSTART_PRESETS[preset]),
                                         list(args.set)))
    if note is not None:  # a short try of the quickstart
        print(f"note: {note}", flush=True)
    return cfg


def make_deterministic(threads: int) -> None:
    """Same numbers on every run: a fixed thread count (it sets the order of parallel
    float sums, and the default follows the machine) and deterministic kernels. On CUDA,
    ops without a deterministic version only warn (the CPU run is the exact one)."""
    torch.set_num_threads(threads)
    if torch.cuda.is_available():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before any cuBLAS call
    torch.use_deterministic_algorithms(True, warn_only=torch.cuda.is_available())


class QuickstartError(RuntimeError):
    """A model's training or sampling failed (the message names it and its log)."""

    exit_status = 1  # the program's, where the inputs were right but a model failed


def train_and_sample(cfg: Config, n_samples: int, threads: int) -> dict:
    """One model's whole job: train it, then sample `n_samples` images from its EMA weights.

    Returns {"run_dir", "samples" (n, 3, H, W) in [0, 1] on the CPU}. Sample i is seeded
    by (train.seed, i), so both models start from the same noise and the grid compares
    them image for image.
    """
    make_deterministic(threads)
    run_dir = train(cfg, overwrite=True)  # the quickstart's own folder: a rerun replaces it
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # its own run's EMA: the model is cfg.model (and the guide, if any, a kept checkpoint)
    images = torch.cat([batch for _, batch in sample_checkpoint(
        cfg, RunFolder(run_dir).ema, range(n_samples), seed=cfg.train.seed, device=device)])
    return {"run_dir": run_dir, "samples": images}


def run_logged(log_path: Path, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a worker process, all its output (the traceback of a failure too) in
    `log_path` instead of the terminal the workers share."""
    log = open(log_path, "w", buffering=1)  # noqa: SIM115 (open for the process's lifetime)
    os.dup2(log.fileno(), 1)  # the C-level streams too (warnings of compiled code)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    try:
        return fn(*args)
    except BaseException:
        traceback.print_exc()
        raise


def train_and_sample_logged(cfg: Config, n_samples: int, threads: int, log_path: Path) -> dict:
    """`train_and_sample` in a worker process, its output in `log_path` (`run_logged`)."""
    return run_logged(log_path, train_and_sample, cfg, n_samples, threads)


def train_models(configs: dict[str, Config], n_samples: int, threads: int,
                 jobs: int) -> dict[str, dict]:
    """`train_and_sample` for every model: one after another (jobs=1, all threads, its own
    progress bar) or `jobs` at a time in separate processes with threads // jobs threads
    each (one bar per model here, read from the runs' logs; each worker's output in
    <run folder>.log). A tiny model keeps two cores busier as two one-thread processes
    than as one two-thread process."""
    if jobs <= 1:
        results = {}
        for name, cfg in configs.items():
            print(f"\n=== {name}: training ({cfg.train.max_steps} steps) ===", flush=True)
            with step_log(cfg.train, threads, tqdm.write, threads):  # a hint if steps slow down
                results[name] = train_and_sample(cfg, n_samples, threads)
        return results

    per_job = max(1, threads // jobs)
    logs = {name: Path(cfg.train.output_dir).with_suffix(".log") for name, cfg in configs.items()}
    print(f"\n=== training {' and '.join(configs)} at once ({per_job} thread(s) each; "
          f"output in {', '.join(str(p) for p in logs.values())}) ===", flush=True)
    context = multiprocessing.get_context("spawn")  # no fork of a threaded parent
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = {name: pool.submit(train_and_sample_logged, cfg, n_samples, per_job,
                                      logs[name])
                   for name, cfg in configs.items()}
        show_progress(configs, futures, per_job, threads)
        results = {}
        for name, future in futures.items():
            try:
                results[name] = future.result()
            except Exception as err:
                raise QuickstartError(f"{name}: {err} (full output: {logs[name]})") from err
    return results


def step_log(train: TrainConfig, threads: int, say: Callable[[str], Any],
             total: int = 1) -> LogWatcher:
    """The run's log.jsonl as it trains: its seconds per step, and the hint (to `say`) when
    its steps turn far slower than its first ones (`uvic.experiments.progress.StepClock`);
    `threads`: the run's, `total`: the quickstart's in all."""
    clock = StepClock(threads, change="" if total == 1 else "make quickstart ARGS=\"--threads "
                      "1\" trains the models one after the other on one thread, into the "
                      "same weights")
    return LogWatcher(RunFolder(train.output_dir).log, clock, train.batch_size,
                      say=say, every=1.0)


def show_progress(configs: dict[str, Config], futures: dict[str, Future],
                  threads: int = 1, total: int = 1) -> None:
    """One progress bar per model, fed by its run's log.jsonl (the records of this run), with
    its loss and seconds per step, until every worker ends; `threads`: each worker's,
    `total`: the quickstart's in all."""
    bars = {name: tqdm(total=cfg.train.max_steps, desc=name, position=i, dynamic_ncols=True)
            for i, (name, cfg) in enumerate(configs.items())}
    logs = {name: step_log(cfg.train, threads, tqdm.write, total) for name, cfg in configs.items()}
    while not all(f.done() for f in futures.values()):
        time.sleep(1.0)
        for name, log in logs.items():
            if log.poll() and log.last is not None:
                bars[name].update(log.last["step"] - bars[name].n)
                bars[name].set_postfix_str(", ".join(filter(None, (
                    f"loss={log.last['loss']:.4f}", log.clock.text()))))
    for bar in bars.values():
        bar.close()


def try_fid(cfg: Config, ckpt: Path, out_dir: Path, name: str) -> tuple[float | None, str]:
    """FID through the real evaluator, or (None, why) when Inception weights are absent;
    the line printed first says which: the model's FID of n samples, or FID skipped."""
    from uvic.evaluation import fid
    from uvic.evaluation.statistics import check_inception

    what = "FID" if cfg.eval.features == "inception" else f"stand-in FID ({cfg.eval.features})"
    try:
        if cfg.eval.features == "inception":
            check_inception(cfg.eval, cfg.eval.mode)  # before the samples: none made for nothing
    except fid.InceptionWeightsMissing as err:
        print(f"=== {name}: FID skipped (no Inception weights: results.md says how to get "
              "them) ===", flush=True)
        return None, str(err)
    print(f"=== {name}: {what} ({cfg.eval.n_samples} samples) ===", flush=True)
    try:
        result = fid.evaluate(cfg, ckpt, out_json=out_dir / "fid.json",
                              samples_dir=out_dir / "fid_samples")
    except fid.InceptionWeightsMissing as err:
        return None, str(err)
    return float(result["fid"]), ""


# --------------------------------------------------------------------------- the run


@dataclass
class RealImages:
    """Real images: the training images are the reference of the HF ratio; held-out images
    are scored like samples (what a perfect model would reach) and give the EMA loss."""

    train: torch.Tensor  # pixels in [0, 1], the first --n-quality training images
    heldout: torch.Tensor  # model space, max(--n-quality, --heldout) held-out images
    quality: dict  # the quality figures of the first --n-quality held-out images


def load_real_images(base: Config, args: argparse.Namespace) -> RealImages:
    """The real images of the quickstart's data and the quality figures of the held-out."""
    n_real = max(args.n_quality, args.heldout)
    train_real = to_pixels(base, real_images(base, "train", args.n_quality))
    heldout = real_images(base, "val", n_real)
    quality = quality_figures(to_pixels(base, heldout[:args.n_quality]), train_real)
    return RealImages(train_real, heldout, quality)


def model_configs(base: Config, out: Path) -> dict[str, Config]:
    """Display name -> the config of that model, its run folder in `out`."""
    return {name: replace(base, name=f"quickstart_{preset}",
                          model=replace(base.model, attention=preset),
                          train=replace(base.train, output_dir=str(out / preset)))
            for name, preset in MODELS.items()}


def job_count(args: argparse.Namespace, device: torch.device) -> int:
    """Models trained at once: --jobs, by default 2 on a CPU and 1 on a GPU; on a CPU
    never more processes than threads."""
    jobs = args.jobs if args.jobs is not None else (1 if device.type == "cuda" else 2)
    if device.type == "cpu":
        jobs = min(jobs, args.threads)
    return jobs


@dataclass
class Scores:
    """What the scoring of the trained models found, per model (display name)."""

    rows: list[dict] = field(default_factory=list)  # results.json's rows
    logs: dict[str, list[dict]] = field(default_factory=dict)  # training logs
    samples: dict[str, torch.Tensor] = field(default_factory=dict)  # grid images
    timing: dict[str, dict] = field(default_factory=dict)
    models: dict[str, torch.nn.Module] = field(default_factory=dict)  # EMA
    fid_note: str = ""  # why FID was skipped, if it was


def score_models(configs: dict[str, Config], trained: dict[str, dict], real: RealImages,
                 args: argparse.Namespace, device: torch.device) -> Scores:
    """Each trained model's row: its losses, the quality figures of its samples, its FID
    (when Inception weights are there and not --no-fid), its training speed."""
    scores = Scores()
    for name, cfg in configs.items():
        run_dir = Path(trained[name]["run_dir"])
        summary = json.loads(RunFolder(run_dir).summary.read_text())
        ckpt = RunFolder(run_dir).ema
        scores.logs[name] = read_log(run_dir)
        model = scores.models[name] = load_model(cfg, ckpt, device)
        images = trained[name]["samples"]
        scores.samples[name] = images[:args.n_grid]  # the grid's images are the first scored
        quality = quality_figures(images[:args.n_quality], real.train)

        fid_value = None
        if not args.no_fid:
            fid_value, why = try_fid(cfg, ckpt, run_dir, name)
            scores.fid_note = why or scores.fid_note
        scores.rows.append({
            "model": name,
            "pattern": "".join(m[0].upper() for m in model.attention_modes),
            "final_loss": summary["final_loss"],
            "heldout_loss": heldout_loss(model, cfg.diffusion, real.heldout[:args.heldout]),
            **quality,
            "fid": fid_value,
            "fid_features": cfg.eval.features,
            "run_dir": MODELS[name],  # relative to the output folder
            "final_step": summary["steps"],
            "guide": guide_record(cfg, MODELS[name]),  # None: unguided
        })
        scores.timing[name] = {"ms_per_step": 1000.0 * summary["mean_step_time_s"],
                               "images_per_s": summary["images_per_s"],
                               "train_wall_s": summary["wall_time_s"]}
    return scores


def write_figures(base: Config, scores: Scores, real: RealImages, args: argparse.Namespace,
                  out: Path, device: torch.device) -> dict:
    """config.json, grid.png, loss.png and the attention analysis (attention.png and
    attention/); returns the analysis."""
    save_config(base, out / "config.json")
    # Small images are shown enlarged (nearest neighbour) so they can be judged by eye.
    zoom = max(1, 64 // base.model.img_size)
    enlarged = {k: F.interpolate(v, scale_factor=zoom, mode="nearest")
                for k, v in scores.samples.items()}
    save_comparison_grid(enlarged, out / "grid.png", nrow=int(args.n_grid**0.5))
    plot_losses(scores.logs, out / "loss.png", objective_name(base.diffusion))

    # How the two models attend: negative mass, entropy, sink and collapse per block and
    # noise level, on held-out images (uvic.analysis); one overview figure beside the grid.
    print("\n=== attention analysis ===", flush=True)
    analysis = analyze(scores.models, base, real.heldout[:args.n_analysis].to(device))
    write_json(out / "attention" / "attention.json", analysis, indent=1)
    figures = save_figures(analysis, out / "attention", map_levels=[0])
    (out / "attention.png").write_bytes(figures["overview"].read_bytes())
    return analysis


def run(args: argparse.Namespace) -> None:
    """The quickstart of `uvic.cli.quickstart` on parsed arguments; raises the error that
    stops it (QuickstartError: a model failed in its worker)."""
    base = build_config(args)
    make_deterministic(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    start = time.time()

    real = load_real_images(base, args)
    configs = model_configs(base, out)
    jobs = job_count(args, device)
    trained = train_models(configs, max(args.n_grid, args.n_quality), args.threads, jobs)

    scores = score_models(configs, trained, real, args, device)
    analysis = write_figures(base, scores, real, args, out, device)
    timing = {**scores.timing, "total_s": time.time() - start, "threads": args.threads,
              "jobs": jobs}
    report = write_report(base, scores.rows, real.quality, analysis, timing, args, out,
                          scores.fid_note)
    print("\n" + report)
    print(f"grid: {out / 'grid.png'}\nloss curves: {out / 'loss.png'}\n"
          f"attention: {out / 'attention.png'}\n"
          f"table: {out / 'results.md'}\ntotal time: {timing['total_s']:.0f} s")
