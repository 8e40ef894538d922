"""Table 3 end to end: train, then FID, then the table, for every (dataset, model) pair.

    uvic-table3 --dry-run         # the plan and the compute it needs
    accelerate launch --multi_gpu --num_processes 8 scripts/reproduce_table3.py
    uvic-table3 --smoke           # the whole chain on a CPU (~10 s)

(`python scripts/reproduce_table3.py` runs the same program.)

Pairs: CIFAR-10 and MS-COCO, each with U-ViT and U-ViC (configs/<dataset>_<model>.py),
trained to the paper's length and scored under the release's FID protocol (the configs'
defaults, `uvic.evaluation.protocols`). Every stage resumes: training continues from the run's
newest checkpoint and is skipped once it reached train.max_steps; FID reuses the samples
on disk and is skipped when a result for the same checkpoint and protocol exists; the
table is rebuilt from all results in <out>/fid. Run it again after an interruption.

`--smoke` swaps in configs/table3_smoke.py (tiny model, 16x16 Shapes, both attentions,
eval.features=projection: a fixed random projection in place of Inception), so it needs no
data, weights or GPU. Its U-ViT and U-ViC numbers come out (nearly) equal, and the table
says why, measured on their samples (`smoke_note`). `--only cifar10` / `--only uvic` pick
pairs; `--set` overrides every config.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from uvic.config import Config, ConfigError, load_config
from uvic.evaluation.protocols import load_results, protocol_of, protocol_table
from uvic.presets import preset_path
from uvic.sampling.checks import PRECISIONS

if TYPE_CHECKING:
    import numpy as np

PAIRS = [("cifar10", "uvit"), ("cifar10", "uvic"), ("mscoco", "uvit"), ("mscoco", "uvic")]
SMOKE_PAIRS = [("shapes", "uvit"), ("shapes", "uvic")]


@dataclass
class Job:
    """One (dataset, model) pair: its config, run folder and FID result file."""

    dataset: str
    model: str
    cfg: Config
    run_dir: Path
    result: Path

    @property
    def ckpt(self) -> Path:
        from uvic.run.folder import RunFolder

        return RunFolder(self.run_dir).ema

    def trained_steps(self) -> int:
        from uvic.run.folder import RunFolder

        summary = RunFolder(self.run_dir).summary
        return int(json.loads(summary.read_text())["steps"]) if summary.is_file() else 0

    def step_time(self) -> float | None:
        """Measured seconds per training step of this run so far, if any."""
        from uvic.run.folder import RunFolder

        summary = RunFolder(self.run_dir).summary
        if not summary.is_file():
            return None
        value = json.loads(summary.read_text()).get("mean_step_time_s")
        return float(value) if isinstance(value, int | float) and value == value else None


def make_jobs(args: argparse.Namespace) -> list[Job]:
    pairs = SMOKE_PAIRS if args.smoke else PAIRS
    pairs = [p for p in pairs if not args.only or set(args.only) & set(p)]
    if not pairs:
        raise ConfigError(f"--only {args.only}: matches no (dataset, model) pair")
    out = Path(args.out)
    jobs = []
    for dataset, model in pairs:
        if args.smoke:
            path, extra = preset_path("table3_smoke"), [f"model.attention={model}"]
        else:
            path, extra = preset_path(f"{dataset}_{model}"), []
        run_dir = out / "runs" / f"{dataset}_{model}"
        cfg = load_config(path, [*extra, f"name={dataset}_{model}",
                                 f"train.output_dir={run_dir}", *args.set])
        jobs.append(Job(dataset, model, cfg, run_dir, out / "fid" / f"{dataset}_{model}.json"))
    return jobs


def plan(jobs: list[Job]) -> str:
    """The compute each stage needs: training images and network calls for sampling, with
    times from this run's measured step time where one exists."""
    lines = ["Plan (train -> FID -> table):"]
    for job in jobs:
        t, s = job.cfg.train, job.cfg.sample
        remaining = max(0, t.max_steps - job.trained_steps())
        step_time = job.step_time()
        if step_time is None:
            train_time = ("time not measured yet (the paper trained on 8 A800 GPUs; a short run "
                          "here measures it)")
        else:
            hours = remaining * step_time / 3600
            train_time = f"~{hours:.1f} h at the measured {step_time:.3f} s/step"
        calls = s.steps * (2 if job.cfg.model.clip_dim > 0 and s.cfg_scale else 1)
        protocol = protocol_of(job.cfg).label()
        lines += [f"- {job.dataset} / {job.model}: train {remaining:,} of {t.max_steps:,} steps "
                  f"x {t.batch_size} images; {train_time}",
                  f"    FID: {job.cfg.eval.n_samples:,} samples x {calls} network calls "
                  f"= {job.cfg.eval.n_samples * calls:,} image forwards; protocol: {protocol}"]
    return "\n".join(lines)


def run_train(job: Job) -> str:
    """Train the pair's model to train.max_steps (resumed; skipped once there)."""
    from uvic.training.trainer import train

    if job.ckpt.is_file() and job.trained_steps() >= job.cfg.train.max_steps:
        return "trained (skipped)"
    train(job.cfg, resume="latest-or-new")  # the first time: a new run
    return f"trained to step {job.trained_steps()}"


def fid_name(cfg: Config) -> str:
    """"FID", or "stand-in FID" when eval.features is not Inception."""
    return "FID" if protocol_of(cfg).inception else "stand-in FID"


def run_fid(job: Job, smoke: bool, args: argparse.Namespace) -> str:
    """The pair's FID (skipped when a result for the same checkpoint and protocol exists)."""
    from uvic.evaluation.fid import evaluate
    from uvic.run.weights import file_sha256

    what = fid_name(job.cfg)
    if job.result.is_file():
        old = json.loads(job.result.read_text())
        label = protocol_of(job.cfg).label()
        if (old.get("checkpoint_sha256") == file_sha256(job.ckpt)
                and old.get("protocol", {}).get("label") == label):
            return f"{what} {old['fid']:.3f} (skipped: result exists)"
    result = evaluate(job.cfg, job.ckpt, out_json=job.result,
                      stats_dir=Path(args.out) / "fid_stats", precision=args.precision,
                      num_workers=0 if smoke else None, progress=not args.quiet)
    return f"{what} {result['fid']:.3f}" if result else f"{what} (other process)"


def _samples(result: Path) -> np.ndarray:
    """The uint8 samples (N, H, W, 3) a result JSON was computed from."""
    import numpy as np
    from PIL import Image

    data = json.loads(result.read_text())
    folder = Path(data["samples_dir"])
    return np.stack([np.asarray(Image.open(folder / f"{i:06d}.png").convert("RGB"))
                     for i in range(int(data["n"]))])


def smoke_note(jobs: list[Job]) -> str:
    """Why the smoke's U-ViT and U-ViC numbers agree, measured on their samples ("" unless
    both have a result). Both start from the same initial weights (the seed decides them,
    and softmax and Cog blocks have the same parameters), see the same batches and the same
    sampling noise, and a few steps barely move them: their samples are nearly the same
    pixels, most clipped to 0 or 255, so their distances agree to about 1e-3."""
    import numpy as np

    done = {job.model: job for job in jobs if job.result.is_file()}
    if not {"uvit", "uvic"} <= done.keys():
        return ""
    a, b = _samples(done["uvit"].result), _samples(done["uvic"].result)
    fids = [json.loads(done[m].result.read_text())["fid"] for m in ("uvit", "uvic")]
    clipped = np.mean([(x == 0) | (x == 255) for x in (a, b)])
    what = fid_name(done["uvic"].cfg)
    return (f"Smoke note: U-ViT and U-ViC score alike ({what} {fids[0]:.4f} vs {fids[1]:.4f}) "
            f"because their samples are {np.mean(a == b):.1%} identical pixels "
            f"({clipped:.1%} clipped to 0 or 255): both models start from the same weights "
            "(same seed; softmax and Cog blocks have the same parameters), see the same "
            f"batches and sampling noise, and train only {done['uvic'].cfg.train.max_steps} "
            "steps. The smoke checks the chain (train, FID, table, resume), not the models.\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="output folder (default runs/table3, or runs/table3_smoke)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny CPU run of the whole chain (Shapes, test feature extractor)")
    p.add_argument("--only", action="append", default=[], metavar="NAME",
                   help="only pairs with this dataset or model (repeatable)")
    p.add_argument("--stage", choices=["all", "train", "fid", "table"], default="all",
                   help="run up to this stage only (default all)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="autocast dtype for FID sampling on CUDA")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override applied to every pair")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    args.out = args.out or ("runs/table3_smoke" if args.smoke else "runs/table3")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the program; returns the exit status."""
    args = parse_args(argv)
    # torch, the training loop: once the arguments parse
    from uvic.run.weights import CheckpointError
    from uvic.training.trainer import TrainError

    try:
        jobs = make_jobs(args)
        print(plan(jobs), flush=True)
        if args.dry_run:
            return 0
        for job in jobs:
            if args.stage in ("all", "train"):
                print(f"{job.dataset} / {job.model}: {run_train(job)}", flush=True)
            if args.stage in ("all", "fid"):
                print(f"{job.dataset} / {job.model}: {run_fid(job, args.smoke, args)}",
                      flush=True)
        if args.stage in ("all", "table") and int(os.environ.get("RANK", "0")) == 0:
            table = protocol_table(load_results(Path(args.out) / "fid"))
            if args.smoke and (note := smoke_note(jobs)):
                table += "\n" + note
            path = Path(args.out) / "table3.md"
            path.write_text(table)
            print(table, end="")
            print(f"table: {path}")
    except (ConfigError, TrainError, CheckpointError, FileNotFoundError, ValueError) as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
