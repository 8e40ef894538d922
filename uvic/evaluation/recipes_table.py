"""The modern-recipe table from FID result JSONs (`uvic-recipes-table`, a `TwinTable`): one
line per recipe row and protocol, U-ViT and its U-ViC twin side by side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from uvic.evaluation.twin_table import TwinTable


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


def recipes_table(results: list[dict[str, Any]]) -> str:
    """Markdown: a line per (recipe row, protocol, reference digest) with our best U-ViT
    and U-ViC FID under it (several training seeds: mean ± 95% interval, `fid_cell`); rows
    without results are left out. Protocols are listed under the table
    (`uvic.evaluation.twin_table`)."""
    return RECIPES_TABLE.render(results)
