"""What `uvic-sample` and `uvic-fid` share on their command lines: the sampler flags,
declared once (`add_sampler_options`), and read back as config overrides. Light (no
torch), so that `--help` answers at once."""

from __future__ import annotations

import argparse

from uvic.config.sampling import PRECISIONS


def add_sampler_options(parser: argparse.ArgumentParser) -> None:
    """--steps, --scheduler, --order, --cfg-scale, --batch-size (None unless given: the
    config's `sample.*` then holds, see `sampler_overrides`), --seed and --precision."""
    parser.add_argument("--steps", type=int, help="sampling steps (default: sample.steps)")
    parser.add_argument("--scheduler", help="dpm_solver++, dpm_solver, "
                        "dpm_solver++_fast_time_uniform, dpm_solver_fast_logsnr, "
                        "euler_maruyama, a diffusers class name (uvic.diffusion.samplers); "
                        "velocity models: flow_euler, flow_heun, flow_euler_maruyama")
    parser.add_argument("--order", type=int, help="DPM-Solver order (default: sample.order)")
    parser.add_argument("--cfg-scale", type=float, help="guidance s in eps = c + s (c - u) "
                        "(diffusers' guidance_scale = s + 1)")
    parser.add_argument("--batch-size", type=int,
                        help="images per forward pass per process")
    parser.add_argument("--seed", type=int, help="sample seed (default: sample.seed, 0)")
    parser.add_argument("--precision", choices=sorted(PRECISIONS),
                        help="autocast dtype on CUDA for sampling (default: sample.precision, "
                        "fp32)")


def sampler_overrides(args: argparse.Namespace) -> list[str]:
    """--steps etc. as config overrides, so the saved config records what was used."""
    pairs = [("steps", args.steps), ("scheduler", args.scheduler), ("order", args.order),
             ("cfg_scale", args.cfg_scale), ("batch_size", args.batch_size),
             ("seed", args.seed), ("precision", args.precision)]
    return [f"sample.{key}={value}" for key, value in pairs if value is not None]


def guidance_option(args: argparse.Namespace) -> str | None:
    """How the command line set a nonzero guidance scale (`--cfg-scale 0.4`, or the last
    `--set sample.cfg_scale=0.4`, which `--cfg-scale` overrides), None when it did not:
    a model that cannot be guided refuses it (`uvic.config.sampling.check_guidance`)."""
    if args.cfg_scale is not None:
        return f"--cfg-scale {args.cfg_scale:g}" if args.cfg_scale != 0 else None
    for item in reversed(args.set):
        key, _, value = item.partition("=")
        if key.strip() == "sample.cfg_scale":
            try:
                nonzero = float(value) != 0
            except ValueError:
                return None  # not a number: the config's own error names it
            return f"--set {item.strip()}" if nonzero else None
    return None
