"""The cells of the kernel benchmark (``python -m uvic_kernels.bench`` is the program):
the methods compared, the measurement of one (method, shape) and the markdown table."""

from __future__ import annotations

import gc
import math
import os
import platform
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from uvic_kernels import reference
from uvic_kernels.fused_attention import attention
from uvic_kernels.modes import DESIGN, DESIGNS

CUDA_GRAPH_MAX_FLOP = 1e11  # also time with CUDA graphs below this forward FLOP count
BWD_FLOP_FACTOR = 2.5  # backward = 2.5x the forward matmul FLOPs (5 vs 2 products)
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


def sigmoid_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Sigmoid attention ``sigmoid(S - log N) @ V`` (Gu et al. 2024), materialising N x N."""
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    return torch.sigmoid(s - math.log(k.shape[-2])) @ v


DIFF_LAMBDA = 0.8  # differential attention's lambda in the benchmark (its deepest lambda_init)


def _pair(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Differential attention's two query/key maps of width D/2 from (B, H, N, D) q and k,
    the values keeping width D (h heads of value width 2d)."""
    half = q.shape[-1] // 2
    return q[..., :half], k[..., :half], q[..., half:], k[..., half:]


def differential(backend: str | None = None) -> Callable[..., torch.Tensor]:
    """softmax(S1) - lambda softmax(S2) weighing V: two softmax-kernel calls sharing V, the
    queries and keys zero-padded to V's width (the U-ViT module's form)."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q1, k1, q2, k2 = _pair(q, k)
        half = q1.shape[-1]
        pad = (0, v.shape[-1] - half)
        maps = [attention(F.pad(a, pad), F.pad(b, pad), v, "softmax", half ** -0.5,
                          backend=backend) for a, b in ((q1, k1), (q2, k2))]
        return maps[0] - DIFF_LAMBDA * maps[1]

    return run


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
        table = {f"{m} (ours, torch)": _ours(m, "torch") for m in ("cog", "softmax", "sigmoid")}
        table["differential (ours, torch)"] = differential("torch")
        table["cog eager"] = cog_eager
        if os.environ.get("TRITON_INTERPRET", "0") == "1":
            table["cog (ours, interpreter)"] = _ours("cog", "triton")
        return table
    return {
        **{f"{d.name} (ours)": _ours(d.name) for d in DESIGNS if d.kernel},
        "differential (ours)": differential(),
        "sdpa flash": _sdpa("FLASH_ATTENTION"),
        "sdpa cudnn": _sdpa("CUDNN_ATTENTION"),
        "cog eager": cog_eager,
        "cog eager compiled": torch.compile(cog_eager, dynamic=False),
        "sigmoid eager compiled": torch.compile(sigmoid_eager, dynamic=False),
    }


def _ours(mode: str, backend: str | None = None) -> Callable[..., torch.Tensor]:
    return lambda q, k, v: attention(q, k, v, mode, backend=backend)


def _max_abs_err(
    name: str, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> float:
    """Max abs difference to the fp32 PyTorch formula, on the (batch, head) slices given.

    The reference builds the N x N score matrix in fp32, so callers pass a single
    head: at N = 16384 that is 1 GiB per intermediate instead of 8 GiB for 8 heads.
    """
    q, k, v = (x.detach().float() for x in (q, k, v))
    design = DESIGN.get(name.split()[0], DESIGN["softmax"])  # "sdpa ...": softmax
    if design.name == "differential":
        q1, k1, q2, k2 = _pair(q, k)
        ref = reference.differential_attention_reference(q1, k1, q2, k2, v, DIFF_LAMBDA,
                                                         q1.shape[-1] ** -0.5)
    else:
        ref = getattr(reference, design.reference)(q, k, v)  # sigmoid: bias -log N, as run
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
