"""The modern-recipe table end to end: train, then FID, then the table, for every recipe row
(CIFAR-10 with flow matching; ImageNet 256 U-ViT-L/2 with flow matching, REPA and the
guidance interval), U-ViT and its U-ViC twin.

    uvic-recipes-table --dry-run                # the plan and the compute it needs
    uvic-recipes-table --only imagenet256       # one row (both models); --only uvic: twins
    uvic-recipes-table --smoke                  # the whole chain on a CPU (~30 s)

The runner is Table 3's (`uvic.cli.table_runner`): every stage resumes per row, and the
smoke runs both rows shrunk on data it writes, with no download (docs/recipes.md).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from uvic.cli import summary, table_runner
from uvic.cli.release_table import PIXELS, SMOKE
from uvic.cli.table_runner import Table, twin_rows
from uvic.evaluation.recipes_table import RECIPE_ROWS

# Per row, on top of SMOKE: its data in <out>/data (`smoke_data.write_recipes_smoke_data`).
SMOKE_DATA = {
    "cifar10_flow": (*PIXELS, "data.name=shapes", "data.root=", "data.num_images=64",
                     "eval.ref_stats=shapes",
                     # post-hoc EMA: both of EDM2's profiles, a snapshot every 10 steps
                     "train.posthoc_ema_stds=0.05,0.1", "train.posthoc_ema_every=10"),
    "imagenet256_large_flow": (
        "model.img_size=8", "model.patch_size=2", "eval.ref_res=64",
        "model.num_classes=4",  # 3 classes + the null class
        "data.root={data}/imagenet_features", "data.vae={data}/vae",
        "eval.ref_images={data}/imagenet/train",
        # the tiny encoder's features were stored with the latents; 3 blocks: the first
        "train.repa_encoder={data}/repa_encoder", "train.repa_block=0",
        "train.repa_projector_dim=16"),
}


def _prepare_smoke(folder: Path) -> None:
    from uvic.cli.smoke_data import write_recipes_smoke_data

    write_recipes_smoke_data(folder)


def _render(results: list[dict]) -> str:
    from uvic.evaluation.recipes_table import recipes_table

    return recipes_table(results)


RECIPES_TABLE = Table(
    name="recipes_table", description=summary(__doc__),
    rows=twin_rows(RECIPE_ROWS), smoke_rows=twin_rows(RECIPE_ROWS, SMOKE_DATA, SMOKE),
    smoke_help="tiny CPU run of the whole chain: both rows on generated Shapes data and "
               "latents with a tiny random REPA encoder, stand-in features",
    render=_render, prepare_smoke=_prepare_smoke,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the program; returns the exit status."""
    return table_runner.main(RECIPES_TABLE, argv)


if __name__ == "__main__":
    sys.exit(main())
