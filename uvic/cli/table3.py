"""Table 3 end to end: train, then FID, then the table, for every (dataset, model) pair.

    uvic-table3 --dry-run         # the plan and the compute it needs
    accelerate launch --multi_gpu --num_processes 8 scripts/reproduce_table3.py
    uvic-table3 --smoke           # the whole chain on a CPU (~10 s)

CIFAR-10 and MS-COCO, each with U-ViT and U-ViC, trained to the paper's length and scored
under the release's FID protocol; every stage resumes, so run it again after an
interruption (docs/evaluation.md, "Table 3 by command"). The program is
`uvic.cli.table_runner`'s, run on the `TABLE3` description.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from uvic.cli import summary, table_runner
from uvic.cli.table_runner import Job, Row, Table
from uvic.cli.table_runner import plan as plan
from uvic.cli.table_runner import smoke_note as smoke_note
from uvic.evaluation.protocols import protocol_table

if TYPE_CHECKING:
    import argparse

PAIRS = [("cifar10", "uvit"), ("cifar10", "uvic"), ("mscoco", "uvit"), ("mscoco", "uvic")]
SMOKE_PAIRS = [("shapes", "uvit"), ("shapes", "uvic")]


TABLE3 = Table(
    name="table3", description=summary(__doc__),
    rows=tuple(Row(d, m, f"{d}_{m}") for d, m in PAIRS),
    smoke_rows=tuple(Row(d, m, "table3_smoke", (f"model.attention={m}",))
                     for d, m in SMOKE_PAIRS),
    smoke_help="tiny CPU run of the whole chain (Shapes, test feature extractor)",
    render=protocol_table,
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options (`uvic.cli.table_runner.parse_args` for Table 3)."""
    return table_runner.parse_args(TABLE3, argv)


def make_jobs(args: argparse.Namespace) -> list[Job]:
    """Table 3's pairs (or smoke pairs) that --only picks."""
    return table_runner.make_jobs(TABLE3, args)


def main(argv: list[str] | None = None) -> int:
    """Run the program; returns the exit status."""
    return table_runner.main(TABLE3, argv)


if __name__ == "__main__":
    sys.exit(main())
