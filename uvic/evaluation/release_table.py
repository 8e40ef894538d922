"""The U-ViT release's table from FID result JSONs: one line per release row and protocol,
U-ViT and its U-ViC twin side by side, beside the FID the release reports.

A result belongs to the row its config is named after (`<row>_<model>`, as
`uvic-release-table` names its runs, or the row's preset, e.g. `imagenet256_uvit_large`).
As in Table 3 (`protocol_table`), results of different protocols never share a line; the
release's protocol is marked, and stand-in features (eval.features=projection) are marked
as not comparable with Inception FID.
"""

from __future__ import annotations

from typing import Any

from uvic.evaluation.protocols import (
    RELEASE_ROWS,
    Protocol,
    ReleaseRow,
    protocol_from_result,
    protocol_notes,
)

MODELS = ("U-ViT", "U-ViC")


def row_of(result: dict[str, Any]) -> ReleaseRow:
    """The release row of a result, by its config name; ValueError naming the file if none."""
    name = result.get("name", "")
    for key, row in RELEASE_ROWS.items():
        if name in (f"{key}_uvit", f"{key}_uvic", row.uvit, row.uvic):
            return row
    raise ValueError(f"{result.get('_path', 'result')}: config name {name!r} is no release "
                     f"row's (<row>_uvit / <row>_uvic, rows: {', '.join(RELEASE_ROWS)})")


def release_table(results: list[dict[str, Any]]) -> str:
    """Markdown: a line per (release row, protocol) with our best U-ViT and U-ViC FID under
    it and the release's reported FID; rows without results show their release protocol
    and "—". Protocols are listed under the table, the release's with both guidance
    conventions and its reference statistics file."""
    best: dict[tuple[str, Protocol], dict[str, dict[str, Any]]] = {}
    for r in results:
        cell = best.setdefault((row_of(r).key, protocol_from_result(r)), {})
        if r["model"] not in cell or r["fid"] < cell[r["model"]]["fid"]:
            cell[r["model"]] = r
    lines_of: list[tuple[ReleaseRow, Protocol, dict[str, dict[str, Any]]]] = []
    for key, row in RELEASE_ROWS.items():
        found = sorted((p for k, p in best if k == key),
                       key=lambda p: (p != row.protocol, p.label()))
        lines_of += [(row, p, best[key, p]) for p in found] or [(row, row.protocol, {})]
    names = {p: f"P{i + 1}" for i, p in enumerate(dict.fromkeys(p for _, p, _ in lines_of))}

    lines = ["| Release row | Protocol | U-ViT | U-ViC | Release (U-ViT) |", "|" + "---|" * 5]
    for row, p, cell in lines_of:
        mark = "" if p.inception else ", stand-in: not FID"
        fids = [f"{cell[m]['fid']:.2f}" if m in cell else "—" for m in MODELS]
        lines.append(f"| {row.title} (`{row.uvit}`) | {names[p]}{mark} | {' | '.join(fids)} | "
                     f"{row.release_fid:.2f} |")
    lines += ["", "Lower is better. Release: the FID the U-ViT repository reports for the row "
              "(50k samples). Our numbers are comparable with it only on a line whose protocol "
              "is marked *release protocol*."]

    def mark(p: Protocol) -> str:
        rows = [row for row, q, _ in lines_of if q == p and row.protocol == p]
        return f" — *release protocol*: {rows[0].label()}" if rows else ""

    lines += protocol_notes(names, "Lines", mark)
    shown = [(row, p, cell[m]) for row, p, cell in lines_of for m in MODELS if m in cell]
    if shown:
        lines += ["", "Results shown:", ""]
        for row, p, r in shown:
            what = "FID" if p.inception else f"stand-in FID ({p.features} features)"
            step = f" step {r['step']}" if r.get("step") is not None else ""
            lines.append(f"- {r['model']} / {row.key} ({names[p]}): {what} {r['fid']:.3f}; "
                         f"{r['checkpoint']}{step}")
    return "\n".join(lines) + "\n"
