"""What `uvic-sample` and `uvic-fid` share on their command lines: the sampler flags as
config overrides. Light (no torch), so that `--help` answers at once."""

from __future__ import annotations

import argparse


def sampler_overrides(args: argparse.Namespace) -> list[str]:
    """--steps etc. as config overrides, so the saved config records what was used."""
    pairs = [("steps", args.steps), ("scheduler", args.scheduler), ("order", args.order),
             ("cfg_scale", args.cfg_scale), ("batch_size", args.batch_size)]
    return [f"sample.{key}={value}" for key, value in pairs if value is not None]
