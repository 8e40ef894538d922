"""Sampling throughput of U-ViT and U-ViC and the projected wall time of a full FID run.

    uvic-bench-sampling [--precision fp16] [--out runs/bench/sampling.json]
    # or: python scripts/bench_sampling.py ...

For CIFAR-10 (batch 500) and MS-COCO (batch 50, guidance on: every step runs a batch of
100) it times 50-step DPM-Solver++ sampling (`uvic.sampling.generate.sample_images`) of the real
U-ViT-S/2 and U-ViC-S/2 (configs/*_uvit.py, *_uvic.py; random weights: the speed does
not depend on them) and, for MS-COCO, the decoding of the latents by a randomly
initialised Stable Diffusion KL-f8 VAE (same architecture as sd-vae-ft-ema). The
projection multiplies by the protocol's sample count (50,000 / 30,000) for one GPU; it
leaves out writing PNGs and the Inception features (a few minutes).

Without CUDA it runs a tiny smoke configuration on the CPU and says the figures need a GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING

from uvic.config import Config, apply_overrides, load_config
from uvic.presets import preset_path
from uvic.sampling.checks import PRECISIONS

if TYPE_CHECKING:
    import torch

SMOKE = ["model.embed_dim=32", "model.depth=2", "model.num_heads=2", "model.img_size=8",
         "model.attention_backend=torch"]


def sd_vae() -> torch.nn.Module:
    """Stable Diffusion's KL-f8 autoencoder architecture, random weights (timing only)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, sample_size=256,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    )


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median wall time of fn() in seconds (CUDA-synchronised)."""
    import torch

    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def bench_config(cfg: Config, batch: int, steps: int, precision: str, repeats: int,
                 device: torch.device) -> dict:
    """Time `steps`-step sampling of one batch with the config's model and guidance."""
    import torch

    from uvic.diffusion.schedule import Diffusion
    from uvic.models.uvit import build_model
    from uvic.sampling.generate import autocast, effective_cfg_scale, sample_images

    torch.manual_seed(0)
    model = build_model(cfg.model).to(device).eval()
    diffusion = Diffusion(cfg.diffusion)
    m = cfg.model
    noise = torch.randn(batch, m.in_chans, m.img_size, m.img_size, device=device)
    context = uncond = None
    if m.clip_dim > 0:
        context = torch.randn(batch, m.num_clip_token, m.clip_dim, device=device)
        uncond = torch.randn(m.num_clip_token, m.clip_dim, device=device)
    scale = effective_cfg_scale(cfg)

    def run(n_steps: int) -> None:
        with autocast(device, precision):
            sample_images(model, diffusion, noise, context=context, uncond_context=uncond,
                          cfg_scale=scale, scheduler=cfg.sample.scheduler, steps=n_steps,
                          order=cfg.sample.order,
                          scheduler_kwargs=cfg.sample.scheduler_kwargs)

    run(2)  # warm-up: kernel compilation and autotuning, allocator
    seconds = timed(lambda: run(steps), device, repeats)
    result = {"name": cfg.name, "attention": m.attention, "batch": batch, "steps": steps,
              "guidance": scale, "forward_batch": batch * (2 if scale else 1),
              "seconds_per_batch": seconds, "images_per_s": batch / seconds}
    return result


def bench_decode(batch: int, latent: int, precision: str, repeats: int,
                 device: torch.device, vae: torch.nn.Module) -> float:
    """Images per second of VAE decoding (batch latents of 4 x latent x latent)."""
    import torch

    from uvic.sampling.generate import autocast

    z = torch.randn(batch, 4, latent, latent, device=device)

    def run() -> None:
        with torch.inference_mode(), autocast(device, precision):
            vae.decode(z)

    run()
    return batch / timed(run, device, repeats)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--precision", choices=sorted(PRECISIONS), default="fp16",
                   help="autocast dtype (CUDA only; default fp16 as the release)")
    p.add_argument("--cifar-batch", type=int, default=500)
    p.add_argument("--coco-batch", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="runs/bench/sampling.json")
    return p.parse_args(argv)


def run_configs(args: argparse.Namespace, device: torch.device, steps: int,
                repeats: int) -> list[dict]:
    """Sampling throughput of both models on both datasets (MS-COCO: with VAE decoding on
    CUDA) and the projected time of a full FID run."""
    import torch

    from uvic.evaluation.fid import PROTOCOL_N

    cuda = device.type == "cuda"
    smoke = [] if cuda else SMOKE
    batches = {"cifar10": args.cifar_batch, "mscoco": args.coco_batch} if cuda else {
        "cifar10": 4, "mscoco": 2}
    rows = []
    for dataset in ("cifar10", "mscoco"):
        decode_ips = None
        if dataset == "mscoco":
            vae = sd_vae().to(device).eval() if cuda else None
            decode_ips = (bench_decode(args.coco_batch, 32, args.precision, repeats, device, vae)
                          if cuda else None)
            del vae
        for attention in ("uvit", "uvic"):
            cfg = load_config(preset_path(f"{dataset}_{attention}"), smoke)
            if not cuda:
                cfg = apply_overrides(cfg, ["model.in_chans=4"] if dataset == "mscoco" else [])
            r = bench_config(cfg, batches[dataset], steps, args.precision, repeats, device)
            if cuda:
                torch.cuda.empty_cache()
            n = PROTOCOL_N[dataset]
            per_image = 1 / r["images_per_s"] + (1 / decode_ips if decode_ips else 0.0)
            r.update(dataset=dataset, decode_images_per_s=decode_ips, fid_n=n,
                     projected_fid_hours=n * per_image / 3600)
            rows.append(r)
            print(f"{cfg.name}: {r['images_per_s']:.1f} images/s", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    args = parse_args(argv)
    import torch

    from uvic.evaluation.fid import versions

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    steps, repeats = (args.steps, args.repeats) if cuda else (3, 1)
    if not cuda:
        print("No CUDA device: tiny smoke configuration on the CPU; the figures need a GPU.")
    rows = run_configs(args, device, steps, repeats)

    name = torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu"
    lines = [f"Sampling throughput on {name} ({'smoke, CPU' if not cuda else args.precision}, "
             f"{steps}-step DPM-Solver++):", "",
             "| config | batch (fwd) | s / batch | images/s | VAE decode images/s | "
             "projected FID run (1 GPU) |", "|---|---|---|---|---|---|"]
    for r in rows:
        decode = "—" if r["decode_images_per_s"] is None else f"{r['decode_images_per_s']:.0f}"
        lines.append(f"| {r['name']} | {r['batch']} ({r['forward_batch']}) | "
                     f"{r['seconds_per_batch']:.2f} | {r['images_per_s']:.1f} | {decode} | "
                     + (f"{r['fid_n']:,} samples: {r['projected_fid_hours']:.2f} h |" if cuda
                        else "n/a (smoke run) |"))
    table = "\n".join(lines)
    print("\n" + table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": name, "cuda": cuda, "precision": args.precision,
                               "steps": steps, "results": rows, "table": table,
                               "versions": versions()}, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
