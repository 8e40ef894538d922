"""Images to files: PNGs written atomically, grids with captions or row labels, and
side-by-side comparisons of several models sampled from the same noise.

Grids can be enlarged (`upscale`: nearest neighbour, every pixel an N x N block, text
drawn at the enlarged size); `grid_upscale` picks the smallest factor that makes a grid
at least MIN_GRID_WIDTH pixels wide, `uvic-sample`'s default."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image, ImageDraw, ImageFont
from torchvision.utils import make_grid

from uvic.files import atomic_write

MIN_GRID_WIDTH = 512  # pixels: the width `grid_upscale` reaches
PADDING = 2  # pixels between the images of a grid (make_grid's padding)
PANEL_GAP = 8  # pixels between the grids of a comparison


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """[0, 1] float images -> uint8 (N, H, W, C) on the CPU (rounded like save_image)."""
    pixels = (images.detach().float().cpu() * 255.0 + 0.5).clamp(0, 255).to(torch.uint8)
    return pixels.permute(0, 2, 3, 1)


def save_images(images: torch.Tensor, folder: str | Path, indices: Sequence[int]) -> list[Path]:
    """Write images [0, 1] (N, 3, H, W) as `folder/{index:06d}.png`, each atomically
    (`uvic.files.atomic_write`) so an interrupted run never leaves a broken PNG."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for array, index in zip(to_uint8(images).numpy(), indices):
        path = folder / f"{int(index):06d}.png"
        with atomic_write(path) as tmp:
            Image.fromarray(array).save(tmp, format="PNG")
        paths.append(path)
    return paths


def _font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: fixed-size bitmap font
        return ImageFont.load_default()


def _text_band(texts: list[tuple[int, int, str]], width: int, font_size: int) -> Image.Image:
    """A white band of `width` holding each (x, w, text), wrapped to its w pixels."""
    font = _font(font_size)
    line_h = font_size + 3
    char_w = max(1.0, font.getlength("abcdefghijklmnopqrstuvwxyz") / 26)
    wrapped = [
        (x, textwrap.wrap(text, max(1, int((w - 4) / char_w))) or [""]) for x, w, text in texts
    ]
    n_lines = max(len(lines) for _, lines in wrapped)
    band = Image.new("RGB", (width, n_lines * line_h + 4), "white")
    draw = ImageDraw.Draw(band)
    for x, lines in wrapped:
        for j, line in enumerate(lines):
            draw.text((x + 2, 2 + j * line_h), line, fill="black", font=font)
    return band


def _stack_vertical(parts: list[Image.Image]) -> Image.Image:
    width = max(p.width for p in parts)
    out = Image.new("RGB", (width, sum(p.height for p in parts)), "white")
    y = 0
    for p in parts:
        out.paste(p, (0, y))
        y += p.height
    return out


def upscale_images(images: torch.Tensor, factor: int) -> torch.Tensor:
    """Images (N, C, H, W) enlarged `factor` times by nearest neighbour (N, C, fH, fW)."""
    if factor < 1:
        raise ValueError(f"upscale factor must be >= 1, got {factor}")
    if factor == 1:
        return images
    return images.repeat_interleave(factor, dim=-2).repeat_interleave(factor, dim=-1)


def grid_upscale(n: int, width: int, nrow: int | None = None, panels: int = 1,
                 min_width: int = MIN_GRID_WIDTH) -> int:
    """The smallest factor >= 1 at which `panels` grids side by side (a comparison; 1: a
    grid) of `n` images `width` pixels wide, `nrow` per row, are >= `min_width` wide."""
    cols = min(nrow or math.ceil(math.sqrt(n)), n)
    fixed = panels * (cols + 1) * PADDING + (panels - 1) * PANEL_GAP
    return max(1, math.ceil((min_width - fixed) / (panels * cols * width)))


def _factor(upscale: int | None, n: int, width: int, nrow: int | None, panels: int) -> int:
    return grid_upscale(n, width, nrow, panels) if upscale is None else upscale


def grid_image(
    images: torch.Tensor,
    nrow: int | None = None,
    captions: list[str] | None = None,
    labels: list[str] | None = None,
    padding: int = PADDING,
) -> Image.Image:
    """A PIL grid of images [0, 1] (N, 3, H, W): torchvision's make_grid, plus text.

    captions: 1 (written under the whole grid), one per row (under each row) or one per
    image (under each image). labels: one per row, written in a column on the left.
    Without text the result is exactly make_grid's image.
    """
    if images.dim() != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"images must be (N, 3, H, W), got {tuple(images.shape)}")
    n, _, h, w = images.shape
    nrow = nrow or math.ceil(math.sqrt(n))
    rows = math.ceil(n / nrow)
    grid = make_grid(images.float().clamp(0, 1).cpu(), nrow=nrow, padding=padding, pad_value=1.0)
    if n == 1 and (captions or labels):  # make_grid gives a lone image unpadded: pad for text
        grid = torch.nn.functional.pad(grid, (padding,) * 4, value=1.0)
    img = Image.fromarray(to_uint8(grid[None])[0].numpy())
    font_size = max(10, min(16, w // 8))
    cell = w + padding

    if captions:
        if len(captions) not in (1, rows, n):
            raise ValueError(
                f"captions: need 1, {rows} (rows) or {n} (images), got {len(captions)}"
            )
        per_image, per_row = len(captions) == n, len(captions) == rows
        parts = []
        for r in range(rows):
            y0 = r * (h + padding)
            parts.append(img.crop((0, y0, img.width, y0 + h + padding)))  # top padding + row
            if per_image:
                cols = range(r * nrow, min(n, (r + 1) * nrow))
                texts = [((i - r * nrow) * cell, cell, captions[i]) for i in cols]
                parts.append(_text_band(texts, img.width, font_size))
            elif per_row:
                parts.append(_text_band([(0, img.width, captions[r])], img.width, font_size))
        parts.append(img.crop((0, rows * (h + padding), img.width, img.height)))  # bottom pad
        if not (per_image or per_row):
            parts.append(_text_band([(0, img.width, captions[0])], img.width, font_size))
        img = _stack_vertical(parts)
        row_height = None  # rows are no longer evenly spaced
    else:
        row_height = h + padding

    if labels:
        if len(labels) != rows:
            raise ValueError(f"labels: need one per row ({rows}), got {len(labels)}")
        if row_height is None:
            raise ValueError("labels and captions together are not supported; pick one")
        font = _font(font_size)
        label_w = int(max(font.getlength(t) for t in labels)) + 8
        out = Image.new("RGB", (img.width + label_w, img.height), "white")
        out.paste(img, (label_w, 0))
        draw = ImageDraw.Draw(out)
        for r, text in enumerate(labels):
            y = padding + r * row_height + (h - font_size) // 2
            draw.text((4, y), text, fill="black", font=font)
        img = out
    return img


def save_grid(
    images: torch.Tensor,
    path: str | Path,
    nrow: int | None = None,
    captions: list[str] | None = None,
    labels: list[str] | None = None,
    upscale: int | None = 1,
) -> Path:
    """Write `grid_image(images, nrow, captions, labels)` as a PNG; returns the path.

    upscale: enlarge the images that many times (nearest neighbour); None: the smallest
    factor that makes the grid at least MIN_GRID_WIDTH wide (`grid_upscale`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    factor = _factor(upscale, images.shape[0], images.shape[-1], nrow, panels=1)
    grid_image(upscale_images(images, factor), nrow=nrow, captions=captions,
               labels=labels).save(path)
    return path


def save_comparison_grid(
    named_grids: dict[str, torch.Tensor],
    path: str | Path,
    nrow: int | None = None,
    captions: list[str] | None = None,
    upscale: int | None = 1,
) -> Path:
    """Side-by-side grids, one per name (e.g. {"U-ViT": imgs, "U-ViC": imgs} sampled from
    the same noise), each headed by its name; optional captions under each grid.
    upscale: as `save_grid`'s (None: the whole comparison at least MIN_GRID_WIDTH wide)."""
    if not named_grids:
        raise ValueError("save_comparison_grid needs at least one named grid")
    first = next(iter(named_grids.values()))
    factor = _factor(upscale, first.shape[0], first.shape[-1], nrow, panels=len(named_grids))
    panels = []
    for name, images in named_grids.items():
        images = upscale_images(images, factor)
        grid = grid_image(images, nrow=nrow, captions=captions)
        size = max(10, min(18, images.shape[-1] // 6))
        header = _text_band([(0, grid.width, name)], grid.width, size)
        panels.append(_stack_vertical([header, grid]))
    gap = PANEL_GAP
    width = sum(p.width for p in panels) + gap * (len(panels) - 1)
    out = Image.new("RGB", (width, max(p.height for p in panels)), "white")
    x = 0
    for p in panels:
        out.paste(p, (x, 0))
        x += p.width + gap
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    out.save(path)
    return path


