"""The embeddings of U-ViT's tokens: the patch embedding, the sinusoidal time embedding and
the 2D sine-cosine position code (`model.pos_embed_init="sincos"`).

Split from `uvic.models.uvit`, which imports them (and still offers them by name).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def timestep_embedding(t: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
    """Sinusoidal embedding (B,) -> (B, dim): [cos(t f_i), sin(t f_i)], f_i = P^(-i/half).

    As in the release: cosines first, frequencies f_i = exp(-ln(max_period) i / half) for
    i = 0..half-1, a zero column when dim is odd. Computed in float32 (as the release)
    or in float64 when `t` is float64.
    """
    dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    half = dim // 2
    i = torch.arange(half, dtype=dtype, device=t.device)
    freqs = torch.exp(-math.log(max_period) * i / half)
    args = t.to(dtype)[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb


class PatchEmbed(nn.Module):
    """(B, C, H, W) -> (B, L, D) with a conv of kernel = stride = patch size."""

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


def sincos_pos_embed_2d(grid: int, dim: int) -> Tensor:
    """Fixed 2D sine-cosine position code of a (grid x grid) patch grid: (grid**2, dim).

    Row-major patches, as `PatchEmbed` flattens them. The first dim/2 channels encode the
    column, the last dim/2 the row, each as dim/4 sines then dim/4 cosines of the position
    at frequencies 10000**(-k / (dim/4)), k = 0..dim/4-1 (the MAE/DiT code). Neighbouring
    patches get similar codes from the first step, where a trunc-normal(0.02) init leaves
    the position to be learned (`model.pos_embed_init`).
    """
    quarter = dim // 4
    freqs = 10000.0 ** (-torch.arange(quarter, dtype=torch.float64) / quarter)  # (dim/4,)
    pos = torch.arange(grid, dtype=torch.float64)
    angles = pos[:, None] * freqs[None, :]  # (grid, dim/4)
    code = torch.cat([angles.sin(), angles.cos()], dim=1)  # (grid, dim/2)
    rows = code[:, None, :].expand(grid, grid, dim // 2)  # row index of each patch
    cols = code[None, :, :].expand(grid, grid, dim // 2)  # column index of each patch
    return torch.cat([cols, rows], dim=-1).reshape(grid * grid, dim).to(torch.float32)
