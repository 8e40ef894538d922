"""Sampling speed of U-ViT and U-ViC per network evaluation, and the time of FID runs.

    uvic-bench-sampling [--compile off,reduce-overhead] [--precision fp16] [--out FILE]

Times the network call the solvers make (and, for latent configs, the VAE decoding) per
dataset config, model, attention backend and `sample.compile` mode, on random weights, and
projects the wall time of a 50k-sample FID run under each protocol. Without CUDA (or with
`--smoke`) it runs a tiny CPU configuration whose figures are not timings
(kernels/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from uvic.cli import summary
from uvic.config import Config, ConfigError, load_config
from uvic.config.sampling import COMPILE_MODES, PRECISIONS
from uvic.experiments.records import environment, write_records
from uvic.experiments.speed import (
    SAMPLING_SMOKE_SIZE,
    SMOKE_BATCH,
    bench_decode,
    bench_network,
    smoke_model,
)
from uvic.presets import preset_path

if TYPE_CHECKING:
    import torch

FID_50K = 50_000
BATCHES = {"cifar10": 500, "mscoco": 50}  # images per sampling batch (--*-batch)
MODELS = ("uvit", "uvic")
RECORD_KEYS = ("dataset", "model", "backend", "compile", "batch", "ms_per_eval",
               "images_per_s_per_eval", "protocol", "evals_per_image",
               "projected_50k_minutes", "peak_mib")


def protocols(dataset: str, cfg: Config) -> list[dict[str, Any]]:
    """The release's FID protocol of `dataset` and the preset's own where it differs:
    label, sample count and network evaluations per image (guidance doublings included)."""
    from uvic.diffusion.guidance_interval import network_passes, sampling_passes
    from uvic.diffusion.schedule import Diffusion
    from uvic.evaluation.protocols import RELEASE, protocol_of

    diffusion = Diffusion(cfg.diffusion)
    own = protocol_of(cfg)  # autoguidance included
    found = []  # (protocol, network passes per image)
    if dataset in RELEASE:
        p = RELEASE[dataset]
        found.append((p, network_passes(diffusion, (), p.sampler, p.steps,
                                        cfg_guided=p.guidance != 0)))
    if not found or own != found[0][0]:
        found.append((own, sampling_passes(cfg, diffusion)))
    return [{"protocol": p.label(), "n_samples": p.n_samples, "evals_per_image": passes}
            for p, passes in found]


def projected_minutes(n: int, evals_per_image: int, images_per_s_per_eval: float,
                      decode_images_per_s: float | None) -> float:
    """Wall time of sampling (and decoding) n images on one device, in minutes."""
    decode = n / decode_images_per_s if decode_images_per_s else 0.0
    return (n * evals_per_image / images_per_s_per_eval + decode) / 60.0


def dataset_records(dataset: str, args: argparse.Namespace, device: torch.device,
                    smoke: bool) -> list[dict[str, Any]]:
    """Every (model, backend, compile, protocol) record of one dataset config."""
    import torch

    from uvic.sampling.assets import is_latent

    images = SMOKE_BATCH if smoke else getattr(args, f"{dataset}_batch")
    records = []
    decode = None
    for model in args.models:
        for backend in args.backends:
            try:
                cfg = load_config(preset_path(f"{dataset}_{model}"))
            except ConfigError as err:
                print(f"{dataset} {model} {backend}: skipped ({err})", flush=True)
                continue
            cfg.model.attention_backend = backend
            cfg = smoke_model(cfg, SAMPLING_SMOKE_SIZE) if smoke else cfg
            if decode is None and is_latent(cfg.data):
                decode = bench_decode(images, cfg.model.img_size, args.precision, args.repeats,
                                      device, smoke)
            for mode in args.compile:
                row = {"dataset": dataset, "model": model, "backend": backend, "compile": mode,
                       "precision": args.precision,
                       **bench_network(cfg, images, mode, args.precision, args.iters,
                                        args.repeats, device),
                       "decode_images_per_s": decode}
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                print(f"{dataset} {model} {backend} {mode}: {row['ms_per_eval']:.2f} ms per "
                      f"call of {row['batch']} rows", flush=True)
                for p in protocols(dataset, cfg):
                    rate = row["images_per_s_per_eval"]
                    records.append({**row, **p, "projected_50k_minutes": projected_minutes(
                        FID_50K, p["evals_per_image"], rate, decode),
                        "projected_minutes": projected_minutes(
                            p["n_samples"], p["evals_per_image"], rate, decode)})
    return records


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("--compile", default="off",
                   help=f"comma-separated sample.compile modes ({', '.join(COMPILE_MODES)})")
    p.add_argument("--datasets", default=",".join(BATCHES), help="comma-separated")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    p.add_argument("--backends", default=None, help="comma-separated attention backends "
                   "(default: triton on CUDA, torch on the CPU; sdpa runs U-ViT only)")
    p.add_argument("--precision", choices=sorted(PRECISIONS), default="fp16",
                   help="autocast dtype (CUDA only; default fp16 as the release)")
    p.add_argument("--cifar10-batch", "--cifar-batch", type=int, default=BATCHES["cifar10"],
                   help=f"CIFAR-10 images per sampling batch (default {BATCHES['cifar10']})")
    p.add_argument("--mscoco-batch", "--coco-batch", type=int, default=BATCHES["mscoco"],
                   help=f"MS-COCO images per sampling batch (default {BATCHES['mscoco']})")
    p.add_argument("--iters", type=int, default=20, help="network calls per timing")
    p.add_argument("--repeats", type=int, default=3, help="timings (the median is kept)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU configuration")
    p.add_argument("--out", default=None, help="JSON record file (default: on a GPU "
                   "kernels/results/<date>_<device>_sampling.json, else "
                   "runs/bench/sampling.json)")
    args = p.parse_args(argv)
    for name, allowed in (("compile", COMPILE_MODES), ("datasets", tuple(BATCHES)),
                          ("models", MODELS)):
        given = [v.strip() for v in getattr(args, name).split(",") if v.strip()]
        bad = [v for v in given if v not in allowed] or ([] if given else [""])
        if bad:
            p.error(f"--{name}: {bad[0]!r} is not one of {', '.join(allowed)}")
        setattr(args, name, given)
    if min(args.iters, args.repeats, args.cifar10_batch, args.mscoco_batch) < 1:
        p.error("--iters, --repeats and the batches must be >= 1")
    if args.backends is not None:
        from uvic_kernels.fused_attention import BACKENDS  # torch: once the rest parses

        args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
        bad = [b for b in args.backends if b not in BACKENDS] or ([] if args.backends else [""])
        if bad:
            p.error(f"--backends: {bad[0]!r} is not one of {', '.join(BACKENDS)}")
    return args


def markdown_table(records: list[dict[str, Any]], header: str) -> str:
    """The records as a markdown table under `header`."""
    lines = [header, "", "| dataset | model | backend | compile | batch (rows) | ms / eval | "
             "images/s / eval | peak MiB | protocol | evals / image | 50k samples, min | "
             "protocol's n, min |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        peak = "—" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        lines.append(
            f"| {r['dataset']} | {r['model']} | {r['backend']} | {r['compile']} | {r['batch']} | "
            f"{r['ms_per_eval']:.2f} | {r['images_per_s_per_eval']:.0f} | {peak} | "
            f"{r['protocol']} | {r['evals_per_image']} | {r['projected_50k_minutes']:.1f} | "
            f"{r['n_samples']:,}: {r['projected_minutes']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    args = parse_args(argv)
    import torch

    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        print("No CUDA device (or --smoke): tiny smoke configuration on the CPU in fp32; its "
              "figures are not timings.")
        args.precision = "fp32"  # autocast is CUDA's (uvic.sampling.generate.autocast)
    args.backends = args.backends or ["triton" if cuda else "torch"]
    env = environment(device)
    records = [r for dataset in args.datasets
               for r in dataset_records(dataset, args, device, smoke=not cuda)]
    table = markdown_table(records, f"Sampling network calls on {env['device']} "
                           f"({args.precision if cuda else 'smoke, CPU: not a timing'}), "
                           f"torch {env['torch']}:")
    print("\n" + table)
    write_records(args.out, "sampling", env, {"smoke": not cuda, "precision": args.precision,
                                               "iters": args.iters, "repeats": args.repeats},
                  records, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
