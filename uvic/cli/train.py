"""Train a U-ViT / U-ViC (see uvic/training/trainer.py for what a run writes).

    accelerate launch scripts/train.py --config configs/cifar10_uvic.py
    accelerate launch --multi_gpu --num_processes 8 scripts/train.py \\
        --config configs/mscoco_uvic.py --set train.batch_size=256 --resume latest
    python scripts/train.py --config configs/quickstart.py --output-dir runs/try

`--config` takes a configs/*.py file, a preset's name (cifar10_uvic; an unknown name is a
usage error listing the presets) or a run's config.json; `--set section.field=value`
(repeatable) overrides any field; `--resume latest` continues the run in
train.output_dir from its newest checkpoint (refused if it has none: `--resume
latest-or-new` starts it then), `--resume latest-intact` from its newest checkpoint whose
files all read back (naming those skipped), `--resume PATH` from a given checkpoint or run
folder. A resume records what it changed in config.json and refuses a train.max_steps below
the checkpoint's step. A run folder is locked while a run uses it; a fresh start into a
folder holding a previous run is refused unless `--overwrite` (which deletes that run's
outputs first). Precision comes from train.mixed_precision when the config sets it (the
presets do), else from the launcher. Several processes without GPUs (gloo):
`ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 scripts/train.py ...`
(Accelerate's `--cpu` flag starts a single process whatever `--num_processes` says: the run
refuses that launch). `--threads auto|N` (config key train.threads) sets the CPU threads per
process (`uvic.cli.threads`; auto: from the cores free at start); the run prints them, and
one hint if its steps turn over 3x slower than its first ones (other work on the cores).
Expected problems (bad config, missing data, diverged run) end with a one-line
`error: ...` and exit status 2; under a multi-process launcher (`--multi_gpu`, torchrun)
the first process prints it and every process writes it to the launcher's error file, so
that the launcher's failure report ends with it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import TYPE_CHECKING

from uvic.cli.config_options import add_config_options
from uvic.cli.errors import run_reported
from uvic.cli.threads import add_threads_option, apply_threads, choose_threads, threads_overrides
from uvic.config import ConfigError, TrainConfig
from uvic.config.validation import start_config, startup_config

if TYPE_CHECKING:
    from uvic.experiments.progress import LogWatcher


# Errors whose message says what is wrong and how to fix it (missing data, VAE or prompt
# files raise FileNotFoundError subclasses that name the path): no traceback needed.
EXPECTED_ERRORS = (ConfigError, FileNotFoundError, "uvic.run.weights:CheckpointError",
                   "uvic.training.launch:TrainError")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_config_options(parser)
    parser.add_argument("--resume", default=None,
                        metavar="latest|latest-intact|latest-or-new|PATH",
                        help="continue from the newest (intact) checkpoint of the run, or "
                        "from PATH; latest-or-new: start the run if it has no checkpoint")
    parser.add_argument("--overwrite", action="store_true",
                        help="start afresh in a run folder that holds a previous run, "
                        "deleting its checkpoints, weights, logs and samples")
    parser.add_argument("--output-dir", default=None,
                        help="run folder (shortcut for --set train.output_dir=...)")
    add_threads_option(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit status."""
    args = parse_args(argv)
    return run_reported(lambda: _train(args), EXPECTED_ERRORS)


def _train(args: argparse.Namespace) -> None:
    """The config's check (no torch), then the run."""
    overrides = list(args.set)
    if args.output_dir is not None:
        overrides.append(f"train.output_dir={args.output_dir}")
    cfg = startup_config(args.config, [*overrides, *threads_overrides(args)], rules=False)
    start_config(cfg)  # the rules and the trainer's own start check (its note: the trainer's)
    threads = choose_threads(cfg.train.threads)
    apply_threads(threads)  # torch, Accelerate: once the config is checked
    from uvic.training.trainer import train

    main_process = int(os.environ.get("RANK", "0")) == 0
    if main_process:
        print(threads.line(), flush=True)
    with step_watcher(cfg.train, threads.threads) if main_process else contextlib.nullcontext():
        run_dir = train(cfg, resume=args.resume, overwrite=args.overwrite)
    if main_process:  # once, not per process
        print(f"done: {run_dir}")


def step_watcher(train: TrainConfig, threads: int) -> LogWatcher:
    """The run's seconds per step, read from its log as it trains, and the hint when its
    steps turn far slower than its first ones (`uvic.experiments.progress.StepClock`)."""
    from tqdm.auto import tqdm

    from uvic.experiments.progress import LogWatcher, StepClock
    from uvic.run.folder import RunFolder

    clock = StepClock(threads, change="" if threads == 1 else "--threads N or config key "
                      "train.threads; continue the run with --resume latest")
    return LogWatcher(RunFolder(train.output_dir).log, clock, train.batch_size,
                      say=tqdm.write)
