"""Tiny data in the real on-disk formats, for the table programs' `--smoke` (no download),
read by the same loaders as the real data.

`write_smoke_data(folder)` (`uvic-release-table --smoke`) writes, once, ImageNet class
folders of Shapes pictures, CelebA's layout, a tiny random VAE and `imagenet_features/`
extracted with it; `write_recipes_smoke_data(folder)` (`uvic-recipes-table --smoke`) adds a
tiny random REPA encoder and extracts its features too.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from PIL import Image

from uvic.data.datasets import render_shapes_image

if TYPE_CHECKING:
    from diffusers import AutoencoderKL

WNIDS = ("n01440764", "n01443537", "n01484850")  # the first ILSVRC-2012 classes
SIZES = ((72, 60), (48, 80), (64, 64), (96, 70))  # (width, height): the crops have work
PER_CLASS = 8
CELEBA_IMAGES = 24
SMOKE_RESOLUTION = 64  # pixels of the latent rows' images: 4 x 8 x 8 latents


def write_imagenet(root: Path) -> None:
    """`PER_CLASS` JPEGs per class in `<root>/train/<wnid>/`; class c draws Shapes pictures
    of its own seed, so the classes differ."""
    for c, wnid in enumerate(WNIDS):
        folder = root / "train" / wnid
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(PER_CLASS):
            picture = Image.fromarray(render_shapes_image(100 + c, i, size=32, supersample=2))
            picture.resize(SIZES[i % len(SIZES)], Image.BICUBIC).save(
                folder / f"{wnid}_{1000 + i}.JPEG", quality=90)


def write_celeba(root: Path) -> None:
    """CelebA's layout: aligned 178 x 218 JPEGs and list_eval_partition.txt (every fourth
    image in val or test, the rest in train)."""
    folder = root / "img_align_celeba"
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(CELEBA_IMAGES):
        name = f"{i + 1:06d}.jpg"
        picture = Image.fromarray(render_shapes_image(7, i, size=32, supersample=2))
        picture.resize((178, 218), Image.BICUBIC).save(folder / name, quality=90)
        lines.append(f"{name} {(i // 4) % 2 + 1 if i % 4 == 3 else 0}")
    (root / "list_eval_partition.txt").write_text("\n".join(lines) + "\n")


def tiny_vae(seed: int = 0) -> AutoencoderKL:
    """A random diffusers AutoencoderKL in Stable Diffusion's layout (4 blocks: f8, 4 latent
    channels) with tiny widths, in eval mode: (B, 3, 64, 64) -> moments (B, 8, 8, 8). The
    smoke runs' autoencoder, and the tests'."""
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=4,
        sample_size=SMOKE_RESOLUTION,
    ).eval()


def extract_latents(folder: Path, repa_encoder: Path | None = None) -> None:
    """The latents of <folder>/imagenet's train split, encoded with <folder>/vae at
    SMOKE_RESOLUTION, into <folder>/imagenet_features (with `repa_encoder`'s features):
    what `uvic-extract-imagenet` writes."""
    from uvic.data.imagenet_extraction import extract_features, list_splits
    from uvic.models.autoencoder import load_vae
    from uvic.models.repa_encoder import load_encoder

    repa = None if repa_encoder is None else load_encoder(str(repa_encoder), "",
                                                          SMOKE_RESOLUTION // 16)
    extract_features(list_splits(folder / "imagenet", ["train"]),
                     folder / "imagenet_features", load_vae(str(folder / "vae")),
                     vae_name=str(folder / "vae"), resolution=SMOKE_RESOLUTION,
                     batch_size=8, chunk_size=8, num_workers=0, skip_corrupt=False,
                     progress=False, repa=repa, repa_name=str(repa_encoder or ""))


def write_smoke_data(folder: Path) -> None:
    """All of the smoke data in `folder` (skipped when a previous run completed it)."""
    done = folder / ".complete"
    if done.is_file():
        return
    write_imagenet(folder / "imagenet")
    write_celeba(folder / "celeba")
    tiny_vae().save_pretrained(folder / "vae")
    extract_latents(folder)
    done.touch()


# A DINOv2 ViT of timm's real class, shrunk: one block of width 32, patch 14 (no download).
TINY_REPA_ARGS = {"depth": 1, "embed_dim": 32, "num_heads": 2, "img_size": 56}


def tiny_repa_encoder(folder: Path, seed: int = 0) -> Path:
    """A randomly initialised `vit_small_patch14_dinov2` (timm's DINOv2 class, shrunk by
    TINY_REPA_ARGS) saved in timm's hub layout (config.json + model.safetensors): a folder
    `train.repa_encoder` and `--repa-encoder` name."""
    import timm
    import torch
    from timm.models import save_for_hf

    torch.manual_seed(seed)
    model = timm.create_model("vit_small_patch14_dinov2", pretrained=False, **TINY_REPA_ARGS)
    save_for_hf(model, str(folder), model_args=TINY_REPA_ARGS, safe_serialization=True)
    return folder


def write_recipes_smoke_data(folder: Path) -> None:
    """The modern-recipe smoke's data in `folder` (skipped when a previous run completed
    it): ImageNet class folders, the tiny VAE and REPA encoder, and latents extracted with
    the encoder's features on the 4 x 4 token grid of 8 x 8 latents in 2 x 2 patches."""
    done = folder / ".complete"
    if done.is_file():
        return
    write_imagenet(folder / "imagenet")
    tiny_vae().save_pretrained(folder / "vae")
    tiny_repa_encoder(folder / "repa_encoder")
    extract_latents(folder, folder / "repa_encoder")
    done.touch()
