"""Gated attention blocks: skip-trigram toy models in every attention mode, and real blocks.

    uvic-gated-attention trigrams --setting 4x5 --out gated/4x5   # toy model, gated block
    uvic-gated-attention capacity --out gated/capacity --dry-run  # trigrams learnt per mode
    uvic-gated-attention distil --config cifar10_uvic --checkpoint ema.safetensors \
        --block mid_block --out gated/cifar10                     # a checkpoint's block

Also `sensitivity`, `copy-suppress` and `control` (the paper's published models); each
writes JSON results and PNG figures to --out (docs/gated_attention.md).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from uvic.cli import positive_int
from uvic.cli.config_options import add_config_options
from uvic.cli.errors import run_reported
from uvic.config import load_config
from uvic_kernels.modes import GATED, MODES

# the toy models' designs: the kernel modes and differential attention, each also "+gate"
ATTENTION_MODES = (*MODES, "differential")

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
    bad = [m for m in modes if m.removesuffix(GATED) not in ATTENTION_MODES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown mode {bad[0]!r}; choose from "
                                         f"{', '.join(ATTENTION_MODES)}, each also with "
                                         f"{GATED} (an output gate)")
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


def _float_list(text: str) -> list[float]:
    return [_positive_float(v) for v in text.split(",")]


def _depth(text: str) -> int:
    value = positive_int(text)
    if value == 2:
        raise argparse.ArgumentTypeError("2: use 1, or >= 3 (softmax first and last leaves "
                                         "no middle layer at 2)")
    return value


def _at_least_two(text: str) -> int:
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 2")
    return value


def _grid_options(p: argparse.ArgumentParser) -> None:
    """The tuning grid every mode gets alike, and the seeds that judge it."""
    p.add_argument("--lr", type=_float_list, default=[1e-2, 1e-1],
                   help="Adam learning rates of the tuning grid (1e-2,1e-1)")
    p.add_argument("--init-std", type=_float_list, default=[0.02, 0.5],
                   help="initial weight scales of the tuning grid (0.02,0.5)")
    p.add_argument("--tune-seeds", type=positive_int, default=1,
                   help="seeds (never reported) that choose each cell's recipe (1)")


def _capacity_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", type=_modes, default=list(MODES),
                   help=f"attention designs, comma-separated (default {','.join(MODES)}; also "
                        f"differential, which pairs heads, and any with {GATED})")
    p.add_argument("--heads", type=_int_list, default=[1, 2, 4], help="head counts (1,2,4)")
    p.add_argument("--seeds", type=positive_int, default=5, help="reported seeds per cell (5)")
    p.add_argument("--max-trigrams", type=positive_int, default=8,
                   help="every n from 1 to this is trained for every seed (8)")
    p.add_argument("--head-dim", type=positive_int, default=1, help="head width (1)")
    p.add_argument("--depth", type=_depth, default=1,
                   help="layers: 1, or >= 3 with softmax in the first and last (1)")
    p.add_argument("--max-steps", type=positive_int, default=4000,
                   help="bound on Adam steps; training stops earlier at a plateau (4000)")
    p.add_argument("--patience", type=positive_int, default=5,
                   help="held-out checks (every 100 steps) without a 0.1%% gain that end "
                        "training (5)")
    p.add_argument("--sites", type=positive_int, default=200,
                   help="scored forced and free B's per trigram, the same at every n (200)")
    p.add_argument("--margin", type=_positive_float, default=1.0,
                   help="equivalence margin in trigrams: 'no difference' needs both "
                        "one-sided tests to reject it (1)")
    p.add_argument("--workers", type=positive_int, default=1,
                   help="models trained at once, one thread each (1)")
    p.add_argument("--dry-run", action="store_true",
                   help="time one model, state the compute, write nothing")
    p.add_argument("--out", required=True,
                   help="output folder; a run stopped there resumes from its models.jsonl")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("trigrams", help="one model and its gated block (the paper's settings)")
    t.add_argument("--setting", choices=SETTING_NAMES, default="4x5",
                   help="HEADSxTRIGRAMS: the paper's three, our smallest (2x2), or the "
                        "hand-built 2-head model")
    t.add_argument("--mode", choices=MODES, default="softmax",
                   help=f"attention of the model ({', '.join(MODES)}; the gated block "
                        "distils one attention pattern per head)")
    t.add_argument("--seed", type=int, default=0, help="model, prompts and init (0)")
    t.add_argument("--allow-unlearnt", action="store_true",
                   help="distil the original even if it did not learn every trigram "
                        "(refused by default: its gated block would explain nothing it held)")
    t.add_argument("--models", type=positive_int, default=1,
                   help="distil this many models in superposition (seeds from --seed on) "
                        "and report the share whose gated block holds each trigram in one "
                        "head, with its exact 95%% interval")
    t.add_argument("--paper", action="store_true",
                   help="the paper's gated training (1,000 epochs of 100 x 1,000 prompts, "
                        "compiled), of the first model from --seed on that learnt every "
                        "trigram with one in superposition")
    t.add_argument("--exact", action="store_true",
                   help="the paper's recipe in full: --paper with originals of 100,000 steps "
                        "x 1,000 prompts at lr 1e-3 from Xavier-normal weights and biases, "
                        "no output bias in the original or the gated block, plain MSE "
                        "(100,000 steps for the original and as many for the gated block)")
    _toy_options(t)
    c = sub.add_parser("capacity", help="skip trigrams learnt per mode and head count, "
                                         "every mode tuned alike")
    _capacity_options(c)
    _grid_options(c)
    s = sub.add_parser("sensitivity", help="the mode ordering when lr, init, head width or "
                                           "depth changes for every mode alike")
    _capacity_options(s)
    s.add_argument("--lr", type=_positive_float, default=1e-2, help="base learning rate")
    s.add_argument("--init-std", type=_positive_float, default=0.02, help="base init scale")
    k = sub.add_parser("copy-suppress", help="a task that needs negative weights: raise one "
                                             "token and lower another by the query")
    k.add_argument("--modes", type=_modes, default=list(MODES),
                   help=f"attention designs, comma-separated (default {','.join(MODES)}; also "
                        f"differential and any with {GATED})")
    k.add_argument("--heads", type=_int_list, default=[1, 2], help="head counts (1,2)")
    k.add_argument("--seeds", type=positive_int, default=5, help="reported seeds per cell (5)")
    k.add_argument("--group", type=_at_least_two, default=4,
                   help="tokens per group: the raised and lowered tokens are drawn from two "
                        "groups of this size (4)")
    k.add_argument("--head-dim", type=positive_int,
                   help="head width (default 2 x group: a head must copy a token's identity)")
    _grid_options(k)
    k.add_argument("--max-steps", type=positive_int, default=4000,
                   help="bound on Adam steps; training stops earlier at a plateau (4000)")
    k.add_argument("--workers", type=positive_int, default=1,
                   help="models trained at once, one thread each (1)")
    k.add_argument("--out", required=True,
                   help="output folder; a run stopped there resumes from its models.jsonl")
    d = sub.add_parser("distil", help="a block of a trained U-ViT / U-ViC checkpoint")
    add_config_options(d, model_from_config=True)
    d.add_argument("--checkpoint", required=True, help=".safetensors or .pth checkpoint")
    d.add_argument("--block", default="mid_block", help="in_blocks.I, mid_block or out_blocks.I")
    d.add_argument("--num-images", type=positive_int, default=8,
                   help="images of the data whose noised versions the block sees (8)")
    d.add_argument("--timestep", type=int, default=499, help="discrete noise level")
    d.add_argument("--epochs", type=positive_int, default=100,
                   help="passes of the gated block over the captured inputs (100)")
    d.add_argument("--coef", type=_positive_float, default=3e-1, help="L0.6 coefficient (0.3)")
    d.add_argument("--lr", type=_positive_float, default=1e-3,
                   help="gated block learning rate (1e-3)")
    d.add_argument("--seed", type=int, default=0, help="images, noise and init (0)")
    d.add_argument("--device", default="cpu", help="torch device (cpu)")
    d.add_argument("--out", required=True, help="output folder")
    k = sub.add_parser("control", help="the paper's published models through uvic's and "
                                       "the paper's head tests")
    k.add_argument("--models-dir", required=True,
                   help="the paper's gated_attention/experiments/saved_models folder")
    k.add_argument("--prompts", type=positive_int, default=10_000,
                   help="prompts per setting, uvic's and the paper's kind each (10000)")
    k.add_argument("--seed", type=int, default=0, help="prompts drawn for the tests (0)")
    k.add_argument("--out", required=True, help="output folder")
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
    from uvic.analysis.superposition import reproduction as te

    if args.setting == "hand-built":
        return te.reproduce_hand_built(args.seed, _settings(args, te.HAND_BUILT))
    heads, trigrams, coef, lr = te.SETTINGS[args.setting]
    paper = args.paper or args.exact
    base = te.EXACT if args.exact else te.PAPER if args.paper else te.ToySettings()
    base = replace(base, coef=coef, gated_lr=lr) if paper else replace(base, coef=coef)
    cfg = _settings(args, base)
    if args.models > 1:
        return te.reproduce_models(args.mode, heads, trigrams, args.seed, cfg, args.models)
    return te.reproduce(args.mode, heads, trigrams, args.seed, cfg, superposed=paper,
                        allow_unlearnt=args.allow_unlearnt)


def _capacity(args: argparse.Namespace, out: Path) -> None:
    """The tuned capacity table, or the sensitivity table; resumable, figures and JSON."""
    import time

    from uvic.analysis.superposition import capacity as C
    from uvic.analysis.superposition.figures import capacity_figure
    from uvic.files import write_json

    base = C.ToyRecipe(head_dim=args.head_dim, depth=args.depth, max_steps=args.max_steps,
                       patience=args.patience, sites=args.sites)
    seeds = list(range(args.seeds))
    cells = _cells(args.modes, args.heads)
    per_seed = len(cells) * args.max_trigrams
    if args.command == "capacity":
        grid = C.Grid(tuple(args.lr), tuple(args.init_std), args.tune_seeds)
        models = per_seed * (len(seeds) + len(grid.recipes(base)) * grid.seeds)
    else:
        base = C.replace(base, lr=args.lr, init_std=args.init_std)
        models = per_seed * len(seeds) * len(C.SENSITIVITY)
    if args.dry_run:
        start = time.perf_counter()
        mode, heads = max(cells, key=lambda cell: cell[1])
        C.run_model(mode, heads, (args.max_trigrams + 1) // 2, 0, base)
        took = time.perf_counter() - start
        print(f"compute: {models} models; one ({mode}, {heads} heads, "
              f"n = {(args.max_trigrams + 1) // 2}) took {took:.1f} s here, so about "
              f"{models * took / args.workers / 60:.0f} min on {args.workers} worker(s)")
        return
    if args.command == "capacity":
        table = C.capacity_experiment(out, args.modes, args.heads, seeds, args.max_trigrams,
                                      base, grid, args.workers, args.margin)
        text = C.capacity_markdown(table)
        print(f"figure: {capacity_figure(table, out / 'capacity.png')}")
    else:
        table = C.sensitivity_experiment(out, args.modes, args.heads, seeds,
                                         args.max_trigrams, base, None, args.workers,
                                         args.margin)
        text = C.sensitivity_markdown(table)
    print(f"json: {write_json(out / f'{args.command}.json', table, indent=1)}")
    (out / f"{args.command}.md").write_text(text)
    print(f"table: {out / f'{args.command}.md'}")
    print(text)


def _cells(modes: list[str], head_counts: list[int]) -> list[tuple[str, int]]:
    """The (design, heads) cells to run; says which ones no toy model can have."""
    from uvic.analysis.superposition.skip_trigrams import design_cells

    cells = design_cells(modes, head_counts)
    skipped = [(m, h) for m in modes for h in head_counts if (m, h) not in cells]
    if not cells:
        raise ValueError(f"--heads {','.join(map(str, head_counts))}: differential attention "
                         "pairs heads; give an even head count")
    if skipped:
        print("skipped (differential attention pairs heads): " +
              ", ".join(f"{m} with {h} head{'s' * (h > 1)}" for m, h in skipped))
    return cells


def _copy_suppress(args: argparse.Namespace, out: Path) -> None:
    """Seeds that solve copy-and-suppress per mode and head count, every mode tuned alike."""
    from uvic.analysis.superposition import copy_suppress as CS
    from uvic.analysis.superposition.capacity import Grid, ToyRecipe
    from uvic.files import write_json

    base = ToyRecipe(head_dim=args.head_dim or 2 * args.group, max_steps=args.max_steps)
    _cells(args.modes, args.heads)
    table = CS.copy_suppress_experiment(
        out, args.modes, args.heads, list(range(args.seeds)), base,
        Grid(tuple(args.lr), tuple(args.init_std), args.tune_seeds),
        CS.CopySuppressTask(group=args.group), args.workers)
    print(f"json: {write_json(out / 'copy_suppress.json', table, indent=1)}")
    text = CS.markdown(table)
    (out / "copy_suppress.md").write_text(text)
    print(text)


def _distil(args: argparse.Namespace, out: Path) -> dict:
    import torch

    from uvic.analysis.core import load_inputs, load_models, noised_inputs
    from uvic.analysis.superposition.distil import capture, distil_module, uvit_block
    from uvic.run.architecture import ModelChoice

    cfg = load_config(args.config, args.set)
    choice = ModelChoice.from_overrides(args.set, args.model_from_config, args.config)
    model = load_models(cfg, {"model": args.checkpoint}, {}, device=args.device,
                        choice=choice, say=print)["model"].eval()
    module = uvit_block(model, args.block)
    images, contexts = load_inputs(cfg, args.num_images, "test", args.seed)
    [(x_t, net_t, _)] = noised_inputs(cfg.diffusion, images, [args.timestep], args.seed)
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


# the paper's published files, per setting (heads x trigrams; gated blocks: twice the heads)
PAPER_FILES = tuple(name for h, n in ((2, 3), (3, 4), (4, 5))
                    for name in (f"toy_model_{h}H_{n}ST.st", f"gated_block_{2 * h}H_{n}ST.st"))


def _control(args: argparse.Namespace, out: Path) -> None:
    """The control; a missing folder or file is refused in one line before torch loads."""
    folder = Path(args.models_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder (the paper's saved_models)")
    for name in PAPER_FILES:
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name}: no such file (one of the paper's saved "
                                    "models)")
    from uvic.analysis.superposition.paper import control, control_markdown
    from uvic.files import write_json, write_text

    result = control(folder, args.prompts, args.seed)
    print(f"json: {write_json(out / 'control.json', result, indent=1)}")
    print(f"table: {write_text(out / 'control.md', control_markdown(result))}")


def main(argv: list[str] | None = None) -> int:
    """Run the program; returns the exit status."""
    args = parse_args(argv)
    return run_reported(lambda: _run(args, Path(args.out)))


def _run(args: argparse.Namespace, out: Path) -> None:
    """The subcommand `args.command`, its results written under `out`."""
    if args.command == "control":
        return _control(args, out)
    if args.command in ("capacity", "sensitivity"):
        return _capacity(args, out)
    if args.command == "copy-suppress":
        return _copy_suppress(args, out)
    from uvic.analysis.superposition.figures import gate_figure
    from uvic.files import write_json

    result = _trigrams(args) if args.command == "trigrams" else _distil(args, out)
    name = "trigrams" if args.command == "trigrams" else "gated"
    reports = ([m["gated"] for m in result.get("models", [result])]
               if args.command == "trigrams" else [result])
    print(f"figure: {gate_figure(reports[0], out / f'{name}_gates.png')}")
    for report in reports:
        for key in ("gate_mean", "open_heads"):  # drawn; large for real blocks
            report.pop(key, None)
    print(f"json: {write_json(out / f'{name}.json', result, indent=1)}")


if __name__ == "__main__":
    sys.exit(main())
