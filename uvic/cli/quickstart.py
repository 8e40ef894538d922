"""Quickstart: train a tiny U-ViT and a tiny U-ViC side by side, sample, plot, evaluate.

    uvic-quickstart                 # CPU: about 5.5 minutes on 2 cores, no download
    uvic-quickstart --preset gpu    # larger run (default when CUDA is present)

(`python scripts/quickstart.py` and `make quickstart` run the same program.)

Both models see the same data in the same order from the same seed, through the real
training loop (`uvic.training.trainer`, Accelerate), the real sampler (the config's diffusers
scheduler, autoguided by each run's own EMA at an early step, `train.keep_steps`) and the
real clean-fid evaluator. Data: the built-in coloured-shapes images
(no download). Outputs in `runs/quickstart/`: `grid.png` (U-ViT | U-ViC from the same
noise), `loss.png`, `results.md` / `results.json`, and each model's run folder (`uvit/`,
`uvic/`).

Sample quality is measured without any download (`uvic.evaluation.quality`): high-frequency energy
relative to training images (1 is ideal; leftover sampler noise gives tens) and the
share of pixels on an image's three dominant colours, for both models' samples and for
held-out real images. FID needs clean-fid's Inception weights; when they are absent the
FID column is skipped with a message saying how to get them. No number is ever made up.

On a CPU the two models train at once, each in its own process on one of the
`--threads` (`--jobs 2`): a model this small keeps two cores busier that way than one
model on two threads, and each model's numbers are those of a one-thread run.

Reproducible: the run uses a fixed number of threads (`--threads`, split over `--jobs`;
`auto`: the count picked from the cores free at start) and PyTorch's deterministic
algorithms, so every number in `results.json` except those under "timing" is the same
on every run with that count on the same machine and software, whatever else the
machine runs. Each model's progress bar shows its seconds per step, and one hint is
printed if its steps turn over 3x slower than its first ones (other work on the cores).

The steps are in `uvic.experiments.quickstart_steps` (training, sampling, scoring) and
`uvic.experiments.quickstart_report` (tables, notes, loss curves).
"""

from __future__ import annotations

import argparse
import sys

from uvic.cli.config_options import add_set_option
from uvic.cli.errors import EXPECTED, run_reported
from uvic.cli.threads import choose_threads, usable_cores
from uvic.config import ConfigError
from uvic.config.training import threads_value
from uvic.config.validation import start_config, startup_config
from uvic.presets import QUICKSTART_MODELS, QUICKSTART_PRESETS, preset_path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=["auto", "cpu", "gpu"], default="auto",
                        help="auto: gpu when CUDA is available, else cpu")
    parser.add_argument("--out", default="runs/quickstart",
                        help="output folder (its uvit/ and uvic/ runs are replaced on a rerun)")
    add_set_option(parser)
    parser.add_argument("--n-grid", type=int, default=16, help="images per model in grid.png")
    parser.add_argument("--n-quality", type=int, default=128,
                        help="samples per model (and real images) for the quality figures")
    parser.add_argument("--heldout", type=int, default=256, help="held-out images for EMA loss")
    parser.add_argument("--n-analysis", type=int, default=8,
                        help="held-out images for the attention analysis")
    parser.add_argument("--threads", default=min(2, usable_cores()), metavar="auto|N",
                        help="CPU threads in all (default 2, or 1 where this process may use "
                             "one core; auto: the cores free at start, or OMP_NUM_THREADS); "
                             "results are bit-identical only for the same --threads and --jobs")
    parser.add_argument("--jobs", type=int, default=None,
                        help="models trained at once, in separate processes sharing --threads "
                             "(default: 2 on a CPU, at most --threads, where it is ~1.5x "
                             "faster than one model at a time on two threads; 1 on a GPU)")
    parser.add_argument("--no-fid", action="store_true", help="skip the FID column")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the quickstart; returns the exit status."""
    args = parse_args(argv)
    return run_reported(lambda: _quickstart(args),
                        (*EXPECTED, "uvic.experiments.quickstart_steps:QuickstartError"))


def _quickstart(args: argparse.Namespace) -> None:
    """The checks that need no torch (threads, jobs, every model's config under each preset
    --preset may pick: auto asks for CUDA only later), then the quickstart."""
    args.threads = choose_threads(threads_value(args.threads, f"--threads {args.threads}:"),
                                  processes=1).threads
    if args.jobs is not None and args.jobs < 1:
        raise ConfigError(f"--jobs {args.jobs}: must be >= 1")
    presets = ["cpu", "gpu"] if args.preset == "auto" else [args.preset]
    for preset in presets:
        for attention in QUICKSTART_MODELS.values():
            start_config(startup_config(str(preset_path(QUICKSTART_PRESETS[preset])),
                                        [*args.set, f"model.attention={attention}"],
                                        rules=False))
    from uvic.experiments.quickstart_steps import run  # torch, the training loop: after the checks

    run(args)


if __name__ == "__main__":
    sys.exit(main())
