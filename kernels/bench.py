"""Benchmark the fused Cog / softmax / expressive / sigmoid kernels against PyTorch attention.

Run on a GPU: ``python -m uvic_kernels.bench [--out runs/bench/kernels.json]`` (installed
as ``uvic-bench-kernels``).  For each shape (B, H, N, D) and method it measures forward and
forward+backward time, TFLOP/s and peak extra memory; a cell that fails reports ``OOM``,
``n/a`` or ``error`` and the run goes on.  Without CUDA it runs a small CPU smoke
configuration.  The methods and the measurement: kernels/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GPU_SHAPES = [
    (128, 8, 257, 64),  # U-ViT-S/2 on CIFAR-10 (256 patches + time token)
    (256, 8, 334, 64),  # U-ViT-S/2 on MS-COCO latents (256 + time + 77 text tokens)
    (32, 8, 1024, 64),
    (4, 8, 4096, 64),
    (1, 8, 16384, 64),
]
SMOKE_SHAPES = [(1, 2, 64, 32)]
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --dtype -> torch dtype


def _parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    shapes = []
    for part in text.split(";"):
        dims = tuple(int(x) for x in part.split(","))
        if len(dims) != 4:
            raise argparse.ArgumentTypeError(f"shape {part!r} is not B,H,N,D")
        shapes.append(dims)
    return shapes


def _parse_methods(text: str) -> list[str]:
    """argparse type of --methods: known method names (imports torch, only when given)."""
    import torch

    from uvic_kernels.bench_cells import methods

    names = [name.strip() for name in text.split(",") if name.strip()]
    known = set(methods(torch.device("cuda"))) | set(methods(torch.device("cpu")))
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        bad = unknown[0] if unknown else text
        raise argparse.ArgumentTypeError(
            f"unknown method {bad!r}; known: {', '.join(sorted(known))}"
        )
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (no torch imported: ``--help`` answers at once)."""
    parser = argparse.ArgumentParser(
        prog="python -m uvic_kernels.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default="runs/bench/kernels.json", help="JSON output path")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="bf16 on a GPU, fp32 on the CPU"
    )
    parser.add_argument(
        "--shapes", type=_parse_shapes, default=None, help='e.g. "128,8,257,64;4,8,4096,64"'
    )
    parser.add_argument(
        "--methods", type=_parse_methods, default=None,
        help='comma-separated method names to run (default: all), e.g. "cog (ours),sdpa flash"',
    )
    parser.add_argument("--no-cuda-graphs", action="store_true", help="skip CUDA-graph timings")
    parser.add_argument("--smoke", action="store_true", help="CPU smoke configuration")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns 0.  See ``--help``."""
    args = parse_args(argv)
    import torch  # and triton, the kernels: once the arguments parse

    from uvic_kernels.bench_cells import bench_cell, environment, markdown_table, methods

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    on_gpu = device.type == "cuda"
    dtype = getattr(torch, DTYPES[args.dtype or ("bf16" if on_gpu else "fp32")])
    shapes = args.shapes or (GPU_SHAPES if on_gpu else SMOKE_SHAPES)
    env = environment(device)

    print(f"# uvic_kernels attention benchmark ({dtype})".replace("torch.", ""))
    print(", ".join(f"{k}: {v}" for k, v in env.items()))
    if not on_gpu:
        print(
            "\nNo CUDA device: smoke run on the CPU only. Timings need a GPU (H100/H200); "
            "these numbers are not performance figures."
        )
    print()

    rows = []
    for shape in shapes:
        # Fresh torch.compile state per shape: every shape (and grad mode) is another
        # graph of the same function, and past torch._dynamo's recompile limit (8)
        # "cog eager compiled" would silently fall back to eager for the later shapes.
        torch.compiler.reset()
        for name, fn in methods(device).items():
            if args.methods is None or name in args.methods:
                rows.append(bench_cell(name, fn, shape, dtype, device, not args.no_cuda_graphs))
                # one line per cell as it finishes: a run cut short keeps what it measured
                print(markdown_table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(markdown_table(rows))

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"environment": env, "dtype": str(dtype), "smoke": not on_gpu, "results": rows}
    out.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
