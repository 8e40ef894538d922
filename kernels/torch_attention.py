"""PyTorch implementation of the fused attention algorithm (the CPU fallback), with the
interface and maths of :mod:`uvic_kernels.triton_attention`: the forward returns ``O`` and
an fp32 row statistic, from which the backward recomputes the weights. It works over chunks
of query rows (at most ``CHUNK_ELEMENTS`` score entries alive at once), in fp32, and returns
the input dtype.
"""

from __future__ import annotations

import math

import torch

CHUNK_ELEMENTS = 1 << 24  # score entries per query chunk (64 MiB in fp32)


def _chunk_rows(q: torch.Tensor, n_kv: int) -> int:
    """Query rows per chunk so that a chunk holds about CHUNK_ELEMENTS scores."""
    batch_heads = max(1, q.shape[0] * q.shape[1])
    return max(1, CHUNK_ELEMENTS // max(1, batch_heads * n_kv))


def _inverse(n: torch.Tensor) -> torch.Tensor:
    """1 / N for expressive attention's row sums, 0 where N = 0 (an all-zero row)."""
    return torch.where(n > 0, 1 / torch.where(n > 0, n, 1.0), 0.0)


def _weights(
    qc: torch.Tensor, k: torch.Tensor, stat: torch.Tensor | None, mode: str, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(S, A, row statistic)`` for one chunk of query rows, in fp32.

    Without ``stat`` (forward) the weights are normalised by their row sums and the
    statistic is computed: the log-sum-exp of ``S`` / ``|S|``, or expressive attention's
    row sum ``N``; with ``stat`` (backward) the weights are recomputed from it.  Sigmoid
    attention always has ``stat`` (its rows' bias) and returns ``S + b`` in place of ``S``.
    """
    s = (qc @ k.transpose(-2, -1)).mul_(scale)
    if mode == "sigmoid":
        s.add_(stat.unsqueeze(-1))
        return s, torch.sigmoid(s), stat
    if mode == "expressive":
        e = s * s / (1 + s * s)
        if stat is None:
            stat = e.sum(dim=-1)
        return s, e * _inverse(stat).unsqueeze(-1), stat
    # In-place where a temporary is not needed again: each pass over the scores costs
    # memory traffic, which is what this path spends its time on at small head dims.
    t = s.abs() if mode == "cog" else s
    if stat is None:
        m = t.amax(dim=-1, keepdim=True)
        p = (t - m).exp_()
        l = p.sum(dim=-1, keepdim=True)
        p.div_(l)
        stat = (m + torch.log(l)).squeeze(-1)
    else:
        p = (t - stat.unsqueeze(-1)).exp_()
    return s, (p.mul_(torch.sign(s)) if mode == "cog" else p), stat


def _score_grad(
    s: torch.Tensor, a: torch.Tensor, da: torch.Tensor, delta: torch.Tensor | None,
    stat: torch.Tensor, mode: str, scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """dL/dS of one chunk from the weights ``A``, ``dA`` and ``Delta = rowsum(dO * O)``
    (written over ``dA``, which the caller does not need again; sigmoid's rows are not
    normalised and use no Delta).  ``scratch``: optional room of A's shape for cog's
    temporaries."""
    if mode == "cog":
        # sign(S) P (sign(S) dA - Delta), unsimplified: exactly 0 where S == 0, as
        # autograd is
        return da.mul_(torch.abs(a, out=scratch)).sub_(torch.mul(a, delta, out=scratch))
    if mode == "sigmoid":
        # dA * A * (1 - A), with 1 - A = sigmoid(-(S + b)): no cancellation where A ~ 1
        return da.mul_(a).mul_(torch.sigmoid(-s))
    if mode == "expressive":
        # A = E / N: dL/dE = (dA - Delta) / N, and dE/dS = 2 S / (1 + S^2)^2
        r = 1 / (1 + s * s)
        return (da - delta) * _inverse(stat).unsqueeze(-1) * 2 * s * r * r
    return da.sub_(delta).mul_(a)


def sigmoid_bias_rows(q: torch.Tensor, n_kv: int, bias: torch.Tensor | None) -> torch.Tensor:
    """Sigmoid attention's row statistic: each query row's bias (its head's, natural units),
    (B, H, Nq) fp32.  ``bias`` is one value per head, (H,), or None for ``-log(n_kv)``.
    Both backends use it (the Triton kernels read it as an input)."""
    b, h, n_q = q.shape[:3]
    if bias is None:
        return torch.full((b, h, n_q), -math.log(n_kv), dtype=torch.float32, device=q.device)
    rows = torch.empty((b, h, n_q), dtype=torch.float32, device=q.device)
    return rows.copy_(bias.detach().reshape(1, h, 1))  # a fresh tensor, never a view of bias


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str, scale: float,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(O, row statistic)`` as :func:`uvic_kernels.launch.forward` does."""
    with torch.autocast(q.device.type, enabled=False):
        qf, kf, vf = q.float(), k.float(), v.float()
        o = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        if mode == "sigmoid":
            stat = sigmoid_bias_rows(q, k.shape[2], bias)
        else:
            stat = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        step = _chunk_rows(q, k.shape[2])
        for start in range(0, q.shape[2], step):
            rows = slice(start, start + step)
            if mode == "sigmoid":
                _, a, _ = _weights(qf[..., rows, :], kf, stat[..., rows], mode, scale)
            else:
                _, a, stat[..., rows] = _weights(qf[..., rows, :], kf, None, mode, scale)
            o[..., rows, :] = a @ vf
    return o.to(q.dtype), stat


def fits_at_once(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the scores of every (batch, head) fit in one chunk: `Materialised`'s case."""
    return q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] <= CHUNK_ELEMENTS


CACHE_ELEMENTS = 1 << 17  # score entries per batch slice of `Materialised` (512 KiB in fp32)


def _batch_slices(q: torch.Tensor, n_kv: int) -> list[slice]:
    """Slices of the batch whose scores take about CACHE_ELEMENTS each (at least one item):
    the passes over one slice's scores then stay in the CPU's cache."""
    per_item = max(1, q.shape[1] * q.shape[2] * n_kv)
    step = max(1, CACHE_ELEMENTS // per_item)
    return [slice(i, i + step) for i in range(0, q.shape[0], step)]


def _scores_room(slices: list[slice], q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """An fp32 buffer for the scores of the largest of ``slices`` (the first), flattened
    over batch and heads: (items x H, Nq, Nkv)."""
    rows = (min(slices[0].stop, q.shape[0]) - slices[0].start) * q.shape[1] if slices else 0
    return torch.empty((rows, q.shape[2], k.shape[2]), dtype=torch.float32, device=q.device)


class Materialised(torch.autograd.Function):
    """The same algorithm where all scores fit at once (small images on a CPU), keeping the
    weights for the backward instead of recomputing them, and working a batch slice at a
    time. ``bias``: sigmoid's (H,) fp32 or None.

    Its tensors are contiguous, so that batch and heads flatten into one dimension (the
    weights are kept so, and the modes' elementwise maths sees them 3-D): each product is
    then one ``torch.bmm``, where ``torch.matmul``'s 4-D path costs some microseconds more
    per call and copies a strided operand or output.  The scores' temporaries live in
    buffers reused from slice to slice: a fresh allocation of that size costs about as much
    as a pass over it."""

    @staticmethod
    def forward(ctx, q, k, v, mode: str, scale: float, bias=None):
        with torch.autocast(q.device.type, enabled=False):
            heads = q.shape[1]
            # q scaled (N x D entries to scale rather than N x N scores) into a fresh
            # contiguous tensor, never q itself
            qf, kf, vf = q.float(), k.float().contiguous(), v.float().contiguous()
            qs = torch.mul(qf, scale, out=torch.empty(q.shape, dtype=torch.float32,
                                                      device=q.device))
            q3, k3, v3 = qs.flatten(0, 1), kf.flatten(0, 1), vf.flatten(0, 1)
            bias_rows = sigmoid_bias_rows(q, k.shape[2], bias) if mode == "sigmoid" else None
            o = torch.empty(q.shape, dtype=torch.float32, device=q.device)
            o3 = o.flatten(0, 1)
            slices = _batch_slices(q, k.shape[2])
            if mode in ("cog", "softmax"):  # S, and cog's |S|
                s_room = _scores_room(slices, q, k)
                t_room = _scores_room(slices, q, k) if mode == "cog" else None
            kept = []  # per slice: S (where the backward needs it), A, the row statistic
            for b in slices:
                r = slice(b.start * heads, b.stop * heads)
                if mode in ("cog", "softmax"):  # one fused softmax; S is not needed again
                    qr = q3[r]
                    s = torch.bmm(qr, k3[r].transpose(1, 2), out=s_room[:len(qr)])
                    t = torch.abs(s, out=t_room[:len(qr)]) if mode == "cog" else s
                    a = torch.softmax(t, dim=-1)
                    s, a, stat = None, (a.mul_(s.sign_()) if mode == "cog" else a), None
                else:
                    rows = None if bias_rows is None else bias_rows[b]
                    s, a, stat = _weights(qf[b], kf[b], rows, mode, scale)
                    s, a, stat = s.flatten(0, 1), a.flatten(0, 1), stat.flatten(0, 1)
                torch.bmm(a, v3[r], out=o3[r])
                kept += [s, a, stat]
        ctx.save_for_backward(qs, kf, vf, o, *kept)
        ctx.mode, ctx.scale, ctx.dtypes = mode, scale, (q.dtype, k.dtype, v.dtype)
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        qs, kf, vf, o, *kept = ctx.saved_tensors
        mode, heads = ctx.mode, qs.shape[1]
        with torch.autocast(do.device.type, enabled=False):
            dof = do.float().contiguous()
            q3, k3, v3 = qs.flatten(0, 1), kf.flatten(0, 1), vf.flatten(0, 1)
            do3, o3 = dof.flatten(0, 1), o.flatten(0, 1)
            dq, dk, dv = torch.empty_like(qs), torch.empty_like(kf), torch.empty_like(vf)
            dq3, dk3, dv3 = dq.flatten(0, 1), dk.flatten(0, 1), dv.flatten(0, 1)
            slices = _batch_slices(qs, kf.shape[2])
            da_room = _scores_room(slices, qs, kf)
            scratch = _scores_room(slices, qs, kf) if mode == "cog" else None
            dbias = []
            for i, b in enumerate(slices):
                s, a, stat = kept[3 * i: 3 * i + 3]
                r = slice(b.start * heads, b.stop * heads)
                da = torch.bmm(do3[r], v3[r].transpose(1, 2), out=da_room[:len(a)])
                # rowsum(dO * O) = rowsum(dA * A); sigmoid's rows are not normalised
                delta = None if mode == "sigmoid" else (do3[r] * o3[r]).sum(-1, keepdim=True)
                ds = _score_grad(s, a, da, delta, stat, mode,
                                 None if scratch is None else scratch[:len(a)])
                if mode == "sigmoid" and ctx.needs_input_grad[5]:
                    dbias.append(ds.view(len(qs[b]), heads, *ds.shape[1:]).sum(dim=(0, 2, 3)))
                torch.bmm(a.transpose(1, 2), do3[r], out=dv3[r])
                torch.bmm(ds, k3[r], out=dq3[r])
                torch.bmm(ds.transpose(1, 2), q3[r], out=dk3[r])
            dq.mul_(ctx.scale)
        grads = (g.to(t) for g, t in zip((dq, dk, dv), ctx.dtypes))
        return (*grads, None, None, torch.stack(dbias).sum(0) if dbias else None)


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    stat: torch.Tensor,
    do: torch.Tensor,
    mode: str,
    scale: float,
    need_dq: bool = True,
    need_dkdv: bool = True,
    need_dbias: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """Return ``(dQ, dK, dV, dBias)`` (None where not needed) as
    :func:`uvic_kernels.launch.backward` does: dBias (sigmoid only) per head, fp32."""
    need_dbias = need_dbias and mode == "sigmoid"
    with torch.autocast(q.device.type, enabled=False):
        qf, kf, vf, dof = q.float(), k.float(), v.float(), do.float()
        if mode == "sigmoid":  # no Delta term: its place holds the row sums of dS
            delta = torch.zeros(q.shape[:-1], dtype=torch.float32, device=q.device)
        else:
            delta = (dof * o.float()).sum(-1)
        dq = torch.empty_like(qf) if need_dq else None
        dk = torch.zeros_like(kf) if need_dkdv else None
        dv = torch.zeros_like(vf) if need_dkdv else None
        step = _chunk_rows(q, k.shape[2])
        for start in range(0, q.shape[2], step):
            rows = slice(start, start + step)
            qc, doc = qf[..., rows, :], dof[..., rows, :]
            s, a, _ = _weights(qc, kf, stat[..., rows], mode, scale)
            da = doc @ vf.transpose(-2, -1)  # dA = dO V^T
            ds = _score_grad(s, a, da, delta[..., rows].unsqueeze(-1), stat[..., rows], mode)
            if need_dbias:
                delta[..., rows] = ds.sum(-1)
            if need_dkdv:
                dv += a.transpose(-2, -1) @ doc
                dk += scale * (ds.transpose(-2, -1) @ qc)
            if need_dq:
                dq[..., rows, :] = scale * (ds @ kf)
        dbias = delta.sum(dim=(0, 2)) if need_dbias else None
    return (*(None if g is None else g.to(q.dtype) for g in (dq, dk, dv)), dbias)
