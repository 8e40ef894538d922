"""Attention metrics on explicit attention weights ``A`` (..., Nq, N), one value per query row
(the analysis averages them over images and queries to one value per head).

To treat every mode alike (softmax rows sum to 1, Cog rows' absolute values sum to 1,
sigmoid rows to anything in (0, N)), the metrics look at |A| normalised per row and, apart
from that, at the signs; `key_weight` and `row_sum` read the weights themselves. A row of
zeros counts as no attention: shares 0, entropy 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

_TINY = 1e-30  # guards divisions by a zero row sum


def abs_shares(a: Tensor) -> Tensor:
    """|A| / sum_row |A|: (..., Nq, N) -> (..., Nq, N), each non-zero row sums to 1."""
    mag = a.abs()
    return mag / mag.sum(dim=-1, keepdim=True).clamp_min(_TINY)


def negative_mass(a: Tensor) -> Tensor:
    """Share of a row's sum |A| carried by negative weights: (..., Nq, N) -> (..., Nq).

    0 for softmax; for Cog, 0.5 means the row subtracts as much as it adds.
    """
    mag = a.abs()
    negative = torch.where(a < 0, mag, torch.zeros_like(mag)).sum(dim=-1)
    return negative / mag.sum(dim=-1).clamp_min(_TINY)


def negative_fraction(a: Tensor) -> Tensor:
    """Share of a row's entries that are negative: (..., Nq, N) -> (..., Nq)."""
    return (a < 0).to(a.dtype).mean(dim=-1)


def entropy(a: Tensor) -> Tensor:
    """Entropy (nats) of each row of |A| normalised to sum 1: (..., Nq, N) -> (..., Nq).

    log N for a uniform row, 0 for a one-hot row; 0 log 0 counts as 0.
    """
    p = abs_shares(a)
    return -torch.xlogy(p, p).sum(dim=-1)


def effective_tokens(a: Tensor) -> Tensor:
    """exp(entropy): how many keys a row attends to "in effect" (N uniform, 1 one-hot)."""
    return entropy(a).exp()


def key_share(a: Tensor, keys: slice | int) -> Tensor:
    """Share of each row's |A| that falls on `keys` (an index or a slice): -> (..., Nq).

    E.g. the weight on the time token, or the summed weight on the text tokens.
    """
    p = abs_shares(a)
    if isinstance(keys, int):
        return p[..., keys]
    return p[..., keys].sum(dim=-1)


def key_weight(a: Tensor, keys: slice | int) -> Tensor:
    """|A| on `keys` (an index or a slice, summed): -> (..., Nq). Equal to `key_share` for
    rows whose |A| sums to 1; for sigmoid attention (no normalisation) the weight the
    keys' values get, Gu et al.'s (2024) measure of a sink."""
    mag = a.abs()
    if isinstance(keys, int):
        return mag[..., keys]
    return mag[..., keys].sum(dim=-1)


def row_sum(a: Tensor) -> Tensor:
    """sum_j |A_ij|: (..., Nq, N) -> (..., Nq). 1 for softmax, Cog and expressive rows (0
    for an all-zero expressive row); for sigmoid attention, how much the row adds up."""
    return a.abs().sum(dim=-1)


def sink_share(first_token_weight: Tensor, threshold: float = 0.3) -> float:
    """Share of heads whose mean weight on the first token exceeds `threshold`.

    `first_token_weight` is (h,) (or any shape: one entry per head). A head counts as an
    attention sink when, averaged over the queries, more than `threshold` of its
    attention goes to the first token, as in the attention-sink literature (0.3 there).
    For sigmoid attention the weight is the first token's weight itself (`key_weight`),
    as Gu et al. 2024 measures it: a sink there is a key every query takes a large part of.
    """
    return float((first_token_weight > threshold).to(torch.float64).mean())


def mean_pairwise_cosine(tokens: Tensor) -> Tensor:
    """Mean cosine similarity over all pairs of distinct tokens: (B, L, D) -> (B,).

    Measures representational collapse: 1 when all tokens point the same way, about 0
    for unrelated tokens. Needs L >= 2.
    """
    if tokens.dim() != 3 or tokens.shape[1] < 2:
        raise ValueError(f"expected tokens (B, L >= 2, D), got {tuple(tokens.shape)}")
    unit = torch.nn.functional.normalize(tokens.to(torch.float64), dim=-1)
    length = tokens.shape[1]
    summed = unit.sum(dim=1)  # sum_ij <u_i, u_j> = |sum_i u_i|^2
    total = (summed * summed).sum(dim=-1)
    diagonal = (unit * unit).sum(dim=(1, 2))  # 1 per non-zero token
    return ((total - diagonal) / (length * (length - 1))).to(tokens.dtype)
