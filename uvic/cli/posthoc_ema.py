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
from uvic.cli.errors import first_line, report_error
from uvic.config import ConfigError
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
    try:
        check_sigma_rel(args.sigma_rel, f"--sigma-rel {args.sigma_rel}")
    except ConfigError as err:
        report_error(f"error: {first_line(err)}")
        return 2
    if not Path(args.run).is_dir():  # as the library says it, before torch loads
        report_error(f"error: run folder not found: {args.run}")
        return 2
    # torch and safetensors from here on: --help and a wrong value stay fast
    from uvic.run.weights import CheckpointError
    from uvic.training.posthoc_reconstruct import PosthocError, reconstruct

    try:
        result = reconstruct(args.run, args.sigma_rel, args.out, step=args.step, say=print)
    except (PosthocError, ConfigError, CheckpointError, OSError) as err:
        report_error(f"error: {first_line(err)}")
        return 2
    print(f"wrote {result.weights} (sample: uvic-sample --config "
          f"{result.weights.parent / 'config.json'} --ckpt {result.weights} --out ...)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
