"""Plain PyTorch reference formulas for softmax, Cog, expressive and sigmoid attention
(test oracles).

All five functions take (..., N, D) tensors, build the full N x N score matrix
and are differentiated by autograd; run them in float64 to check the kernels.

Cog attention has two published forms (Lv et al., eq. 3 and Figure 3) that agree
everywhere except at scores that are exactly zero:

* ``cog_attention_eq3`` is eq. 3 literally::

      SignExp(p) = sign(p) * exp(sign(p) * p - max|p|)
      phi(p)_j   = SignExp(p_j) / sum_k |SignExp(p_k)|

  A zero score has ``SignExp(0) = sign(0) * ... = 0``: it gets weight 0 **and adds
  nothing to the denominator**.

* ``cog_attention_reference`` is the "faster" form, ``sign(p) * softmax(|p|)``: a
  zero score still gets weight 0 (``sign(0) = 0``), but ``exp(|0| - max|p|)`` **is
  counted in the denominator**.

For a row without exact zeros ``|SignExp(p)| = exp(|p| - max|p|)`` and the two are
equal.  The fused kernels implement the second form (the one the paper's code and
``docs/cog_attention.md`` define); the difference only shows on exact ties at 0, e.g. an
all-zero query row or key.
"""

from __future__ import annotations

import math

import torch


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float | None) -> torch.Tensor:
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return scale * (q @ k.transpose(-2, -1))


def softmax_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """``softmax(scale * q k^T) v`` (scale defaults to ``D ** -0.5``)."""
    return torch.softmax(_scores(q, k, scale), dim=-1) @ v


def cog_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Cog attention as ``sign(S) * softmax(|S|) @ v`` (the paper's Figure 3, faster form).

    A score of exactly 0 gets weight 0 but still counts ``exp(-max|S|)`` in the
    denominator; this is the definition the fused kernels follow.
    """
    s = _scores(q, k, scale)
    return (torch.sign(s) * torch.softmax(s.abs(), dim=-1)) @ v


def cog_attention_eq3(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Cog attention as the literal eq. 3: ``SignExp(S) / sum |SignExp(S)|``.

    ``SignExp(p) = sign(p) * exp(sign(p) * p - max|p|)``.  A score of exactly 0 gives
    ``SignExp(0) = 0``, which adds nothing to the denominator, so rows with exact
    zeros differ from :func:`cog_attention_reference`; elsewhere the two are equal.
    A row whose scores are all exactly 0 gives 0 / 0 = NaN here.
    """
    s = _scores(q, k, scale)
    sign = torch.sign(s)
    max_abs = s.abs().amax(dim=-1, keepdim=True)
    e = sign * torch.exp(sign * s - max_abs)
    return (e / e.abs().sum(dim=-1, keepdim=True)) @ v


def expressive_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Expressive attention: ``A = E / rowsum(E)`` with ``E = S^2 / (1 + S^2)``, then ``A v``.

    Parallel and antiparallel query-key pairs (large ``|S|``) both attract attention,
    orthogonal ones (``S = 0``) none; every weight is >= 0.  A row whose scores are all
    exactly 0 has ``rowsum(E) = 0``: its weights are defined as 0 (output 0, and, since
    ``dE/dS = 0`` at ``S = 0``, gradient 0), not 0 / 0.
    """
    s = _scores(q, k, scale)
    e = s * s / (1 + s * s)
    n = e.sum(dim=-1, keepdim=True)
    return torch.where(n > 0, e / torch.where(n > 0, n, torch.ones_like(n)), 0.0) @ v


def sigmoid_bias_default(n_kv: int) -> float:
    """Sigmoid attention's default bias, ``-log(N)`` for ``N`` keys: at initialisation
    (scores near 0) every weight is about ``1 / (1 + N)``, so a row sums to about 1."""
    return -math.log(n_kv)


def sigmoid_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    bias: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Sigmoid attention without normalisation: ``sigmoid(S + b) @ v``.

    Seed 002 (Table 15; Ramapuram et al. 2024).  Every weight lies in (0, 1) and no row
    is normalised.  ``bias`` defaults to ``-log(N)`` (N keys); a tensor is one bias per
    head (shape (H,), broadcast over batch, queries and keys) or a single value (shape
    () or (1,)), and gets its gradient from autograd.
    """
    s = _scores(q, k, scale)
    if bias is None:
        bias = sigmoid_bias_default(k.shape[-2])
    if isinstance(bias, torch.Tensor):
        bias = bias.to(s.dtype).reshape(-1, 1, 1)  # (H, 1, 1) or (1, 1, 1)
    return torch.sigmoid(s + bias) @ v
