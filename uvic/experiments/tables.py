"""The tables built by command, as data: Table 3 of the paper, the U-ViT release's table and
the modern-recipe table, each its rows (a U-ViT and a U-ViC run per row), its smoke rows (the
whole chain on a CPU, on tiny data in the real formats) and its renderer."""

from __future__ import annotations

from pathlib import Path

from uvic.evaluation.protocols import RELEASE_ROWS, protocol_table
from uvic.evaluation.recipes_table import RECIPE_ROWS, recipes_table
from uvic.evaluation.release_table import release_table
from uvic.experiments.runner import Row, Table, twin_rows

# Every smoke run of the release and recipe tables: a tiny network, a few steps, few
# samples, stand-in features.
SMOKE = ("model.embed_dim=32", "model.depth=2", "model.num_heads=2", "model.mlp_ratio=2",
         "model.attention_backend=torch", "data.num_workers=0", "optim.warmup_steps=5",
         "optim.lr=1e-3", "train.batch_size=8", "train.max_steps=30", "train.ema_decay=0.9",
         "train.mixed_precision=no", "train.log_every=10", "train.sample_every=0",
         "train.ckpt_every=15", "train.keep_last=1", "train.n_grid=4", "sample.steps=10",
         "sample.batch_size=16", "sample.decode_batch_size=16", "eval.n_samples=16",
         "eval.features=projection")
PIXELS = ("model.img_size=16", "model.patch_size=4", "eval.ref_res=16")
LATENTS = ("model.img_size=8", "model.patch_size=2", "eval.ref_res=64",
           "model.num_classes=4",  # 3 classes + the null class
           "data.root={data}/imagenet_features", "data.vae={data}/vae",
           "eval.ref_images={data}/imagenet/train")

# One release row per kind of data, its data (and reference images) in <out>/data.
RELEASE_SMOKE = {
    "celeba64_small": (*PIXELS, "data.root={data}/celeba",
                       "eval.ref_images={data}/celeba/img_align_celeba"),
    "imagenet64_mid": (*PIXELS, "model.num_classes=3", "data.root={data}/imagenet",
                       "eval.ref_images={data}/imagenet/train"),
    "imagenet256_huge": LATENTS,
}
RECIPES_SMOKE = {
    "cifar10_flow": (*PIXELS, "data.name=shapes", "data.root=", "data.num_images=64",
                     "eval.ref_stats=shapes",
                     # post-hoc EMA: both of EDM2's profiles, a snapshot every 10 steps
                     "train.posthoc_ema_stds=0.05,0.1", "train.posthoc_ema_every=10"),
    "imagenet256_large_flow": (
        *LATENTS,
        # the tiny encoder's features were stored with the latents; 3 blocks: the first
        "train.repa_encoder={data}/repa_encoder", "train.repa_block=0",
        "train.repa_projector_dim=16"),
}


# The smoke data's writers import torch: loaded only when a smoke run starts.
def _release_data(folder: Path) -> None:
    from uvic.experiments.smoke_data import write_smoke_data

    write_smoke_data(folder)


def _recipes_data(folder: Path) -> None:
    from uvic.experiments.smoke_data import write_recipes_smoke_data

    write_recipes_smoke_data(folder)


TABLE3 = Table(
    name="table3",
    description="Table 3 end to end: train, then FID, then the table, for every (dataset, "
                "model) pair: CIFAR-10 and MS-COCO, each with U-ViT and U-ViC, trained to "
                "the paper's length and scored under the release's FID protocol.",
    rows=tuple(Row(d, m, f"{d}_{m}") for d in ("cifar10", "mscoco") for m in ("uvit", "uvic")),
    smoke_rows=tuple(Row("shapes", m, "table3_smoke", (f"model.attention={m}",))
                     for m in ("uvit", "uvic")),
    smoke_help="tiny CPU run of the whole chain (Shapes, test feature extractor)",
    render=protocol_table,
)
RELEASE_TABLE = Table(
    name="release_table",
    description="The U-ViT release's table end to end: train, then FID, then the table, for "
                "every release row (CelebA 64, ImageNet 64, 256 and 512) with U-ViT and its "
                "U-ViC twin, and Table 3's CIFAR-10 and MS-COCO rows.",
    rows=twin_rows(RELEASE_ROWS), smoke_rows=twin_rows(RELEASE_ROWS, RELEASE_SMOKE, SMOKE),
    smoke_help="tiny CPU run of the whole chain: one row per kind of data on generated "
               "CelebA, ImageNet folders and latents, stand-in features",
    render=release_table, prepare_smoke=_release_data,
)
RECIPES_TABLE = Table(
    name="recipes_table",
    description="The modern-recipe table end to end: train, then FID, then the table, for "
                "every recipe row (CIFAR-10 with flow matching; ImageNet 256 U-ViT-L/2 with "
                "flow matching, REPA and the guidance interval), U-ViT and its U-ViC twin.",
    rows=twin_rows(RECIPE_ROWS), smoke_rows=twin_rows(RECIPE_ROWS, RECIPES_SMOKE, SMOKE),
    smoke_help="tiny CPU run of the whole chain: both rows on generated Shapes data and "
               "latents with a tiny random REPA encoder, stand-in features",
    render=recipes_table, prepare_smoke=_recipes_data,
)
