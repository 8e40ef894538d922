"""Public entry point: ``attention(q, k, v, mode="cog")``, with autograd and a choice of backend:
``"triton"`` (the fused kernels, compiled on CUDA or interpreted on the CPU under
``TRITON_INTERPRET=1``), ``"torch"`` (the same algorithm in PyTorch) and, softmax only,
``"sdpa"``. Triton and the chunked PyTorch path run as PyTorch custom ops, opaque to
``torch.compile`` and fake tensors; in eager mode, where a call's scores fit in one
chunk, the PyTorch path is a plain autograd function (``torch_attention.Materialised``).
The kernel module is imported lazily.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from types import ModuleType
from typing import Optional

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from uvic_kernels.modes import BACKEND_MODES, BACKENDS, MODES
from uvic_kernels.torch_attention import Materialised
from uvic_kernels.torch_attention import fits_at_once as torch_fits_at_once

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 128
_KERNEL_MODULE = "uvic_kernels.triton_attention"


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def _triton_available() -> bool:
    return _TRITON_AVAILABLE


def _kernels_interpreted() -> bool:
    """Whether the Triton kernels run (or, once imported, will run) in the interpreter.

    Triton fixes this when the kernels are defined, i.e. when the kernel module is
    first imported; later changes of ``TRITON_INTERPRET`` do not affect it.
    """
    module = sys.modules.get(_KERNEL_MODULE)
    if module is not None:
        return bool(module.INTERPRET)
    return _interpret_requested()


def interpreted_on_cpu() -> bool:
    """Whether the default backend runs the Triton kernels in Triton's interpreter on a CPU
    (``TRITON_INTERPRET=1``, as when the kernels were defined)."""
    return _triton_available() and _interpret_requested() and _kernels_interpreted()


def _backend_for(q: torch.Tensor, mode: str) -> str:
    """Default backend for tensors on ``q.device``: ``"triton"`` on CUDA (and on a CPU under
    the interpreter); elsewhere PyTorch's own attention for softmax, our PyTorch path else."""
    if ((q.device.type == "cuda" and _triton_available())
            or (q.device.type == "cpu" and interpreted_on_cpu())):
        return "triton"
    return "sdpa" if mode == "softmax" else "torch"


def _implementation(backend: str, device: torch.device) -> ModuleType:
    if backend == "torch":
        from uvic_kernels import torch_attention

        return torch_attention
    if not _triton_available():
        raise RuntimeError("backend='triton' needs the triton package, which is not installed")
    if device.type != "cuda" and not _kernels_interpreted():
        raise ValueError(
            f"backend='triton' needs CUDA tensors or TRITON_INTERPRET=1 (set before the kernels "
            f"are first used); got tensors on {device}"
        )
    from uvic_kernels import launch

    return launch


def _check_bias(q: torch.Tensor, mode: str, bias: float | torch.Tensor | None) -> None:
    """Sigmoid attention's bias: None (``-log N``), a finite number, or a floating tensor
    on q's device with one value (shape () or (1,)) or one per head (H,)."""
    if bias is None:
        return
    if mode != "sigmoid":
        raise ValueError(f"bias is sigmoid attention's; mode={mode!r} takes none")
    if isinstance(bias, torch.Tensor):
        heads = q.shape[1]
        if bias.shape not in ((), (1,), (heads,)):
            raise ValueError(f"bias must have shape (), (1,) or ({heads},) (one value per "
                             f"head), got {tuple(bias.shape)}")
        if not bias.is_floating_point():
            raise ValueError(f"bias must be a floating tensor, got {bias.dtype}")
        if bias.device != q.device:
            raise ValueError(f"bias is on {bias.device}, q on {q.device}")
    elif isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias):
        raise ValueError(f"bias must be a finite number, a tensor or None, got {bias!r}")


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mode: str,
    scale: float | None,
    backend: str | None,
    bias: float | torch.Tensor | None = None,
) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 4:
            raise ValueError(f"{name} must be a 4-D (B, H, N, D) tensor, got ndim={t.ndim}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes mismatch: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q and k shapes mismatch: {tuple(q.shape)} vs {tuple(k.shape)} "
            "(batch, heads and head dim must agree)"
        )
    if not 1 <= q.shape[3] <= MAX_HEAD_DIM:
        raise ValueError(f"head dim D={q.shape[3]} must be between 1 and {MAX_HEAD_DIM}")
    if k.shape[2] < 1:
        raise ValueError("k and v need at least one key (N >= 1)")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale)
    ):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend is not None and mode not in BACKEND_MODES[backend]:  # sdpa: softmax only
        raise ValueError(
            "backend='sdpa' runs softmax attention only (PyTorch's "
            f"scaled_dot_product_attention); mode={mode!r} needs backend 'triton' or 'torch'"
        )
    _check_bias(q, mode, bias)


# The implementations as PyTorch custom ops: torch.compile treats them as opaque calls (no
# tracing into Triton launchers) and fake tensors know the output shapes.  The
# autograd.Function below wires them together.


@torch.library.custom_op("uvic_kernels::attention_forward", mutates_args=())
def _forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str, scale: float, backend: str,
    bias: Optional[torch.Tensor] = None,  # noqa: UP045 (the custom op's schema reads it)
) -> tuple[torch.Tensor, torch.Tensor]:
    o, lse = _implementation(backend, q.device).forward(q, k, v, mode, scale, bias)
    return o.contiguous(), lse.contiguous()  # the fake kernel promises contiguous outputs


@_forward_op.register_fake
def _forward_fake(q, k, v, mode, scale, backend, bias=None):
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return o, torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)


@torch.library.custom_op("uvic_kernels::attention_backward", mutates_args=())
def _backward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    mode: str,
    scale: float,
    backend: str,
    need_dq: bool,
    need_dkdv: bool,
    need_dbias: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dQ, dK, dV, dBias)``, contiguous; an empty tensor where not computed."""
    grads = _implementation(backend, q.device).backward(
        q, k, v, o, lse, do, mode, scale, need_dq=need_dq, need_dkdv=need_dkdv,
        need_dbias=need_dbias,
    )
    return tuple(q.new_empty(0) if g is None else g.contiguous() for g in grads)


@_backward_op.register_fake
def _backward_fake(q, k, v, o, lse, do, mode, scale, backend, need_dq, need_dkdv,
                   need_dbias=False):
    def like(x: torch.Tensor, needed: bool) -> torch.Tensor:
        return torch.empty(x.shape if needed else (0,), dtype=x.dtype, device=x.device)

    dbias = torch.empty((q.shape[1],) if need_dbias and mode == "sigmoid" else (0,),
                        dtype=torch.float32 if need_dbias and mode == "sigmoid" else q.dtype,
                        device=q.device)
    return like(q, need_dq), like(k, need_dkdv), like(v, need_dkdv), dbias


class FusedAttention(torch.autograd.Function):
    """Autograd wrapper: saves q, k, v, O and the row LSE; the backward recomputes P.

    ``FusedAttention.apply(q, k, v, mode, scale, backend, bias)`` with validated inputs
    (``bias``: sigmoid's per-head bias as an (H,) fp32 tensor, or None); use
    :func:`attention` instead.
    """

    @staticmethod
    def forward(ctx, q, k, v, mode: str, scale: float, backend: str, bias=None):
        o, lse = _forward_op(q, k, v, mode, scale, backend, bias)
        ctx.save_for_backward(q, k, v, o, lse)  # sigmoid: lse holds the bias per row
        ctx.mode, ctx.scale, ctx.backend = mode, scale, backend
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        need_q, need_k, need_v, _, _, _, need_bias = ctx.needs_input_grad
        dq, dk, dv, dbias = _backward_op(
            q, k, v, o, lse, do, ctx.mode, ctx.scale, ctx.backend, need_q, need_k or need_v,
            need_bias,
        )
        return (
            dq if need_q else None,
            dk if need_k else None,
            dv if need_v else None,
            None,
            None,
            None,
            dbias if need_bias else None,
        )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mode: str = "cog",
    scale: float | None = None,
    *,
    bias: float | torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Fused non-causal attention over (B, H, N, D) tensors, differentiable.

    ``mode="cog"``: ``sign(S) * softmax(|S|) @ v``; ``mode="softmax"``: ``softmax(S) @ v``;
    ``mode="expressive"``: ``(E / rowsum(E)) @ v`` with ``E = S^2 / (1 + S^2)`` (a row of
    all-zero scores gets weights 0); ``mode="sigmoid"``: ``sigmoid(S + bias) @ v``, no row
    normalisation; with ``S = scale * q k^T`` and ``scale`` defaulting to ``D ** -0.5``.
    ``bias`` (sigmoid only) defaults to ``-log(Nkv)``; a tensor of shape (H,) is one bias
    per head, of shape () or (1,) one for all, and receives its gradient.  k and v may have
    a different sequence length than q.  Inputs are fp16, bf16 or fp32 (any strides,
    D <= 128); the output has q's dtype and is contiguous.  ``backend`` forces
    ``"triton"``, ``"torch"`` or (softmax only) ``"sdpa"``; by default Triton runs on
    CUDA (and on the CPU under ``TRITON_INTERPRET=1``); elsewhere softmax runs on SDPA and
    the other modes on the PyTorch path.
    """
    _check_inputs(q, k, v, mode, scale, backend, bias)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    backend = backend or _backend_for(q, mode)
    if backend == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, scale=float(scale))
    if isinstance(bias, torch.Tensor):  # one fp32 value per head; autograd maps the gradient
        bias = bias.to(torch.float32).reshape(-1).expand(q.shape[1])
    elif bias is not None:
        bias = torch.full((q.shape[1],), float(bias), dtype=torch.float32, device=q.device)
    grad_bias = bias is not None and bias.requires_grad
    if (backend == "torch" and q.device.type != "meta" and not torch.compiler.is_compiling()
            and torch_fits_at_once(q, k)):
        return Materialised.apply(q, k, v, mode, float(scale), bias)
    if torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or grad_bias
    ):
        return FusedAttention.apply(q, k, v, mode, float(scale), backend, bias)
    return _forward_op(q, k, v, mode, float(scale), backend, bias)[0]
