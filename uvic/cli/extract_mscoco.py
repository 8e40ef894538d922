"""Extract MS-COCO 2014 features for text-to-image U-ViT / U-ViC (the release's protocol):
VAE moments of every image and CLIP token states of every caption, resumable.

    uvic-extract-mscoco --coco data/coco --out data/mscoco_features \
        [--splits train val] [--vae CompVis/stable-diffusion-v1-4/vae] [--device cuda]

Expects ``<coco>/{train,val}2014/*.jpg`` and
``<coco>/annotations/captions_{train,val}2014.json``; run it again after an interruption:
committed chunks are kept (docs/training.md, "Training MS-COCO").
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from uvic.cli import extract_options, positive_int
from uvic.cli.errors import EXPECTED, run_reported
from uvic.config import DataConfig


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--coco", required=True, help="COCO 2014 root (train2014/, val2014/, "
                   "annotations/)")
    p.add_argument("--out", required=True, help="output feature folder (data.root)")
    p.add_argument("--splits", nargs="+", default=["train", "val"], choices=["train", "val"],
                   help="the splits to extract (default: train val)")
    data = DataConfig()  # the models the MS-COCO configs load by default
    extract_options.add_vae_option(p, data.vae)
    p.add_argument("--clip-model", default=data.clip_model, help="open_clip model name")
    p.add_argument("--clip-pretrained", default=data.clip_pretrained,
                   help="open_clip tag or local checkpoint file")
    p.add_argument("--resolution", type=int, default=256, help="image side (latents: /8)")
    p.add_argument("--batch-size", type=positive_int, default=64, help="images per VAE batch")
    p.add_argument("--text-batch-size", type=positive_int, default=256,
                   help="captions per CLIP batch")
    p.add_argument("--chunk-size", type=positive_int, default=1000,
                   help="images per committed chunk")
    extract_options.add_worker_options(p)
    p.add_argument("--limit", type=int, default=None, help="only the first N images per split")
    p.add_argument("--moments-dtype", default="float32", choices=extract_options.STORED_DTYPES,
                   help="stored VAE moments (default float32, as the release; float16 halves "
                   "the disk)")
    p.add_argument("--context-dtype", default="float32", choices=extract_options.STORED_DTYPES,
                   help="stored CLIP context dtype (default float32, as the release; float16 "
                   "halves the disk and rounds by about 5e-4)")
    extract_options.add_repa_options(p, "resolution / 16: latents in 2x2 patches")
    extract_options.add_run_options(p)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (2: a missing --coco folder, found
    before the imports, which take seconds; 1: an error of the extraction, named in one line,
    or features left incomplete)."""
    args = parse_args(argv)
    return run_reported(lambda: _check_folder(args.coco)) or run_reported(
        lambda: _extract(args), (*EXPECTED, "uvic.data.mscoco_extraction:CorruptImageError",
                                 "uvic.models.text_encoder:ClipLoadError"), status=1)


def _check_folder(coco: str) -> None:
    if not Path(coco).is_dir():
        raise FileNotFoundError(f"--coco {coco}: no such folder (it holds train2014/, "
                                "val2014/ and annotations/)")


def _extract(args: argparse.Namespace) -> int:
    """The inputs' checks (before the models load), then the extraction."""
    from uvic.data.mscoco_extraction import check_inputs, extract_features
    from uvic.models.autoencoder import load_vae
    from uvic.models.text_encoder import ClipTextEncoder

    args.device = extract_options.extraction_device(args.device)
    check_inputs(args.coco, args.splits, args.limit, args.skip_corrupt)
    vae = load_vae(args.vae, args.device)
    text_encoder = ClipTextEncoder(args.clip_model, args.clip_pretrained, args.device)
    repa = extract_options.load_repa_encoder(args, args.resolution // 16, args.device)
    complete = extract_features(
        args.coco, args.out, vae, text_encoder, splits=args.splits, vae_name=args.vae,
        clip_model=args.clip_model, clip_pretrained=args.clip_pretrained,
        resolution=args.resolution, limit=args.limit, moments_dtype=args.moments_dtype,
        context_dtype=args.context_dtype, batch_size=args.batch_size,
        text_batch_size=args.text_batch_size, chunk_size=args.chunk_size,
        num_workers=args.workers, skip_corrupt=args.skip_corrupt,
        progress=not args.no_progress, repa=repa, repa_name=args.repa_encoder,
    )
    print(f"features {'complete' if complete else 'incomplete'} in {args.out}")
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
