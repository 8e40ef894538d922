"""Sample images from U-ViT / U-ViC checkpoints into an image grid (and optional PNGs).

    python scripts/sample.py --config configs/cifar10_uvic.py \
        --ckpt runs/cifar10_uvic/ema.safetensors --n 64 --out samples/cifar10_uvic
    # U-ViT and U-ViC side by side, same noise:
    python scripts/sample.py --config configs/cifar10_uvit.py \
        --ckpt runs/cifar10_uvit/ema.safetensors --label U-ViT \
        --ckpt runs/cifar10_uvic/ema.safetensors --label U-ViC --out samples/compare
    # text-to-image, prompts one per line (default: the feature folder's sample prompts):
    python scripts/sample.py --config configs/mscoco_uvic.py --ckpt nnet_ema.pth \
        --prompts prompts.txt --cfg-scale 1.0 --out samples/coco
    # many images on all GPUs:
    accelerate launch scripts/sample.py ... --n 1000 --save-individual

The config may also be a run's saved config.json. Checkpoints are our EMA .safetensors or a
released U-ViT nnet_ema.pth. The same --seed gives the same images on any device, batch
size or number of processes. Installed as `uvic-sample`; `scripts/sample.py` runs the same.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from accelerate.utils import gather_object

from uvic.checkpoint import CheckpointError
from uvic.config import Config, ConfigError, load_config, to_dict, validate
from uvic.diffusion import Diffusion
from uvic.images import save_comparison_grid, save_grid, save_images, to_uint8
from uvic.sampling import (
    PRECISIONS,
    SamplingAssets,
    distributed_state,
    effective_cfg_scale,
    generate,
    load_guide,
    load_model,
    prompt_contexts,
    read_prompts,
    text_encoder,
)
from uvic.text_encoder import ClipLoadError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="configs/*.py or a run's config.json")
    p.add_argument("--ckpt", action="append", required=True,
                   help="checkpoint (.safetensors or .pth); repeat for a side-by-side grid")
    p.add_argument("--label", action="append", help="grid label per --ckpt (same order)")
    p.add_argument("--prompts", help="text-to-image: file with one prompt per line")
    p.add_argument("--n", "--num-samples", dest="n", type=int, default=64,
                   help="number of images (default 64)")
    p.add_argument("--nrow", type=int, help="images per grid row")
    p.add_argument("--steps", type=int, help="sampling steps (default: sample.steps)")
    p.add_argument("--scheduler", help="dpm_solver++, dpm_solver, dpm_solver_fast, "
                   "euler_maruyama or a diffusers class name (uvic.samplers)")
    p.add_argument("--order", type=int, help="DPM-Solver order (default: sample.order)")
    p.add_argument("--cfg-scale", type=float,
                   help="guidance s in eps = c + s (c - u) (diffusers' guidance_scale = s + 1)")
    p.add_argument("--batch-size", type=int, help="images per forward pass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32",
                   help="autocast dtype on CUDA (default fp32)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, e.g. --set data.root=/data/coco_features")
    p.add_argument("--save-individual", action="store_true", help="also write each image")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def sampler_overrides(args: argparse.Namespace) -> list[str]:
    """--steps etc. as config overrides, so the saved config records what was used."""
    pairs = [("steps", args.steps), ("scheduler", args.scheduler), ("order", args.order),
             ("cfg_scale", args.cfg_scale), ("batch_size", args.batch_size)]
    return [f"sample.{key}={value}" for key, value in pairs if value is not None]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, [*args.set, *sampler_overrides(args)])
        written = sample_to_folder(
            cfg, args.ckpt, args.out, labels=args.label, n=args.n, seed=args.seed,
            prompts_file=args.prompts, precision=args.precision,
            save_individual=args.save_individual, nrow=args.nrow,
            record={"config_path": args.config, "args": vars(args)}, progress=not args.quiet,
        )
    except (ConfigError, CheckpointError, ClipLoadError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for name, path in written.items():
        print(f"{name}: {path}")
    return 0


# --------------------------------------------------------------------------- orchestration


def checkpoint_labels(
    ckpts: Sequence[str | Path], labels: Sequence[str] | None = None
) -> list[str]:
    """Display labels of checkpoints: the given ones, or each checkpoint's run folder name."""
    if labels:
        if len(labels) != len(ckpts):
            raise ValueError(f"got {len(labels)} --label for {len(ckpts)} --ckpt; give one each")
        return list(labels)
    if len(ckpts) == 1:
        return ["samples"]
    names = [Path(c).parent.name or Path(c).stem for c in ckpts]
    if len(set(names)) < len(names):
        names = [f"{name}_{i}" for i, name in enumerate(names)]
    return names


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_") or "samples"


def sample_to_folder(
    cfg: Config,
    ckpts: Sequence[str | Path],
    out: str | Path,
    *,
    labels: Sequence[str] | None = None,
    n: int = 64,
    seed: int = 0,
    prompts_file: str | Path | None = None,
    precision: str = "fp32",
    save_individual: bool = False,
    nrow: int | None = None,
    record: dict | None = None,
    progress: bool = True,
) -> dict[str, Path]:
    """Sample `n` images from each checkpoint with the same noise and write them to `out`.

    Writes `grid.png` (one checkpoint) or `grid_<label>.png` per checkpoint plus
    `comparison.png` (labelled, side by side), `<label>/{i:06d}.png` with
    `save_individual`, and `sample_config.json` (resolved config, prompts and `record`).
    Text-to-image: prompts from `prompts_file` (else the feature folder's sample prompts);
    each prompt gets max(1, n // #prompts) images, one grid row per prompt.
    Under `accelerate launch` each process samples every num_processes-th image; the main
    process gathers and writes. Returns the written grid paths by name.
    """
    if n < 1:
        raise ValueError(f"--n must be >= 1, got {n}")
    validate(cfg)
    state = distributed_state()
    device = state.device
    out = Path(out)
    labels = checkpoint_labels(ckpts, labels)
    diffusion = Diffusion(cfg.diffusion)
    if prompts_file is not None and cfg.model.clip_dim <= 0:
        raise ValueError(f"--prompts given but {cfg.name} is not text-conditional "
                         "(model.clip_dim=0)")
    encoder = None
    if prompts_file is not None:
        read_prompts(prompts_file)  # a bad file fails before CLIP loads
        encoder = text_encoder(cfg, device)
    assets = SamplingAssets.from_config(cfg, device, encoder)

    prompts: list[str] | None = None
    context_fn = None
    captions = None
    total = n
    if cfg.model.clip_dim > 0:
        prompts, contexts = prompt_contexts(cfg, prompts_file, encoder)
        per_prompt = max(1, n // len(prompts))
        total = per_prompt * len(prompts)
        prompt_of = torch.arange(total) // per_prompt  # image i shows prompt i // per_prompt

        def context_fn(indices: list[int]) -> torch.Tensor:
            return contexts[prompt_of[indices]]

        nrow = nrow or (per_prompt if per_prompt > 1 else math.ceil(math.sqrt(total)))
        captions = list(prompts)

    mine = list(range(total))[state.process_index :: state.num_processes]
    grids: dict[str, torch.Tensor] = {}
    for label, ckpt in zip(labels, ckpts):
        model = load_model(cfg, ckpt, device)
        guide = load_guide(cfg, ckpt, device)
        local = []
        for indices, images in generate(
            model, diffusion, cfg, mine, seed=seed, context_fn=context_fn,
            uncond_context=assets.uncond, vae=assets.vae, device=device, precision=precision,
            progress=progress and state.is_main_process, guide=guide,
        ):
            local += list(zip(indices, to_uint8(images)))
        del model, guide
        gathered = sorted(gather_object(local), key=lambda item: item[0])
        if state.is_main_process:
            images = torch.stack([img for _, img in gathered]).permute(0, 3, 1, 2).float() / 255
            grids[label] = images
            if save_individual:
                save_images(images, out / _slug(label), [i for i, _ in gathered])

    written: dict[str, Path] = {}
    if state.is_main_process:
        if len(grids) == 1:
            written["grid"] = save_grid(next(iter(grids.values())), out / "grid.png", nrow=nrow,
                                        captions=captions)
        else:
            for label, images in grids.items():
                written[label] = save_grid(images, out / f"grid_{_slug(label)}.png", nrow=nrow,
                                           captions=captions)
            written["comparison"] = save_comparison_grid(grids, out / "comparison.png",
                                                         nrow=nrow, captions=captions)
        summary = {
            "config": to_dict(cfg),
            "checkpoints": {label: str(c) for label, c in zip(labels, ckpts)},
            "n": total, "seed": seed, "precision": precision,
            "guidance": effective_cfg_scale(cfg), "prompts": prompts,
            "num_processes": state.num_processes, "device": str(device),
            **(record or {}),
        }
        (out / "sample_config.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    state.wait_for_everyone()
    return written
