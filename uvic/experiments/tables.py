"""The tables built by command, as data: Table 3 of the paper, the U-ViT release's table and
the modern-recipe table, each its rows (a U-ViT and a U-ViC run per row), its smoke rows (the
whole chain on a CPU, on tiny data in the real formats) and its renderer."""

from __future__ import annotations

from pathlib import Path

from uvic.config import Config
from uvic.evaluation.protocols import RELEASE_ROWS, protocol_table
from uvic.evaluation.recipes_table import RECIPE_ROWS, recipes_table
from uvic.evaluation.release_table import release_table
from uvic.experiments.runner import Adapt, Row, Table, twin_rows


def _tiny(cfg: Config) -> None:
    """Every smoke run of the release and recipe tables: a tiny network, a few steps, few
    samples, stand-in features."""
    m, t, s = cfg.model, cfg.train, cfg.sample
    m.embed_dim, m.depth, m.num_heads, m.mlp_ratio = 32, 2, 2, 2.0
    m.attention_backend = "torch"
    cfg.data.num_workers = 0
    cfg.optim.warmup_steps, cfg.optim.lr = 5, 1e-3
    t.batch_size, t.max_steps, t.ema_decay, t.mixed_precision = 8, 30, 0.9, "no"
    t.log_every, t.sample_every, t.ckpt_every, t.keep_last, t.n_grid = 10, 0, 15, 1, 4
    s.steps, s.batch_size, s.decode_batch_size = 10, 16, 16
    cfg.eval.n_samples, cfg.eval.features = 16, "projection"


def _pixels(cfg: Config) -> None:
    """A tiny run on 16x16 pixels."""
    _tiny(cfg)
    cfg.model.img_size, cfg.model.patch_size, cfg.eval.ref_res = 16, 4, 16


def _latents(cfg: Config, data: Path) -> None:
    """A tiny run on 8x8 latents of the smoke ImageNet (3 classes + the null class)."""
    _tiny(cfg)
    cfg.model.img_size, cfg.model.patch_size, cfg.eval.ref_res = 8, 2, 64
    cfg.model.num_classes = 4
    cfg.data.root, cfg.data.vae = str(data / "imagenet_features"), str(data / "vae")
    cfg.eval.ref_images = str(data / "imagenet" / "train")


def _celeba(cfg: Config, data: Path) -> None:
    """The CelebA 64 row on the smoke CelebA folder."""
    _pixels(cfg)
    cfg.data.root = str(data / "celeba")
    cfg.eval.ref_images = str(data / "celeba" / "img_align_celeba")


def _imagenet64(cfg: Config, data: Path) -> None:
    """The ImageNet 64 row on the smoke ImageNet folders (3 classes)."""
    _pixels(cfg)
    cfg.model.num_classes = 3
    cfg.data.root = str(data / "imagenet")
    cfg.eval.ref_images = str(data / "imagenet" / "train")


def _shapes_flow(cfg: Config, data: Path) -> None:
    """The CIFAR-10 flow-matching row on Shapes, with post-hoc EMA."""
    _pixels(cfg)
    cfg.data.name, cfg.data.root, cfg.data.num_images = "shapes", "", 64
    cfg.eval.ref_stats = "shapes"
    # post-hoc EMA: both of EDM2's profiles, a snapshot every 10 steps
    cfg.train.posthoc_ema_stds, cfg.train.posthoc_ema_every = (0.05, 0.1), 10


def _latents_repa(cfg: Config, data: Path) -> None:
    """The ImageNet 256 recipe row on the smoke latents, with the tiny REPA encoder."""
    _latents(cfg, data)
    # the tiny encoder's features were stored with the latents; 3 blocks: the first
    t = cfg.train
    t.repa_encoder, t.repa_block, t.repa_projector_dim = str(data / "repa_encoder"), 0, 16


def _attention(model: str) -> Adapt:
    """Table 3's smoke run of `model` (uvit or uvic) on the table3_smoke preset."""
    def adapt(cfg: Config, data: Path) -> None:
        cfg.model.attention = model
    return adapt


# One release row per kind of data, its data (and reference images) in <out>/data.
RELEASE_SMOKE = {"celeba64_small": _celeba, "imagenet64_mid": _imagenet64,
                 "imagenet256_huge": _latents}
RECIPES_SMOKE = {"cifar10_flow": _shapes_flow, "imagenet256_large_flow": _latents_repa}


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
    smoke_rows=tuple(Row("shapes", m, "table3_smoke", _attention(m)) for m in ("uvit", "uvic")),
    smoke_help="tiny CPU run of the whole chain (Shapes, test feature extractor)",
    render=protocol_table,
)
RELEASE_TABLE = Table(
    name="release_table",
    description="The U-ViT release's table end to end: train, then FID, then the table, for "
                "every release row (CelebA 64, ImageNet 64, 256 and 512) with U-ViT and its "
                "U-ViC twin, and Table 3's CIFAR-10 and MS-COCO rows.",
    rows=twin_rows(RELEASE_ROWS), smoke_rows=twin_rows(RELEASE_ROWS, RELEASE_SMOKE),
    smoke_help="tiny CPU run of the whole chain: one row per kind of data on generated "
               "CelebA, ImageNet folders and latents, stand-in features",
    render=release_table, prepare_smoke=_release_data,
)
RECIPES_TABLE = Table(
    name="recipes_table",
    description="The modern-recipe table end to end: train, then FID, then the table, for "
                "every recipe row (CIFAR-10 with flow matching; ImageNet 256 U-ViT-L/2 with "
                "flow matching, REPA and the guidance interval), U-ViT and its U-ViC twin.",
    rows=twin_rows(RECIPE_ROWS), smoke_rows=twin_rows(RECIPE_ROWS, RECIPES_SMOKE),
    smoke_help="tiny CPU run of the whole chain: both rows on generated Shapes data and "
               "latents with a tiny random REPA encoder, stand-in features",
    render=recipes_table, prepare_smoke=_recipes_data,
)
