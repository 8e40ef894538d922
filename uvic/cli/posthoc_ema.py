"""Reconstruct the EMA weights of any length from a run's post-hoc EMA snapshots (EDM2).

    uvic-posthoc-ema runs/cifar10_uvic --sigma-rel 0.08 --out runs/cifar10_uvic/phema_0.080
    uvic-posthoc-ema runs/cifar10_uvic --sigma-rel 0.12 --step 200000 --out phema_0.12_200k

The run must have been trained with train.posthoc_ema_stds. --out is a checkpoint folder
for `uvic-sample`, `uvic-fid` and `uvic-export`; the line printed states the fit
(docs/training.md, "Post-hoc EMA"). Bad input ends with a one-line `error: ...` and exit
status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from uvic.cli import positive_int, summary
from uvic.cli.errors import EXPECTED, run_reported
from uvic.config.training import check_sigma_rel


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("run", help="the run folder (holding posthoc_ema/ and config.json)")
    p.add_argument("--sigma-rel", type=float, required=True, metavar="S",
                   help="relative standard deviation of the EMA to build, in (0, 0.2887) "
                   "(EDM2's best lie around 0.05-0.15)")
    p.add_argument("--step", type=positive_int, metavar="N",
                   help="the training step to reconstruct at (a step with snapshots; "
                   "default: the newest)")
    p.add_argument("--out", required=True, help="the checkpoint folder to write (new or empty)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the program; returns the exit status."""
    args = parse_args(argv)
    return run_reported(lambda: _posthoc(args), (*EXPECTED, OSError))


def _posthoc(args: argparse.Namespace) -> None:
    """The checks that need no torch, then the reconstruction."""
    check_sigma_rel(args.sigma_rel, f"--sigma-rel {args.sigma_rel}")
    if not Path(args.run).is_dir():  # as the library says it, before torch loads
        raise FileNotFoundError(f"run folder not found: {args.run}")
    from uvic.training.posthoc_reconstruct import reconstruct  # torch, safetensors

    result = reconstruct(args.run, args.sigma_rel, args.out, step=args.step, say=print)
    print(f"wrote {result.weights} (sample: uvic-sample --config "
          f"{result.weights.parent / 'config.json'} --ckpt {result.weights} --out ...)")


if __name__ == "__main__":
    sys.exit(main())
