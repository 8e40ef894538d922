"""Sampling: DPM-Solver (or any diffusers scheduler) on a U-ViT / U-ViC noise predictor.

The core pieces, reused by `uvic-sample` (`uvic.cli.sample`), the training loop's periodic
grids, the quickstart and the FID evaluator:

* `sample_images`: the reverse process for a batch of initial noises x_T, with
  classifier-free guidance `eps = c + s (c - u)` (the U-ViT release's convention) and
  optional autoguidance by a weaker model (`load_guide`).
* `sample_generators` / `make_noise` (from `uvic.data.order`): per-sample seeding from
  (seed, index), so sample `i` of a run is the same image whatever the batch size, the
  number of processes or the device.
* `generate`: batches of (global indices, images in [0, 1]) for a list of sample indices,
  including text contexts, mixed precision and VAE decoding; its progress bar counts
  solver steps (network evaluations x batches) and the images done.
* `load_model` / `load_guide`: a checkpoint built as the architecture it was trained with
  (`uvic.run.folder.resolve_model`: the model config stored with the weights; the given
  config's only for files that record none, such as a released `nnet_ema.pth`, or when
  asked for with `ModelChoice(from_config=True)`).
* `SamplingAssets`: the VAE and empty-prompt context a config needs, loaded once;
  `to_pixels` turns model outputs into images in [0, 1] (`uvic.sampling.images` writes them).

Time conventions (see `uvic.diffusion.schedule`): a diffusers timestep k is fed to the network as
`diffusion.net_time(k)`: 999 (k + 1) / 1000 for the continuous VP schedule (CIFAR-10),
k + 1 for the discrete scaled-linear one (MS-COCO).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from uvic.config import Config, ConfigError, ModelConfig
from uvic.data.checks import LATENT_DATASETS
from uvic.data.datasets import load_empty_context, load_sample_prompts
from uvic.diffusion.samplers import model_calls, run_sampler
from uvic.diffusion.schedule import Diffusion
from uvic.models.autoencoder import decode_latents, load_vae
from uvic.models.uvit import build_model
from uvic.run.folder import ModelChoice, check_same_inputs, resolve_model, same_file_content
from uvic.run.weights import load_weights
from uvic.sampling.checks import PRECISIONS
from uvic.sampling.noise import make_noise, sample_generators

_AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}  # of PRECISIONS

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
    scheduler_kwargs: dict | None = None,
    guide: nn.Module | None = None,
    autoguidance_scale: float = 0.0,
    on_step: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Run the reverse process from the initial noise x_T (B, C, H, W) to x_0.

    Returns x_0 in model space (pixels in [-1, 1] or scaled VAE latents), float32. The
    caller owns seeding (it draws `noise`) and the model's mode (`model.eval()`); wrap the
    call in `torch.autocast` for mixed precision (the solver itself stays in float32).
    `generator` (one per sample, see `sample_generators`) only matters for stochastic
    schedulers. The samplers (`scheduler`, `scheduler_kwargs`) are `uvic.diffusion.samplers`'.

    Autoguidance: with `autoguidance_scale` s != 0, `eps = g + s (g - b)`, where g and b
    are the (classifier-free guided) predictions of `model` and of the weaker `guide`:
    the direction in which the better model improves on the weaker one, extrapolated.
    `on_step()` is called after each of the solver's network evaluations (progress).
    """
    if autoguidance_scale != 0.0 and guide is None:
        raise ValueError(f"autoguidance_scale={autoguidance_scale} needs a guide model")
    if context is not None and context.shape[0] != noise.shape[0]:
        raise ValueError(f"context batch {context.shape[0]} != noise batch {noise.shape[0]}")
    if context is not None:
        context = context.to(noise.device)

    def eps_fn(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        eps = guided_eps(model, x, t, context, uncond_context, cfg_scale)
        if autoguidance_scale != 0.0:
            weak = guided_eps(guide, x, t, context, uncond_context, cfg_scale)
            eps = eps + autoguidance_scale * (eps - weak)
        if on_step is not None:
            on_step()
        return eps

    return run_sampler(
        eps_fn, diffusion, noise, scheduler=scheduler, steps=steps, order=order,
        scheduler_kwargs=scheduler_kwargs, generator=generator, progress=progress,
    )


def effective_cfg_scale(cfg: Config) -> float:
    """The guidance s of `eps = c + s (c - u)` for this config: `sample.cfg_scale` for
    text-conditional models, 0 for the others. (diffusers' `guidance_scale` is s + 1.)"""
    return cfg.sample.cfg_scale if cfg.model.clip_dim > 0 else 0.0


def autocast(
    device: torch.device | str, precision: str = "fp32"
) -> contextlib.AbstractContextManager:
    """Autocast context for `--precision fp32|fp16|bf16` (mixed precision on CUDA only)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    device = torch.device(device)
    if precision not in _AUTOCAST_DTYPES:  # fp32
        return contextlib.nullcontext()
    if device.type != "cuda":
        msg = f"precision {precision} is for CUDA; sampling on {device} in fp32"
        warnings.warn(msg, stacklevel=2)
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=_AUTOCAST_DTYPES[precision])


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
                f"(uvic.models.autoencoder.load_vae({cfg.data.vae!r}, device))"
            )
        x0 = decode_latents(vae, x0, cfg.data.scale_factor, cfg.sample.decode_batch_size)
    return ((x0.float() + 1.0) / 2.0).clamp(0.0, 1.0)


# --------------------------------------------------------------------------- checkpoints and text


def load_model(cfg: Config, ckpt: str | Path, device: torch.device | str = "cpu",
               choice: ModelChoice | None = None) -> nn.Module:
    """Build the architecture the checkpoint (our EMA .safetensors or a released U-ViT
    `nnet_ema.pth`) was trained with and load it; eval mode, without gradients.

    The architecture is `resolve_model(cfg, ckpt, choice).model`: the model config stored
    with the weights, cfg.model for a file that records none (or with
    `choice.from_config`); a conflicting explicit `model.*` value is a ConfigError.
    """
    return build_loaded(resolve_model(cfg, _existing(ckpt), choice).model, ckpt, device)


def build_loaded(model: ModelConfig, ckpt: str | Path,
                 device: torch.device | str = "cpu") -> nn.Module:
    """The network of `model` with the weights of `ckpt` (strict), eval mode, no gradients."""
    net = build_model(model)
    load_weights(net, _existing(ckpt), strict=True)
    return net.to(device).eval().requires_grad_(False)


def _existing(ckpt: str | Path) -> Path:
    ckpt = Path(ckpt)
    if not ckpt.is_file():
        raise FileNotFoundError(f"checkpoint not found: {ckpt}")
    return ckpt


def load_guide(cfg: Config, ckpt: str | Path, device: torch.device | str = "cpu",
               choice: ModelChoice | None = None,
               say: Callable[[str], None] | None = None) -> nn.Module | None:
    """The weaker model of autoguidance for sampling checkpoint `ckpt`, or None when
    `sample.autoguidance_scale` is 0.

    A relative `sample.autoguidance_ckpt` is taken from the run folder of `ckpt`: the
    folder of a run's `ema.safetensors`, the run above `checkpoints/step_N/`. `cfg.model`
    is the sampled model's (`resolve_model(cfg, ckpt).model`); the guide is built as its
    own checkpoint records (`resolve_model`, compared with the sampled model's), and must
    take the same inputs. `say` gets the guide's one-line note.
    """
    s = cfg.sample
    if s.autoguidance_scale == 0.0:
        return None
    path = Path(s.autoguidance_ckpt)
    if not path.is_absolute():
        base = Path(ckpt).parent
        if base.parent.name == "checkpoints":
            base = base.parent.parent
        path = base / path
    if not path.is_file():
        raise FileNotFoundError(
            f"sample.autoguidance_ckpt={s.autoguidance_ckpt!r}: weights not found at {path} "
            "(keep an early checkpoint with train.keep_steps, or set "
            "sample.autoguidance_scale=0)")
    if Path(ckpt).is_file() and same_file_content(path, Path(ckpt)):  # e.g. the last step's
        raise ConfigError(
            f"sample.autoguidance_ckpt={s.autoguidance_ckpt!r}: {path} holds the same weights "
            f"as the sampled {ckpt}, and a model guided by itself samples as unguided, at "
            "twice the cost (guide with an earlier checkpoint, or set "
            "sample.autoguidance_scale=0)")
    choice = dataclasses.replace(choice or ModelChoice(), config_name="the sampled model")
    resolved = resolve_model(cfg, path, choice)
    check_same_inputs({f"the model of {ckpt}": cfg.model,
                       f"its guide {path}": resolved.model})
    if say is not None:
        say(f"guide {resolved.note}")
    return build_loaded(resolved.model, path, device)


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
    from uvic.models.text_encoder import ClipTextEncoder

    return ClipTextEncoder(cfg.data.clip_model, cfg.data.clip_pretrained, device)


def empty_context(cfg: Config, device: torch.device | str = "cpu", encoder=None) -> torch.Tensor:
    """The empty-prompt context (L, D) used for guidance: the feature folder's
    `empty_context.npy` when present (exactly what training dropped captions to),
    otherwise the text encoder's encoding of ""."""
    if (Path(cfg.data.root) / "empty_context.npy").is_file() or encoder is None:
        return load_empty_context(cfg).to(device)
    return encoder.encode([""])[0].to(device)


def prompt_contexts(cfg: Config, prompts_file: str | Path | None,
                    encoder=None) -> tuple[list[str], torch.Tensor]:
    """Prompts and their contexts (n, L, D) on the CPU for a text-to-image config: from a
    prompts file (encoded with `encoder`, by default `text_encoder(cfg)`) or, without one,
    the feature folder's sample prompts (`uvic.data.datasets.load_sample_prompts`)."""
    if prompts_file is None:
        prompts, contexts = load_sample_prompts(cfg)
        return list(prompts), contexts.cpu()
    prompts = read_prompts(prompts_file)
    encoder = encoder or text_encoder(cfg, "cpu")
    return prompts, encoder.encode(prompts).cpu()


@dataclass
class SamplingAssets:
    """What sampling a config needs besides the network, loaded once from the config: the
    VAE that decodes latents (latent data) and the empty-prompt context for guidance
    (text-to-image). The training grids, `scripts/sample.py` and the FID evaluator all
    build it with `from_config`."""

    cfg: Config
    vae: nn.Module | None = None
    uncond: torch.Tensor | None = None  # (L, D)

    @classmethod
    def from_config(cls, cfg: Config, device: torch.device | str = "cpu",
                    encoder=None) -> SamplingAssets:
        """Load what `cfg` needs; `encoder` encodes "" when the feature folder has no
        empty context."""
        vae = load_vae(cfg.data.vae, device) if is_latent(cfg) else None
        uncond = empty_context(cfg, device, encoder) if cfg.model.clip_dim > 0 else None
        return cls(cfg, vae, uncond)

    def to_pixels(self, x0: torch.Tensor) -> torch.Tensor:
        """Model-space samples -> images in [0, 1] (`to_pixels` with this VAE)."""
        return to_pixels(self.cfg, x0, self.vae)


class SampleGrid:
    """Fixed initial noises (and prompts) sampled again and again: the training loop's
    periodic grids. Sample i is sample i of `uvic-sample` with the same seed (without
    autoguidance: its weaker model may not exist yet during training)."""

    def __init__(self, cfg: Config, device: torch.device | str, seed: int, n: int) -> None:
        m = cfg.model
        self.cfg, self.captions, self.context = cfg, None, None
        if m.clip_dim > 0:
            prompts, contexts = load_sample_prompts(cfg)
            n = min(n, len(prompts))
            self.captions, self.context = list(prompts[:n]), contexts[:n].to(device)
        self.assets = SamplingAssets.from_config(cfg, device)
        self.seed, self.n, self.device = seed, n, device
        self.shape = (m.in_chans, m.img_size, m.img_size)

    def sample(self, model: nn.Module, diffusion: Diffusion,
               autocast: contextlib.AbstractContextManager | None = None) -> torch.Tensor:
        """Images in [0, 1] (n, 3, H, W) of `model` from the fixed noise; `autocast` wraps
        the network (e.g. the Accelerator's), decoding runs outside it."""
        s = self.cfg.sample
        # fresh per-sample generators each time: the same noise, and for stochastic
        # samplers the same step noise, at every grid
        gens = sample_generators(self.seed, range(self.n))
        noise = make_noise(self.shape, gens, self.device)
        with autocast or contextlib.nullcontext():
            x0 = sample_images(
                model, diffusion, noise, context=self.context,
                uncond_context=self.assets.uncond, cfg_scale=effective_cfg_scale(self.cfg),
                scheduler=s.scheduler, steps=s.steps, order=s.order, generator=gens,
                scheduler_kwargs=s.scheduler_kwargs)
        return self.assets.to_pixels(x0)


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
    guide: nn.Module | None = None,
) -> Iterator[tuple[list[int], torch.Tensor]]:
    """Sample the images with global indices `indices` in batches of cfg.sample.batch_size.

    Yields (indices, images in [0, 1] on the CPU). Sampler settings come from cfg.sample
    (scheduler, steps, order, cfg_scale; guidance only for text-conditional models;
    autoguidance_scale with the weaker model `guide`, see `load_guide`); the noise shape
    from cfg.model, which must be `model`'s. `context_fn(indices) -> (b, L, D)` gives the
    text context of each sample. Sample i is seeded by (seed, i) (`SampleGenerator`), so
    any split of `indices` into batches, processes or resumed runs gives the same images.
    With `progress`, one bar counts the solver's steps over all batches (steps per batch
    x batches: it moves at every network evaluation) and shows the images done.
    """
    s = cfg.sample
    shape = (cfg.model.in_chans, cfg.model.img_size, cfg.model.img_size)
    scale = effective_cfg_scale(cfg)
    batch = s.batch_size  # >= 1: uvic.validation
    chunks = [list(indices[i : i + batch]) for i in range(0, len(indices), batch)]
    per_batch = model_calls(diffusion, s.scheduler, s.steps, s.order, s.scheduler_kwargs)
    done = 0
    with tqdm(total=per_batch * len(chunks), unit="step", disable=not progress,
              desc=f"sampling ({len(chunks)} x {per_batch} steps)") as bar:
        bar.set_postfix_str(f"images 0/{len(indices)}", refresh=False)
        for chunk in chunks:
            gens = sample_generators(seed, chunk)
            noise = make_noise(shape, gens, device)
            context = context_fn(chunk).to(device) if context_fn is not None else None
            with autocast(device, precision):
                x0 = sample_images(
                    model, diffusion, noise, context=context, uncond_context=uncond_context,
                    cfg_scale=scale, scheduler=s.scheduler, steps=s.steps, order=s.order,
                    generator=gens, scheduler_kwargs=s.scheduler_kwargs,
                    guide=guide, autoguidance_scale=s.autoguidance_scale,
                    on_step=bar.update,
                )
            with torch.inference_mode():
                images = to_pixels(cfg, x0, vae)
            done += len(chunk)
            bar.set_postfix_str(f"images {done}/{len(indices)}")
            yield chunk, images.cpu()


# --------------------------------------------------------------------------- processes


def distributed_state():
    """Accelerate's process state for `accelerate launch` / torchrun (one process: no-op).

    CPU runs (no CUDA, or `accelerate launch --cpu`) use the gloo backend; PartialState
    only does so when told `cpu=True`, which AcceleratorState reads from ACCELERATE_USE_CPU.
    """
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    cpu = parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available()
    return PartialState(cpu=cpu)
