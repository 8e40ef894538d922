"""Training-step speed of U-ViT vs U-ViC, per attention backend and compile mode, side by side.

    uvic-bench-train [--compile off,default,reduce-overhead,max-autotune] [--huge]
                     [--steps 20] [--profile] [--out FILE]   # or python scripts/bench_train.py

For the paper's two settings, with the real U-ViT-S/2 / U-ViC-S/2 configs (random
weights: speed does not depend on them):

* CIFAR-10: batch 128, 32x32 pixels, patch 2 -> N = 257 tokens;
* MS-COCO: batch 64 (one GPU's share of the release's 256 on 4 GPUs), 32x32x4 latents
  and 77 CLIP tokens -> N = 334;

and with `--huge` U-ViT-H/2 at ImageNet-256 latent size (configs/imagenet256_uvit_huge.py,
N = 258, batch 128) without and with gradient checkpointing, it times the trainer's
step: forward, loss, backward, AdamW and the EMA update, under bf16 autocast, with the
model compiled as `train.compile=<mode>` compiles it (`uvic.training.compile`: inductor,
fullgraph). Rows: every (dataset, model, attention backend, compile mode), where the
backends of `model.attention_backend` are

* ``triton``: our fused kernels (Cog and softmax);
* ``sdpa``: PyTorch's ``scaled_dot_product_attention`` (U-ViT only: softmax blocks);
* ``torch``: the same algorithm as ours in PyTorch (chunked; a correctness fallback).

Columns: ms / step (mean over `--steps` after `--warmup` steps, which include the
compilation), images / s, MFU (the model's matmul FLOPs, `uvic.models.flops`, over the
device's dense bf16 peak, `uvic.experiments.speed.PEAK_BF16_TFLOPS`; n/a for another
device) and peak memory.
It prints a markdown table and writes JSON (`kernels/results/README.md` has the schema):
by default `kernels/results/<date>_<device>_train.json` on a GPU. Without CUDA (or with
`--smoke`) it runs a tiny configuration on the CPU (our kernels' rows run PyTorch's
path, `torch`), writes `runs/bench/train.json` by default and says that timings need a
GPU. `--threads auto|N`: its CPU threads, as `uvic-train`'s (`uvic.cli.threads`).
`--release DIR` times uvic's step beside the U-ViT release's own code at the same size
instead (`uvic.cli.bench_release`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from uvic.cli import summary
from uvic.cli.threads import add_threads_option, apply_threads, choose_threads, threads_overrides
from uvic.config import ConfigError
from uvic.config.models import ATTENTION_PRESETS
from uvic.config.training import TRAIN_COMPILE_MODES
from uvic.experiments.profile import profile_lines
from uvic.experiments.records import environment, write_records
from uvic.experiments.speed import SMOKE_BATCH, Cell, peak_tflops, run_cell

SETTINGS = {"cifar10": 128, "mscoco": 64}  # training batch per GPU
HUGE = ("imagenet256", "imagenet256_uvit_huge", 128)  # dataset, preset, batch
GPU_COMPILE = ",".join(m for m in TRAIN_COMPILE_MODES if m != "max-autotune-no-cudagraphs")


def backends_for(attention: str) -> list[str]:
    """The kernel backends that run every block of an attention preset (the kernels'
    BACKEND_MODES: sdpa runs U-ViT only). A preset's set of modes is the same at any depth."""
    from uvic.config.models import resolve_attention
    from uvic_kernels.fused_attention import BACKEND_MODES

    modes = set(resolve_attention(attention, depth=2))
    return [b for b, runs in BACKEND_MODES.items() if modes <= set(runs)]


def plan_cells(args: argparse.Namespace, cuda: bool) -> list[Cell]:
    """The rows, in table order: each setting's models x backends x compile modes, then the
    U-ViT-H/2 rows (--huge) without and with gradient checkpointing. On a CPU our kernels'
    rows run PyTorch's path (the interpreter is a test tool, not a benchmark)."""
    backends = [b if cuda or b != "triton" else "torch" for b in args.backends]
    backends = list(dict.fromkeys(backends))  # triton -> torch on a CPU: once
    settings = [(d, f"{d}_{m}", m, SETTINGS[d], False) for d in args.datasets for m in args.models]
    if args.huge:
        dataset, preset, batch = HUGE
        settings += [(dataset, preset, "uvit", batch, ckpt) for ckpt in (False, True)]
    cells = []
    for dataset, preset, model, batch, ckpt in settings:
        for backend in (b for b in backends if b in backends_for(model)):
            cells += [Cell(dataset, preset, model, backend, mode,
                           batch if cuda else SMOKE_BATCH, ckpt) for mode in args.compile]
    return cells


def markdown_table(rows: list[dict[str, Any]], header: str, timed: bool = True) -> str:
    """The rows as a markdown table under `header`; without `timed` (a CPU smoke, whose
    one step after one warm-up measures the order rows ran in, not their speed) no
    timing columns, only whether each row ran."""
    columns = "| dataset (N) | model | attention backend | compile | grad ckpt | batch |"
    if not timed:
        lines = [header, "", f"{columns} ran |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['dataset']} ({r['tokens']}) | {r['model']} | {r['backend']} | "
                         f"{r['compile']} | {'yes' if r['grad_checkpointing'] else 'no'} | "
                         f"{r['batch']} | {'yes' if r['status'] == 'ok' else r['status']} |")
        return "\n".join(lines)
    lines = [header, "", f"{columns} ms/step | images/s | MFU | peak MiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def fmt(value: float | None, digits: int = 1, scale: float = 1.0, unit: str = "") -> str:
        return "n/a" if value is None else f"{value * scale:.{digits}f}{unit}"

    for r in rows:
        cells = (f"| {r['dataset']} ({r['tokens']}) | {r['model']} | {r['backend']} | "
                 f"{r['compile']} | {'yes' if r['grad_checkpointing'] else 'no'} | {r['batch']} |")
        if r["status"] != "ok":
            lines.append(f"{cells} {r['status']} | | | |")
            continue
        lines.append(f"{cells} {fmt(r['ms_per_step'])} | {fmt(r['images_per_s'], 0)} | "
                     f"{fmt(r['mfu'], 1, 100, '%')} | {fmt(r['peak_mib'], 0)} |")
    return "\n".join(lines)


def _choices(given: str, allowed: tuple[str, ...] | list[str], flag: str,
             parser: argparse.ArgumentParser) -> list[str]:
    """The comma-separated values of `flag`, each one of `allowed` (else a usage error)."""
    values = [v.strip() for v in given.split(",") if v.strip()]
    unknown = [v for v in values if v not in allowed]
    if unknown or not values:
        parser.error(f"{flag}: unknown value {unknown[0] if unknown else given!r}; "
                     f"choose from {', '.join(allowed)}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("--steps", type=int, default=20, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=5,
                   help="untimed steps first (compilation, autotuning, CUDA graphs)")
    p.add_argument("--out", default=None, help="JSON file (default: kernels/results/"
                   "<date>_<device>_train.json on a GPU, runs/bench/train.json on a CPU)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU configuration")
    p.add_argument("--backends", default="triton,sdpa",
                   help="attention backends: triton (ours), sdpa, torch (default triton,sdpa)")
    p.add_argument("--compile", default=None,
                   help=f"compile modes, comma-separated, of {', '.join(TRAIN_COMPILE_MODES)} "
                   f"(default: {GPU_COMPILE} on a GPU, off on a CPU)")
    p.add_argument("--datasets", default=",".join(SETTINGS), help="cifar10, mscoco")
    p.add_argument("--models", default="uvit,uvic",
                   help=f"attention presets to time, of {', '.join(ATTENTION_PRESETS)} "
                        "(default uvit,uvic)")
    p.add_argument("--huge", action="store_true",
                   help="add U-ViT-H/2 at ImageNet-256 latent size, batch 128, without and "
                   "with gradient checkpointing")
    p.add_argument("--profile", action="store_true",
                   help="also profile each row's step (torch.profiler): GPU busy fraction, "
                   "top host operators and kernels, in the printout and the JSON")
    p.add_argument("--release", default=None, metavar="DIR",
                   help="a checkout of the U-ViT release: time its libs/uvit.py model and "
                        "uvic's side by side on the CPU instead")
    p.add_argument("--release-size", choices=("quickstart", "small"), default="quickstart",
                   help="with --release: the quickstart's model (batch 32) or U-ViT-S/2 (8)")
    p.add_argument("--release-models", default="uvit,uvic",
                   help="with --release: uvic's attention presets to time (default uvit,uvic)")
    p.add_argument("--rounds", type=int, default=30,
                   help="with --release: timed rounds, each model one step per round")
    add_threads_option(p)
    args = p.parse_args(argv)
    try:
        threads_overrides(args)  # a bad --threads: one line, before torch loads
    except ConfigError as err:
        p.exit(2, f"error: {err}\n")
    from uvic_kernels.fused_attention import BACKENDS  # torch: once the other arguments parse

    args.backends = _choices(args.backends, BACKENDS, "--backends", p)
    if args.compile is not None:  # None: the device's default, chosen in main
        args.compile = _choices(args.compile, TRAIN_COMPILE_MODES, "--compile", p)
    args.datasets = _choices(args.datasets, tuple(SETTINGS), "--datasets", p)
    args.models = _choices(args.models, ATTENTION_PRESETS, "--models", p)

    args.release_models = _choices(args.release_models, ATTENTION_PRESETS, "--release-models", p)
    if args.release is not None and not (Path(args.release) / "libs" / "uvit.py").is_file():
        p.exit(2, f"error: --release {args.release}: no libs/uvit.py there (a checkout of the "
                  "U-ViT release is needed)\n")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    args = parse_args(argv)
    threads = choose_threads(args.threads or "auto")
    apply_threads(threads)
    import torch

    from uvic.training.compile import compile_note

    print(threads.line())
    if args.release is not None:
        return release_main(args, threads.threads)

    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    args.compile = args.compile or (GPU_COMPILE.split(",") if cuda else ["off"])
    if not cuda:
        print("No CUDA device (or --smoke): tiny smoke configuration on the CPU; "
              "timings need a GPU.")
    for mode in args.compile:
        note = compile_note(mode, device.type)
        if note is not None:
            print(note)
    peak = peak_tflops(torch.cuda.get_device_name(device)) if cuda else None
    steps, warmup = (args.steps, args.warmup) if cuda else (1, 1)
    rows = []
    for cell in plan_cells(args, cuda):
        rows.append(run_cell(cell, steps, warmup, device, peak, args.profile))
        r = rows[-1]
        result = r["status"] if r["status"] != "ok" else (
            f"{r['ms_per_step']:.1f} ms/step" if cuda else "ran (smoke: not a timing)")
        title = (f"{cell.dataset} {cell.model} {cell.backend} compile={cell.compile} "
                 f"grad ckpt={cell.grad_checkpointing}")
        print(f"{title}: {result}", flush=True)
        if "profile" in r:
            print("\n".join(profile_lines(f"  profile of {title}", r["profile"])), flush=True)
    env = environment(device)  # after the rows: its date is when the run ended
    table = markdown_table(rows, "Training step (fwd+bwd+AdamW+EMA, bf16 autocast) on "
                           f"{env['device']}"
                           f"{'' if cuda else ' (smoke, CPU: not a timing)'}, torch "
                           f"{env['torch']}, {env['date'][:10]}:", timed=cuda)
    print("\n" + table)
    write_records(args.out, "train", env, {"smoke": not cuda, "peak_bf16_tflops": peak,
                                           "steps": steps, "warmup": warmup}, rows, table)
    return 0


def release_main(args: argparse.Namespace, threads: int) -> int:
    """`--release DIR`: uvic's step beside the release's code, on the CPU."""
    import torch

    from uvic.cli.bench_release import side_by_side, table

    rows = side_by_side(Path(args.release), args.release_size, args.release_models, args.rounds)
    text = table(rows, threads)
    print("\n" + text)
    env = environment(torch.device("cpu"))
    out = args.out or "runs/bench/release.json"
    write_records(out, "release", env, {"threads": threads, "rounds": args.rounds}, rows, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
