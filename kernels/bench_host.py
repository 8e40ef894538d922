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

Run as a program (``main``; installed as the command ``uvic-bench-host``) it compiles
(never interprets) with ``UVIC_KERNELS_AUTOTUNE=0`` (the stand-in driver cannot time
configs); importing it changes no environment variable and imports neither torch nor
triton. The stand-in driver and the timed calls are in ``uvic_kernels.standin_driver``.
"""

from __future__ import annotations

import argparse
import os
import sys

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --dtype -> torch dtype


def main(argv: list[str] | None = None) -> int:
    """Run the program; returns the exit status (1 when the launches differ)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="2,8,257,64", help="B,H,N,D")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                        help="input dtype (default bf16)")
    parser.add_argument("--mode", choices=("cog", "softmax", "expressive", "sigmoid"),
                        default="cog", help="attention mode (default cog)")
    parser.add_argument("--calls", type=int, default=300,
                        help="calls per timed run (default 300)")
    parser.add_argument("--repeats", type=int, default=7,
                        help="timed runs; the best is kept (default 7)")
    parser.add_argument("--check", action="store_true", help="only compare the launches")
    args = parser.parse_args(argv)
    try:
        shape = tuple(int(x) for x in args.shape.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        parser.error(f"--shape must be four positive integers B,H,N,D, got {args.shape!r}")
    # compiled, never interpreted; the stand-in driver cannot time autotuning configs
    os.environ["TRITON_INTERPRET"] = "0"  # before triton and uvic_kernels.tiles read them
    os.environ["UVIC_KERNELS_AUTOTUNE"] = "0"
    import torch
    import triton

    from uvic_kernels.standin_driver import StandInDriver, _calls, best_us, check, uncached
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
    dtype = getattr(torch, DTYPES[args.dtype])
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
