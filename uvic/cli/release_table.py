"""The U-ViT release's table end to end: train, then FID, then the table, for every release
row (CelebA 64, ImageNet 64, 256 and 512) with U-ViT and its U-ViC twin, and Table 3's
CIFAR-10 and MS-COCO rows.

    uvic-release-table --dry-run                 # the plan and the compute it needs
    uvic-release-table --only imagenet256_huge   # one row (both models); --only uvic: twins
    uvic-release-table --smoke                   # the whole chain on a CPU (~1 min)

Each row is scored under the release's protocol against its reference statistics file
(eval.ref_stats); the runner is Table 3's (`uvic.cli.table_runner`), and the smoke writes
tiny data in the real formats (docs/evaluation.md, "The release's table by command").
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from uvic.cli import summary, table_runner
from uvic.cli.table_runner import Table, twin_rows
from uvic.evaluation.protocols import RELEASE_ROWS

# Every run of the smoke: a tiny network, a few steps, few samples, stand-in features.
SMOKE = ("model.embed_dim=32", "model.depth=2", "model.num_heads=2", "model.mlp_ratio=2",
         "model.attention_backend=torch", "data.num_workers=0", "optim.warmup_steps=5",
         "optim.lr=1e-3", "train.batch_size=8", "train.max_steps=30", "train.ema_decay=0.9",
         "train.mixed_precision=no", "train.log_every=10", "train.sample_every=0",
         "train.ckpt_every=15", "train.keep_last=1", "train.n_grid=4", "sample.steps=10",
         "sample.batch_size=16", "sample.decode_batch_size=16", "eval.n_samples=16",
         "eval.features=projection")
PIXELS = ("model.img_size=16", "model.patch_size=4", "eval.ref_res=16")
# One row per kind of data, its data (and reference images) in <out>/data (`smoke_data`).
SMOKE_DATA = {
    "celeba64_small": (*PIXELS, "data.root={data}/celeba",
                       "eval.ref_images={data}/celeba/img_align_celeba"),
    "imagenet64_mid": (*PIXELS, "model.num_classes=3", "data.root={data}/imagenet",
                       "eval.ref_images={data}/imagenet/train"),
    "imagenet256_huge": ("model.img_size=8", "model.patch_size=2", "eval.ref_res=64",
                         "model.num_classes=4",  # 3 classes + the null class
                         "data.root={data}/imagenet_features", "data.vae={data}/vae",
                         "eval.ref_images={data}/imagenet/train"),
}


def _prepare_smoke(folder: Path) -> None:
    from uvic.cli.smoke_data import write_smoke_data

    write_smoke_data(folder)


def _render(results: list[dict]) -> str:
    from uvic.evaluation.release_table import release_table

    return release_table(results)


RELEASE_TABLE = Table(
    name="release_table", description=summary(__doc__),
    rows=twin_rows(RELEASE_ROWS), smoke_rows=twin_rows(RELEASE_ROWS, SMOKE_DATA, SMOKE),
    smoke_help="tiny CPU run of the whole chain: one row per kind of data on generated "
               "CelebA, ImageNet folders and latents, stand-in features",
    render=_render, prepare_smoke=_prepare_smoke,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the program; returns the exit status."""
    return table_runner.main(RELEASE_TABLE, argv)


if __name__ == "__main__":
    sys.exit(main())
