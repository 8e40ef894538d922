"""Improved precision and recall (Kynkaanniemi et al. 2019) of generated against real feature
sets: each set covers the union of balls around its points, reaching each point's k-th
nearest neighbour in its own set; precision is the share of generated points inside the
real set's balls, recall the share of real points inside the generated set's.

Squared distances (float64 by default) are computed in blocks under `max_bytes`, so 50,000
x 50,000 points never need the full matrix, and compared squared.
"""

from __future__ import annotations

import numpy as np
import torch

MAX_BYTES = 1 << 28  # one block of the distance matrix: 256 MiB


def _sq_dists(a: torch.Tensor, b: torch.Tensor, b_sq: torch.Tensor) -> torch.Tensor:
    """Squared Euclidean distances (len(a), len(b)); `b_sq` is b's squared norms."""
    a_sq = (a * a).sum(1, keepdim=True)
    return (a_sq + b_sq[None, :] - 2.0 * (a @ b.T)).clamp_min_(0)


def _rows(n_cols: int, dtype: torch.dtype, max_bytes: int) -> int:
    """Rows per block so that a (rows, n_cols) matrix of `dtype` fits `max_bytes`."""
    itemsize = torch.finfo(dtype).bits // 8
    return max(1, max_bytes // (max(1, n_cols) * itemsize))


def knn_radii(feats: torch.Tensor, k: int, max_bytes: int = MAX_BYTES) -> torch.Tensor:
    """Squared distance from each point to its k-th nearest other point in `feats`
    (the (k+1)-th smallest of its row, the point itself being the first)."""
    n = len(feats)
    if not 1 <= k < n:
        raise ValueError(f"precision/recall: k={k} needs more than k points, got {n}")
    sq = (feats * feats).sum(1)
    step = _rows(n, feats.dtype, max_bytes)
    out = [_sq_dists(feats[i:i + step], feats, sq).kthvalue(k + 1, dim=1).values
           for i in range(0, n, step)]
    return torch.cat(out)


def coverage(points: torch.Tensor, radii: torch.Tensor, queries: torch.Tensor,
             max_bytes: int = MAX_BYTES) -> float:
    """Fraction of `queries` inside at least one ball (centre `points`, squared radius
    `radii`), boundary included."""
    sq = (points * points).sum(1)
    square = int(_rows(1, points.dtype, max_bytes) ** 0.5)  # a square block's side
    cols = max(1, min(len(points), square))
    rows = _rows(cols, points.dtype, max_bytes)
    inside = 0
    for i in range(0, len(queries), rows):
        q = queries[i:i + rows]
        hit = torch.zeros(len(q), dtype=torch.bool, device=q.device)
        for j in range(0, len(points), cols):
            d = _sq_dists(q, points[j:j + cols], sq[j:j + cols])
            hit |= (d <= radii[None, j:j + cols]).any(1)
        inside += int(hit.sum())
    return inside / len(queries)


def precision_recall(real: np.ndarray, fake: np.ndarray, k: int = 3, *,
                     device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64,
                     max_bytes: int = MAX_BYTES) -> tuple[float, float]:
    """(precision, recall) of generated features `fake` (N, F) against real ones `real`
    (M, F), with k-NN radii of each set in its own features."""
    real_t = torch.as_tensor(np.asarray(real), device=device).to(dtype)
    fake_t = torch.as_tensor(np.asarray(fake), device=device).to(dtype)
    if real_t.ndim != 2 or fake_t.ndim != 2 or real_t.shape[1] != fake_t.shape[1]:
        raise ValueError(f"precision/recall: features of shapes {tuple(real_t.shape)} and "
                         f"{tuple(fake_t.shape)} do not match")
    precision = coverage(real_t, knn_radii(real_t, k, max_bytes), fake_t, max_bytes)
    recall = coverage(fake_t, knn_radii(fake_t, k, max_bytes), real_t, max_bytes)
    return precision, recall
