"""What `uvic-extract-imagenet` and `uvic-extract-mscoco` share on their command lines,
declared once: the autoencoder (`--vae`), where the work runs (`--workers`, `--device`),
how a run reports (`--skip-corrupt`, `--no-progress`) and the stored dtypes. Light (no
torch at import), so that `--help` answers at once; `extraction_device` imports torch
when a command runs."""

from __future__ import annotations

import argparse
import os

STORED_DTYPES = ["float32", "float16"]  # --moments-dtype / --context-dtype: float32 as the release
VAE_HELP = "diffusers AutoencoderKL hub name or folder, or the release's autoencoder_kl.pth"


def add_vae_option(parser: argparse.ArgumentParser, default: str | None,
                   note: str = "") -> None:
    """`--vae` (into `args.vae`): the autoencoder whose posterior moments are stored;
    `note` follows the help (e.g. what a None default means)."""
    parser.add_argument("--vae", default=default, help=f"{VAE_HELP}{note}")


def add_worker_options(parser: argparse.ArgumentParser) -> None:
    """`--workers` (image decoding processes) and `--device` (None: `extraction_device`)."""
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                        help="image decoding processes")
    parser.add_argument("--device", default=None,
                        help="torch device (default: cuda when there is one, else cpu)")


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """`--skip-corrupt` (unreadable images recorded and left out) and `--no-progress`."""
    parser.add_argument("--skip-corrupt", action="store_true",
                        help="skip unreadable images (recorded in progress.json) instead of "
                        "failing")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def extraction_device(device: str | None) -> str:
    """`--device`, else cuda when there is one, else cpu (imports torch: call it after
    the arguments are parsed)."""
    import torch

    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def add_repa_options(parser: argparse.ArgumentParser, default_grid: str) -> None:
    """`--repa-encoder`, `--repa-encoder-weights`, `--repa-grid`: also store a REPA
    encoder's patch features of every image (`uvic.models.repa_encoder`)."""
    parser.add_argument("--repa-encoder", default="",
                        help="also store this REPA encoder's patch features of every image "
                        "(the run's train.repa_encoder: a timm name or a local folder; "
                        "float16, grid^2 x width per image)")
    parser.add_argument("--repa-encoder-weights", default="",
                        help="local weights file for a timm --repa-encoder name")
    parser.add_argument("--repa-grid", type=int, default=None,
                        help="the encoder's patch grid, which is the model's token grid "
                        f"(default: {default_grid})")


def load_repa_encoder(args: argparse.Namespace, grid: int, device: str):
    """The encoder `--repa-encoder` names on `device` for a `grid` x `grid` patch grid (or
    `--repa-grid`), or None without it; a missing file is a ConfigError naming it."""
    if not args.repa_encoder:
        return None
    from uvic.models.repa_encoder import load_encoder

    return load_encoder(args.repa_encoder, args.repa_encoder_weights,
                        args.repa_grid or grid).to(device)
