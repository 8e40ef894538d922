"""Host side of the Triton attention kernels: outputs, arguments, grids and launches.

``forward`` and ``backward`` have the interface of :mod:`uvic_kernels.torch_attention`
and launch the kernels of :mod:`uvic_kernels.triton_attention` with ``kernel[grid](...)``.
Inputs are assumed validated (see ``uvic_kernels.attention``).
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton

from uvic_kernels import triton_attention as kernels
from uvic_kernels.tiles import MIN_BLOCK, PREPROCESS_BLOCK_M, num_programs
from uvic_kernels.torch_attention import sigmoid_bias_rows
from uvic_kernels.triton_attention import LOG2E, MODE_IDS

MAX_STRIDE_ALIGN = 16  # elements; 16 fp16 = 32 bytes, more buys no wider loads


def _block_d(head_dim: int) -> int:
    return max(MIN_BLOCK, triton.next_power_of_2(head_dim))


def _stride_align(*tensors: torch.Tensor) -> int:
    """Largest power of two (<= 16) dividing every batch, head and row stride.

    The kernels get those strides divided by it and multiply back by the ``STRIDE_ALIGN``
    constexpr, so the compiler knows every row starts on an aligned element.
    """
    g = 0
    for t in tensors:
        for st in t.stride()[:3]:
            g = math.gcd(g, st)
    if g == 0:  # every stride 0 (broadcast tensors): any factor divides them
        return MAX_STRIDE_ALIGN
    return min(g & -g, MAX_STRIDE_ALIGN)


def _strides(t: torch.Tensor, align: int) -> tuple[int, int, int, int]:
    """(batch, head, row) strides divided by ``align``, then the head-dim stride."""
    sz, sh, sm, sd = t.stride()
    return sz // align, sh // align, sm // align, sd


def _dot_precision(dtype: torch.dtype) -> str | None:
    """IEEE products for fp32 (TF32 would lose digits); the default path for fp16 / bf16."""
    return "ieee" if dtype == torch.float32 else None


def _device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Launch on the tensors' GPU, not on the current one."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _kernel_scales(q: torch.Tensor, mode: int, scale: float):
    """``(q', qk_scale, grad_scale, dq_sign)`` for the kernels.

    softmax / cog fold ``scale * log2(e)`` and need ``scale > 0``: a negative scale runs as
    ``(-q)`` with ``|scale|`` (dQ changes sign), a zero scale in Cog mode as ``q = 0``.
    expressive reads ``scale^2`` only (gradients times ``2 scale^2``); sigmoid runs any scale.
    """
    if mode == MODE_IDS["expressive"]:
        return q, scale * scale, 2.0 * scale * scale, 1.0
    if mode == MODE_IDS["sigmoid"]:
        return q, scale * LOG2E, scale, 1.0
    dq_sign = 1.0
    if scale < 0:
        q, scale, dq_sign = -q, -scale, -1.0
    elif scale == 0 and mode == MODE_IDS["cog"]:
        q = torch.zeros_like(q)
    return q, scale * LOG2E, scale, dq_sign


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str, scale: float,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(O, row statistic)``: O in q's dtype, and per query row in fp32 the log-sum-exp
    of ``S`` / ``|S|``, expressive attention's row sum, or sigmoid attention's bias
    (``bias``, one value per head, default ``-log Nkv``)."""
    B, H, n_q, head_dim = q.shape
    n_kv = k.shape[2]
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    mode_id = MODE_IDS[mode]
    if mode == "sigmoid":  # an input of the kernels, which read it
        lse = sigmoid_bias_rows(q, n_kv, bias)
    else:
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        return o, lse
    q, qk_scale, _, _ = _kernel_scales(q, mode_id, scale)
    a = _stride_align(q, k, v, o)

    def grid(meta):
        return (num_programs(n_q, meta["BLOCK_M"]) * B * H,)

    with _device_guard(q):
        kernels._attn_fwd[grid](
            q, k, v, o, lse,
            *_strides(q, a), *_strides(k, a), *_strides(v, a), *_strides(o, a),
            H, B * H, n_q, n_kv, qk_scale,
            MODE=mode_id, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), STRIDE_ALIGN=a,
            DOT_PRECISION=_dot_precision(q.dtype),
        )
    return o, lse


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    mode: str,
    scale: float,
    need_dq: bool = True,
    need_dkdv: bool = True,
    need_dbias: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """Return ``(dQ, dK, dV, dBias)``, None where not needed; dBias (sigmoid only) is the
    per-head bias's gradient, (H,) fp32.  dQ (which also writes Delta, or sigmoid's row sums
    of dS) runs before dK/dV; without it a small kernel writes Delta.  No atomics."""
    B, H, n_q, head_dim = q.shape
    n_kv = k.shape[2]
    mode_id = MODE_IDS[mode]
    need_dbias = need_dbias and mode == "sigmoid"
    run_dq = need_dq or need_dbias  # the dQ kernel also sums dS for dBias
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if run_dq else None
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device) if need_dkdv else None
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device) if need_dkdv else None
    dbias = torch.zeros(H, dtype=torch.float32, device=q.device) if need_dbias else None
    if q.numel() == 0 or k.numel() == 0:
        return (*(None if g is None else g.zero_() for g in (dq, dk, dv)), dbias)
    if not (run_dq or need_dkdv):
        return dq, dk, dv, dbias
    q, qk_scale, grad_scale, dq_sign = _kernel_scales(q, mode_id, scale)
    delta = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    a = _stride_align(*(t for t in (q, k, v, o, do, dq, dk, dv) if t is not None))
    consts = dict(MODE=mode_id, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), STRIDE_ALIGN=a,
                  DOT_PRECISION=_dot_precision(q.dtype))

    def grid_q(meta):
        return (num_programs(n_q, meta["BLOCK_M"]) * B * H,)

    def grid_kv(meta):
        return (num_programs(n_kv, meta["BLOCK_N"]) * B * H,)

    with _device_guard(q):
        if run_dq:
            kernels._attn_bwd_dq[grid_q](
                q, k, v, o, do, dq, lse, delta,
                *_strides(q, a), *_strides(k, a), *_strides(v, a), *_strides(o, a),
                *_strides(do, a), *_strides(dq, a),
                H, B * H, n_q, n_kv, grad_scale * dq_sign, qk_scale, **consts,
            )
        elif mode != "sigmoid":  # sigmoid has no Delta
            kernels._attn_bwd_preprocess[(triton.cdiv(n_q, PREPROCESS_BLOCK_M) * B * H,)](
                o, do, delta, *_strides(o, a), *_strides(do, a), H, n_q,
                HEAD_DIM=head_dim, BLOCK_D=consts["BLOCK_D"], STRIDE_ALIGN=a,
                BLOCK_M=PREPROCESS_BLOCK_M,
            )
        if need_dkdv:
            kernels._attn_bwd_dkdv[grid_kv](
                q, k, v, do, dk, dv, lse, delta,
                *_strides(q, a), *_strides(k, a), *_strides(v, a), *_strides(do, a),
                *_strides(dk, a), *_strides(dv, a),
                H, B * H, n_q, n_kv, grad_scale, qk_scale, **consts,
            )
    if need_dbias:
        dbias = delta.sum(dim=(0, 2))  # delta holds the row sums of dS here
    return (dq if need_dq else None), dk, dv, dbias
