"""Markdown version of the paper's Table 3 from a folder of `eval/fid.py` result JSONs.

    uvic-fid-table runs/fid --out runs/fid/table.md     # or: python eval/fid_table.py ...

Rows U-ViT / U-ViC, one column per (dataset, FID protocol, reference statistics) with our
best FID, beside the paper's and the release's numbers (docs/evaluation.md). A folder with
no result JSON, or a JSON that is not one, stops it with one line and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from uvic.cli import summary
from uvic.cli.errors import run_reported
from uvic.evaluation.protocols import load_results, protocol_table


def main(argv: list[str] | None = None) -> int:
    """Run the program; returns the exit status."""
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("results_dir", help="folder with result JSONs (searched recursively)")
    p.add_argument("--out", help="also write the table to this markdown file")
    args = p.parse_args(argv)
    return run_reported(lambda: _table(args))


def _table(args: argparse.Namespace) -> None:
    table = protocol_table(load_results(args.results_dir))
    print(table, end="")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(table)


if __name__ == "__main__":
    sys.exit(main())
