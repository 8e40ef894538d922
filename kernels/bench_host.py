"""Host time of one attention call, measured without a GPU.

Triton compiles the kernels for sm_90 (as for an H100) against a stand-in driver that
loads nothing and launches nothing; CPU tensors stand in for CUDA ones.  Everything else
a call does on a GPU runs as it would there: the input checks, autograd, the custom ops
or the direct eager path, the output allocations (here by the CPU allocator), the launch
cache or Triton's autotuner and binder, down to the arguments handed to the launcher.
Not measured: Triton's launcher itself (argument packing and ``cuLaunchKernel``), CUDA
allocations and the device guard.

    python -m uvic_kernels.bench_host [--shape 2,8,257,64] [--dtype bf16] [--mode cog]

prints microseconds per call (best of ``--repeats`` runs of ``--calls`` calls) for the
forward under ``no_grad``, forward + backward (``torch.autograd.grad``) and the launch
functions alone, on the lean path and on the path without caches (the custom ops, every
input check, Triton's autotuner and binder at every launch: the host path before the
launch cache).  ``--check`` only verifies that the cached launches hand the launcher the
same arguments as Triton's own path (exit status 1 if not).

Run as a program it compiles (never interprets) with ``UVIC_KERNELS_AUTOTUNE=0`` (the
stand-in driver cannot time configs); importing it changes no environment variable.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any, ClassVar

if __name__ == "__main__":  # before triton and uvic_kernels.tiles read them
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ["UVIC_KERNELS_AUTOTUNE"] = "0"

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import LazyDict

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
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


class StandInDriver:
    """A Triton driver for an H100 that is not there: compiles for sm_90, launches nothing."""

    def __init__(self) -> None:
        self.utils = _Utils()
        self.launcher_cls = _Launcher

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="2,8,257,64", help="B,H,N,D")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--mode", choices=("cog", "softmax", "expressive"), default="cog")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--check", action="store_true", help="only compare the launches")
    args = parser.parse_args(argv)
    try:
        shape = tuple(int(x) for x in args.shape.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        parser.error(f"--shape must be four positive integers B,H,N,D, got {args.shape!r}")
    from uvic_kernels.tiles import INTERPRET

    if INTERPRET:
        parser.error("run as a program (python -m uvic_kernels.bench_host): the kernels are "
                     "interpreted in this process")
    triton.runtime.driver.set_active(StandInDriver())
    from uvic_kernels import fused_attention, launch

    implementation = fused_attention._implementation
    # CPU tensors stand in for CUDA ones: the "triton" backend takes them here
    fused_attention._implementation = lambda backend, device: (
        launch if backend == "triton" else implementation(backend, device))
    dtype = DTYPES[args.dtype]
    problems = check(shape, dtype, args.mode)
    for problem in problems:
        print(problem, file=sys.stderr)
    verdict = "DIFFER from" if problems else "hand the launcher the same arguments as"
    print(f"cached launches {verdict} Triton's own path")
    if args.check:
        return 1 if problems else 0
    print(f"host time per call, us (shape {shape}, {args.dtype}, {args.mode}; "
          f"best of {args.repeats} x {args.calls} calls; the launcher itself not included)")
    print("| call | without caches | lean path |")
    print("|---|---|---|")
    for name, fn in _calls(shape, dtype, args.mode).items():
        with uncached():
            slow = best_us(fn, args.calls, args.repeats)
        fast = best_us(fn, args.calls, args.repeats)
        print(f"| {name} | {slow:.1f} | {fast:.1f} |")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
