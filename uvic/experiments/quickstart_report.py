"""The quickstart's report (`uvic.cli.quickstart`): the loss curves, the tables of
losses, quality figures and timings, and the notes under them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from uvic.config import Config, DiffusionConfig, SampleConfig
from uvic.files import write_json
from uvic.run.folder import RunFolder, checkpoint_step


def read_log(run_dir: Path) -> list[dict]:
    """The training log (one JSON object per logging step)."""
    path = RunFolder(run_dir).log
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def objective_name(diffusion: DiffusionConfig) -> str:
    """What the training loss is: the noise MSE, Min-SNR weighted when the config says so,
    or the velocity MSE of flow matching."""
    if diffusion.objective == "velocity":
        return f"velocity MSE ({diffusion.interpolant} interpolant)"
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


def heldout_name(diffusion: DiffusionConfig) -> str:
    """What the held-out column measures: the noise MSE, or flow matching's velocity MSE."""
    return "velocity MSE" if diffusion.objective == "velocity" else "noise MSE"


def results_table(rows: list[dict], timing: dict[str, dict], heldout: str = "noise MSE") -> str:
    """Markdown table of the losses, quality figures and timings of both models (`heldout`:
    what the held-out column measures, `heldout_name`)."""
    header = (f"| model | attention (per block) | final train loss | held-out {heldout} (EMA) "
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
            | {key: [mean(blk[key]) for blk in model["blocks"]]
               for key in ("collapse", "sink_share", "massive_ratio")}
            for label, model in analysis["models"].items()}


def attention_table(summary: dict[str, dict[str, list[float]]]) -> str:
    """Markdown table of :func:`attention_summary`: one row per model and block."""
    lines = ["| model | block | negative mass | entropy | sink share | massive ratio |",
             "|---|---|---|---|---|---|"]
    for label, m in summary.items():
        for i, neg in enumerate(m["negative_mass"]):
            lines.append(f"| {label} | {i} | {neg:.3f} | {m['entropy'][i]:.2f} "
                         f"| {m['sink_share'][i]:.2f} | {m['massive_ratio'][i]:.2f} |")
    return "\n".join(lines)


def notes(base: Config, rows: list[dict], args: argparse.Namespace, jobs: int,
          fid_note: str) -> list[str]:
    """The lines under the tables: what each column is, how the samples were drawn, what
    is exact and what depends on the machine, why FID is missing if it is."""
    objective = objective_name(base.diffusion)
    lines = [
        "S = softmax block, C = Cog block (in-blocks, mid-block, out-blocks).",
        sampler_note(base.sample, rows),
        f"Final train loss: the training objective ({objective}, mean over the last "
        f"{base.train.log_every} steps). Held-out {heldout_name(base.diffusion)}: plain, "
        f"EMA weights, {args.heldout} held-out images at fixed noise levels and noise.",
        "Attention analysis (attention.png, attention/): per block and noise level, "
        "the share of |A| on negative weights, the entropy of |A|, the weight on the time "
        "token, the similarity of patch tokens, the share of heads sinking into the first "
        "token and the massive-activation ratio (the largest token's norm over the mean of "
        "the others; scripts/analyze_attention.py).",
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
        lines.append(f"FID skipped: {fid_note}")
    elif args.no_fid:
        lines.append("FID skipped (--no-fid).")
    return lines


def write_report(base: Config, rows: list[dict], real_quality: dict, analysis: dict,
                 timing: dict, args: argparse.Namespace, out: Path, fid_note: str) -> str:
    """results.md (tables and notes) and results.json in `out`; returns results.md's text."""
    lines = notes(base, rows, args, timing["jobs"], fid_note)
    summary = attention_summary(analysis)
    report = (results_table(rows, timing, heldout_name(base.diffusion)) + "\n\n"
              + quality_table(rows, real_quality) + "\n\n" + attention_table(summary)
              + "\n\n" + "\n".join(lines) + "\n")
    (out / "results.md").write_text(report)
    results = {"rows": rows, "real_heldout": real_quality, "notes": lines,
               "attention": summary, "timing": timing}
    write_json(out / "results.json", results)
    return report
