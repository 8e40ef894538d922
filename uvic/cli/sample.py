"""Sample images from U-ViT / U-ViC checkpoints into an image grid (and optional PNGs).

    python scripts/sample.py --config configs/cifar10_uvic.py \
        --ckpt runs/cifar10_uvic/ema.safetensors --n 64 --out samples/cifar10_uvic
    # U-ViT and U-ViC side by side, same noise:
    python scripts/sample.py --config configs/cifar10_uvit.py \
        --ckpt runs/cifar10_uvit/ema.safetensors --label U-ViT \
        --ckpt runs/cifar10_uvic/ema.safetensors --label U-ViC --out samples/compare
    # text-to-image, prompts one per line (default: the feature folder's sample prompts):
    python scripts/sample.py --config configs/mscoco_uvic.py --ckpt nnet_ema.pth \
        --prompts prompts.txt --cfg-scale 1.0 --out samples/coco
    # class-conditional: n // 8 images of each class, one grid row per class:
    python scripts/sample.py --config configs/imagenet256_uvic_large.py \
        --ckpt runs/imagenet256_uvic_large/ema.safetensors \
        --class-labels 207,360,387,974,88,979,417,279 --out samples/imagenet256
    # many images on all GPUs:
    accelerate launch scripts/sample.py ... --n 1000 --save-individual

The config may also be a preset's name (cifar10_uvic) or a run's saved config.json
(uvic.cli.config_options). Checkpoints are our EMA .safetensors or a
released U-ViT nnet_ema.pth. The same --seed gives the same images on any device, batch
size or number of processes. Installed as `uvic-sample`; `scripts/sample.py` runs the same.

Each checkpoint is built as the architecture it was trained with (`uvic.run.architecture.
resolve_model`): the model config stored in its safetensors metadata, else its run's
config.json; `--config` gives the sampler settings (and the model of a file that records
none, such as a released nnet_ema.pth). One note per checkpoint states the architecture
and where it came from, and names the `--config` model values it did not use. A
`--set model.*` value that differs from a checkpoint's is refused with one line;
`--model-from-config` builds every checkpoint as `--config` (+ `--set`) says instead.
Several checkpoints of a side-by-side may differ (U-ViT and U-ViC) but must take the same
inputs (image size, channels, conditioning).

A class-conditional model shows each `--class-labels` id (a number, or for ImageNet a
WordNet id such as n01440764, its class folder's name) in a grid row of n // #ids images
(at least one), as `--prompts` does with prompts; without them image i shows class
i mod K (its K classes). The grid captions each row's class (with its WordNet id and name
for ImageNet), which a line printed at the
start and `sample_config.json` (`class_labels`, one per image) list too. `--class-labels`
for a model without class labels, an id outside [0, K), and a nonzero `--cfg-scale` (or
`--set sample.cfg_scale`) for a model that cannot be guided stop with one line.

Writes to --out: `grid.png`, the main grid (with several checkpoints: their grids side by
side, labelled), `grid_<label>.png` per checkpoint when there are several,
`<label>/{i:06d}.png` with --save-individual (native size) and `sample_config.json`.
Grids are enlarged by nearest neighbour to at least 512 px wide (`--upscale N` forces a
factor, 1 = native size). `--threads auto|N` (config key train.threads) sets the CPU
threads per process (`uvic.cli.threads`).
"""

from __future__ import annotations

import argparse
import os

from uvic.cli import class_list, input_error, positive_int, summary
from uvic.cli.config_options import add_config_options
from uvic.cli.errors import EXPECTED, run_reported
from uvic.cli.sampler_options import add_sampler_options, guidance_option, sampler_overrides
from uvic.cli.threads import add_threads_option, apply_threads, choose_threads, threads_overrides
from uvic.config import ConfigError
from uvic.config.validation import startup_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=summary(__doc__))
    add_config_options(p, model_from_config=True)
    p.add_argument("--ckpt", action="append", required=True,
                   help="checkpoint (.safetensors or .pth); repeat for a side-by-side grid")
    p.add_argument("--label", action="append", help="grid label per --ckpt (same order)")
    p.add_argument("--prompts", help="text-to-image: file with one prompt per line")
    p.add_argument("--class-labels", type=class_list, metavar="ID,ID,...",
                   help="class-conditional: classes to show, by number or ImageNet WordNet id "
                   "(n01440764), n // #ids images each, one grid row per id (default: image i "
                   "shows class i mod K)")
    p.add_argument("--n", "--num-samples", dest="n", type=int, default=64,
                   help="number of images (default 64)")
    p.add_argument("--nrow", type=positive_int, help="images per grid row")
    add_sampler_options(p)
    p.add_argument("--upscale", type=positive_int, metavar="N",
                   help="enlarge grids N times, nearest neighbour (default: the smallest N "
                   "that makes a grid at least 512 px wide; 1: native size)")
    p.add_argument("--save-individual", action="store_true", help="also write each image")
    p.add_argument("--out", required=True, help="output folder")
    add_threads_option(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def usage_error(args: argparse.Namespace) -> str | None:
    """The first problem of the arguments that needs no model (a count out of range, a
    missing or unreadable input, labels that do not pair with the checkpoints), or None:
    checked before torch loads."""
    if args.n < 1:
        return f"--n {args.n}: must be >= 1"
    if args.label and len(args.label) != len(args.ckpt):
        return f"got {len(args.label)} --label for {len(args.ckpt)} --ckpt; give one each"
    inputs = [(ckpt, "--ckpt") for ckpt in args.ckpt]
    inputs += [(args.prompts, "--prompts")] if args.prompts is not None else []
    return next(filter(None, (input_error(path, option) for path, option in inputs)), None)


def main(argv: list[str] | None = None) -> int:
    """Run the program; returns the exit status."""
    args = parse_args(argv)
    return run_reported(lambda: _sample(args),
                        (*EXPECTED, "uvic.models.text_encoder:ClipLoadError"))


def _sample(args: argparse.Namespace) -> None:
    """The checks that need no torch, then the samples."""
    cfg = startup_config(args.config, [*args.set, *sampler_overrides(args),
                                       *threads_overrides(args)])
    if (problem := usage_error(args)) is not None:
        raise ConfigError(problem)
    threads = choose_threads(cfg.train.threads)
    apply_threads(threads)  # the library (torch) is imported from here on
    if not args.quiet and int(os.environ.get("RANK", "0")) == 0:
        print(threads.line(), flush=True)
    from uvic.run.architecture import ModelChoice
    from uvic.sampling.folder import sample_to_folder

    written = sample_to_folder(
        cfg, args.ckpt, args.out, labels=args.label, n=args.n, prompts_file=args.prompts,
        save_individual=args.save_individual, nrow=args.nrow,
        record={"config_path": args.config, "args": vars(args)}, progress=not args.quiet,
        choice=ModelChoice.from_overrides(args.set, args.model_from_config, args.config),
        upscale=args.upscale, say=print, class_labels=args.class_labels,
        guidance_option=guidance_option(args),
    )
    for name, path in written.items():
        print(f"{name}: {path}")
