"""Training-step and sampling-forward speed of U-ViT vs U-ViC, per attention backend.

    python scripts/bench_train.py [--steps 20] [--out runs/bench/train.json]

For the paper's two settings, with the real U-ViT-S/2 / U-ViC-S/2 configs (random
weights: speed does not depend on them):

* CIFAR-10: batch 128, 32x32 pixels, patch 2 -> N = 257 tokens;
* MS-COCO: batch 64 (one GPU's share of the release's 256 on 4 GPUs), 32x32x4 latents
  and 77 CLIP tokens -> N = 334;

it times one training step (forward, backward and AdamW step under bf16 autocast, as
`uvic.training.trainer` runs it) and the sampling forward (no grad, batch 500), for each
attention backend of `model.attention_backend`:

* ``triton``: our fused kernels (Cog and softmax);
* ``torch``: the same algorithm in PyTorch (chunked; a correctness fallback);
* ``sdpa``: PyTorch's ``scaled_dot_product_attention`` (U-ViT only: softmax blocks).

It prints a markdown table (ms / step, images / s, peak memory) and writes JSON.  Without
CUDA it runs a tiny smoke configuration on the CPU and says that timings need a GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from uvic.config import Config, load_config
from uvic.diffusion.schedule import Diffusion, diffusion_loss
from uvic.models.checks import resolve_attention
from uvic.models.uvit import build_model
from uvic_kernels.fused_attention import BACKEND_MODES

REPO = Path(__file__).resolve().parents[1]
MIB = 1 << 20
SETTINGS = {"cifar10": 128, "mscoco": 64}  # training batch per GPU
SAMPLING_BATCH = 500
SMOKE = ["model.embed_dim=32", "model.depth=2", "model.num_heads=2", "model.img_size=8"]
SMOKE_BATCH = 2


def make_batch(cfg: Config, batch: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Random images (or latents) and, for text conditioning, random CLIP contexts."""
    m = cfg.model
    out = {"x": torch.randn(batch, m.in_chans, m.img_size, m.img_size, device=device)}
    if m.clip_dim > 0:
        out["context"] = torch.randn(batch, m.num_clip_token, m.clip_dim, device=device)
    return out


def timed_ms(fn: Callable[[], object], device: torch.device, steps: int) -> float:
    """Mean wall time of ``fn()`` over ``steps`` calls, in ms (CUDA-synchronised)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / steps * 1e3


def peak_mib(fn: Callable[[], object], device: torch.device) -> float | None:
    """Peak memory allocated during one ``fn()`` (CUDA only), in MiB."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / MIB


def bench_one(cfg: Config, batch: int, sampling_batch: int, steps: int,
              device: torch.device) -> dict[str, object]:
    """Training step and sampling forward of one (config, backend)."""
    torch.manual_seed(0)
    model = build_model(cfg.model).to(device)
    diffusion = Diffusion(cfg.diffusion)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr,
                                  weight_decay=cfg.optim.weight_decay, betas=cfg.optim.betas)
    data = make_batch(cfg, batch, device)
    generator = torch.Generator(device=device).manual_seed(0)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = diffusion_loss(model, diffusion, data, generator)
        loss.backward()
        optimizer.step()

    sample = make_batch(cfg, sampling_batch, device)
    t = torch.full((sampling_batch,), 500.0, device=device)

    def sampling_forward() -> None:
        with torch.no_grad(), autocast:
            model(sample["x"], t, context=sample.get("context"))

    row: dict[str, object] = {"batch": batch, "sampling_batch": sampling_batch}
    for name, fn, n in (("train", train_step, batch), ("sample", sampling_forward,
                                                         sampling_batch)):
        for _ in range(3):  # warm-up: autotuning, allocator, cuDNN heuristics
            fn()
        ms = timed_ms(fn, device, steps)
        row[f"{name}_ms"] = ms
        row[f"{name}_images_per_s"] = n / ms * 1e3
        row[f"{name}_peak_mib"] = peak_mib(fn, device)
    return row


def num_tokens(cfg: Config) -> int:
    """Sequence length the attention sees: patches, time token, label or text tokens."""
    m = cfg.model
    extras = 1 + (m.num_classes > 0) + (m.num_clip_token if m.clip_dim > 0 else 0)
    return (m.img_size // m.patch_size) ** 2 + extras


def backends_for(attention: str) -> list[str]:
    """The kernel backends that run every block of an attention preset (the kernels'
    BACKEND_MODES: sdpa runs U-ViT only). A preset's set of modes is the same at any depth."""
    modes = set(resolve_attention(attention, depth=2))
    return [b for b, runs in BACKEND_MODES.items() if modes <= set(runs)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps per cell")
    p.add_argument("--out", default="runs/bench/train.json")
    p.add_argument("--smoke", action="store_true", help="tiny CPU configuration")
    p.add_argument("--backends", default="triton,torch,sdpa",
                   help="comma-separated attention backends to time (default: all three)")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        print("No CUDA device (or --smoke): tiny smoke configuration on the CPU; "
              "timings need a GPU.")
    steps = args.steps if cuda else 1
    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(set(wanted) - set(backends_for("uvit")))
    if unknown or not wanted:
        p.error(f"--backends: unknown backend {unknown[0] if unknown else args.backends!r}; "
                f"choose from {', '.join(backends_for('uvit'))}")

    rows = []
    for dataset, batch in SETTINGS.items():
        for attention in ("uvit", "uvic"):
            for backend in (b for b in backends_for(attention) if b in wanted):
                if not cuda and backend == "triton":
                    continue  # the interpreter is a test tool, not a benchmark
                overrides = [f"model.attention_backend={backend}"] + ([] if cuda else SMOKE)
                cfg = load_config(REPO / "configs" / f"{dataset}_{attention}.py", overrides)
                cell = {"dataset": dataset, "model": attention, "backend": backend,
                        "tokens": num_tokens(cfg)}
                try:
                    cell.update(bench_one(cfg, batch if cuda else SMOKE_BATCH,
                                          SAMPLING_BATCH if cuda else SMOKE_BATCH, steps, device))
                    cell["status"] = "ok"
                except torch.cuda.OutOfMemoryError:
                    cell["status"] = "OOM"
                finally:
                    if cuda:
                        torch.cuda.empty_cache()
                rows.append(cell)
                print(f"{dataset} {attention} {backend}: {cell.get('train_ms', float('nan')):.1f}"
                      " ms/step", flush=True)

    name = torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu"
    header = (f"Training step (fwd+bwd+AdamW, bf16 autocast) and sampling forward on {name}"
              f"{'' if cuda else ' (smoke, CPU: not a timing)'}, torch {torch.__version__}:")
    lines = [header, "",
             "| dataset (N) | model | attention backend | batch | train ms/step | train images/s | "
             "train peak MiB | sampling batch | sampling ms | sampling images/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def fmt(value: object, digits: int = 1) -> str:
        return "—" if value is None else f"{value:.{digits}f}"

    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['dataset']} ({r['tokens']}) | {r['model']} | {r['backend']} | "
                         f"{r['status']} |||||||")
            continue
        lines.append(f"| {r['dataset']} ({r['tokens']}) | {r['model']} | {r['backend']} | "
                     f"{r['batch']} | "
                     f"{fmt(r['train_ms'])} | {fmt(r['train_images_per_s'], 0)} | "
                     f"{fmt(r['train_peak_mib'], 0)} | {r['sampling_batch']} | "
                     f"{fmt(r['sample_ms'])} | {fmt(r['sample_images_per_s'], 0)} |")
    table = "\n".join(lines)
    print("\n" + table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": name, "cuda": cuda, "smoke": not cuda,
                               "torch": torch.__version__, "steps": steps, "results": rows,
                               "table": table}, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
