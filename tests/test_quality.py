"""The quickstart's download-free quality figures tell real Shapes images from noise."""

from __future__ import annotations

import pytest
import torch

from uvic.data.datasets import ShapesDataset
from uvic.evaluation.quality import (
    dominant_colours,
    hf_energy,
    palette_share,
    quality_figures,
    shape_share,
)


def shapes(seed: int, n: int = 64) -> torch.Tensor:
    images = ShapesDataset(n, seed=seed).images  # uint8 (N, H, W, 3)
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0


@pytest.fixture(scope="module")
def real() -> torch.Tensor:
    return shapes(seed=0)


@pytest.fixture(scope="module")
def heldout() -> torch.Tensor:
    return shapes(seed=1)


def noise_images(kind: str, like: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if kind == "uniform":
        return torch.rand(like.shape, generator=g)
    if kind == "gaussian":  # what an untrained sampler leaves: N(0, 1) in [-1, 1], clipped
        return ((torch.randn(like.shape, generator=g) + 1) / 2).clamp(0, 1)
    # real images with per-pixel noise of std 0.1 on top (the quickstart's old symptom)
    return (like + 0.1 * torch.randn(like.shape, generator=g)).clamp(0, 1)


def test_hf_energy_of_held_out_images_matches_training_images(real, heldout) -> None:
    ratio = hf_energy(heldout) / hf_energy(real)
    assert 0.8 < ratio < 1.25


@pytest.mark.parametrize("kind", ["uniform", "gaussian", "noisy_shapes"])
def test_hf_ratio_separates_real_from_noise(real, heldout, kind) -> None:
    noisy = quality_figures(noise_images(kind, heldout), real)
    clean = quality_figures(heldout, real)
    assert clean["hf_ratio"] < 1.5  # the quickstart's target
    assert noisy["hf_ratio"] > 4.0


@pytest.mark.parametrize("kind", ["uniform", "gaussian", "noisy_shapes"])
def test_palette_share_separates_real_from_noise(heldout, kind) -> None:
    assert palette_share(heldout) > 0.9
    assert palette_share(noise_images(kind, heldout)) < 0.3


@pytest.mark.parametrize("kind", ["uniform", "gaussian"])
def test_shape_share_separates_real_from_noise(heldout, kind) -> None:
    assert shape_share(heldout) > 0.95  # every Shapes image has a shape
    assert shape_share(noise_images(kind, heldout)) < 0.1


def test_shape_share_is_zero_for_plain_backgrounds(heldout) -> None:
    """The undertrained model's empty samples: one colour everywhere, slightly noisy."""
    g = torch.Generator().manual_seed(1)
    colour = heldout[:, :, 0, 0]  # (N, 3): each image's top-left pixel
    plain = colour[:, :, None, None].expand_as(heldout).clone()
    plain += 0.02 * torch.randn(plain.shape, generator=g)
    assert shape_share(plain.clamp(0, 1)) == 0.0
    # a 6x6 square of a distinct colour (3.5% of 32x32) is a shape; a single pixel is not
    square, dot = plain.clone(), plain.clone()
    square[:, :, 4:10, 4:10] = 1.0 - colour[:, :, None, None]
    dot[:, :, 5, 5] = 1.0 - colour
    distinct = (1.0 - 2 * colour).norm(dim=1) >= 0.3  # the inverse colour is far enough
    assert distinct.sum() > 30
    assert shape_share(square.clamp(0, 1)[distinct]) == 1.0
    assert shape_share(dot.clamp(0, 1)) == 0.0


def test_hf_energy_is_zero_for_flat_images_and_blur_lowers_it(real) -> None:
    flat = torch.full((2, 3, 16, 16), 0.3)
    assert hf_energy(flat) == 0.0
    blurred = torch.nn.functional.avg_pool2d(real, 3, stride=1, padding=1)
    assert hf_energy(blurred) < 0.9 * hf_energy(real)


def test_dominant_colours_find_the_colours_of_a_two_colour_image() -> None:
    image = torch.zeros(1, 3, 8, 8)
    image[:, 0] = 1.0  # red background
    image[:, :, 2:5, 2:5] = torch.tensor([0.0, 0.0, 1.0])[:, None, None]  # blue square
    colours = dominant_colours(image, k=3)[0]
    for target in ([1.0, 0.0, 0.0], [0.0, 0.0, 1.0]):
        assert (colours - torch.tensor(target)).norm(dim=1).min() < 1e-6
    assert palette_share(image) == 1.0


def test_figures_reject_images_of_the_wrong_shape() -> None:
    with pytest.raises(ValueError, match="N, 3, H, W"):
        hf_energy(torch.zeros(3, 8, 8))
