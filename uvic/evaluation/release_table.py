"""The U-ViT release's table from FID result JSONs (a `TwinTable`): one line per release row
and protocol, U-ViT and its U-ViC twin side by side, beside the FID the release reports;
the release's protocol is marked.
"""

from __future__ import annotations

from typing import Any

from uvic.evaluation.protocols import RELEASE_ROWS, ReleaseRow
from uvic.evaluation.twin_table import TwinTable
from uvic.evaluation.twin_table import row_of as twin_row_of

RELEASE_TABLE: TwinTable[ReleaseRow] = TwinTable(
    RELEASE_ROWS, "release",
    "Lower is better. Release: the FID the U-ViT repository reports for the row (50k "
    "samples). Our numbers are comparable with it only on a line whose protocol is marked "
    "*release protocol*.",
    extra=("Release (U-ViT)", lambda row: f"{row.release_fid:.2f}"),
    own_protocol=lambda row: row.protocol,
    own_mark=lambda row: f" — *release protocol*: {row.label()}")


def row_of(result: dict[str, Any]) -> ReleaseRow:
    """The release row of a result, by its config name; ValueError naming the file if none."""
    return twin_row_of(RELEASE_ROWS, result, "release")


def release_table(results: list[dict[str, Any]]) -> str:
    """Markdown: a line per (release row, protocol, reference digest) with our best U-ViT
    and U-ViC FID under it (several training seeds: mean ± 95% interval, `fid_cell`) and
    the release's reported FID (a protocol is split by reference, and marked, only where its
    results' references differ); rows without results show their
    release protocol and "—". Protocols are listed under the table, the release's with both
    guidance conventions and its reference statistics file (`uvic.evaluation.twin_table`)."""
    return RELEASE_TABLE.render(results)
