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

Each checkpoint is built as the architecture it was trained with (`uvic.run.folder.
resolve_model`): the model config stored in its safetensors metadata, else its run's
config.json; `--config` gives the sampler settings (and the model of a file that records
none, such as a released nnet_ema.pth). One note per checkpoint states the architecture
and where it came from, and names the `--config` model values it did not use. A
`--set model.*` value that differs from a checkpoint's is refused with one line;
`--model-from-config` builds every checkpoint as `--config` (+ `--set`) says instead.
Several checkpoints of a side-by-side may differ (U-ViT and U-ViC) but must take the same
inputs (image size, channels, conditioning).

Writes to --out: `grid.png`, the main grid (with several checkpoints: their grids side by
side, labelled), `grid_<label>.png` per checkpoint when there are several,
`<label>/{i:06d}.png` with --save-individual (native size) and `sample_config.json`.
Grids are enlarged by nearest neighbour to at least 512 px wide (`--upscale N` forces a
factor, 1 = native size).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from accelerate.utils import gather_object

from uvic.cli import positive_int
from uvic.config import Config, ConfigError, load_config, to_dict
from uvic.diffusion.schedule import Diffusion
from uvic.models.text_encoder import ClipLoadError
from uvic.run.folder import ModelChoice, check_same_inputs, resolve_model
from uvic.run.weights import CheckpointError
from uvic.sampling.checks import PRECISIONS
from uvic.sampling.generate import (
    SamplingAssets,
    build_loaded,
    distributed_state,
    effective_cfg_scale,
    generate,
    load_guide,
    prompt_contexts,
    read_prompts,
    text_encoder,
)
from uvic.sampling.images import save_comparison_grid, save_grid, save_images, to_uint8
from uvic.validation import validate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="configs/*.py or a run's config.json")
    p.add_argument("--ckpt", action="append", required=True,
                   help="checkpoint (.safetensors or .pth); repeat for a side-by-side grid")
    p.add_argument("--label", action="append", help="grid label per --ckpt (same order)")
    p.add_argument("--prompts", help="text-to-image: file with one prompt per line")
    p.add_argument("--n", "--num-samples", dest="n", type=int, default=64,
                   help="number of images (default 64)")
    p.add_argument("--nrow", type=positive_int, help="images per grid row")
    p.add_argument("--steps", type=int, help="sampling steps (default: sample.steps)")
    p.add_argument("--scheduler", help="dpm_solver++, dpm_solver, "
                   "dpm_solver++_fast_time_uniform, dpm_solver_fast_logsnr, euler_maruyama "
                   "or a diffusers class name (uvic.diffusion.samplers)")
    p.add_argument("--order", type=int, help="DPM-Solver order (default: sample.order)")
    p.add_argument("--cfg-scale", type=float,
                   help="guidance s in eps = c + s (c - u) (diffusers' guidance_scale = s + 1)")
    p.add_argument("--batch-size", type=int, help="images per forward pass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32",
                   help="autocast dtype on CUDA (default fp32)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, e.g. --set data.root=/data/coco_features")
    p.add_argument("--model-from-config", action="store_true",
                   help="build every checkpoint as --config and --set say, not as the model "
                   "config stored with it (run a checkpoint under another attention pattern)")
    p.add_argument("--upscale", type=positive_int, metavar="N",
                   help="enlarge grids N times, nearest neighbour (default: the smallest N "
                   "that makes a grid at least 512 px wide; 1: native size)")
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
            choice=ModelChoice.from_overrides(args.set, args.model_from_config, args.config),
            upscale=args.upscale, say=print,
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


def _check_labels(labels: Sequence[str]) -> None:
    """Labels name files (`grid_<label>.png`, `<label>/`): distinct after `_slug`."""
    seen: dict[str, str] = {}
    for label in labels:
        if _slug(label) in seen:
            raise ValueError(f"--label {seen[_slug(label)]!r} and {label!r} would write the "
                             f"same files (grid_{_slug(label)}.png); give distinct labels")
        seen[_slug(label)] = label


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
    choice: ModelChoice | None = None,
    upscale: int | None = None,
    say: Callable[[str], None] | None = None,
) -> dict[str, Path]:
    """Sample `n` images from each checkpoint with the same noise and write them to `out`.

    Writes `grid.png`, the main grid: the one checkpoint's, or with several their grids
    side by side, labelled; with several also `grid_<label>.png` per checkpoint;
    `<label>/{i:06d}.png` (native size) with `save_individual` (label "samples" for one
    checkpoint); and `sample_config.json` (the given config, the model built for each
    checkpoint and its source, prompts and `record`). Grids are enlarged `upscale` times
    (nearest neighbour; None: each grid at least 512 px wide, `uvic.sampling.images.grid_upscale`).
    Each checkpoint is built as `resolve_model(cfg, ckpt, choice)` says (its own stored
    model config, see the module docstring); `say` gets one note per checkpoint.
    Text-to-image: prompts from `prompts_file` (else the feature folder's sample prompts);
    each prompt gets max(1, n // #prompts) images, one grid row per prompt.
    Under `accelerate launch` each process samples every num_processes-th image; the main
    process gathers and writes. Returns the written grid paths: "grid" and, with several
    checkpoints, "grid_<label>" each.
    """
    if n < 1:
        raise ValueError(f"--n must be >= 1, got {n}")
    validate(cfg)
    state = distributed_state()
    device = state.device
    out = Path(out)
    labels = checkpoint_labels(ckpts, labels)
    _check_labels(labels)
    # every checkpoint's architecture first: a refused one stops before any work
    resolved = {label: resolve_model(cfg, ckpt, choice) for label, ckpt in zip(labels, ckpts)}
    check_same_inputs({f"--ckpt {ckpt}": r.model for ckpt, r in zip(ckpts, resolved.values())})
    given = cfg
    cfg = dataclasses.replace(cfg, model=next(iter(resolved.values())).model)  # the inputs
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
    say = say if state.is_main_process else None
    for label, ckpt in zip(labels, ckpts):
        if say is not None:
            say(f"{label}: {resolved[label].note}")
        model = build_loaded(resolved[label].model, ckpt, device)
        ckpt_cfg = dataclasses.replace(cfg, model=resolved[label].model)
        guide = load_guide(ckpt_cfg, ckpt, device, choice, say=say)
        local = []
        for indices, images in generate(
            model, diffusion, ckpt_cfg, mine, seed=seed, context_fn=context_fn,
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
                                        captions=captions, upscale=upscale)
        else:
            written["grid"] = save_comparison_grid(grids, out / "grid.png", nrow=nrow,
                                                   captions=captions, upscale=upscale)
            for label, images in grids.items():
                name = f"grid_{_slug(label)}"
                written[name] = save_grid(images, out / f"{name}.png", nrow=nrow,
                                          captions=captions, upscale=upscale)
        summary = {
            "config": to_dict(given),
            "checkpoints": {label: str(c) for label, c in zip(labels, ckpts)},
            "models": {label: {"source": r.source, "model": dataclasses.asdict(r.model)}
                       for label, r in resolved.items()},
            "n": total, "seed": seed, "precision": precision,
            "guidance": effective_cfg_scale(cfg), "prompts": prompts,
            "num_processes": state.num_processes, "device": str(device),
            **(record or {}),
        }
        (out / "sample_config.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    state.wait_for_everyone()
    return written
