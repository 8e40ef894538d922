"""Host side of the Triton attention kernels: arguments, launches and the launch cache.

``forward`` and ``backward`` have the interface of :mod:`uvic_kernels.torch_attention`;
they allocate the outputs, fold the scale (``_kernel_scales``) and launch the kernels of
:mod:`uvic_kernels.triton_attention`, which holds the algorithm.  Inputs are assumed
validated (see ``uvic_kernels.attention``).

Launch cache.  Everything a launch derives from the inputs' signature (mode, dtype,
device, shapes, strides, and the 16-byte alignment of every pointer, on which Triton
specialises) is worked out once per signature: the integer kernel arguments, the
constexprs, and, after the first call, for each kernel the config the autotuner chose,
its grid and its compiled kernel.  A later call with the same signature allocates its
outputs, finds that plan in a dict and hands the same arguments straight to the
compiled kernel's launcher (``CompiledKernel[grid](*args)``; in the interpreter, to the
kernel function).  The autotuner (its key over every argument), Triton's binder (type
and specialisation of every argument, the cache key), the grid function and this
module's stride arithmetic are not run again.  The kernel launched is the one Triton's
own path would launch with the same arguments, so results are bit-identical;
``CACHE = False`` takes Triton's path on every call (the tests compare the two), and
``cache_info()`` counts the launches of each path.  As with Triton's own autotuning
cache, a config list changed after a signature was first launched is not seen: call
``clear_cache()``.

Where Triton's internals are not what the cache expects (another release: the autotuner,
the kernel's argument names or the compiled kernel's launcher laid out otherwise, found
by reading them or by a direct launch that raises), that signature falls back to
Triton's own launch path for good: same results, only the host time saved is lost.  The
first fallback of the process says why in a ``RuntimeWarning`` (once);
``cache_info()["fallbacks"]`` counts them and ``fallback_reasons()`` lists the reasons.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import triton
from triton.compiler import CompiledKernel

from uvic_kernels import triton_attention as kernels
from uvic_kernels.tiles import INTERPRET, MIN_BLOCK, PREPROCESS_BLOCK_M, num_programs
from uvic_kernels.torch_attention import sigmoid_bias_rows
from uvic_kernels.triton_attention import LOG2E, MODE_IDS

# fmt: off
# (kernel argument lists are grouped by tensor, as in the kernels' signatures)

CACHE = True  # False: every launch goes through Triton's autotuner and binder
MAX_PLANS = 4096  # signatures kept; beyond, the cache starts afresh
PTR_ALIGN = 16  # bytes: Triton specialises a pointer on whether it is a multiple of this

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
    """The MODE constexpr of ``mode`` ("softmax", "cog", "expressive", "sigmoid"); a bool is read as
    the ``cog`` flag of the two-mode interface (True: cog, False: softmax)."""
    if isinstance(mode, bool):
        return MODE_IDS["cog" if mode else "softmax"]
    return MODE_IDS[mode]


def _kernel_scales(q: torch.Tensor, mode: int, scale: float):
    """``(q', qk_scale, grad_scale, dq_sign)`` for the kernels (see the docstring of
    :mod:`uvic_kernels.triton_attention`).

    softmax / cog: the folded scale needs ``scale > 0``: a negative scale runs as
    ``(-q) k^T * |scale|`` (dQ changes sign), a zero scale in Cog mode as ``q = 0`` (every
    score an exact zero, weight ``sign(0) = 0``); ``qk_scale = scale * log2(e)`` and the
    gradients are multiplied by ``scale``.  expressive: ``e = s^2 / (1 + s^2)`` depends on
    ``s^2 = scale^2 x^2`` only, so ``qk_scale = scale^2`` and ``de/dx = 2 scale^2 x r^2``
    puts ``2 scale^2`` on the gradients.  sigmoid: nothing is folded into a max, so any
    scale runs as it is (``qk_scale = scale * log2(e)``, gradients times ``scale``).
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


class _Launch:
    """One kernel's launch for one input signature.

    ``ints`` are the integer arguments after the tensors, ``constexprs`` the compile-time
    ones (without the autotuned ``BLOCK_M`` / ``BLOCK_N``), ``grid`` a tuple or a function
    of the constexprs.  The first call runs ``kernel[grid](...)`` (autotuning, binding,
    compiling) and, with ``CACHE``, keeps what it launched; later calls launch that
    directly with the same arguments.
    """

    __slots__ = ("constexprs", "direct", "fallback", "grid", "ints", "kernel", "tail")

    def __init__(self, kernel: Any, ints: tuple[int, ...], constexprs: dict[str, Any],
                 grid: tuple[int, ...] | Callable[[dict[str, Any]], tuple[int, ...]]):
        self.kernel, self.ints, self.constexprs, self.grid = kernel, ints, constexprs, grid
        self.direct: Callable[..., Any] | None = None
        self.fallback = False  # True: Triton's own path for good (see _fall_back)
        self.tail: tuple[Any, ...] = ()  # the constexpr values, in signature order

    def __call__(self, tensors: tuple[torch.Tensor, ...], floats: tuple[float, ...]) -> None:
        if self.direct is not None and CACHE:
            try:
                self.direct(*tensors, *self.ints, *floats, *self.tail)
            except Exception as err:  # a launcher that takes other arguments: Triton's path
                self._fall_back(f"the direct launch raised {type(err).__name__}: {err}")
            else:
                _STATS["hits"] += 1
                return
        _STATS["misses"] += 1
        launched = self.kernel[self.grid](*tensors, *self.ints, *floats, **self.constexprs)
        if CACHE and not self.fallback:
            n_runtime = len(tensors) + len(self.ints) + len(floats)
            try:
                self.direct, self.tail, reason = _direct_launch(
                    self.kernel, launched, n_runtime, self.constexprs, self.grid)
            except Exception as err:  # Triton's objects laid out otherwise
                self.direct, reason = None, f"reading Triton's launch raised {type(err).__name__}"
            if self.direct is None:
                self._fall_back(reason)

    def _fall_back(self, reason: str) -> None:
        """Take Triton's own path for this signature from now on, and say why (once)."""
        self.direct, self.tail, self.fallback = None, (), True
        _fall_back(reason)


def _fall_back(reason: str) -> None:
    """Count a signature that falls back to Triton's launch path; warn on the first."""
    _STATS["fallbacks"] += 1
    first = not _FALLBACK_REASONS
    _FALLBACK_REASONS.setdefault(reason.splitlines()[0][:200], None)
    if first:
        warnings.warn(
            f"uvic_kernels: the launch cache cannot repeat Triton {triton.__version__}'s "
            f"launches ({reason.splitlines()[0][:200]}); those signatures take Triton's own "
            "launch path (same results, more host time per call). Said once per process; "
            "uvic_kernels.launch.fallback_reasons() lists every reason.",
            RuntimeWarning, stacklevel=4)


def _direct_launch(kernel: Any, launched: Any, n_runtime: int, constexprs: dict[str, Any],
                   grid: Any) -> tuple[Callable[..., Any] | None, tuple[Any, ...], str]:
    """``(launch, constexpr values, "")`` that repeat what ``kernel[grid](...)`` just
    launched, or ``(None, (), why not)`` where that cannot be done safely (a config with a
    pre-hook, argument names that do not match the launch, a launch that returned no
    compiled kernel)."""
    fn, values = kernel, dict(constexprs)
    if isinstance(kernel, triton.runtime.Autotuner):
        config = kernel.best_config
        if config.pre_hook is not None:
            return None, (), "the autotuner's chosen config has a pre-hook"
        values.update(config.kwargs)
        fn = kernel.fn
    names = getattr(fn, "arg_names", None)
    if names is None or sorted(names[n_runtime:]) != sorted(values):
        return None, (), "the kernel's argument names do not match the launch"
    grid = tuple(grid(values) if callable(grid) else grid)
    grid += (1,) * (3 - len(grid))  # CompiledKernel[grid] reads all three dimensions
    tail = tuple(values[name] for name in names[n_runtime:])
    if INTERPRET:
        return fn[grid], tail, ""
    if hasattr(launched, "result"):  # the future of an asynchronous compile
        launched = launched.result()
    if not isinstance(launched, CompiledKernel):
        return None, (), f"the launch returned a {type(launched).__name__}, not a CompiledKernel"
    return launched[grid], tail, ""


_PLANS: dict[tuple, Any] = {}
_STATS = {"hits": 0, "misses": 0, "fallbacks": 0}
_FALLBACK_REASONS: dict[str, None] = {}  # why signatures fell back, first seen first


def cache_info() -> dict[str, int]:
    """Kernel launches served by the cache (``hits``) and through Triton's autotuner and
    binder (``misses``) since the process started, the signatures cached (``plans``) and
    the kernel launches whose signature fell back to Triton's path for good (``fallbacks``)."""
    return {**_STATS, "plans": len(_PLANS)}


def fallback_reasons() -> list[str]:
    """Why launches fell back to Triton's own path in this process (empty: none did)."""
    return list(_FALLBACK_REASONS)


def clear_cache() -> None:
    """Forget every cached launch: the next call of each signature goes through the
    autotuner and Triton's binder again."""
    _PLANS.clear()


def _plan(key: tuple, build: Callable[[], Any]) -> Any:
    """The cached plan of ``key``, built (and kept, with ``CACHE``) on first use."""
    plan = _PLANS.get(key) if CACHE else None
    if plan is None:
        plan = build()
        if CACHE:
            if len(_PLANS) >= MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan
    return plan


def _layout(*tensors: torch.Tensor) -> tuple:
    """Strides and pointer alignment of each tensor: with the shapes, dtype and device,
    what Triton specialises a launch on."""
    return tuple((t.stride(), t.data_ptr() % PTR_ALIGN) for t in tensors)


def _forward_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                  mode: int) -> _Launch:
    B, H, n_q, head_dim = q.shape
    n_kv = k.shape[2]

    def grid(meta):
        return (num_programs(n_q, meta["BLOCK_M"]) * B * H,)

    a = _stride_align(q, k, v, o)
    return _Launch(
        kernels._attn_fwd,
        (*_strides(q, a), *_strides(k, a), *_strides(v, a), *_strides(o, a),
         H, B * H, n_q, n_kv),
        dict(MODE=mode, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), STRIDE_ALIGN=a,
             DOT_PRECISION=_dot_precision(q.dtype)),
        grid,
    )


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str | bool, scale: float,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(O, row statistic)``: O (B, H, Nq, D) in the input dtype, and per query row
    in fp32 the natural log-sum-exp of ``|S|`` (cog) or ``S`` (softmax), the row sum
    ``N`` of ``s^2 / (1 + s^2)`` (expressive), or the row's bias (sigmoid: ``bias``, one
    value per head, default ``-log Nkv``; ignored by the other modes).  The backward reads
    it to recompute the weights.  Inputs are assumed validated (see
    ``uvic_kernels.attention``).
    """
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    mode = _mode_id(mode)
    if mode == MODE_IDS["sigmoid"]:  # an input of the kernels, which read it
        lse = sigmoid_bias_rows(q, k.shape[2], bias)
    else:
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        return o, lse
    q, qk_scale, _, _ = _kernel_scales(q, mode, scale)
    # o and lse are fresh allocations: their layout follows from q's shape
    key = ("fwd", mode, q.dtype, q.device, q.shape, k.shape, _layout(q, k, v))
    launch = _plan(key, lambda: _forward_plan(q, k, v, o, mode))
    with _device_guard(q):
        launch((q, k, v, o, lse), (qk_scale,))
    return o, lse


def _backward_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                   do: torch.Tensor, dq: torch.Tensor | None, dk: torch.Tensor | None,
                   dv: torch.Tensor | None, mode: int) -> tuple[_Launch | None, _Launch | None]:
    """``(dQ launch, Delta launch or None (sigmoid has no Delta), dK/dV launch or None)``."""
    B, H, n_q, head_dim = q.shape
    n_kv = k.shape[2]
    block_d = _block_d(head_dim)
    precision = _dot_precision(q.dtype)

    def grid_kv(meta):
        return (num_programs(n_kv, meta["BLOCK_N"]) * B * H,)

    def grid_q(meta):
        return (num_programs(n_q, meta["BLOCK_M"]) * B * H,)

    a = _stride_align(*(t for t in (q, k, v, o, do, dq, dk, dv) if t is not None))
    if dq is not None:
        first = _Launch(
            kernels._attn_bwd_dq,
            (*_strides(q, a), *_strides(k, a), *_strides(v, a), *_strides(o, a),
             *_strides(do, a), *_strides(dq, a),
             H, B * H, n_q, n_kv),
            dict(MODE=mode, HEAD_DIM=head_dim, BLOCK_D=block_d, STRIDE_ALIGN=a,
                 DOT_PRECISION=precision),
            grid_q,
        )
    elif mode == MODE_IDS["sigmoid"]:
        first = None
    else:
        first = _Launch(
            kernels._attn_bwd_preprocess,
            (*_strides(o, a), *_strides(do, a), H, n_q),
            dict(HEAD_DIM=head_dim, BLOCK_D=block_d, STRIDE_ALIGN=a, BLOCK_M=PREPROCESS_BLOCK_M),
            (triton.cdiv(n_q, PREPROCESS_BLOCK_M) * B * H,),
        )
    if dk is None:
        return first, None
    return first, _Launch(
        kernels._attn_bwd_dkdv,
        (*_strides(q, a), *_strides(k, a), *_strides(v, a), *_strides(do, a),
         *_strides(dk, a), *_strides(dv, a),
         H, B * H, n_q, n_kv),
        dict(MODE=mode, HEAD_DIM=head_dim, BLOCK_D=block_d, STRIDE_ALIGN=a,
             DOT_PRECISION=precision),
        grid_kv,
    )


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
    need_dbias: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """Return ``(dQ, dK, dV, dBias)`` (None where not needed), dQ, dK, dV in the input
    dtype; ``dBias`` (sigmoid only) is the gradient of the per-head bias, (H,) fp32.

    Launch order: dQ (which also writes Delta, or in sigmoid mode the row sums of dS,
    whose sum per head is dBias), then dK/dV; without dQ, a small kernel computes Delta
    first (sigmoid needs none; dBias needs the dQ kernel).  No atomics, and dBias is a
    sum in a fixed order: results are bit-identical run to run.
    """
    mode = _mode_id(mode)
    sigmoid = mode == MODE_IDS["sigmoid"]
    need_dbias = need_dbias and sigmoid
    # every element of dq / dk / dv is written by the kernels (nothing is accumulated,
    # no atomics), so autotuning needs no reset_to_zero / restore_value
    run_dq = need_dq or need_dbias  # the dQ kernel also sums dS for dBias
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if run_dq else None
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device) if need_dkdv else None
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device) if need_dkdv else None
    dbias = torch.zeros(q.shape[1], dtype=torch.float32, device=q.device) if need_dbias else None
    if q.numel() == 0 or k.numel() == 0:
        return (*(None if g is None else g.zero_() for g in (dq, dk, dv)), dbias)
    if not (run_dq or need_dkdv):
        return dq, dk, dv, dbias
    q, qk_scale, grad_scale, dq_sign = _kernel_scales(q, mode, scale)
    delta = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    # dq, dk, dv and delta are fresh allocations: their layout follows from the shapes
    key = ("bwd", mode, run_dq, need_dkdv, q.dtype, do.dtype, q.device, q.shape, k.shape,
           _layout(q, k, v, o, do, lse))
    first, dkdv = _plan(key, lambda: _backward_plan(q, k, v, o, do, dq, dk, dv, mode))
    with _device_guard(q):
        if run_dq:
            first((q, k, v, o, do, dq, lse, delta), (grad_scale * dq_sign, qk_scale))
        elif first is not None:
            first((o, do, delta), ())
        if need_dkdv:
            dkdv((q, k, v, do, dk, dv, lse, delta), (grad_scale, qk_scale))
    if need_dbias:
        dbias = delta.sum(dim=(0, 2))  # delta holds the row sums of dS here
    return (dq if need_dq else None), dk, dv, dbias


# fmt: on
