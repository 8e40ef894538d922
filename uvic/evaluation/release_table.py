"""The U-ViT release's table from FID result JSONs: one line per release row and protocol,
U-ViT and its U-ViC twin side by side, beside the FID the release reports.

A result belongs to the row its config is named after (`<row>_<model>`, as
`uvic-release-table` names its runs, or the row's preset, e.g. `imagenet256_uvit_large`).
As in Table 3 (`protocol_table`), results of different protocols never share a line, nor
do results of one protocol scored against different reference statistics (their own line
each, marked `ref <digest>`, and a note naming their files: `uvic.evaluation.
reference_split`); the release's protocol is marked, and stand-in features
(eval.features=projection) are marked as not comparable with Inception FID.
"""

from __future__ import annotations

from typing import Any

from uvic.evaluation.protocols import (
    RELEASE_ROWS,
    Protocol,
    ReleaseRow,
    best_per_seed,
    fid_cell,
    protocol_from_result,
    protocol_notes,
    seeds_note,
)
from uvic.evaluation.reference_split import ReferenceSplit, digest_order

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
    """Markdown: a line per (release row, protocol, reference digest) with our best U-ViT
    and U-ViC FID under it (several training seeds: mean ± 95% interval, `fid_cell`) and
    the release's reported FID (a protocol is split by reference, and marked, only where its
    results' references differ); rows without results show their
    release protocol and "—". Protocols are listed under the table, the release's with both
    guidance conventions and its reference statistics file."""
    split = ReferenceSplit()
    best: dict[tuple[str, Protocol, str | None], dict[str, list[dict[str, Any]]]] = {}
    for r in results:
        key, p = row_of(r).key, protocol_from_result(r)
        cell = best.setdefault((key, p, split.add(key, p, r)), {})
        cell.setdefault(r["model"], []).append(r)
    lines_of: list[tuple[ReleaseRow, Protocol, str, dict[str, list[dict[str, Any]]]]] = []
    for key, row in RELEASE_ROWS.items():
        found = sorted(((p, g) for k, p, g in best if k == key),
                       key=lambda k: (k[0] != row.protocol, k[0].label(), digest_order(k[1])))
        lines_of += ([(row, p, split.tag(key, p, g), best[key, p, g]) for p, g in found]
                     or [(row, row.protocol, "", {})])
    names = {p: f"P{i + 1}" for i, p in enumerate(dict.fromkeys(p for _, p, _, _ in lines_of))}

    lines = ["| Release row | Protocol | U-ViT | U-ViC | Release (U-ViT) |", "|" + "---|" * 5]
    for row, p, tag, cell in lines_of:
        mark = "" if p.inception else ", stand-in: not FID"
        fids = [fid_cell(cell[m]) if m in cell else "—" for m in MODELS]
        lines.append(f"| {row.title} (`{row.uvit}`) | {names[p]}{tag}{mark} | "
                     f"{' | '.join(fids)} | {row.release_fid:.2f} |")
    lines += ["", "Lower is better. Release: the FID the U-ViT repository reports for the row "
              "(50k samples). Our numbers are comparable with it only on a line whose protocol "
              "is marked *release protocol*."]

    def mark(p: Protocol) -> str:
        rows = [row for row, q, _, _ in lines_of if q == p and row.protocol == p]
        return f" — *release protocol*: {rows[0].label()}" if rows else ""

    lines += protocol_notes(names, "Lines", mark)
    lines += seeds_note(c for _, _, _, cell in lines_of for c in cell.values())
    lines += split.notes({(row.key, p): f"{row.title}, {names[p]}"
                          for row, p, _, _ in lines_of}, "line")
    shown = [(row, p, tag, r) for row, p, tag, cell in lines_of for m in MODELS if m in cell
             for r in best_per_seed(cell[m])]
    if shown:
        lines += ["", "Results shown:", ""]
        for row, p, tag, r in shown:
            what = "FID" if p.inception else f"stand-in FID ({p.features} features)"
            step = f" step {r['step']}" if r.get("step") is not None else ""
            lines.append(f"- {r['model']} / {row.key} ({names[p]}{tag}): {what} "
                         f"{r['fid']:.3f}; {r['checkpoint']}{step}")
    return "\n".join(lines) + "\n"
