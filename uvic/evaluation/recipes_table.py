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

from uvic.evaluation.twin_table import TwinTable, row_of


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


RECIPES_TABLE: TwinTable[RecipeRow] = TwinTable(
    RECIPE_ROWS, "recipe",
    "Lower is better. Each row is its presets' recipe (docs/recipes.md, \"The recipe "
    "configs\"); the U-ViT release reports no number under these recipes.",
)


def recipe_row_of(result: dict[str, Any]) -> RecipeRow:
    """The recipe row of a result, by its config name; ValueError naming the file if none."""
    return row_of(RECIPE_ROWS, result, "recipe")


def recipes_table(results: list[dict[str, Any]]) -> str:
    """Markdown: a line per (recipe row, protocol, reference digest) with our best U-ViT
    and U-ViC FID under it (several training seeds: mean ± 95% interval, `fid_cell`); rows
    without results are left out. Protocols are listed under the table
    (`uvic.evaluation.twin_table`)."""
    return RECIPES_TABLE.render(results)
