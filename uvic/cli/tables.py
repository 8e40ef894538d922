"""The tables built by command, one program on three tables: train, then FID, then the table.

    uvic-table3 --dry-run                       # the plan and the compute it needs
    accelerate launch --multi_gpu --num_processes 8 scripts/reproduce_table3.py
    uvic-release-table --only imagenet256_huge  # one row (both models); --only uvic: twins
    uvic-recipes-table --smoke                  # the whole chain on a CPU (~30 s)

Every stage resumes, so run a command again after an interruption (docs/evaluation.md,
docs/recipes.md). The tables are `uvic.experiments.tables`, the runner
`uvic.experiments.runner`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from uvic.cli.config_options import add_set_option
from uvic.cli.errors import run_reported
from uvic.config.sampling import PRECISIONS

if TYPE_CHECKING:
    from uvic.experiments.runner import Table, TableOptions


def parse_args(table: Table, argv: Sequence[str] | None = None) -> TableOptions:
    """A table program's options (the same for every table)."""
    from uvic.experiments.runner import TableOptions

    p = argparse.ArgumentParser(description=table.description)
    p.add_argument("--out", help=f"output folder (default runs/{table.name}, or "
                                 f"runs/{table.name}_smoke)")
    p.add_argument("--smoke", action="store_true", help=table.smoke_help)
    p.add_argument("--only", action="append", default=[], metavar="NAME",
                   help="only rows with this name (or name prefix) or model (repeatable)")
    p.add_argument("--stage", choices=["all", "train", "fid", "table"], default="all",
                   help="run up to this stage only (default all)")
    p.add_argument("--seeds", type=int, default=1,
                   help="training seeds per row (default 1); with 2 or more every cell is "
                        "the mean over seeds with its 95%% interval")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    p.add_argument("--precision", choices=PRECISIONS,
                   help="autocast dtype for FID sampling on CUDA (sets sample.precision; "
                        "default fp32)")
    add_set_option(p)  # applied to every row
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    a = p.parse_args(argv)
    out = a.out or (f"runs/{table.name}_smoke" if a.smoke else f"runs/{table.name}")
    return TableOptions(out=out, smoke=a.smoke, only=tuple(a.only), stage=a.stage,
                        seeds=a.seeds, dry_run=a.dry_run, quiet=a.quiet,
                        overrides=(*a.set, *([f"sample.precision={a.precision}"]
                                             if a.precision else [])))


def run(table: Table, argv: Sequence[str] | None = None) -> int:
    """Run one table's program; returns the exit status."""
    from uvic.experiments.runner import run_table

    options = parse_args(table, argv)
    return run_reported(lambda: run_table(table, options),
                        resume_note="every finished cell is kept; run the same command "
                                    "again to continue")


def table3(argv: Sequence[str] | None = None) -> int:
    """`uvic-table3`: the paper's Table 3 (CIFAR-10 and MS-COCO, U-ViT and U-ViC)."""
    from uvic.experiments.tables import TABLE3

    return run(TABLE3, argv)


def release_table(argv: Sequence[str] | None = None) -> int:
    """`uvic-release-table`: every row of the U-ViT release with its U-ViC twin."""
    from uvic.experiments.tables import RELEASE_TABLE

    return run(RELEASE_TABLE, argv)


def recipes_table(argv: Sequence[str] | None = None) -> int:
    """`uvic-recipes-table`: the modern-recipe rows with their U-ViC twins."""
    from uvic.experiments.tables import RECIPES_TABLE

    return run(RECIPES_TABLE, argv)

