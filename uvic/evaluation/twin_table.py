"""A table of twin rows from FID result JSONs: one line per row, protocol and reference
digest, a U-ViT and its U-ViC twin side by side (the release table and the modern-recipe
table are two `TwinTable`s). A result belongs to the row its config is named after
(`<row>_<model>`, or one of the row's presets); as in Table 3, results of different
protocols or reference statistics never share a line.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from uvic.evaluation.cells import TWINS, paired_note
from uvic.evaluation.protocols import (
    Protocol,
    best_per_seed,
    fid_cell,
    protocol_from_result,
    protocol_notes,
    seeds_note,
)
from uvic.evaluation.reference_split import ReferenceSplit, digest_order

MODELS = TWINS


class TwinRow(typing.Protocol):
    """What a row of a twin table has: its key (the runs' name prefix), title and presets."""

    @property
    def key(self) -> str: ...
    @property
    def title(self) -> str: ...
    @property
    def uvit(self) -> str: ...
    @property
    def uvic(self) -> str: ...


R = TypeVar("R", bound=TwinRow)
Cell = dict[str, list[dict[str, Any]]]  # a line's results by model
Line = tuple[Any, Protocol, str, Cell]  # (row, protocol, reference tag, cell)


def row_of(rows: Mapping[str, R], result: dict[str, Any], kind: str) -> R:
    """The row of `rows` a result belongs to, by its config name; ValueError naming the file
    (and `kind`, e.g. "release", the rows' name) if none."""
    name = result.get("name", "")
    for key, row in rows.items():
        if name in (f"{key}_uvit", f"{key}_uvic", row.uvit, row.uvic):
            return row
    raise ValueError(f"{result.get('_path', 'result')}: config name {name!r} is no {kind} "
                     f"row's (<row>_uvit / <row>_uvic, rows: {', '.join(rows)})")


@dataclass(frozen=True)
class TwinTable(Generic[R]):
    """What sets one twin table apart: its rows, their name (`kind`, its heading "<Kind>
    row"), the footnote under the table, an optional extra column (heading, cell of a row),
    and optionally each row's own protocol (`own_protocol`: listed first on its row, its
    entry in the protocol list followed by `own_mark(row)`, and a row without results shown
    under it with "—"; without it, rows without results are left out)."""

    rows: Mapping[str, R]
    kind: str
    footnote: str
    extra: tuple[str, Callable[[R], str]] | None = None
    own_protocol: Callable[[R], Protocol] | None = None
    own_mark: Callable[[R], str] = lambda row: ""

    def lines_of(self, results: list[dict[str, Any]]) -> tuple[list[Line], ReferenceSplit]:
        """The table's lines in order: by row, the row's own protocol first, then by
        protocol and reference; and the results' references."""
        split = ReferenceSplit()
        cells: dict[tuple[str, Protocol, str | None], Cell] = {}
        for r in results:
            key, p = row_of(self.rows, r, self.kind).key, protocol_from_result(r)
            cells.setdefault((key, p, split.add(key, p, r)), {}).setdefault(
                r["model"], []).append(r)
        lines: list[Line] = []
        for key, row in self.rows.items():
            own = self.own_protocol(row) if self.own_protocol else None
            found = sorted(((p, g) for k, p, g in cells if k == key),
                           key=lambda k: (k[0] != own, k[0].label(), digest_order(k[1])))
            lines += [(row, p, split.tag(key, p, g), cells[key, p, g]) for p, g in found]
            if not found and own is not None:
                lines.append((row, own, "", {}))
        return lines, split

    def render(self, results: list[dict[str, Any]]) -> str:
        """Markdown: a line per (row, protocol, reference digest) with our best U-ViT and
        U-ViC FID under it (several training seeds: mean ± 95% interval, `fid_cell`), the
        notes, the protocols and the results shown."""
        lines_of, split = self.lines_of(results)
        names = {p: f"P{i + 1}" for i, p in enumerate(dict.fromkeys(p for _, p, _, _ in lines_of))}
        heads = [f"{self.kind.capitalize()} row", "Protocol", *MODELS]
        heads += [self.extra[0]] if self.extra else []
        lines = [f"| {' | '.join(heads)} |", "|" + "---|" * len(heads)]
        for row, p, tag, cell in lines_of:
            mark = "" if p.inception else ", stand-in: not FID"
            cells = [fid_cell(cell[m]) if m in cell else "—" for m in MODELS]
            cells += [self.extra[1](row)] if self.extra else []
            lines.append(f"| {row.title} (`{row.uvit}`) | {names[p]}{tag}{mark} | "
                         f"{' | '.join(cells)} |")
        lines += ["", self.footnote]

        def own_mark(p: Protocol) -> str:
            rows = [row for row, q, _, _ in lines_of if q == p and self.own_protocol
                    and self.own_protocol(row) == p]
            return self.own_mark(rows[0]) if rows else ""

        lines += protocol_notes(names, "Lines", own_mark)
        lines += seeds_note(c for _, _, _, cell in lines_of for c in cell.values())
        lines += paired_note([(f"{row.title}, {names[p]}{tag}", cell)
                              for row, p, tag, cell in lines_of])
        lines += split.notes({(row.key, p): f"{row.title}, {names[p]}"
                              for row, p, _, _ in lines_of}, "line")
        shown = [(row, p, tag, r) for row, p, tag, cell in lines_of
                 for m in MODELS if m in cell for r in best_per_seed(cell[m])]
        if shown:
            lines += ["", "Results shown:", ""]
        for row, p, tag, r in shown:
            what = "FID" if p.inception else f"stand-in FID ({p.features} features)"
            step = f" step {r['step']}" if r.get("step") is not None else ""
            lines.append(f"- {r['model']} / {row.key} ({names[p]}{tag}): {what} "
                         f"{r['fid']:.3f}; {r['checkpoint']}{step}")
        return "\n".join(lines) + "\n"
