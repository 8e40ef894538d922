"""Sampling: DPM-Solver (or any diffusers scheduler) on a U-ViT / U-ViC noise predictor.

The core pieces, reused by `scripts/sample.py`, the training loop's periodic grids, the
quickstart and the FID evaluator:

* `sample_images`: the reverse process for a batch of initial noises x_T, with
  classifier-free guidance `eps = c + s (c - u)` (the U-ViT release's convention).
* `sample_generators` / `make_noise` (from `uvic.seeding`): per-sample seeding from
  (seed, index), so sample `i` of a run is the same image whatever the batch size, the
  number of processes or the device.
* `generate`: batches of (global indices, images in [0, 1]) for a list of sample indices,
  including text contexts, mixed precision and VAE decoding.
* `to_pixels`, `save_grid`, `save_comparison_grid`, `save_images`: turn model outputs into
  PNG files.

Time conventions (see `uvic.diffusion`): a diffusers timestep k is fed to the network as
`diffusion.net_time(k)`: 999 (k + 1) / 1000 for the continuous VP schedule (CIFAR-10),
k + 1 for the discrete scaled-linear one (MS-COCO).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import re
import textwrap
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from PIL import Image, ImageDraw, ImageFont
from torch import nn
from torchvision.utils import make_grid
from tqdm.auto import tqdm

from uvic.config import Config, to_dict
from uvic.diffusion import Diffusion
from uvic.files import atomic_write
from uvic.seeding import make_noise, sample_generators

LATENT_DATASETS = ("mscoco",)  # data whose model space is VAE latents, not pixels
PRECISIONS = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}

# --------------------------------------------------------------------------- guidance


def guided_eps(
    model: nn.Module,
    x: torch.Tensor,
    t: torch.Tensor,
    context: torch.Tensor | None = None,
    uncond_context: torch.Tensor | None = None,
    cfg_scale: float = 0.0,
) -> torch.Tensor:
    """Noise prediction with classifier-free guidance.

    The U-ViT release's convention is `eps = c + s (c - u)` with c / u the conditional /
    unconditional predictions (s = 1.0 for the MS-COCO FID protocol). This equals diffusers'
    `eps = u + g (c - u)` with `guidance_scale g = s + 1`. s = 0 is the conditional model
    alone (no unconditional pass). With guidance on, both passes run as one batch of 2B.

    x: (B, C, H, W); t: (B,) network time; context: (B, L, D); uncond_context: (L, D) or
    (B, L, D), the empty-prompt context.
    """
    if context is None:
        if cfg_scale != 0.0:
            raise ValueError(f"cfg_scale={cfg_scale} needs a context (the model is unconditional)")
        return model(x, t)
    if cfg_scale == 0.0:
        return model(x, t, context=context)
    if uncond_context is None:
        raise ValueError(f"cfg_scale={cfg_scale} needs uncond_context (the empty-prompt context)")
    b = x.shape[0]
    uncond = uncond_context.to(device=context.device, dtype=context.dtype)
    uncond = uncond.expand(b, *context.shape[1:]) if uncond.dim() == 2 else uncond
    out = model(torch.cat([x, x]), torch.cat([t, t]), context=torch.cat([context, uncond]))
    cond, unc = out.chunk(2)
    return cond + cfg_scale * (cond - unc)


# --------------------------------------------------------------------------- sampler


@torch.inference_mode()
def sample_images(
    model: nn.Module,
    diffusion: Diffusion,
    noise: torch.Tensor,
    *,
    context: torch.Tensor | None = None,
    uncond_context: torch.Tensor | None = None,
    cfg_scale: float = 0.0,
    scheduler: str = "dpm_solver++",
    steps: int = 50,
    order: int = 2,
    progress: bool = False,
    generator: torch.Generator | list[torch.Generator] | None = None,
) -> torch.Tensor:
    """Run the reverse process from the initial noise x_T (B, C, H, W) to x_0.

    Returns x_0 in model space (pixels in [-1, 1] or scaled VAE latents), float32. The
    caller owns seeding (it draws `noise`) and the model's mode (`model.eval()`); wrap the
    call in `torch.autocast` for mixed precision (the solver itself stays in float32).
    `generator` (one per sample, see `sample_generators`) only matters for stochastic
    schedulers.
    """
    if steps < 1:
        raise ValueError(f"sample.steps must be >= 1, got {steps}")
    if context is not None and context.shape[0] != noise.shape[0]:
        raise ValueError(f"context batch {context.shape[0]} != noise batch {noise.shape[0]}")
    sched = diffusion.make_scheduler(scheduler, order)  # fresh: multistep solvers keep state
    sched.set_timesteps(steps, device=noise.device)
    step_kwargs = {}
    if generator is not None and "generator" in inspect.signature(sched.step).parameters:
        step_kwargs["generator"] = generator
    if context is not None:
        context = context.to(noise.device)
    b = noise.shape[0]

    x = noise.float() * sched.init_noise_sigma
    for k in tqdm(sched.timesteps, desc="sampling", disable=not progress, leave=False):
        x_in = sched.scale_model_input(x, k)
        t = diffusion.net_time(k.reshape(1).expand(b)).to(noise.device)
        eps = guided_eps(model, x_in, t, context, uncond_context, cfg_scale).float()
        x = sched.step(eps, k, x, **step_kwargs).prev_sample
    return x


def guidance_scale(cfg: Config) -> float:
    """The guidance scale to use for this config: 0 for unconditional models."""
    return cfg.sample.cfg_scale if cfg.model.clip_dim > 0 else 0.0


def autocast(
    device: torch.device | str, precision: str = "fp32"
) -> contextlib.AbstractContextManager:
    """Autocast context for `--precision fp32|fp16|bf16` (mixed precision on CUDA only)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    device = torch.device(device)
    if PRECISIONS[precision] is None:
        return contextlib.nullcontext()
    if device.type != "cuda":
        msg = f"precision {precision} is for CUDA; sampling on {device} in fp32"
        warnings.warn(msg, stacklevel=2)
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=PRECISIONS[precision])


# --------------------------------------------------------------------------- model space -> pixels


def is_latent(cfg: Config) -> bool:
    """Whether the model works on VAE latents (decoded before viewing)."""
    return cfg.data.name in LATENT_DATASETS


def to_pixels(cfg: Config, x0: torch.Tensor, vae: nn.Module | None = None) -> torch.Tensor:
    """Model-space samples -> images in [0, 1] (N, 3, H, W), float32.

    Pixel data (cifar10, shapes) is in [-1, 1]; MS-COCO latents are decoded with the
    Stable Diffusion VAE (scale factor cfg.data.scale_factor) in chunks of
    cfg.sample.decode_batch_size.
    """
    if is_latent(cfg):
        if vae is None:
            raise ValueError(
                f"data.name={cfg.data.name!r} samples are VAE latents: pass the VAE "
                f"(uvic.autoencoder.load_vae({cfg.data.vae!r}, device))"
            )
        from uvic.autoencoder import decode_latents

        x0 = decode_latents(vae, x0, cfg.data.scale_factor, cfg.sample.decode_batch_size)
    return ((x0.float() + 1.0) / 2.0).clamp(0.0, 1.0)


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """[0, 1] float images -> uint8 (N, H, W, C) on the CPU (rounded like save_image)."""
    pixels = (images.detach().float().cpu() * 255.0 + 0.5).clamp(0, 255).to(torch.uint8)
    return pixels.permute(0, 2, 3, 1)


# --------------------------------------------------------------------------- checkpoints and text


def load_model(cfg: Config, ckpt: str | Path, device: torch.device | str = "cpu") -> nn.Module:
    """Build the model of `cfg.model` and load a checkpoint (our EMA .safetensors or a
    released U-ViT `nnet_ema.pth`); returns it in eval mode without gradients."""
    from uvic.checkpoint import load_weights
    from uvic.uvit import build_model

    ckpt = Path(ckpt)
    if not ckpt.is_file():
        raise FileNotFoundError(f"checkpoint not found: {ckpt}")
    model = build_model(cfg.model)
    load_weights(model, ckpt, strict=True)
    return model.to(device).eval().requires_grad_(False)


def read_prompts(path: str | Path) -> list[str]:
    """Prompts file: one prompt per line; blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file not found: {path}")
    prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompts file {path} has no prompts")
    return prompts


def text_encoder(cfg: Config, device: torch.device | str):
    """The CLIP text encoder of the config (open_clip, the release's padding)."""
    from uvic.text_encoder import ClipTextEncoder

    return ClipTextEncoder(cfg.data.clip_model, cfg.data.clip_pretrained, device)


def empty_context(cfg: Config, device: torch.device | str = "cpu", encoder=None) -> torch.Tensor:
    """The empty-prompt context (L, D) used for guidance: the feature folder's
    `empty_context.npy` when present (exactly what training dropped captions to),
    otherwise the text encoder's encoding of ""."""
    from uvic.data import load_empty_context

    if (Path(cfg.data.root) / "empty_context.npy").is_file() or encoder is None:
        return load_empty_context(cfg).to(device)
    return encoder.encode([""])[0].to(device)


def prompt_contexts(
    cfg: Config, prompts_file: str | Path | None, device: torch.device | str = "cpu"
) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """Prompts, their contexts (n, L, D) and the empty context (L, D) for a
    text-to-image config: from a prompts file (encoded with CLIP) or, without one,
    the feature folder's sample prompts (`uvic.data.load_sample_prompts`)."""
    if prompts_file is None:
        from uvic.data import load_sample_prompts

        prompts, contexts = load_sample_prompts(cfg)
        return list(prompts), contexts.to(device), empty_context(cfg, device)
    prompts = read_prompts(prompts_file)
    encoder = text_encoder(cfg, device)
    contexts = encoder.encode(prompts).to(device)
    return prompts, contexts, empty_context(cfg, device, encoder=encoder)


# --------------------------------------------------------------------------- batched generation


def generate(
    model: nn.Module,
    diffusion: Diffusion,
    cfg: Config,
    indices: Sequence[int],
    *,
    seed: int,
    context_fn: Callable[[list[int]], torch.Tensor] | None = None,
    uncond_context: torch.Tensor | None = None,
    vae: nn.Module | None = None,
    device: torch.device | str = "cpu",
    precision: str = "fp32",
    progress: bool = False,
) -> Iterator[tuple[list[int], torch.Tensor]]:
    """Sample the images with global indices `indices` in batches of cfg.sample.batch_size.

    Yields (indices, images in [0, 1] on the CPU). Sampler settings come from cfg.sample
    (scheduler, steps, order, cfg_scale; guidance only for text-conditional models).
    `context_fn(indices) -> (b, L, D)` gives the text context of each sample. Sample i is
    seeded by (seed, i) (`SampleGenerator`), so any split of `indices` into batches, processes
    or resumed runs gives the same images.
    """
    s = cfg.sample
    shape = (cfg.model.in_chans, cfg.model.img_size, cfg.model.img_size)
    scale = guidance_scale(cfg)
    batch = max(1, s.batch_size)
    chunks = [list(indices[i : i + batch]) for i in range(0, len(indices), batch)]
    for chunk in tqdm(chunks, desc="generating", unit="batch", disable=not progress):
        gens = sample_generators(seed, chunk)
        noise = make_noise(shape, gens, device)
        context = context_fn(chunk).to(device) if context_fn is not None else None
        with autocast(device, precision):
            x0 = sample_images(
                model, diffusion, noise, context=context, uncond_context=uncond_context,
                cfg_scale=scale, scheduler=s.scheduler, steps=s.steps, order=s.order,
                generator=gens,
            )
        with torch.inference_mode():
            images = to_pixels(cfg, x0, vae)
        yield chunk, images.cpu()


# --------------------------------------------------------------------------- files


def save_images(images: torch.Tensor, folder: str | Path, indices: Sequence[int]) -> list[Path]:
    """Write images [0, 1] (N, 3, H, W) as `folder/{index:06d}.png`, each atomically
    (`uvic.files.atomic_write`) so an interrupted run never leaves a broken PNG."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for array, index in zip(to_uint8(images).numpy(), indices):
        path = folder / f"{int(index):06d}.png"
        with atomic_write(path) as tmp:
            Image.fromarray(array).save(tmp, format="PNG")
        paths.append(path)
    return paths


def _font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: fixed-size bitmap font
        return ImageFont.load_default()


def _text_band(texts: list[tuple[int, int, str]], width: int, font_size: int) -> Image.Image:
    """A white band of `width` holding each (x, w, text), wrapped to its w pixels."""
    font = _font(font_size)
    line_h = font_size + 3
    char_w = max(1.0, font.getlength("abcdefghijklmnopqrstuvwxyz") / 26)
    wrapped = [
        (x, textwrap.wrap(text, max(1, int((w - 4) / char_w))) or [""]) for x, w, text in texts
    ]
    n_lines = max(len(lines) for _, lines in wrapped)
    band = Image.new("RGB", (width, n_lines * line_h + 4), "white")
    draw = ImageDraw.Draw(band)
    for x, lines in wrapped:
        for j, line in enumerate(lines):
            draw.text((x + 2, 2 + j * line_h), line, fill="black", font=font)
    return band


def _stack_vertical(parts: list[Image.Image]) -> Image.Image:
    width = max(p.width for p in parts)
    out = Image.new("RGB", (width, sum(p.height for p in parts)), "white")
    y = 0
    for p in parts:
        out.paste(p, (0, y))
        y += p.height
    return out


def grid_image(
    images: torch.Tensor,
    nrow: int | None = None,
    captions: list[str] | None = None,
    labels: list[str] | None = None,
    padding: int = 2,
) -> Image.Image:
    """A PIL grid of images [0, 1] (N, 3, H, W): torchvision's make_grid, plus text.

    captions: 1 (written under the whole grid), one per row (under each row) or one per
    image (under each image). labels: one per row, written in a column on the left.
    Without text the result is exactly make_grid's image.
    """
    if images.dim() != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"images must be (N, 3, H, W), got {tuple(images.shape)}")
    n, _, h, w = images.shape
    nrow = nrow or math.ceil(math.sqrt(n))
    rows = math.ceil(n / nrow)
    grid = make_grid(images.float().clamp(0, 1).cpu(), nrow=nrow, padding=padding, pad_value=1.0)
    img = Image.fromarray(to_uint8(grid[None])[0].numpy())
    font_size = max(10, min(16, w // 8))
    cell = w + padding

    if captions:
        if len(captions) not in (1, rows, n):
            raise ValueError(
                f"captions: need 1, {rows} (rows) or {n} (images), got {len(captions)}"
            )
        per_image, per_row = len(captions) == n, len(captions) == rows
        parts = []
        for r in range(rows):
            y0 = r * (h + padding)
            parts.append(img.crop((0, y0, img.width, y0 + h + padding)))  # top padding + row
            if per_image:
                cols = range(r * nrow, min(n, (r + 1) * nrow))
                texts = [((i - r * nrow) * cell, cell, captions[i]) for i in cols]
                parts.append(_text_band(texts, img.width, font_size))
            elif per_row:
                parts.append(_text_band([(0, img.width, captions[r])], img.width, font_size))
        parts.append(img.crop((0, rows * (h + padding), img.width, img.height)))  # bottom pad
        if not (per_image or per_row):
            parts.append(_text_band([(0, img.width, captions[0])], img.width, font_size))
        img = _stack_vertical(parts)
        row_height = None  # rows are no longer evenly spaced
    else:
        row_height = h + padding

    if labels:
        if len(labels) != rows:
            raise ValueError(f"labels: need one per row ({rows}), got {len(labels)}")
        if row_height is None:
            raise ValueError("labels and captions together are not supported; pick one")
        font = _font(font_size)
        label_w = int(max(font.getlength(t) for t in labels)) + 8
        out = Image.new("RGB", (img.width + label_w, img.height), "white")
        out.paste(img, (label_w, 0))
        draw = ImageDraw.Draw(out)
        for r, text in enumerate(labels):
            y = padding + r * row_height + (h - font_size) // 2
            draw.text((4, y), text, fill="black", font=font)
        img = out
    return img


def save_grid(
    images: torch.Tensor,
    path: str | Path,
    nrow: int | None = None,
    captions: list[str] | None = None,
    labels: list[str] | None = None,
) -> Path:
    """Write `grid_image(images, nrow, captions, labels)` as a PNG; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid_image(images, nrow=nrow, captions=captions, labels=labels).save(path)
    return path


def save_comparison_grid(
    named_grids: dict[str, torch.Tensor],
    path: str | Path,
    nrow: int | None = None,
    captions: list[str] | None = None,
) -> Path:
    """Side-by-side grids, one per name (e.g. {"U-ViT": imgs, "U-ViC": imgs} sampled from
    the same noise), each headed by its name; optional captions under each grid."""
    if not named_grids:
        raise ValueError("save_comparison_grid needs at least one named grid")
    panels = []
    for name, images in named_grids.items():
        grid = grid_image(images, nrow=nrow, captions=captions)
        size = max(10, min(18, images.shape[-1] // 6))
        header = _text_band([(0, grid.width, name)], grid.width, size)
        panels.append(_stack_vertical([header, grid]))
    gap = 8
    width = sum(p.width for p in panels) + gap * (len(panels) - 1)
    out = Image.new("RGB", (width, max(p.height for p in panels)), "white")
    x = 0
    for p in panels:
        out.paste(p, (x, 0))
        x += p.width + gap
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    out.save(path)
    return path


# --------------------------------------------------------------------------- sampling CLI core


def distributed_state():
    """Accelerate's process state for `accelerate launch` / torchrun (one process: no-op).

    CPU runs (no CUDA, or `accelerate launch --cpu`) use the gloo backend; PartialState
    only does so when told `cpu=True`, which AcceleratorState reads from ACCELERATE_USE_CPU.
    """
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    cpu = parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available()
    return PartialState(cpu=cpu)


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
    from accelerate.utils import gather_object

    if n < 1:
        raise ValueError(f"--n must be >= 1, got {n}")
    state = distributed_state()
    device = state.device
    out = Path(out)
    labels = checkpoint_labels(ckpts, labels)
    diffusion = Diffusion(cfg.diffusion)

    prompts: list[str] | None = None
    context_fn = uncond = None
    captions = None
    total = n
    if cfg.model.clip_dim > 0:
        prompts, contexts, uncond = prompt_contexts(cfg, prompts_file, device)
        per_prompt = max(1, n // len(prompts))
        total = per_prompt * len(prompts)
        prompt_of = torch.arange(total) // per_prompt  # image i shows prompt i // per_prompt
        contexts = contexts.cpu()

        def context_fn(indices: list[int]) -> torch.Tensor:
            return contexts[prompt_of[indices]]

        nrow = nrow or (per_prompt if per_prompt > 1 else math.ceil(math.sqrt(total)))
        captions = list(prompts)
    elif prompts_file is not None:
        raise ValueError(f"--prompts given but {cfg.name} is not text-conditional "
                         "(model.clip_dim=0)")
    vae = None
    if is_latent(cfg):
        from uvic.autoencoder import load_vae

        vae = load_vae(cfg.data.vae, device)

    mine = list(range(total))[state.process_index :: state.num_processes]
    grids: dict[str, torch.Tensor] = {}
    for label, ckpt in zip(labels, ckpts):
        model = load_model(cfg, ckpt, device)
        local = []
        for indices, images in generate(
            model, diffusion, cfg, mine, seed=seed, context_fn=context_fn,
            uncond_context=uncond, vae=vae, device=device, precision=precision,
            progress=progress and state.is_main_process,
        ):
            local += list(zip(indices, to_uint8(images)))
        del model
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
            "guidance": guidance_scale(cfg), "prompts": prompts,
            "num_processes": state.num_processes, "device": str(device),
            **(record or {}),
        }
        (out / "sample_config.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    state.wait_for_everyone()
    return written
