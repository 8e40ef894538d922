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
from uvic.cli.config_options import add_config_options, startup_config
from uvic.cli.errors import first_line, report_error
from uvic.config import ConfigError


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
    args = parse_args(argv)
    try:  # without --config, the source's run config: its --set keys and values checked
        startup_config(args.config, args.set)
    except ConfigError as err:
        report_error(f"error: {first_line(err)}")
        return 2
    if not Path(args.source).exists():  # as the library says it, before torch loads
        report_error(f"error: export source not found: {args.source}")
        return 2
    # torch, diffusers and the model only now: --help and a wrong option stay fast
    from uvic.models.autoencoder import VAELoadError
    from uvic.pipelines.export import ExportError, export
    from uvic.run.weights import CheckpointError

    try:
        out = export(args.source, args.out, config=args.config, overrides=args.set,
                     from_config=args.model_from_config, null_class=args.null_class,
                     say=print)
    except (ExportError, ConfigError, CheckpointError, VAELoadError, FileNotFoundError,
            ValueError) as err:
        report_error(f"error: {first_line(err)}")
        return 2
    print(f"pipeline: {out} (UViTPipeline.from_pretrained({str(out)!r}))")
    return 0
