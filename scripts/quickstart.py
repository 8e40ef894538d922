"""Quickstart: train a tiny U-ViT and a tiny U-ViC side by side, sample, plot, evaluate.

    python scripts/quickstart.py                 # CPU: ~5 minutes on 2 cores, no download
    python scripts/quickstart.py --preset gpu    # larger run (default when CUDA is present)

Both models see the same data in the same order from the same seed, through the real
training loop (`uvic.training.trainer`, Accelerate), the real sampler (the config's diffusers
scheduler, autoguided by each run's own EMA at an early step, `train.keep_steps`) and the
real clean-fid evaluator. Data: the built-in coloured-shapes images
(no download). Outputs in `runs/quickstart/`: `grid.png` (U-ViT | U-ViC from the same
noise), `loss.png`, `results.md` / `results.json`, and each model's run folder (`uvit/`,
`uvic/`).

Sample quality is measured without any download (`uvic.evaluation.quality`): high-frequency energy
relative to training images (1 is ideal; leftover sampler noise gives tens) and the
share of pixels on an image's three dominant colours, for both models' samples and for
held-out real images. FID needs clean-fid's Inception weights; when they are absent the
FID column is skipped with a message saying how to get them. No number is ever made up.

On a CPU the two models train at once, each in its own process on one of the
`--threads` (`--jobs 2`): a model this small keeps two cores busier that way than one
model on two threads, and each model's numbers are those of a one-thread run.

Reproducible: the run uses a fixed number of threads (`--threads`, split over `--jobs`)
and PyTorch's deterministic algorithms, so every number in `results.json` except those
under "timing" is the same on every run on the same machine and software, whatever else
the machine runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import sys
import time
import traceback
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

from uvic.analysis import analyze, save_figures
from uvic.config import (
    Config,
    ConfigError,
    DiffusionConfig,
    SampleConfig,
    apply_overrides,
    load_config,
    save_config,
)
from uvic.data.datasets import build_dataset
from uvic.diffusion.schedule import Diffusion
from uvic.evaluation.quality import quality_figures
from uvic.run.files import write_json
from uvic.run.folder import RunFolder, checkpoint_step
from uvic.sampling.assets import to_pixels
from uvic.sampling.generate import sample_checkpoint
from uvic.sampling.images import save_comparison_grid
from uvic.sampling.load import load_model
from uvic.training.trainer import diffusion_loss, train

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "quickstart.py"
MODELS = {"U-ViT": "uvit", "U-ViC": "uvic"}  # display name -> attention preset

# A larger run for a machine with a GPU: same script and config, these overrides.
GPU_PRESET = [
    "model.embed_dim=256", "model.depth=8", "model.num_heads=4",
    "model.mlp_ratio=4",  # the CPU default's 2 saves CPU time; a GPU affords the usual 4
    "data.num_images=50000", "data.num_workers=4",
    "train.batch_size=128", "train.max_steps=20000", "train.mixed_precision=bf16",
    "train.ema_decay=0.9995", "train.log_every=100", "train.sample_every=5000",
    "train.ckpt_every=5000", "optim.lr=4e-4", "optim.warmup_steps=1000",
    "eval.n_samples=10000",
    # autoguidance was tuned on the CPU run (guide at step 1000 of 2700); unmeasured here
    "train.keep_steps=[]", "sample.autoguidance_scale=0", "sample.steps=100",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=["auto", "cpu", "gpu"], default="auto",
                        help="auto: gpu when CUDA is available, else cpu")
    parser.add_argument("--out", default="runs/quickstart",
                        help="output folder (its uvit/ and uvic/ runs are replaced on a rerun)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="config override, repeatable")
    parser.add_argument("--n-grid", type=int, default=16, help="images per model in grid.png")
    parser.add_argument("--n-quality", type=int, default=128,
                        help="samples per model (and real images) for the quality figures")
    parser.add_argument("--heldout", type=int, default=256, help="held-out images for EMA loss")
    parser.add_argument("--n-analysis", type=int, default=8,
                        help="held-out images for the attention analysis")
    parser.add_argument("--threads", type=int, default=2,
                        help="CPU threads in all; results are bit-identical only for the same "
                             "--threads and --jobs")
    parser.add_argument("--jobs", type=int, default=None,
                        help="models trained at once, in separate processes sharing --threads "
                             "(default: 2 on a CPU, at most --threads, where it is ~1.5x "
                             "faster than one model at a time on two threads; 1 on a GPU)")
    parser.add_argument("--no-fid", action="store_true", help="skip the FID column")
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> Config:
    """The quickstart config with the preset and the user's overrides applied."""
    preset = args.preset
    if preset == "auto":
        preset = "gpu" if torch.cuda.is_available() else "cpu"
    overrides = (GPU_PRESET if preset == "gpu" else []) + list(args.overrides)
    cfg = load_config(CONFIG, overrides)
    check_guide(cfg)
    return cfg


def check_guide(cfg: Config) -> None:
    """The quickstart samples right after training, so an autoguidance model must be a
    checkpoint the run itself keeps, and an earlier one than the final model (guided by
    itself, a model's eps does not change: twice the sampling time for nothing). Say so
    before minutes of training, not after."""
    s, t = cfg.sample, cfg.train
    if s.autoguidance_scale == 0:
        return
    kept = {str(RunFolder("").checkpoint(step) / RunFolder.EMA): step for step in t.keep_steps}
    step = kept.get(s.autoguidance_ckpt)
    fix = ("point it at checkpoints/step_N/ema.safetensors for a step N in train.keep_steps "
           "below train.max_steps, or set sample.autoguidance_scale=0")
    if step is None:
        raise ConfigError(
            f"sample.autoguidance_ckpt={s.autoguidance_ckpt!r} is not a checkpoint this run "
            f"keeps (train.keep_steps={list(t.keep_steps)}, train.max_steps={t.max_steps}); "
            + fix)
    if step >= t.max_steps:
        final = "is the final model" if step == t.max_steps else "would never be written"
        raise ConfigError(
            f"sample.autoguidance_ckpt={s.autoguidance_ckpt!r} (step {step}) {final} with "
            f"train.max_steps={t.max_steps}: a model guided by itself samples as unguided, "
            "at twice the cost; " + fix)


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


def train_and_sample_logged(cfg: Config, n_samples: int, threads: int, log_path: Path) -> dict:
    """`train_and_sample` in a worker process, all its output (the traceback of a failure
    too) in `log_path` instead of the terminal the workers share."""
    log = open(log_path, "w", buffering=1)  # noqa: SIM115 (open for the process's lifetime)
    os.dup2(log.fileno(), 1)  # the C-level streams too (warnings of compiled code)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    try:
        return train_and_sample(cfg, n_samples, threads)
    except BaseException:
        traceback.print_exc()
        raise


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
        show_progress(configs, futures)
        results = {}
        for name, future in futures.items():
            try:
                results[name] = future.result()
            except Exception as err:
                raise QuickstartError(f"{name}: {err} (full output: {logs[name]})") from err
    return results


def show_progress(configs: dict[str, Config], futures: dict[str, Future]) -> None:
    """One progress bar per model, fed by its run's log.jsonl, until every worker ends."""
    from tqdm.auto import tqdm

    started = time.time()
    bars = {name: tqdm(total=cfg.train.max_steps, desc=name, position=i, dynamic_ncols=True)
            for i, (name, cfg) in enumerate(configs.items())}
    while not all(f.done() for f in futures.values()):
        time.sleep(1.0)
        for name, cfg in configs.items():
            path = RunFolder(cfg.train.output_dir).log
            try:
                if path.stat().st_mtime < started:  # the previous run's, not yet replaced
                    continue
                last = json.loads(path.read_text().splitlines()[-1])
            except (OSError, IndexError, ValueError):  # not written yet, or mid-write
                continue
            bars[name].update(last["step"] - bars[name].n)
            bars[name].set_postfix(loss=f"{last['loss']:.4f}")
    for bar in bars.values():
        bar.close()


def real_images(cfg: Config, split: str, n: int) -> torch.Tensor:
    """The first `n` images of a split in model space, without random flips."""
    dataset = build_dataset(apply_overrides(cfg, ["data.random_flip=false"]), split=split)
    return torch.stack([dataset[i]["x"] for i in range(min(n, len(dataset)))])


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, diffusion: DiffusionConfig, x: torch.Tensor,
                 seed: int = 0) -> float:
    """Noise-prediction MSE of `model` (the EMA weights) on held-out images `x`, with
    fixed t and noise so both models are scored on the same draws. Always the plain MSE
    (no `min_snr_gamma` weighting), so runs with different weightings compare."""
    plain = Diffusion(dataclasses.replace(diffusion, min_snr_gamma=0.0))
    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)
    total = 0.0
    for chunk in x.to(device).split(64):
        loss = diffusion_loss(model, plain, {"x": chunk}, generator)
        total += loss.item() * chunk.shape[0]
    return total / x.shape[0]


def read_log(run_dir: Path) -> list[dict]:
    """The training log (one JSON object per logging step)."""
    path = RunFolder(run_dir).log
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def objective_name(diffusion: DiffusionConfig) -> str:
    """What the training loss is: the noise MSE, Min-SNR weighted when the config says so."""
    gamma = diffusion.min_snr_gamma
    return f"Min-SNR-{gamma:g} weighted noise MSE" if gamma > 0 else "noise MSE"


def plot_losses(logs: dict[str, list[dict]], path: Path, objective: str):
    """Both training-loss curves in one PNG, the y axis named by the `objective` they are
    (`objective_name`). Returns the (closed) matplotlib figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for name, rows in logs.items():
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=name)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss ({objective})")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("U-ViT vs U-ViC on the shapes quickstart")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return fig


def try_fid(cfg: Config, ckpt: Path, out_dir: Path) -> tuple[float | None, str]:
    """FID through the real evaluator, or (None, why) when Inception weights are absent."""
    from uvic.evaluation import fid

    try:
        result = fid.evaluate(cfg, ckpt, n=cfg.eval.n_samples, out_json=out_dir / "fid.json",
                              samples_dir=out_dir / "fid_samples")
    except fid.InceptionWeightsMissing as err:
        return None, str(err)
    return float(result["fid"]), ""


def guide_record(cfg: Config, run: str) -> dict | None:
    """What guided the samples of the run in folder `run` (of the output folder): the
    weights file, its training step (read from the checkpoint) and the scale s of
    eps = g + s (g - b); None without autoguidance."""
    s = cfg.sample
    if s.autoguidance_scale == 0:
        return None
    return {"ckpt": f"{run}/{s.autoguidance_ckpt}",
            "step": checkpoint_step(Path(cfg.train.output_dir) / s.autoguidance_ckpt),
            "scale": s.autoguidance_scale}


def sampler_note(sample: SampleConfig, rows: list[dict]) -> str:
    """The notes' line on how the samples were drawn, naming what guided them."""
    steps = sorted({r["final_step"] for r in rows})
    note = (f"Samples: {sample.scheduler}, {sample.steps} steps, from the EMA weights at step "
            f"{', '.join(map(str, steps))}")
    guides = [r["guide"] for r in rows if r["guide"]]
    if not guides:
        return note + ", unguided (sample.autoguidance_scale=0)."
    at = sorted({g["step"] for g in guides}, key=str)
    return (note + f", autoguided by the same run's EMA weights at step "
            f"{', '.join(map(str, at))} ({', '.join(g['ckpt'] for g in guides)}): "
            f"eps = g + {sample.autoguidance_scale:g} (g - b).")


def results_table(rows: list[dict], timing: dict[str, dict]) -> str:
    """Markdown table of the losses, quality figures and timings of both models."""
    header = ("| model | attention (per block) | final train loss | held-out noise MSE (EMA) "
              "| HF energy vs real | palette share | with a shape | FID | ms / step | images / s |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fid_cell = f"{r['fid']:.2f}" if r["fid"] is not None else "skipped"
        if r["fid"] is not None and r.get("fid_features", "inception") != "inception":
            fid_cell += f" ({r['fid_features']} stand-in: not Inception FID)"
        t = timing[r["model"]]
        lines.append(
            f"| {r['model']} | {r['pattern']} | {r['final_loss']:.4f} | {r['heldout_loss']:.4f} "
            f"| {r['hf_ratio']:.2f} | {r['palette_share']:.3f} | {r['shape_share']:.2f} "
            f"| {fid_cell} "
            f"| {t['ms_per_step']:.1f} | {t['images_per_s']:.1f} |"
        )
    return "\n".join(lines)


def quality_table(rows: list[dict], real: dict) -> str:
    """Markdown table of the sample-quality figures, samples beside held-out real images."""
    lines = ["| images | HF energy (mean abs Laplacian) | HF energy vs real | palette share "
             "| with a shape |", "|---|---|---|---|---|"]
    for name, q in [(f"{r['model']} samples", r) for r in rows] + [("held-out real", real)]:
        lines.append(f"| {name} | {q['hf_energy']:.4f} | {q['hf_ratio']:.2f} "
                     f"| {q['palette_share']:.3f} | {q['shape_share']:.2f} |")
    return "\n".join(lines)


def attention_summary(analysis: dict) -> dict[str, dict[str, list[float]]]:
    """Per model and block, the analysis metrics averaged over the noise levels."""
    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    return {label: {metric: [mean(blk["mean"][metric]) for blk in model["blocks"]]
                    for metric in ("negative_mass", "entropy", "time_weight")}
            | {"collapse": [mean(blk["collapse"]) for blk in model["blocks"]]}
            for label, model in analysis["models"].items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        base = build_config(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.threads < 1 or (args.jobs is not None and args.jobs < 1):
        print(f"error: --threads {args.threads} and --jobs {args.jobs} must be >= 1",
              file=sys.stderr)
        return 2
    make_deterministic(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    start = time.time()

    # Real images: training images are the reference of the HF ratio; held-out images
    # are scored like samples (what a perfect model would reach) and give the EMA loss.
    n_real = max(args.n_quality, args.heldout)
    train_real = to_pixels(base, real_images(base, "train", args.n_quality))
    heldout = real_images(base, "val", n_real)
    real_quality = quality_figures(to_pixels(base, heldout[:args.n_quality]), train_real)

    configs = {name: apply_overrides(base, [f"model.attention={preset}",
                                            f"name=quickstart_{preset}",
                                            f"train.output_dir={out / preset}"])
               for name, preset in MODELS.items()}
    jobs = args.jobs if args.jobs is not None else (1 if device.type == "cuda" else 2)
    if device.type == "cpu":
        jobs = min(jobs, args.threads)  # never more processes than threads
    n_samples = max(args.n_grid, args.n_quality)
    try:
        trained = train_models(configs, n_samples, args.threads, jobs)
    except (QuickstartError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1

    rows, logs, samples, timing, models = [], {}, {}, {}, {}
    fid_note = ""
    for name, cfg in configs.items():
        run_dir = Path(trained[name]["run_dir"])
        summary = json.loads(RunFolder(run_dir).summary.read_text())
        ckpt = RunFolder(run_dir).ema
        logs[name] = read_log(run_dir)
        model = models[name] = load_model(cfg, ckpt, device)
        images = trained[name]["samples"]
        samples[name] = images[:args.n_grid]  # the grid's images are the first scored
        quality = quality_figures(images[:args.n_quality], train_real)

        fid_value = None
        if not args.no_fid:
            print(f"=== {name}: FID ({cfg.eval.n_samples} samples) ===", flush=True)
            fid_value, why = try_fid(cfg, ckpt, run_dir)
            fid_note = why or fid_note
        rows.append({
            "model": name,
            "pattern": "".join(m[0].upper() for m in model.attention_modes),
            "final_loss": summary["final_loss"],
            "heldout_loss": heldout_loss(model, cfg.diffusion, heldout[:args.heldout]),
            **quality,
            "fid": fid_value,
            "fid_features": cfg.eval.features,
            "run_dir": MODELS[name],  # relative to the output folder
            "final_step": summary["steps"],
            "guide": guide_record(cfg, MODELS[name]),  # None: unguided
        })
        timing[name] = {"ms_per_step": 1000.0 * summary["mean_step_time_s"],
                        "images_per_s": summary["images_per_s"],
                        "train_wall_s": summary["wall_time_s"]}

    save_config(base, out / "config.json")
    # Small images are shown enlarged (nearest neighbour) so they can be judged by eye.
    zoom = max(1, 64 // base.model.img_size)
    enlarged = {k: F.interpolate(v, scale_factor=zoom, mode="nearest")
                for k, v in samples.items()}
    save_comparison_grid(enlarged, out / "grid.png", nrow=int(args.n_grid**0.5))
    objective = objective_name(base.diffusion)
    plot_losses(logs, out / "loss.png", objective)

    # How the two models attend: negative mass, entropy, sink and collapse per block and
    # noise level, on held-out images (uvic.analysis); one overview figure beside the grid.
    print("\n=== attention analysis ===", flush=True)
    analysis = analyze(models, base, heldout[:args.n_analysis].to(device))
    write_json(out / "attention" / "attention.json", analysis, indent=1)
    figures = save_figures(analysis, out / "attention", map_levels=[0])
    (out / "attention.png").write_bytes(figures["overview"].read_bytes())
    timing["total_s"] = time.time() - start
    timing["threads"] = args.threads
    timing["jobs"] = jobs
    notes = [
        "S = softmax block, C = Cog block (in-blocks, mid-block, out-blocks).",
        sampler_note(base.sample, rows),
        f"Final train loss: the training objective ({objective}, mean over the last "
        f"{base.train.log_every} steps). Held-out noise MSE: plain, EMA weights, "
        f"{args.heldout} held-out images at fixed noise levels and noise.",
        "Attention analysis (attention.png, attention/): per block and noise level, "
        "the share of |A| on negative weights, the entropy of |A|, the weight on the time "
        "token and the similarity of patch tokens (scripts/analyze_attention.py).",
        f"HF energy vs real: mean |Laplacian| of {args.n_quality} samples over that of "
        f"{args.n_quality} training images (1 is ideal; held-out real images give about 1). "
        "Palette share: pixels within 0.1 of one of their image's 3 dominant colours. "
        "With a shape: share of images with >= 2% of their pixels on a dominant colour "
        "at least 0.25 from their background (every real image; a plain background fails).",
        f"Exact on every run on this machine: all but the timings (ms / step, images / s), "
        f"which depend on the machine and its load (threads: {args.threads}, models trained "
        f"at once: {jobs}).",
    ]
    if fid_note:
        notes.append(f"FID skipped: {fid_note}")
    elif args.no_fid:
        notes.append("FID skipped (--no-fid).")
    report = (results_table(rows, timing) + "\n\n" + quality_table(rows, real_quality)
              + "\n\n" + "\n".join(notes) + "\n")
    (out / "results.md").write_text(report)
    results = {"rows": rows, "real_heldout": real_quality, "notes": notes,
               "attention": attention_summary(analysis), "timing": timing}
    write_json(out / "results.json", results)

    print("\n" + report)
    print(f"grid: {out / 'grid.png'}\nloss curves: {out / 'loss.png'}\n"
          f"attention: {out / 'attention.png'}\n"
          f"table: {out / 'results.md'}\ntotal time: {timing['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
