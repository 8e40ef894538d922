"""The stand-in GPU of ``python -m uvic_kernels.bench_host`` (the program): a Triton driver
for an H100 that is not there (compiles for sm_90, loads and launches nothing, records the
launches), the host path without this package's caches, and the calls it times.

Importing this module imports triton: a process that runs the kernels compiled must set
``TRITON_INTERPRET=0`` before (the program does).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import LazyDict

TARGET = GPUTarget("cuda", 90, 32)
H100_MAX_SMEM = 232448
H100_SMS = 132


class _Launcher:
    """Stands in for Triton's CUDA launcher: records the launches instead of running them."""

    record = False
    calls: ClassVar[list[tuple[str, tuple]]] = []

    def __init__(self, src: Any, metadata: Any):
        self.name = metadata.name

    def __call__(self, *args: Any) -> None:
        if _Launcher.record:
            _Launcher.calls.append((self.name, args))


class _Utils:
    def load_binary(self, name, kernel, shared, device):
        return 1, 2, 0, 0, 1024  # module, function, registers, spills, max threads

    def get_device_properties(self, device):
        return {"max_shared_mem": H100_MAX_SMEM, "multiprocessor_count": H100_SMS}


def _no_timing(kernel_call: Callable[[], Any], quantiles: Any = None, **kwargs: Any) -> Any:
    """The stand-in's benchmarker: runs nothing (so no launch is recorded) and gives every
    config the same time, so the autotuner keeps the first that survives pruning."""
    return [0.0] * len(quantiles) if quantiles else 0.0


class StandInDriver:
    """A Triton driver for an H100 that is not there: compiles for sm_90, launches nothing.

    Triton releases that benchmark even a single config left after pruning (3.6) ask the
    driver for a benchmarker (``get_benchmarker``): this one times nothing (``_no_timing``).
    """

    def __init__(self) -> None:
        self.utils = _Utils()
        self.launcher_cls = _Launcher

    def get_benchmarker(self) -> Callable[..., Any]:
        return _no_timing

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


@contextmanager
def uncached():
    """The host path without this package's caches: custom ops, every input check,
    Triton's autotuner and binder at every launch."""
    from uvic_kernels import fused_attention, launch

    saved = launch.CACHE, fused_attention._validate, fused_attention._plain
    launch.CACHE = False
    fused_attention._validate = fused_attention._check_inputs
    fused_attention._plain = lambda *tensors: False
    try:
        yield
    finally:
        launch.CACHE, fused_attention._validate, fused_attention._plain = saved


def best_us(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    """Best of ``repeats`` runs, microseconds per call."""
    for _ in range(max(1, calls // 4)):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def _calls(shape, dtype, mode):
    """The four measured calls on fresh inputs of ``shape``."""
    from uvic_kernels import attention, launch

    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(*shape, generator=gen).to(dtype) for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = launch.forward(q, k, v, mode, shape[-1] ** -0.5)

    def forward():
        with torch.no_grad():
            return attention(q, k, v, mode, backend="triton")

    def forward_backward():
        out = attention(*leaves, mode, backend="triton")
        return torch.autograd.grad(out, leaves, do)

    return {
        "attention forward (no_grad)": forward,
        "attention forward + backward": forward_backward,
        "launch.forward": lambda: launch.forward(q, k, v, mode, shape[-1] ** -0.5),
        "launch.backward": lambda: launch.backward(q, k, v, o, lse, do, mode, shape[-1] ** -0.5),
    }


def _recorded(fn: Callable[[], Any]) -> list[tuple[str, tuple]]:
    _Launcher.calls, _Launcher.record = [], True
    try:
        fn()
    finally:
        _Launcher.record = False
    return _Launcher.calls


def _same_launch(a: tuple[str, tuple], b: tuple[str, tuple]) -> bool:
    """Same kernel, grid, stream, function, metadata and arguments (tensors: same dtype,
    shape, strides and pointer alignment; fresh outputs are other allocations)."""
    if a[0] != b[0] or len(a[1]) != len(b[1]):
        return False
    for x, y in zip(a[1], b[1]):
        if isinstance(x, LazyDict) and isinstance(y, LazyDict):  # launch metadata for hooks
            x, y = x.get(), y.get()
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                return False
            if (x.dtype, x.shape, x.stride(), x.data_ptr() % 16) != (
                y.dtype, y.shape, y.stride(), y.data_ptr() % 16
            ):
                return False
        elif x != y:
            return False
    return True


def check(shape, dtype, mode) -> list[str]:
    """Problems found: the cached launches of forward + backward (all gradients, and dK/dV
    alone) against Triton's own launches of the same calls; empty when they agree."""
    from uvic_kernels import attention, launch

    problems = []
    calls = _calls(shape, dtype, mode)
    gen = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(*shape, generator=gen).to(dtype) for _ in range(4))
    k_leaf = k.clone().requires_grad_()

    def dkdv_only():  # the Delta kernel instead of dQ
        out = attention(q, k_leaf, v, mode, backend="triton")
        return torch.autograd.grad(out, (k_leaf,), do)

    for name, fn in (("forward + backward", calls["attention forward + backward"]),
                     ("dK/dV only", dkdv_only)):
        with uncached():
            reference = _recorded(fn)
        launch.clear_cache()
        before = launch.cache_info()
        first, second = _recorded(fn), _recorded(fn)
        after = launch.cache_info()
        if after["hits"] - before["hits"] != len(second):
            problems.append(f"{name}: the second call did not take the cached path ({after})")
        for label, got in (("first", first), ("cached", second)):
            if len(got) != len(reference) or not all(map(_same_launch, got, reference)):
                problems.append(f"{name}: the {label} call's launches differ from Triton's")
    return problems
