"""FID / KID of a checkpoint with clean-fid (the paper's Table 3 protocol by default).

    python eval/fid.py --config configs/cifar10_uvic.py --ckpt runs/cifar10_uvic/ema.safetensors
    accelerate launch --multi_gpu --num_processes 8 eval/fid.py \
        --config configs/mscoco_uvic.py --ckpt runs/mscoco_uvic/ema.safetensors \
        --out runs/fid/mscoco_uvic.json --precision fp16

The protocol comes from the config (`uvic.evaluation.protocols`): with configs/cifar10_*.py,
Euler-Maruyama 1000 steps, 50,000 samples, clean-fid `legacy_pytorch` against CIFAR-10
train; with configs/mscoco_*.py, the release's DPM-Solver "fast" 50 steps with guidance
scale 1, 30,000 samples with captions of the val split, `legacy_pytorch` against val2014 at
256x256; class-conditional models sample their classes as the release does (uniform for the
ImageNet latent rows, in the training set's class frequencies for ImageNet 64, each
sample's class seeded by (seed, i)). A faster protocol is one option away (`--scheduler
dpm_solver++ --steps 50`, `--mode clean`); the result JSON and the table name the
protocol either way.

Generates N samples as PNGs into --samples-dir (resumable: existing samples are kept and
sample i is always seeded by (seed, i)), then computes FID and KID against the reference
statistics of eval.ref_stats and writes a result JSON. Offline by default: missing
Inception weights or statistics stop the run before sampling with a message saying which
file, where, and the URL; --download lets clean-fid fetch them. The Inception weights
live in the user cache (~/.cache/uvic/inception-2015-12-05.pt, or $XDG_CACHE_HOME/uvic;
legacy_pytorch: torch.hub's checkpoint folder) unless eval.inception_path names a file.

`--metrics fid,fd_dinov2,precision_recall` adds FD-DINOv2 (DINOv2 ViT-L/14 features,
weights from --dinov2-path) and precision/recall beside FID (`uvic.evaluation.metrics`).

Without any download: `--features projection` (eval.features=projection) scores with a
fixed random projection instead of Inception, the reference statistics built with it
from the dataset's local files (data.root's CIFAR-10 copy, Shapes, or eval.ref_images).
It checks the pipeline on one's own checkpoint; the number is NOT comparable with
Inception FID, and the printed line, the result's protocol and the table all say so.
The work is done by `uvic.evaluation.fid.evaluate`; `python eval/fid_table.py runs/fid` builds the
table.

The checkpoint is built as the architecture it was trained with (its stored model config,
else its run's config.json; `--config`'s for a released nnet_ema.pth), as `uvic-sample`
does: a `--set model.*` value that differs from it is refused with one line, and
`--model-from-config` builds `--config`'s model instead. `--config` is a file or a
preset's name (cifar10_uvit). `--threads auto|N` (config key train.threads) sets the CPU
threads per process (`uvic.cli.threads`).
"""

from __future__ import annotations

import argparse
import os

from uvic.cli import input_error, summary
from uvic.cli.config_options import add_config_options
from uvic.cli.errors import run_reported
from uvic.cli.sampler_options import add_sampler_options, guidance_option, sampler_overrides
from uvic.cli.threads import add_threads_option, apply_threads, choose_threads, threads_overrides
from uvic.config import ConfigError
from uvic.config.evaluation import FID_FEATURES, FID_MODES, METRICS
from uvic.config.validation import startup_config
from uvic.evaluation.protocols import NOT_FID


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=summary(__doc__))
    add_config_options(p, model_from_config=True)
    p.add_argument("--ckpt", required=True, help="EMA .safetensors or released nnet_ema.pth")
    p.add_argument("--n", "--num-samples", dest="n", type=int,
                   help="number of samples (default: eval.n_samples)")
    p.add_argument("--out", help="result JSON (default runs/fid/<name>_<run>_<ckpt>.json)")
    p.add_argument("--samples-dir", help="sample PNG folder (default: next to --out)")
    p.add_argument("--mode", choices=FID_MODES, help="clean-fid mode (default: eval.mode)")
    p.add_argument("--features", choices=FID_FEATURES,
                   help="inception: FID; projection: download-free stand-in features to "
                   f"check the pipeline, {NOT_FID} (default: eval.features)")
    p.add_argument("--metrics", help=f"comma-separated, of {', '.join(METRICS)}: FID and "
                   "the metrics beside it (default: eval.metrics, fid)")
    p.add_argument("--dinov2-path", help="DINOv2 ViT-L/14 weights for fd_dinov2: a local "
                   "file or a hub name (eval.dinov2_path)")
    add_sampler_options(p)
    p.add_argument("--inception-path", help="local Inception weights (eval.inception_path)")
    p.add_argument("--stats-dir", help="cache of built reference statistics "
                   "(default $UVIC_FID_STATS or ~/.cache/uvic/fid_stats, "
                   "$XDG_CACHE_HOME/uvic/fid_stats when that is set)")
    p.add_argument("--download", action="store_true",
                   help="let clean-fid download missing Inception weights / statistics")
    p.add_argument("--feature-batch-size", type=int, default=64,
                   help="images per batch of the feature extractor (default 64)")
    p.add_argument("--num-workers", type=int, help="image loading workers for features")
    add_threads_option(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def overrides(args: argparse.Namespace) -> list[str]:
    """Command-line options as config overrides (recorded in the result's config): the
    sampler flags as `uvic-sample` reads them, then the evaluator's own."""
    pairs = [("eval.n_samples", args.n), ("eval.mode", args.mode),
             ("eval.features", args.features),
             ("eval.inception_path", args.inception_path), ("eval.metrics", args.metrics),
             ("eval.dinov2_path", args.dinov2_path)]
    return sampler_overrides(args) + [f"{key}={value}" for key, value in pairs
                                      if value is not None]


def count_error(args: argparse.Namespace) -> str | None:
    """The first count out of range, said with its option (checked before the config, whose
    rules would name `--n`'s key instead), or None."""
    counts = [("--n", args.n, 2), ("--feature-batch-size", args.feature_batch_size, 1),
              ("--num-workers", args.num_workers, 0)]
    for option, value, least in counts:
        if value is not None and value < least:
            return f"{option} {value}: must be >= {least}"
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the program; returns the exit status."""
    args = parse_args(argv)
    return run_reported(lambda: _fid(args))


def _fid(args: argparse.Namespace) -> None:
    """The checks that need no torch, then the evaluation and its summary."""
    if (problem := count_error(args)) is not None:
        raise ConfigError(problem)
    cfg = startup_config(args.config, [*args.set, *overrides(args), *threads_overrides(args)])
    if (problem := input_error(args.ckpt, "--ckpt")) is not None:
        raise FileNotFoundError(problem)
    threads = choose_threads(cfg.train.threads)
    apply_threads(threads)  # the library (torch) is imported from here on
    if not args.quiet and int(os.environ.get("RANK", "0")) == 0:
        print(threads.line(), flush=True)
    from uvic.evaluation.fid import evaluate
    from uvic.evaluation.metrics import summary_line
    from uvic.evaluation.protocols import protocol_from_result
    from uvic.run.architecture import ModelChoice

    result = evaluate(
        cfg, args.ckpt, out_json=args.out, samples_dir=args.samples_dir,
        config_path=args.config, stats_dir=args.stats_dir, allow_download=args.download,
        feature_batch_size=args.feature_batch_size, num_workers=args.num_workers,
        progress=not args.quiet,
        choice=ModelChoice.from_overrides(args.set, args.model_from_config, args.config),
        say=print, guidance_option=guidance_option(args),
    )
    if result:  # main process
        kid = "n/a" if result["kid"] is None else f"{result['kid']:.5f}"
        protocol = protocol_from_result(result)
        what = ("FID" if protocol.inception
                else f"stand-in FID ({protocol.features} features, {NOT_FID})")
        print(f"{result['model']} {result['dataset']}: {what} {result['fid']:.3f}  KID {kid}  "
              f"(N={result['n']}, {result['mode']}, {result['sampler']['scheduler']} "
              f"{result['sampler']['steps']} steps, guidance {result['guidance']})")
        if line := summary_line(result):
            print(line)
        print(f"protocol: {result['protocol']['label']}")
        print(f"result: {result['result_json']}")
