"""The rules on `sample.*` values, and the precisions and compile modes sampling runs in.

Read by `uvic.sampling.generate`, by `uvic.validation` and by the CLI (`--precision`
choices); no torch here.
"""

from __future__ import annotations

import math

from uvic.config import SampleConfig, require
from uvic.diffusion.checks import check_scheduler

PRECISIONS = ("fp32", "fp16", "bf16")  # `--precision`: autocast dtype on CUDA (fp32: none)
# `sample.compile`: off, or a torch.compile mode for the network call (uvic.sampling.compiled)
COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune")


def compile_rule(mode: str) -> tuple[bool, str]:
    """The rule on `sample.compile` (checked by `check_sample` before a run and by
    `uvic.sampling.compiled.compile_network` where it is used): (holds, message)."""
    return (mode in COMPILE_MODES,
            f"sample.compile={mode!r} must be one of {', '.join(COMPILE_MODES)}")


def check_sample(sample: SampleConfig) -> None:
    """The rules on `sample.*` values (the sampler is first used hours into a run: check
    its settings before the first training step)."""
    require([
        (sample.steps >= 1, f"sample.steps={sample.steps} must be >= 1"),
        (sample.batch_size >= 1, f"sample.batch_size={sample.batch_size} must be >= 1"),
        (sample.decode_batch_size >= 1,
         f"sample.decode_batch_size={sample.decode_batch_size} must be >= 1"),
        (math.isfinite(sample.cfg_scale), f"sample.cfg_scale={sample.cfg_scale} must be finite"),
        (math.isfinite(sample.autoguidance_scale),
         f"sample.autoguidance_scale={sample.autoguidance_scale} must be finite"),
        (sample.autoguidance_scale == 0 or sample.autoguidance_ckpt,
         f"sample.autoguidance_scale={sample.autoguidance_scale} needs "
         "sample.autoguidance_ckpt (the weaker model's weights)"),
        compile_rule(sample.compile),
    ])
    check_scheduler(sample.scheduler, sample.order)
