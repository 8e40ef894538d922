"""Download-free sample-quality figures for the Shapes quickstart, deterministic functions of
the images that tell a clean sample of coloured shapes from a noisy one: `hf_energy` (mean
absolute Laplacian, compared with real images as a ratio, 1 ideal), `palette_share` (pixels
on one of their image's dominant colours; noise scores near 0) and `shape_share` (images
that hold a shape at all; a plain background, an undertrained model's commonest failure,
scores 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_LAPLACIAN = torch.tensor([[0.0, 1.0, 0.0], [1.0, -4.0, 1.0], [0.0, 1.0, 0.0]])


# The colour figures' settings (RGB distances in [0, 1] units): k dominant colours per
# image, a pixel is "on" a colour within RADIUS of it, and a shape covers at least
# MIN_AREA of the image in a colour at least CONTRAST from the background.
K, RADIUS, MIN_AREA, CONTRAST = 3, 0.1, 0.02, 0.25


def _check_images(images: torch.Tensor) -> torch.Tensor:
    if images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"expected images (N, 3, H, W) in [0, 1], got {tuple(images.shape)}")
    return images.detach().to("cpu", torch.float64)


def hf_energy(images: torch.Tensor) -> float:
    """Mean |Laplacian| of images (N, 3, H, W) in [0, 1]: their high-frequency energy."""
    x = _check_images(images)
    kernel = _LAPLACIAN.to(x).expand(3, 1, 3, 3)
    return F.conv2d(x, kernel, groups=3).abs().mean().item()


def dominant_colours(images: torch.Tensor, k: int = K, iters: int = 10) -> torch.Tensor:
    """k dominant colours of each image (N, k, 3): k-means on its pixels, started from
    farthest-point seeds (the first is the top-left pixel, usually background)."""
    x = _check_images(images)
    pixels = x.flatten(2).transpose(1, 2)  # (N, P, 3)
    centres = [pixels[:, 0]]
    for _ in range(k - 1):  # farthest point from the centres so far
        dist = torch.stack([(pixels - c[:, None]).norm(dim=-1) for c in centres]).amin(0)
        centres.append(pixels[torch.arange(len(pixels)), dist.argmax(1)])
    centre = torch.stack(centres, 1)  # (N, k, 3)
    for _ in range(iters):
        assign = torch.cdist(pixels, centre).argmin(-1)  # (N, P)
        onehot = F.one_hot(assign, k).to(pixels)  # (N, P, k)
        count = onehot.sum(1)[..., None]  # (N, k, 1)
        mean = onehot.transpose(1, 2) @ pixels / count.clamp(min=1)
        centre = torch.where(count > 0, mean, centre)  # an empty cluster keeps its centre
    return centre


def _fit_colours(images: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each image's k dominant colours (N, k, 3) and every pixel's distance to them (N, P, k)."""
    x = _check_images(images)
    pixels = x.flatten(2).transpose(1, 2)  # (N, P, 3)
    centres = dominant_colours(x, k)
    return centres, torch.cdist(pixels, centres)


def _palette_share(distance: torch.Tensor, radius: float) -> float:
    return (distance.amin(-1) <= radius).double().mean().item()


def _shape_share(centres: torch.Tensor, distance: torch.Tensor, radius: float,
                 min_area: float, contrast: float) -> float:
    k = centres.shape[1]
    on_colour = F.one_hot(distance.argmin(-1), k).to(distance)  # (N, P, k)
    on_colour *= (distance.amin(-1) <= radius)[..., None]
    area = on_colour.mean(1)  # (N, k): share of pixels on each colour
    background = centres[torch.arange(len(centres)), area.argmax(1)]  # (N, 3)
    distinct = (centres - background[:, None]).norm(dim=-1) >= contrast  # (N, k)
    has_shape = ((area >= min_area) & distinct).any(1)
    return has_shape.double().mean().item()


def palette_share(images: torch.Tensor, k: int = K, radius: float = RADIUS) -> float:
    """Share of pixels within `radius` of one of their image's k dominant colours."""
    return _palette_share(_fit_colours(images, k)[1], radius)


def shape_share(images: torch.Tensor, k: int = K, radius: float = RADIUS,
                min_area: float = MIN_AREA, contrast: float = CONTRAST) -> float:
    """Share of images with a shape: >= `min_area` of their pixels within `radius` of a
    dominant colour at least `contrast` from the background (their commonest colour)."""
    return _shape_share(*_fit_colours(images, k), radius, min_area, contrast)


def quality_figures(images: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """The quickstart's figures for `images` against real `reference` images, both [0, 1]."""
    hf, hf_ref = hf_energy(images), hf_energy(reference)
    centres, distance = _fit_colours(images, K)  # one k-means for both colour figures
    return {
        "hf_energy": hf,
        "hf_ratio": hf / hf_ref,
        "palette_share": _palette_share(distance, RADIUS),
        "shape_share": _shape_share(centres, distance, RADIUS, MIN_AREA, CONTRAST),
    }
