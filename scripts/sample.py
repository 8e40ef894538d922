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
    # many images on all GPUs:
    accelerate launch scripts/sample.py ... --n 1000 --save-individual

The config may also be a run's saved config.json. Checkpoints are our EMA .safetensors or a
released U-ViT nnet_ema.pth. The same --seed gives the same images on any device, batch
size or number of processes. The work is done by `uvic.sampling.sample_to_folder`.
"""

from __future__ import annotations

import argparse
import sys

from uvic.checkpoint import CheckpointError
from uvic.config import ConfigError, load_config
from uvic.sampling import PRECISIONS, sample_to_folder
from uvic.text_encoder import ClipLoadError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="configs/*.py or a run's config.json")
    p.add_argument("--ckpt", action="append", required=True,
                   help="checkpoint (.safetensors or .pth); repeat for a side-by-side grid")
    p.add_argument("--label", action="append", help="grid label per --ckpt (same order)")
    p.add_argument("--prompts", help="text-to-image: file with one prompt per line")
    p.add_argument("--n", "--num-samples", dest="n", type=int, default=64,
                   help="number of images (default 64)")
    p.add_argument("--nrow", type=int, help="images per grid row")
    p.add_argument("--steps", type=int, help="sampling steps (default: sample.steps)")
    p.add_argument("--scheduler", help="dpm_solver++, dpm_solver, dpm_solver_fast, "
                   "euler_maruyama or a diffusers class name (uvic.samplers)")
    p.add_argument("--order", type=int, help="DPM-Solver order (default: sample.order)")
    p.add_argument("--cfg-scale", type=float,
                   help="guidance s in eps = c + s (c - u) (diffusers' guidance_scale = s + 1)")
    p.add_argument("--batch-size", type=int, help="images per forward pass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32",
                   help="autocast dtype on CUDA (default fp32)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, e.g. --set data.root=/data/coco_features")
    p.add_argument("--save-individual", action="store_true", help="also write each image")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def sampler_overrides(args: argparse.Namespace) -> list[str]:
    """--steps etc. as config overrides, so the saved config records what was used."""
    pairs = [("steps", args.steps), ("scheduler", args.scheduler), ("order", args.order),
             ("cfg_scale", args.cfg_scale), ("batch_size", args.batch_size)]
    return [f"sample.{key}={value}" for key, value in pairs if value is not None]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, [*args.set, *sampler_overrides(args)])
        written = sample_to_folder(
            cfg, args.ckpt, args.out, labels=args.label, n=args.n, seed=args.seed,
            prompts_file=args.prompts, precision=args.precision,
            save_individual=args.save_individual, nrow=args.nrow,
            record={"config_path": args.config, "args": vars(args)}, progress=not args.quiet,
        )
    except (ConfigError, CheckpointError, ClipLoadError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for name, path in written.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
