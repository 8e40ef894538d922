"""Gated attention blocks: skip-trigram toy models in every attention mode, and real blocks.

    # a one-layer softmax model on 5 skip trigrams, 4 heads -> gated block with 8 heads
    uvic-gated-attention trigrams --setting 4x5 --out gated/4x5
    # the capacity table: trigrams learnt per mode and head count, over seeds
    uvic-gated-attention capacity --out gated/capacity --dry-run
    # a block of a trained U-ViT / U-ViC checkpoint, on noised images of its data
    uvic-gated-attention distil --config cifar10_uvic --checkpoint ema.safetensors \
        --block mid_block --out gated/cifar10

Writes JSON results and PNG figures to --out. See docs/gated_attention.md.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from uvic.cli import positive_int
from uvic.cli.config_options import add_config_options
from uvic.config import ConfigError, load_config
from uvic.config.models import ATTENTION_MODES

SETTING_NAMES = ("4x5", "2x3", "3x4", "2x2", "hand-built")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 1")
    return values


def _modes(text: str) -> list[str]:
    modes = [m.strip().lower() for m in text.split(",")]
    bad = [m for m in modes if m not in ATTENTION_MODES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown mode {bad[0]!r}; choose from "
                                         f"{', '.join(ATTENTION_MODES)}")
    return modes


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a number > 0")
    return value


def _toy_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=positive_int, help="Adam steps of each one-layer model")
    p.add_argument("--gated-epochs", type=positive_int, help="epochs of each gated block")
    p.add_argument("--coef", type=_positive_float, help="L0.6 coefficient")
    p.add_argument("--gated-lr", type=_positive_float, help="gated block learning rate")
    p.add_argument("--warmup", type=float, help="share of gated epochs the coefficient ramps")
    p.add_argument("--out", required=True, help="output folder")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("trigrams", help="one model and its gated block (the paper's settings)")
    t.add_argument("--setting", choices=SETTING_NAMES, default="4x5",
                   help="HEADSxTRIGRAMS: the paper's three, our smallest (2x2), or the "
                        "hand-built 2-head model")
    t.add_argument("--mode", type=lambda s: _modes(s)[0], default="softmax",
                   help=f"attention of the model ({', '.join(ATTENTION_MODES)})")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--models", type=positive_int, default=1,
                   help="distil this many models in superposition (seeds from --seed on) "
                        "and report the share whose gated block holds each trigram in one "
                        "head, with its exact 95%% interval")
    t.add_argument("--paper", action="store_true",
                   help="the paper's gated training (1,000 epochs of 100 x 1,000 prompts, "
                        "compiled), of the first model from --seed on that learnt every "
                        "trigram with one in superposition")
    _toy_options(t)
    c = sub.add_parser("capacity", help="the capacity table of every mode")
    c.add_argument("--modes", type=_modes, default=list(ATTENTION_MODES))
    c.add_argument("--heads", type=_int_list, default=[1, 2, 4], help="head counts (1,2,4)")
    c.add_argument("--seeds", type=positive_int, default=2, help="seeds per cell (2)")
    c.add_argument("--workers", type=positive_int, default=1,
                   help="cells run at once, one thread each (1)")
    c.add_argument("--max-trigrams", type=positive_int, default=6)
    c.add_argument("--dry-run", action="store_true", help="state the compute, run nothing")
    _toy_options(c)
    d = sub.add_parser("distil", help="a block of a trained U-ViT / U-ViC checkpoint")
    add_config_options(d, model_from_config=True)
    d.add_argument("--checkpoint", required=True, help=".safetensors or .pth checkpoint")
    d.add_argument("--block", default="mid_block", help="in_blocks.I, mid_block or out_blocks.I")
    d.add_argument("--num-images", type=positive_int, default=8)
    d.add_argument("--timestep", type=int, default=499, help="discrete noise level")
    d.add_argument("--epochs", type=positive_int, default=100)
    d.add_argument("--coef", type=_positive_float, default=3e-1)
    d.add_argument("--lr", type=_positive_float, default=1e-3)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--device", default="cpu")
    d.add_argument("--out", required=True, help="output folder")
    args = p.parse_args(argv)
    if args.command == "trigrams" and args.models > 1 and args.setting == "hand-built":
        p.error("--models: the hand-built setting is one model; use a trained setting")
    warmup = getattr(args, "warmup", None)
    if warmup is not None and not 0 <= warmup <= 1:
        p.error(f"--warmup {warmup}: must be in [0, 1]")
    return args


def _settings(args: argparse.Namespace, base):
    """ToySettings from the defaults (or the paper's) and the options given."""
    over = {"steps": args.steps, "gated_epochs": args.gated_epochs, "coef": args.coef,
            "gated_lr": args.gated_lr, "warmup": args.warmup}
    return replace(base, **{k: v for k, v in over.items() if v is not None})


def _trigrams(args: argparse.Namespace) -> dict:
    from uvic.analysis import trigram_experiments as te

    if args.setting == "hand-built":
        return te.reproduce_hand_built(args.seed, _settings(args, te.HAND_BUILT))
    heads, trigrams, coef, lr = te.SETTINGS[args.setting]
    base = te.PAPER if args.paper else te.ToySettings()
    base = replace(base, coef=coef, gated_lr=lr) if args.paper else replace(base, coef=coef)
    cfg = _settings(args, base)
    if args.models > 1:
        return te.reproduce_models(args.mode, heads, trigrams, args.seed, cfg, args.models)
    return te.reproduce(args.mode, heads, trigrams, args.seed, cfg, superposed=args.paper)


def _capacity(args: argparse.Namespace, out: Path) -> None:
    from uvic.analysis import trigram_experiments as te
    from uvic.analysis.gated_figures import capacity_figure
    from uvic.files import write_json

    cfg = _settings(args, te.ToySettings())
    seeds = list(range(args.seeds))
    bound = te.trainings_bound(args.heads, seeds, args.max_trigrams) * len(args.modes)
    print(f"compute: {len(args.modes)} modes x {len(args.heads)} head counts x {len(seeds)} "
          f"seeds; at most {bound} one-layer models of {cfg.steps} steps (batch {cfg.batch}) "
          f"and {len(args.modes) * len(args.heads)} gated blocks of "
          f"{cfg.gated_epochs * cfg.gated_batches} steps; about "
          f"{te.estimate_seconds(cfg, bound, len(args.modes) * len(args.heads)) / 60:.0f} "
          f"min of one thread at most, on {args.workers} worker(s) (docs/gated_attention.md)")
    if args.dry_run:
        return
    table = te.capacity_table(args.modes, args.heads, seeds, args.max_trigrams, cfg,
                              workers=args.workers)
    print(f"json: {write_json(out / 'capacity.json', table, indent=1)}")
    (out / "capacity.md").write_text(te.markdown_table(table))
    print(f"table: {out / 'capacity.md'}")
    print(f"figure: {capacity_figure(table, out / 'capacity.png')}")
    print(te.markdown_table(table))


def _distil(args: argparse.Namespace, out: Path) -> dict:
    import torch

    from uvic.analysis.core import load_inputs, load_models, noised_inputs
    from uvic.analysis.gated_distil import capture, distil_module, uvit_block
    from uvic.run.architecture import ModelChoice

    cfg = load_config(args.config, args.set)
    choice = ModelChoice.from_overrides(args.set, args.model_from_config, args.config)
    model = load_models(cfg, {"model": args.checkpoint}, {}, device=args.device,
                        choice=choice, say=print)["model"].eval()
    module = uvit_block(model, args.block)
    images, contexts = load_inputs(cfg, args.num_images, "test", args.seed)
    [(x_t, net_t, _)] = noised_inputs(cfg, images, [args.timestep], args.seed)
    dev = args.device
    labels = torch.zeros(len(x_t), dtype=torch.long, device=dev) if model.num_classes > 0 else None
    inputs, outputs = capture(module, lambda: model(
        x_t.to(dev), net_t.to(dev), context=None if contexts is None else contexts.to(dev),
        y=labels))
    _, report = distil_module(module, inputs, outputs, coef=args.coef, lr=args.lr,
                              epochs=args.epochs, seed=args.seed, say=print)
    report.update({"block": args.block, "timestep": args.timestep,
                   "checkpoint": str(args.checkpoint)})
    return report


def main(argv: list[str] | None = None) -> int:
    """Run the program; returns the exit status."""
    args = parse_args(argv)
    out = Path(args.out)
    from uvic.files import write_json  # light; the heavy imports follow per command
    from uvic.run.weights import CheckpointError

    try:
        if args.command == "capacity":
            _capacity(args, out)
            return 0
        from uvic.analysis.gated_figures import gate_figure

        result = _trigrams(args) if args.command == "trigrams" else _distil(args, out)
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    name = "trigrams" if args.command == "trigrams" else "gated"
    reports = ([m["gated"] for m in result.get("models", [result])]
               if args.command == "trigrams" else [result])
    print(f"figure: {gate_figure(reports[0], out / f'{name}_gates.png')}")
    for report in reports:
        for key in ("gate_mean", "open_heads"):  # drawn; large for real blocks
            report.pop(key, None)
    print(f"json: {write_json(out / f'{name}.json', result, indent=1)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
