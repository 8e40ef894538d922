"""Host side of the Triton attention kernels: argument preparation and launches.

``forward`` and ``backward`` have the interface of :mod:`uvic_kernels.torch_attention`;
they allocate the outputs, fold the scale (``_kernel_scales``), derive strides and
constexprs, and launch the kernels of :mod:`uvic_kernels.triton_attention`, which holds
the algorithm.  Inputs are assumed validated (see ``uvic_kernels.attention``).
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton

from uvic_kernels import triton_attention as kernels
from uvic_kernels.tiles import MIN_BLOCK, PREPROCESS_BLOCK_M, num_programs
from uvic_kernels.triton_attention import LOG2E, MODE_IDS

# fmt: off
# (kernel argument lists are grouped by tensor, as in the kernels' signatures)


def _block_d(head_dim: int) -> int:
    return max(MIN_BLOCK, triton.next_power_of_2(head_dim))


MAX_STRIDE_ALIGN = 16  # elements; 16 fp16 = 32 bytes, more buys no wider loads


def _stride_align(*tensors: torch.Tensor) -> int:
    """Largest power of two (<= 16) dividing every batch, head and row stride.

    The kernels receive those strides divided by it and multiply back by the
    ``STRIDE_ALIGN`` constexpr, so the compiler knows that every row starts on an
    aligned element.  Triton only specialises integers divisible by 16; without the
    hint a head dim such as 72 (rows 144 bytes apart) gets scalar, unpipelined loads
    of padded 128-wide tiles and spills registers.
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
    """fp32 products in full precision (TF32 would lose ~3 of the digits the tests
    check); fp16 / bf16 operands use Triton's default tensor-core path."""
    return "ieee" if dtype == torch.float32 else None


def _device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Launch on the tensors' GPU, not on the current one."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _mode_id(mode: str | bool) -> int:
    """The MODE constexpr of ``mode`` ("softmax", "cog", "expressive"); a bool is read as
    the ``cog`` flag of the two-mode interface (True: cog, False: softmax)."""
    if isinstance(mode, bool):
        return MODE_IDS["cog" if mode else "softmax"]
    return MODE_IDS[mode]


def _kernel_scales(q: torch.Tensor, mode: int, scale: float):
    """``(q', qk_scale, grad_scale, dq_sign)`` for the kernels (module docstring).

    softmax / cog: the folded scale needs ``scale > 0``: a negative scale runs as
    ``(-q) k^T * |scale|`` (dQ changes sign), a zero scale in Cog mode as ``q = 0`` (every
    score an exact zero, weight ``sign(0) = 0``); ``qk_scale = scale * log2(e)`` and the
    gradients are multiplied by ``scale``.  expressive: ``e = s^2 / (1 + s^2)`` depends on
    ``s^2 = scale^2 x^2`` only, so ``qk_scale = scale^2`` and ``de/dx = 2 scale^2 x r^2``
    puts ``2 scale^2`` on the gradients.
    """
    if mode == MODE_IDS["expressive"]:
        return q, scale * scale, 2.0 * scale * scale, 1.0
    dq_sign = 1.0
    if scale < 0:
        q, scale, dq_sign = -q, -scale, -1.0
    elif scale == 0 and mode == MODE_IDS["cog"]:
        q = torch.zeros_like(q)
    return q, scale * LOG2E, scale, dq_sign


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str | bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(O, row statistic)``: O (B, H, Nq, D) in the input dtype, and per query row
    in fp32 the natural log-sum-exp of ``|S|`` (cog) or ``S`` (softmax), or the row sum
    ``N`` of ``s^2 / (1 + s^2)`` (expressive).  The backward reads it to recompute the
    weights.  Inputs are assumed validated (see ``uvic_kernels.attention``).
    """
    B, H, n_q, head_dim = q.shape
    n_kv = k.shape[2]
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, n_q), dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        return o, lse
    mode = _mode_id(mode)
    q, qk_scale, _, _ = _kernel_scales(q, mode, scale)

    def grid(meta):
        return (num_programs(n_q, meta["BLOCK_M"]) * B * H,)

    a = _stride_align(q, k, v, o)
    with _device_guard(q):
        kernels._attn_fwd[grid](
            q, k, v, o, lse,
            *_strides(q, a), *_strides(k, a), *_strides(v, a), *_strides(o, a),
            H, B * H, n_q, n_kv, qk_scale,
            MODE=mode, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), STRIDE_ALIGN=a,
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
    mode: str | bool,
    scale: float,
    need_dq: bool = True,
    need_dkdv: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Return ``(dQ, dK, dV)`` (None where not needed), in the input dtype.

    Launch order: dQ (which also writes Delta), then dK/dV; without dQ, a small
    kernel computes Delta first.  No atomics: results are bit-identical run to run.
    """
    B, H, n_q, head_dim = q.shape
    n_kv = k.shape[2]
    block_d = _block_d(head_dim)
    precision = _dot_precision(q.dtype)
    # every element of dq / dk / dv is written by the kernels (nothing is accumulated,
    # no atomics), so autotuning needs no reset_to_zero / restore_value
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if need_dq else None
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device) if need_dkdv else None
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device) if need_dkdv else None
    if q.numel() == 0 or k.numel() == 0:
        return tuple(None if g is None else g.zero_() for g in (dq, dk, dv))
    if not (need_dq or need_dkdv):
        return dq, dk, dv
    mode = _mode_id(mode)
    q, qk_scale, grad_scale, dq_sign = _kernel_scales(q, mode, scale)

    delta = torch.empty((B, H, n_q), dtype=torch.float32, device=q.device)

    def grid_kv(meta):
        return (num_programs(n_kv, meta["BLOCK_N"]) * B * H,)

    def grid_q(meta):
        return (num_programs(n_q, meta["BLOCK_M"]) * B * H,)

    a = _stride_align(*(t for t in (q, k, v, o, do, dq, dk, dv) if t is not None))
    with _device_guard(q):
        if need_dq:
            kernels._attn_bwd_dq[grid_q](
                q, k, v, o, do, dq, lse, delta,
                *_strides(q, a), *_strides(k, a), *_strides(v, a), *_strides(o, a),
                *_strides(do, a), *_strides(dq, a),
                H, B * H, n_q, n_kv, grad_scale * dq_sign, qk_scale,
                MODE=mode, HEAD_DIM=head_dim, BLOCK_D=block_d, STRIDE_ALIGN=a,
                DOT_PRECISION=precision,
            )
        else:
            kernels._attn_bwd_preprocess[(triton.cdiv(n_q, PREPROCESS_BLOCK_M) * B * H,)](
                o, do, delta, *_strides(o, a), *_strides(do, a), H, n_q,
                HEAD_DIM=head_dim, BLOCK_D=block_d, STRIDE_ALIGN=a, BLOCK_M=PREPROCESS_BLOCK_M,
            )
        if need_dkdv:
            kernels._attn_bwd_dkdv[grid_kv](
                q, k, v, do, dk, dv, lse, delta,
                *_strides(q, a), *_strides(k, a), *_strides(v, a), *_strides(do, a),
                *_strides(dk, a), *_strides(dv, a),
                H, B * H, n_q, n_kv, grad_scale, qk_scale,
                MODE=mode, HEAD_DIM=head_dim, BLOCK_D=block_d, STRIDE_ALIGN=a,
                DOT_PRECISION=precision,
            )
    return dq, dk, dv


# fmt: on
