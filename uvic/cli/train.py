"""Train a U-ViT / U-ViC (see uvic/train.py for what a run writes).

    accelerate launch scripts/train.py --config configs/cifar10_uvic.py
    accelerate launch --multi_gpu --num_processes 8 scripts/train.py \\
        --config configs/mscoco_uvic.py --set train.batch_size=256 --resume latest
    python scripts/train.py --config configs/quickstart.py --output-dir runs/try

`--config` takes a configs/*.py file or a run's config.json; `--set section.field=value`
(repeatable) overrides any field; `--resume latest` continues the run in
train.output_dir from its newest checkpoint (or starts it if it has none), `--resume
latest-intact` from its newest checkpoint whose files all read back (naming those skipped),
`--resume PATH` from a given checkpoint or run folder. A run folder is locked while a run
uses it; a fresh start into a folder holding a previous run is refused unless `--overwrite`
(which deletes that run's outputs first). Precision comes from train.mixed_precision when the
config sets it (the presets do), else from the launcher. Several processes without GPUs (gloo):
`ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 scripts/train.py ...`
(Accelerate's `--cpu` flag alone starts a single process).
Expected problems (bad config, missing data, diverged run) end with a one-line
`error: ...` and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from uvic.checkpoint import CheckpointError
from uvic.config import ConfigError, load_config
from uvic.train import TrainError, train

# Errors whose message says what is wrong and how to fix it: no traceback needed.
# (Missing data, VAE or prompt files raise FileNotFoundError subclasses that name the path.)
EXPECTED_ERRORS = (ConfigError, TrainError, CheckpointError, FileNotFoundError)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True,
                        help="configs/*.py (defines get_config()) or a run's config.json")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.FIELD=VALUE", help="override a config field (repeatable)")
    parser.add_argument("--resume", default=None, metavar="latest|latest-intact|PATH",
                        help="continue from the newest (intact) checkpoint of the run, or "
                        "from PATH")
    parser.add_argument("--overwrite", action="store_true",
                        help="start afresh in a run folder that holds a previous run, "
                        "deleting its checkpoints, weights, logs and samples")
    parser.add_argument("--output-dir", default=None,
                        help="run folder (shortcut for --set train.output_dir=...)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit status."""
    args = parse_args(argv)
    overrides = list(args.overrides)
    if args.output_dir is not None:
        overrides.append(f"train.output_dir={args.output_dir}")
    try:
        cfg = load_config(args.config, overrides)
        run_dir = train(cfg, resume=args.resume, overwrite=args.overwrite)
    except EXPECTED_ERRORS as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if int(os.environ.get("RANK", "0")) == 0:  # once, not per process
        print(f"done: {run_dir}")
    return 0
