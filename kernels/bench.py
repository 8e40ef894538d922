"""Benchmark the fused Cog / softmax kernels against PyTorch attention.

Run ``python -m uvic_kernels.bench [--out runs/bench/kernels.json]`` on a GPU.  For
each shape (B, H, N, D) and method it measures forward and forward+backward time
(median, ``triton.testing.do_bench``; also with CUDA graphs for small shapes),
TFLOP/s (forward ``4*B*H*N^2*D``, backward 2.5x that) and the peak extra memory
(``torch.cuda.max_memory_allocated`` above the inputs).  Methods:

* ``cog (ours)``, ``softmax (ours)``, ``expressive (ours)``: :func:`uvic_kernels.attention`;
* ``sdpa flash``, ``sdpa cudnn``: PyTorch SDPA with one backend forced (softmax);
* ``cog eager``: the paper's Figure 3 form ``sign(S) * softmax(|S|) @ V`` (N x N);
* ``cog eager compiled``: ``torch.compile`` of the eager form.

A cell that runs out of memory reports ``OOM``, an unsupported one ``n/a``, any other
failure ``error`` (with the message in the JSON); the run goes on with the next cell.
Without CUDA the script runs a small smoke configuration on the CPU and says that
timings need a GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from uvic_kernels.fused_attention import attention
from uvic_kernels.reference import (
    cog_attention_reference,
    expressive_attention_reference,
    softmax_attention_reference,
)

GPU_SHAPES = [
    (128, 8, 257, 64),  # U-ViT-S/2 on CIFAR-10 (256 patches + time token)
    (256, 8, 334, 64),  # U-ViT-S/2 on MS-COCO latents (256 + time + 77 text tokens)
    (32, 8, 1024, 64),
    (4, 8, 4096, 64),
    (1, 8, 16384, 64),
]
SMOKE_SHAPES = [(1, 2, 64, 32)]
CUDA_GRAPH_MAX_FLOP = 1e11  # also time with CUDA graphs below this forward FLOP count
BWD_FLOP_FACTOR = 2.5  # backward = 2.5x the forward matmul FLOPs (5 vs 2 products)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MIB = 1 << 20
COLUMNS = [  # (JSON key, table title)
    ("fwd_ms", "fwd ms"),
    ("fwd_tflops", "fwd TFLOP/s"),
    ("fwd_bwd_ms", "fwd+bwd ms"),
    ("fwd_bwd_tflops", "fwd+bwd TFLOP/s"),
    ("fwd_ms_cuda_graph", "fwd ms (CUDA graph)"),
    ("fwd_bwd_ms_cuda_graph", "fwd+bwd ms (CUDA graph)"),
    ("fwd_peak_mib", "fwd peak MiB"),
    ("fwd_bwd_peak_mib", "fwd+bwd peak MiB"),
    ("max_abs_err", "max abs err vs fp32"),
]


def forward_flop(shape: tuple[int, int, int, int]) -> float:
    """FLOPs of the two forward matrix products, ``4 * B * H * N^2 * D``."""
    b, h, n, d = shape
    return 4.0 * b * h * n * n * d


def cog_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Cog attention as in the paper's Figure 3 (faster form), materialising N x N."""
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    return (torch.sign(s) * torch.softmax(s.abs(), dim=-1)) @ v


def _sdpa(backend_name: str) -> Callable[..., torch.Tensor]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v)

    return run


def methods(device: torch.device) -> dict[str, Callable[..., torch.Tensor]]:
    """Name -> callable(q, k, v) for the methods available on ``device``."""
    if device.type != "cuda":
        table = {
            "cog (ours, torch)": lambda q, k, v: attention(q, k, v, "cog", backend="torch"),
            "softmax (ours, torch)": lambda q, k, v: attention(q, k, v, "softmax", backend="torch"),
            "cog eager": cog_eager,
        }
        if os.environ.get("TRITON_INTERPRET", "0") == "1":
            table["cog (ours, interpreter)"] = lambda q, k, v: attention(
                q, k, v, "cog", backend="triton"
            )
        return table
    return {
        "cog (ours)": lambda q, k, v: attention(q, k, v, "cog"),
        "softmax (ours)": lambda q, k, v: attention(q, k, v, "softmax"),
        "expressive (ours)": lambda q, k, v: attention(q, k, v, "expressive"),
        "sdpa flash": _sdpa("FLASH_ATTENTION"),
        "sdpa cudnn": _sdpa("CUDNN_ATTENTION"),
        "cog eager": cog_eager,
        "cog eager compiled": torch.compile(cog_eager, dynamic=False),
    }


def _max_abs_err(
    name: str, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> float:
    """Max abs difference to the fp32 PyTorch formula, on the (batch, head) slices given.

    The reference builds the N x N score matrix in fp32, so callers pass a single
    head: at N = 16384 that is 1 GiB per intermediate instead of 8 GiB for 8 heads.
    """
    q, k, v = (x.detach().float() for x in (q, k, v))
    if name.startswith("cog"):
        ref = cog_attention_reference(q, k, v)
    elif name.startswith("expressive"):
        ref = expressive_attention_reference(q, k, v)
    else:
        ref = softmax_attention_reference(q, k, v)
    return (out.float() - ref).abs().max().item()


def _time_ms(fn: Callable[[], object], device: torch.device, cuda_graph: bool) -> float:
    if device.type != "cuda":
        fn()
        reps, start = 3, time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps * 1e3
    import triton.testing

    if cuda_graph:
        return triton.testing.do_bench_cudagraph(fn, return_mode="median")
    return triton.testing.do_bench(fn, return_mode="median")


def _peak_mib(fn: Callable[[], object], device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / MIB


def _measure(
    row: dict[str, object],
    name: str,
    fn: Callable[..., torch.Tensor],
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    cuda_graphs: bool,
) -> None:
    """Fill ``row`` with the measurements of one (method, shape).

    A separate function, so that its tensors are freed as soon as it returns or
    raises (before ``bench_cell`` empties the CUDA cache for the next cell).
    """
    flop = forward_flop(shape)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(shape, device=device, dtype=dtype, generator=gen).requires_grad_()
        for _ in range(3)
    )
    do = torch.randn(shape, device=device, dtype=dtype, generator=gen)

    def fwd() -> torch.Tensor:
        with torch.no_grad():
            return fn(q, k, v)

    def fwd_bwd() -> object:
        return torch.autograd.grad(fn(q, k, v), (q, k, v), do)

    fwd_bwd()  # compile / autotune outside the timed region
    fwd()  # (torch.compile traces the no-grad forward separately)
    row["fwd_ms"] = _time_ms(fwd, device, cuda_graph=False)
    row["fwd_bwd_ms"] = _time_ms(fwd_bwd, device, cuda_graph=False)
    row["fwd_tflops"] = flop / row["fwd_ms"] / 1e9
    row["fwd_bwd_tflops"] = (1 + BWD_FLOP_FACTOR) * flop / row["fwd_bwd_ms"] / 1e9
    row["fwd_peak_mib"] = _peak_mib(fwd, device)
    row["fwd_bwd_peak_mib"] = _peak_mib(fwd_bwd, device)
    if cuda_graphs and device.type == "cuda" and flop <= CUDA_GRAPH_MAX_FLOP:
        for key, f in (("fwd_ms_cuda_graph", fwd), ("fwd_bwd_ms_cuda_graph", fwd_bwd)):
            try:
                row[key] = _time_ms(f, device, cuda_graph=True)
            except Exception as exc:  # capture is optional: report, keep going
                row[key] = None
                row.setdefault("notes", []).append(f"{key}: {type(exc).__name__}: {exc}"[:300])
    try:  # accuracy on the first (batch, head): an OOM of the fp32 reference keeps the timings
        out = fwd()[:1, :1]
        row["max_abs_err"] = _max_abs_err(name, out, q[:1, :1], k[:1, :1], v[:1, :1])
    except torch.cuda.OutOfMemoryError:
        row["max_abs_err"] = None
        row.setdefault("notes", []).append("max_abs_err: OOM in the fp32 reference")


def bench_cell(
    name: str,
    fn: Callable[..., torch.Tensor],
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    cuda_graphs: bool,
) -> dict[str, object]:
    """Time one (method, shape); errors become a status string instead of numbers."""
    row: dict[str, object] = {"method": name, "shape": list(shape), "status": "ok"}
    try:
        _measure(row, name, fn, shape, dtype, device, cuda_graphs)
    except torch.cuda.OutOfMemoryError:
        row["status"] = "OOM"
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        # e.g. "No available kernel" from an SDPA backend forced on an unsupported input
        row["status"] = "n/a"
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    except Exception as exc:  # e.g. triton OutOfResources: one bad cell must not end the run
        row["status"] = "error"
        row["error"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def environment(device: torch.device) -> dict[str, object]:
    """Device name and library versions for the report header."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"CPU ({platform.processor() or platform.machine()})"
    return {
        "device": name,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda (torch build)": torch.version.cuda,
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
    }


def _fmt(value: object, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if math.isfinite(value) else str(value)
    return str(value)


def markdown_table(rows: list[dict[str, object]]) -> str:
    """Render the result rows as a markdown table."""
    columns = ["shape (B,H,N,D)", "method", *(title for _, title in COLUMNS)]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        if r["status"] != "ok":
            lines.append(f"| {shape} | {r['method']} | {r['status']} |" + " |" * (len(COLUMNS) - 1))
            continue
        cells = [r.get(key) for key, _ in COLUMNS]
        lines.append(f"| {shape} | {r['method']} | " + " | ".join(map(_fmt, cells)) + " |")
    return "\n".join(lines)


def _parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    shapes = []
    for part in text.split(";"):
        dims = tuple(int(x) for x in part.split(","))
        if len(dims) != 4:
            raise argparse.ArgumentTypeError(f"shape {part!r} is not B,H,N,D")
        shapes.append(dims)
    return shapes


def _parse_methods(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    known = set(methods(torch.device("cuda"))) | set(methods(torch.device("cpu")))
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        bad = unknown[0] if unknown else text
        raise argparse.ArgumentTypeError(
            f"unknown method {bad!r}; known: {', '.join(sorted(known))}"
        )
    return names


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns 0.  See ``--help``."""
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
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    on_gpu = device.type == "cuda"
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if on_gpu else torch.float32)
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
