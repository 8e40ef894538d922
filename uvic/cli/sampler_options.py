"""What `uvic-sample` and `uvic-fid` share on their command lines: the sampler flags as
config overrides, and the check of `--precision`. Light: argparse only, so that `--help`
answers without importing torch; the precision names are the library's (`uvic.sampling.
generate.PRECISIONS`), checked after parsing."""

from __future__ import annotations

import argparse

# --precision's metavar: the names of uvic.sampling.generate.PRECISIONS (a test keeps them equal)
PRECISION_METAVAR = "{bf16,fp16,fp32}"


def sampler_overrides(args: argparse.Namespace) -> list[str]:
    """--steps etc. as config overrides, so the saved config records what was used."""
    pairs = [("steps", args.steps), ("scheduler", args.scheduler), ("order", args.order),
             ("cfg_scale", args.cfg_scale), ("batch_size", args.batch_size)]
    return [f"sample.{key}={value}" for key, value in pairs if value is not None]


def check_precision(parser: argparse.ArgumentParser, value: str) -> None:
    """Refuse a `--precision` that is not one of the library's, with argparse's own usage
    error (as `choices=` would: exit status 2)."""
    from uvic.sampling.generate import PRECISIONS

    choices = sorted(PRECISIONS)
    if value not in choices:
        parser.error(f"argument --precision: invalid choice: {value!r} (choose from "
                     f"{', '.join(map(repr, choices))})")
