"""Compare model variants the way a reviewer accepts: several seeds, matched steps, paired
confidence intervals.

    uvic-compare --dry-run --steps 1500,2100 --set eval.n_samples=128  # runs x steps x evals
    uvic-compare --steps 1500,2100 --best --set eval.n_samples=128  # presets, Shapes, 3 seeds
    uvic-compare --variant-file variants.json --seeds 5 --every 500
    uvic-compare --plan runs/compare/compare.json --target heldout_mse=0.001  # seeds needed

Each variant trains with each seed through the real loop and is evaluated at every step of
the grid; the report in `--out` pairs the variants by seed (docs/comparisons.md). Every
stage resumes: run the same command again. The stages are in `uvic.experiments.compare_run`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from uvic.cli.config_options import add_config_options
from uvic.cli.errors import run_reported


def _ints(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers separated by commas"
                                         ) from None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_config_options(p, optional_config="quickstart")  # --config, --set (every run's)
    p.add_argument("--variants", type=lambda s: [v for v in s.split(",") if v], default=[],
                   help="variant keys, comma-separated: attention presets or defined "
                        "variants (default: the defined ones, else every attention preset)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[;...]",
                   help="define a variant by config overrides (repeatable)")
    p.add_argument("--variant-file", help='JSON {"name": ["section.key=value", ...]}')
    p.add_argument("--seeds", type=int, default=3, help="seeds per variant (>= 2; default 3)")
    p.add_argument("--steps", type=_ints, default=[], help="evaluation steps, comma-separated")
    p.add_argument("--every", type=int, help="evaluate every K steps too")
    p.add_argument("--table-steps", type=_ints, default=[],
                   help="steps the tables show, on the grid (default the last)")
    p.add_argument("--metrics", default="heldout_mse,standin_fid,quality",
                   help="comma-separated: heldout_mse, standin_fid, fid, quality (hf_ratio, "
                        "palette_share, shape_share)")
    p.add_argument("--best", action="store_true",
                   help="also report each run's best step, selected on the metric itself")
    p.add_argument("--heldout", type=int, default=256, help="held-out images of heldout_mse")
    p.add_argument("--out", default="runs/compare", help="output folder")
    p.add_argument("--threads", type=int, default=2, help="CPU threads in all")
    p.add_argument("--jobs", type=int, help="runs at once on a CPU, one process each, "
                                            "sharing --threads (default: --threads)")
    p.add_argument("--stage", choices=["all", "train", "report"], default="all",
                   help="train only; or the report from the evaluations on disk")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    p.add_argument("--margin", action="append", default=[], metavar="METRIC=VALUE",
                   help="equivalence margin of a metric (repeatable): each pair's TOST "
                        "p-value of |B - A| < VALUE")
    p.add_argument("--plan", nargs="?", const="", metavar="FILE",
                   help="plan the seeds from a finished pilot's compare.json (default "
                        "<--out>/compare.json): sd, MDE and seeds per pair; trains nothing")
    p.add_argument("--target", action="append", default=[], metavar="METRIC=VALUE",
                   help="with --plan: the difference to detect (repeatable; default the "
                        "pilot's mean difference)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the comparison; returns the exit status."""
    args = parse_args(argv)
    return run_reported(lambda: _compare(args), (ValueError, FileNotFoundError, RuntimeError),
                        stopped=(KeyboardInterrupt, "uvic.experiments.compare_eval:RunStopped"),
                        resume_note="every finished step is kept; run the same command "
                                    "again to continue")


def _compare(args: argparse.Namespace) -> None:
    """The plan (no torch: every run's config and its rules), then the comparison."""
    from uvic.experiments.compare_plan import make_plan, metric_names, metric_values, power_plan

    if args.threads < 1 or (args.jobs is not None and args.jobs < 1):
        raise ValueError(f"--threads {args.threads} and --jobs {args.jobs} must be >= 1")
    if args.plan is not None:
        print(power_plan(args.plan, args.out, args.target))
        return
    metric_values(args.margin, "--margin", metric_names(args.metrics))
    plan = make_plan(args)
    from uvic.experiments.compare_run import run  # torch, the training loop: after the plan

    run(args, plan)


if __name__ == "__main__":
    sys.exit(main())
