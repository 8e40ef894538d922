"""Plain PyTorch reference formulas for softmax, Cog, expressive and sigmoid attention: the
kernels' test oracles.

Every function takes (..., N, D) tensors, forms the full N x N scores and is differentiated
by autograd; run them in float64 to check the kernels. ``attention_weights`` gives a mode's
weights ``A`` (optionally causal), each ``<mode>_attention_reference`` is ``A @ v``. Cog's
two published forms differ only at exact zero scores: ``cog_attention_reference`` (the
kernels' form) and ``cog_attention_eq3``.
"""

from __future__ import annotations

import math

import torch


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float | None) -> torch.Tensor:
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return scale * (q @ k.transpose(-2, -1))


def sigmoid_bias_default(n_kv: int) -> float:
    """Sigmoid attention's default bias, ``-log(N)`` for ``N`` keys: at initialisation
    (scores near 0) every weight is about ``1 / (1 + N)``, so a row sums to about 1."""
    return -math.log(n_kv)


def _masked(x: torch.Tensor, keep: torch.Tensor | None, fill: float) -> torch.Tensor:
    return x if keep is None else x.masked_fill(~keep, fill)


def attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    mode: str,
    scale: float | None = None,
    bias: float | torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """The attention weights ``A`` (..., Nq, Nk) of ``mode``: each ``<mode>_attention_reference``
    below is ``A @ v``.

    ``causal``: query i sees keys 0..i only (Nq == Nk). A masked key gets weight exactly 0
    and no share of a normalised row's denominator, so each row is the mode's formula
    over the keys it sees; sigmoid attention's default bias is then ``-log(i + 1)`` for
    row i (its own key count). ``bias``: sigmoid attention's (see
    :func:`sigmoid_attention_reference`); other modes take none.
    """
    s = _scores(q, k, scale)
    n_q, n_k = s.shape[-2:]
    keep = None
    if causal:
        if n_q != n_k:
            raise ValueError(f"causal attention needs as many keys as queries, got {n_k} "
                             f"and {n_q}")
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).tril()
    if bias is not None and mode != "sigmoid":
        raise ValueError(f"only sigmoid attention takes a bias, not {mode!r}")
    if mode == "softmax":
        return torch.softmax(_masked(s, keep, -math.inf), dim=-1)
    if mode == "cog":
        # sign(S) * softmax(|S|): a masked key's sign is finite and its softmax share 0
        return torch.sign(s) * torch.softmax(_masked(s.abs(), keep, -math.inf), dim=-1)
    if mode == "expressive":
        e = _masked(s * s / (1 + s * s), keep, 0.0)
        n = e.sum(dim=-1, keepdim=True)
        return torch.where(n > 0, e / torch.where(n > 0, n, torch.ones_like(n)), 0.0)
    if mode == "sigmoid":
        if bias is None and causal:  # row i sees i + 1 keys
            bias = -torch.arange(1, n_q + 1, dtype=s.dtype, device=s.device).log().unsqueeze(-1)
        elif bias is None:
            bias = sigmoid_bias_default(n_k)
        elif isinstance(bias, torch.Tensor):
            bias = bias.to(s.dtype).reshape(-1, 1, 1)  # (H, 1, 1) or (1, 1, 1)
        return _masked(torch.sigmoid(s + bias), keep, 0.0)
    raise ValueError(f"unknown attention mode {mode!r}; known: softmax, cog, expressive, "
                     "sigmoid")


def softmax_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """``softmax(scale * q k^T) v`` (scale defaults to ``D ** -0.5``)."""
    return attention_weights(q, k, "softmax", scale) @ v


def cog_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Cog attention as ``sign(S) * softmax(|S|) @ v`` (the paper's Figure 3, faster form).

    A score of exactly 0 gets weight 0 but still counts ``exp(-max|S|)`` in the
    denominator; this is the definition the fused kernels follow.
    """
    return attention_weights(q, k, "cog", scale) @ v


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
    return attention_weights(q, k, "expressive", scale) @ v


def sigmoid_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    bias: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Sigmoid attention without normalisation: ``sigmoid(S + b) @ v``.

    Ramapuram et al. (2024); Gu et al. (2024), Table 15.  Every weight lies in (0, 1)
    and no row is normalised.  ``bias`` defaults to ``-log(N)`` (N keys); a tensor is one
    bias per head (shape (H,), broadcast over batch, queries and keys) or a single value
    (shape () or (1,)), and gets its gradient from autograd.
    """
    return attention_weights(q, k, "sigmoid", scale, bias) @ v


def lambda_init_at(layer: int) -> float:
    """Differential attention's lambda_init in block ``layer`` (1-based):
    ``0.8 - 0.6 exp(-0.3 (l - 1))`` (Ye et al., ICLR 2025)."""
    return 0.8 - 0.6 * math.exp(-0.3 * (layer - 1))


def differential_attention_reference(
    q1: torch.Tensor,
    k1: torch.Tensor,
    q2: torch.Tensor,
    k2: torch.Tensor,
    v: torch.Tensor,
    lam: float | torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """``(softmax(S1) - lam * softmax(S2)) @ v`` with ``S_i = scale * q_i k_i^T``: differential
    attention's two maps (Ye et al., ICLR 2025) before its per-head norm; v may be wider."""
    a1 = attention_weights(q1, k1, "softmax", scale)
    return (a1 - lam * attention_weights(q2, k2, "softmax", scale)) @ v


def differential_v2_attention_reference(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lam: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """``(softmax(S1) - lam * softmax(S2)) @ v`` with ``S_i = scale * q_i k^T``: the second
    version of differential attention (the authors' public code), two query maps per head
    sharing k and v, ``lam`` (B, H, Nq) one weight per query token and head (a sigmoid)."""
    a1 = attention_weights(q1, k, "softmax", scale)
    return (a1 - lam.unsqueeze(-1) * attention_weights(q2, k, "softmax", scale)) @ v
