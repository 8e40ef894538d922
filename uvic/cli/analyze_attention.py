"""Measure and draw how the attention of U-ViT / U-ViC checkpoints differs, block by block.

    uvic-analyze-attention --config configs/cifar10_uvit.py \
        --checkpoint U-ViT=runs/cifar10_uvit/ema.safetensors \
        --checkpoint U-ViC=runs/cifar10_uvic/ema.safetensors --out analysis/cifar10

Writes `attention.json` and figures to `--out` (docs/analysis.md). Each checkpoint is built
as the architecture it was trained with, as `uvic-sample` does; `--attention LABEL=SPEC`
runs one under another attention pattern (a released `nnet_ema.pth` as U-ViC, say).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from uvic.cli import positive_int, summary, unit_float
from uvic.cli.config_options import add_config_options
from uvic.cli.errors import run_reported
from uvic.config.validation import startup_config


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    """["LABEL=VALUE", ...] -> {LABEL: VALUE}; a bare PATH is labelled by its stem."""
    out: dict[str, str] = {}
    for item in items:
        label, sep, value = item.partition("=")
        if not sep:
            label, value = Path(item).parent.name or Path(item).stem, item
        if not label or not value:
            raise ValueError(f"{flag} {item!r} must look like LABEL=VALUE")
        if label in out:
            raise ValueError(f"{flag}: label {label!r} given twice")
        out[label] = value
    return out


def _query(text: str) -> tuple[int, int]:
    row, sep, col = text.partition(",")
    try:
        if not sep:
            raise ValueError
        return int(row), int(col)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must look like ROW,COL (integers)") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=summary(__doc__))
    add_config_options(p, model_from_config=True)
    p.add_argument("checkpoints", nargs="*", metavar="[LABEL=]PATH",
                   help="checkpoints (.safetensors or .pth); same as --checkpoint")
    p.add_argument("--checkpoint", action="append", default=[], metavar="LABEL=PATH",
                   help="checkpoint to analyse (repeat); a bare PATH is labelled by its folder")
    p.add_argument("--attention", action="append", default=[], metavar="LABEL=SPEC",
                   help="attention pattern of one checkpoint (uvit, uvic, uvie, uvis or a list)")
    p.add_argument("--num-images", type=positive_int, default=8, help="images (default 8)")
    p.add_argument("--split", default="test", help="dataset split (default test)")
    p.add_argument("--levels", type=positive_int, default=5, help="noise levels (default 5)")
    p.add_argument("--timestep", type=int, action="append",
                   help="explicit discrete timestep (repeat); overrides --levels")
    p.add_argument("--query", type=_query, action="append", metavar="ROW,COL",
                   help="query patch of the maps (repeat; default three on the diagonal)")
    p.add_argument("--sink-threshold", type=unit_float, default=0.3,
                   help="a head is a sink when its mean first-token weight exceeds this")
    p.add_argument("--batch-size", type=positive_int, default=8,
                   help="images per forward pass (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data draw and the noise")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--out", required=True, help="output folder")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the program; returns the exit status."""
    args = parse_args(argv)
    return run_reported(lambda: _analyze(args))


def _analyze(args: argparse.Namespace) -> None:
    """The config's check (no torch), then the models, the analysis and its files."""
    cfg = startup_config(args.config, args.set, rules=False)
    from uvic.analysis import analyze, load_inputs, load_models, save_figures
    from uvic.analysis.core import checkpoints_config
    from uvic.analysis.massive import massive_table
    from uvic.files import write_json
    from uvic.run.architecture import ModelChoice

    checkpoints = _pairs([*args.checkpoints, *args.checkpoint], "--checkpoint")
    if not checkpoints:
        raise ValueError("give at least one checkpoint (--checkpoint LABEL=PATH)")
    attention = _pairs(args.attention, "--attention")
    unknown = sorted(set(attention) - set(checkpoints))
    if unknown:
        raise ValueError(f"--attention names label {unknown[0]!r}, which no checkpoint has")
    choice = ModelChoice.from_overrides(args.set, args.model_from_config, args.config)
    models = load_models(cfg, checkpoints, attention, device=args.device, choice=choice,
                         say=print)
    cfg = checkpoints_config(cfg, checkpoints, choice)  # their noise schedule
    images, contexts = load_inputs(cfg, args.num_images, args.split, args.seed)
    result = analyze(models, cfg, images, contexts, timesteps=args.timestep,
                     num_levels=args.levels, queries=args.query,
                     batch_size=args.batch_size, seed=args.seed,
                     sink_threshold=args.sink_threshold)
    out = Path(args.out)
    print(f"json: {write_json(out / 'attention.json', result, indent=1)}")
    print(massive_table(result))
    for name, path in save_figures(result, out).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    sys.exit(main())
