"""PyTorch implementation of the fused attention algorithm (CPU fallback).

Same interface and the same maths as :mod:`uvic_kernels.triton_attention`: the
forward returns ``O`` and the fp32 row log-sum-exp, the backward recomputes the
weights from the LSE.  Work runs over chunks of query rows, so at most
``CHUNK_ELEMENTS`` score entries (per chunk, over all heads) are alive at once,
and nothing of size N x N is kept for the backward.  Computation is in fp32
(autocast disabled); results are returned in the input dtype.
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 24  # score entries per query chunk (64 MiB in fp32)


def _chunk_rows(q: torch.Tensor, n_kv: int) -> int:
    """Query rows per chunk so that a chunk holds about CHUNK_ELEMENTS scores."""
    batch_heads = max(1, q.shape[0] * q.shape[1])
    return max(1, CHUNK_ELEMENTS // max(1, batch_heads * n_kv))


def _weights(
    qc: torch.Tensor, k: torch.Tensor, lse: torch.Tensor | None, cog: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Return ``(P, sign(S) or None, LSE)`` for one chunk of query rows, in fp32.

    Without ``lse`` (forward), P is normalised by its row sum, as in the kernel's
    epilogue; with ``lse`` (backward), P is recomputed as ``exp(t - lse)``.
    """
    s = (qc @ k.transpose(-2, -1)) * scale
    t = s.abs() if cog else s
    if lse is None:
        m = t.amax(dim=-1, keepdim=True)
        p = torch.exp(t - m)
        l = p.sum(dim=-1, keepdim=True)
        p = p / l
        lse = (m + torch.log(l)).squeeze(-1)
    else:
        p = torch.exp(t - lse.unsqueeze(-1))
    return p, (torch.sign(s) if cog else None), lse


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cog: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(O, LSE)`` as :func:`uvic_kernels.triton_attention.forward` does."""
    with torch.autocast(q.device.type, enabled=False):
        qf, kf, vf = q.float(), k.float(), v.float()
        o = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        step = _chunk_rows(q, k.shape[2])
        for start in range(0, q.shape[2], step):
            rows = slice(start, start + step)
            p, sign, lse_c = _weights(qf[..., rows, :], kf, None, cog, scale)
            a = p * sign if cog else p
            o[..., rows, :] = a @ vf
            lse[..., rows] = lse_c
    return o.to(q.dtype), lse


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    cog: bool,
    scale: float,
    need_dq: bool = True,
    need_dkdv: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Return ``(dQ, dK, dV)`` (None where not needed), in the input dtype."""
    with torch.autocast(q.device.type, enabled=False):
        qf, kf, vf, dof = q.float(), k.float(), v.float(), do.float()
        delta = (dof * o.float()).sum(-1)
        dq = torch.empty_like(qf) if need_dq else None
        dk = torch.zeros_like(kf) if need_dkdv else None
        dv = torch.zeros_like(vf) if need_dkdv else None
        step = _chunk_rows(q, k.shape[2])
        for start in range(0, q.shape[2], step):
            rows = slice(start, start + step)
            qc, doc = qf[..., rows, :], dof[..., rows, :]
            p, sign, _ = _weights(qc, kf, lse[..., rows], cog, scale)
            da = doc @ vf.transpose(-2, -1)  # dA = dO V^T
            if cog:
                # unsimplified: exactly 0 where S == 0, as autograd is
                ds = sign * p * (sign * da - delta[..., rows].unsqueeze(-1))
            else:
                ds = p * (da - delta[..., rows].unsqueeze(-1))
            if need_dkdv:
                dv += (p * sign if cog else p).transpose(-2, -1) @ doc
                dk += scale * (ds.transpose(-2, -1) @ qc)
            if need_dq:
                dq[..., rows, :] = scale * (ds @ kf)
    return tuple(None if g is None else g.to(q.dtype) for g in (dq, dk, dv))
