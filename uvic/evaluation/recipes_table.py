"""The modern-recipe table from FID result JSONs (`uvic-recipes-table`): one line per recipe
row and protocol, U-ViT and its U-ViC twin side by side.

A result belongs to the row its config is named after (`<row>_<model>`, as the table
program names its runs, or the row's presets, e.g. `imagenet256_uvit_large_flow`). As in
the release table (`uvic.evaluation.release_table`), results of different protocols never
share a line, nor do results of one protocol scored against different reference statistics,
and stand-in features (eval.features=projection) are marked as not comparable with FID.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from uvic.evaluation.protocols import (
    Protocol,
    best_per_seed,
    fid_cell,
    protocol_from_result,
    protocol_notes,
    seeds_note,
)
from uvic.evaluation.reference_split import ReferenceSplit, digest_order

MODELS = ("U-ViT", "U-ViC")


@dataclass(frozen=True)
class RecipeRow:
    """One row of the table: its key (the runs' name prefix), title and two presets."""

    key: str
    title: str
    uvit: str
    uvic: str


RECIPE_ROWS = {row.key: row for row in [
    RecipeRow("cifar10_flow", "CIFAR-10, U-ViT-S/2, flow matching", "cifar10_uvit_flow",
              "cifar10_uvic_flow"),
    RecipeRow("imagenet256_large_flow", "ImageNet 256, U-ViT-L/2, flow matching + REPA + "
              "guidance interval", "imagenet256_uvit_large_flow", "imagenet256_uvic_large_flow"),
]}


def recipe_row_of(result: dict[str, Any]) -> RecipeRow:
    """The recipe row of a result, by its config name; ValueError naming the file if none."""
    name = result.get("name", "")
    for key, row in RECIPE_ROWS.items():
        if name in (f"{key}_uvit", f"{key}_uvic", row.uvit, row.uvic):
            return row
    raise ValueError(f"{result.get('_path', 'result')}: config name {name!r} is no recipe "
                     f"row's (<row>_uvit / <row>_uvic, rows: {', '.join(RECIPE_ROWS)})")


def recipes_table(results: list[dict[str, Any]]) -> str:
    """Markdown: a line per (recipe row, protocol, reference digest) with our best U-ViT
    and U-ViC FID under it (several training seeds: mean ± 95% interval, `fid_cell`); rows
    without results are left out. Protocols are listed under the table."""
    split = ReferenceSplit()
    cells: dict[tuple[str, Protocol, str | None], dict[str, list[dict[str, Any]]]] = {}
    for r in results:
        key, p = recipe_row_of(r).key, protocol_from_result(r)
        cells.setdefault((key, p, split.add(key, p, r)), {}).setdefault(
            r["model"], []).append(r)
    order = list(RECIPE_ROWS)
    lines_of = sorted(cells, key=lambda k: (order.index(k[0]), k[1].label(),
                                            digest_order(k[2])))
    names = {p: f"P{i + 1}" for i, p in enumerate(dict.fromkeys(p for _, p, _ in lines_of))}
    lines = ["| Recipe row | Protocol | U-ViT | U-ViC |", "|---|---|---|---|"]
    for key, p, digest in lines_of:
        row, cell = RECIPE_ROWS[key], cells[key, p, digest]
        mark = "" if p.inception else ", stand-in: not FID"
        fids = [fid_cell(cell[m]) if m in cell else "—" for m in MODELS]
        lines.append(f"| {row.title} (`{row.uvit}`) | {names[p]}{split.tag(key, p, digest)}"
                     f"{mark} | {' | '.join(fids)} |")
    lines += ["", "Lower is better. Each row is its presets' recipe (docs/recipes.md, \"The "
              "recipe configs\"); the U-ViT release reports no number under these recipes."]
    lines += protocol_notes(names, "Lines", lambda p: "")
    lines += seeds_note(runs for cell in cells.values() for runs in cell.values())
    lines += split.notes({(key, p): f"{RECIPE_ROWS[key].title}, {names[p]}"
                          for key, p, _ in lines_of}, "line")
    lines += ["", "Results shown:", ""]
    for key, p, digest in lines_of:
        for m in MODELS:
            for r in best_per_seed(cells[key, p, digest].get(m, [])):
                what = "FID" if p.inception else f"stand-in FID ({p.features} features)"
                step = f" step {r['step']}" if r.get("step") is not None else ""
                lines.append(f"- {m} / {key} ({names[p]}): {what} {r['fid']:.3f}; "
                             f"{r['checkpoint']}{step}")
    return "\n".join(lines) + "\n"
