"""Export a uvic run, checkpoint or released U-ViT as a diffusers pipeline folder.

    uvic-export runs/cifar10_uvic --out exported/cifar10_uvic
    uvic-export cifar10_uvit_small.pth --config configs/cifar10_uvit.py \
        --out exported/cifar10_uvit_release

Load the folder with `UViTPipeline.from_pretrained(folder)` (docs/diffusers.md). A source
that is none of these, or an output folder that is not empty, ends with a one-line
`error: ...` and exit status 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from uvic.cli import summary
from uvic.cli.config_options import add_config_options
from uvic.cli.errors import run_reported
from uvic.config.validation import startup_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("source", help="run folder, checkpoint folder, .safetensors checkpoint or "
                   "released .pth (with --config)")
    p.add_argument("--out", required=True, help="the pipeline folder to write (new or empty)")
    add_config_options(p, model_from_config=True, optional_config="the source's run "
                       "config; required for a released .pth")
    p.add_argument("--null-class", type=int, metavar="ID",
                   help="class-conditional models: the class id of 'no class' for guidance "
                   "(the release's ImageNet models: num_classes - 1)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the program; returns the exit status."""
    args = parse_args(argv)
    return run_reported(lambda: _export(args))


def _export(args: argparse.Namespace) -> None:
    """The checks that need no torch (without --config, the source's run config: its --set
    keys and values), then the export."""
    startup_config(args.config, args.set)
    if not Path(args.source).exists():  # as the library says it, before torch loads
        raise FileNotFoundError(f"export source not found: {args.source}")
    from uvic.pipelines.export import export  # torch, diffusers: --help stays fast

    out = export(args.source, args.out, config=args.config, overrides=args.set,
                 from_config=args.model_from_config, null_class=args.null_class, say=print)
    print(f"pipeline: {out} (UViTPipeline.from_pretrained({str(out)!r}))")
