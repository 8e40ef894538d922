"""Extract ImageNet 256 / 512 latent features for the release's latent configs (resumable).

    uvic-extract-imagenet --imagenet data/imagenet --out data/imagenet256_features --resolution 256
    uvic-extract-imagenet --imagenet data/imagenet --out data/imagenet512_features --resolution 512

Reads ``<imagenet>/train/<wnid>/*.JPEG`` and stores the Stable Diffusion VAE's posterior
moments of each release crop and of its mirror image, with the labels (docs/training.md).
Run it again after an interruption: committed chunks are kept.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from uvic.cli import extract_options, positive_int
from uvic.cli.errors import run_reported


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--imagenet", required=True,
                   help="ImageNet root holding the split folders (train/<wnid>/*.JPEG)")
    p.add_argument("--out", required=True, help="output feature folder (data.root)")
    p.add_argument("--resolution", type=positive_int, default=256,
                   help="crop side in pixels, a multiple of 8 (256 or 512: latents /8)")
    p.add_argument("--splits", nargs="+", default=["train"],
                   help="split folders under --imagenet, each in class folders (the release "
                   "extracts train)")
    extract_options.add_vae_option(p, None, " (default: uvic.models.autoencoder.DEFAULT_VAE, "
                                   "CompVis/stable-diffusion-v1-4/vae: the autoencoder the "
                                   "release extracts every row's features with)")
    p.add_argument("--batch-size", type=positive_int, default=64,
                   help="images per VAE batch (each encoded with its mirror image)")
    p.add_argument("--chunk-size", type=positive_int, default=1000,
                   help="images per committed chunk")
    extract_options.add_worker_options(p)
    p.add_argument("--per-class", type=positive_int, default=None,
                   help="only the first N images of every class (a quick subset)")
    p.add_argument("--moments-dtype", default="float32", choices=extract_options.STORED_DTYPES,
                   help="stored moments (float32 as the release; float16 halves the disk: "
                   "ImageNet 256 takes 84 GB in float32, 512 takes 336 GB)")
    extract_options.add_repa_options(p, "resolution / 16: latents in 2x2 patches")
    extract_options.add_run_options(p)
    args = p.parse_args(argv)
    if args.resolution % 8:
        p.error(f"--resolution must be a multiple of 8 (the VAE downsamples by 8), got "
                f"{args.resolution}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (2: an error, named in one line)."""
    args = parse_args(argv)
    return run_reported(lambda: _extract(args))


def _extract(args: argparse.Namespace) -> None:
    """Every split's listing (before the VAE loads), then the extraction."""
    from uvic.data.imagenet_extraction import extract_features, list_splits
    from uvic.models.autoencoder import DEFAULT_VAE, load_vae

    vae_name = args.vae or DEFAULT_VAE
    device = extract_options.extraction_device(args.device)
    listings = list_splits(args.imagenet, args.splits, args.per_class)
    vae = load_vae(vae_name, device)
    repa = extract_options.load_repa_encoder(args, args.resolution // 16, device)
    extract_features(
        listings, args.out, vae, vae_name=vae_name, resolution=args.resolution,
        per_class=args.per_class, moments_dtype=args.moments_dtype,
        batch_size=args.batch_size, chunk_size=args.chunk_size, num_workers=args.workers,
        skip_corrupt=args.skip_corrupt, progress=not args.no_progress,
        repa=repa, repa_name=args.repa_encoder,
    )
    latent = args.resolution // 8
    for split, listing in listings.items():
        print(f"{split}: {len(listing)} images in {len(listing.classes)} classes, latents "
              f"4x{latent}x{latent} of each and of its mirror image")
    print(f"features complete in {args.out}")


if __name__ == "__main__":
    sys.exit(main())
