"""Sampling a U-ViT / U-ViC: the one generate path of `uvic-sample`, the FID evaluator, the
quickstart and the training loop's periodic grids.

`sample_images` runs the reverse process on a batch of noises, with classifier-free
guidance (`eps = c + s (c - u)`) and autoguidance, optionally in a noise-level interval;
`generate` samples a list of indices in batches and decodes them (sample i is seeded by
(seed, i): the same image in any batch, process or device); `sample_checkpoint` does so for
a checkpoint, and `SampleGrid` samples fixed noise again and again (the training grids).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from torch import nn
from tqdm.auto import tqdm

from uvic.config import Config
from uvic.config.sampling import PRECISIONS, effective_cfg_scale, guidance_interval, real_classes
from uvic.data.datasets import load_sample_prompts
from uvic.diffusion.guidance_interval import limited
from uvic.diffusion.samplers import model_calls, run_sampler
from uvic.diffusion.schedule import Diffusion
from uvic.run.architecture import ModelChoice
from uvic.sampling.assets import SamplingAssets, to_pixels
from uvic.sampling.compiled import compile_network, static_batch
from uvic.sampling.labels import LabelFn
from uvic.sampling.load import load_guide, load_model
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
    *,
    y: torch.Tensor | None = None,
    uncond_y: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Noise prediction with classifier-free guidance.

    The U-ViT release's convention is `eps = c + s (c - u)` with c / u the conditional /
    unconditional predictions (s = 1.0 for the MS-COCO FID protocol). This equals diffusers'
    `eps = u + g (c - u)` with `guidance_scale g = s + 1`. s = 0 is the conditional model
    alone (no unconditional pass). With guidance on, both passes run as one batch of 2B.

    x: (B, C, H, W); t: (B,) network time; context: (B, L, D); uncond_context: (L, D) or
    (B, L, D), the empty-prompt context. A class-conditional model is guided the same way
    with class ids y (B,) against the null class `uncond_y` (an id or (B,) ids; the
    release's ImageNet models use the last id).
    `model` is called as diffusers' models are, `model(x, t, ..., return_dict=False)[0]`
    (the plain tuple: no output object per call).
    """
    if context is None and y is None:
        if cfg_scale != 0.0:
            raise ValueError(f"cfg_scale={cfg_scale} needs a context (the model is unconditional)")
        return model(x, t, return_dict=False)[0]
    key, cond = ("context", context) if context is not None else ("y", y)
    if cfg_scale == 0.0:
        return model(x, t, return_dict=False, **{key: cond})[0]
    if key == "context":
        if uncond_context is None:
            raise ValueError(f"cfg_scale={cfg_scale} needs uncond_context (the empty-prompt "
                             "context)")
        uncond = uncond_context.to(device=context.device, dtype=context.dtype)
        uncond = uncond.expand(x.shape[0], *context.shape[1:]) if uncond.dim() == 2 else uncond
    else:
        if uncond_y is None:
            raise ValueError(f"cfg_scale={cfg_scale} needs uncond_y (the null class)")
        uncond = torch.as_tensor(uncond_y, device=y.device, dtype=y.dtype).expand(x.shape[0])
    out = model(torch.cat([x, x]), torch.cat([t, t]), return_dict=False,
                **{key: torch.cat([cond, uncond])})[0]
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
    y: torch.Tensor | None = None,
    uncond_y: int | torch.Tensor | None = None,
    scheduler: str | SchedulerMixin = "dpm_solver++",
    steps: int = 50,
    order: int = 2,
    progress: bool = False,
    generator: torch.Generator | list[torch.Generator] | None = None,
    scheduler_kwargs: dict | None = None,
    guide: nn.Module | None = None,
    autoguidance_scale: float = 0.0,
    on_step: Callable[[], None] | None = None,
    guidance_interval: Sequence[float] = (),
) -> torch.Tensor:
    """Run the reverse process from the initial noise x_T (B, C, H, W) to x_0.

    Returns x_0 in model space (pixels in [-1, 1] or scaled VAE latents), float32. The
    caller owns seeding (it draws `noise`) and the model's mode (`model.eval()`); wrap the
    call in `torch.autocast` for mixed precision (the solver itself stays in float32).
    `generator` (one per sample, see `sample_generators`) only matters for stochastic
    schedulers. The samplers (`scheduler`, `scheduler_kwargs`) are `uvic.diffusion.samplers`'.
    Class-conditional models take class ids `y` (B,) (guided against `uncond_y`, see
    `guided_eps`), text-conditional ones `context`.

    Autoguidance: with `autoguidance_scale` s != 0, `eps = g + s (g - b)`, where g and b
    are the (classifier-free guided) predictions of `model` and of the weaker `guide`:
    the direction in which the better model improves on the weaker one, extrapolated.
    `guidance_interval` (low, high]: both guidances only at the steps whose noise level
    sigma lies in it, the conditional model alone (one network call) at the others
    (`uvic.diffusion.guidance_interval`); () guides every step.
    `on_step()` is called after each of the solver's network evaluations (progress).
    A velocity model (diffusion.objective "velocity") predicts v, not eps: the guidance
    is linear in the output and applies to v alike (`uvic.diffusion.flow` samples it).
    """
    if autoguidance_scale != 0.0 and guide is None:
        raise ValueError(f"autoguidance_scale={autoguidance_scale} needs a guide model")
    if context is not None and context.shape[0] != noise.shape[0]:
        raise ValueError(f"context batch {context.shape[0]} != noise batch {noise.shape[0]}")
    if context is not None:
        context = context.to(noise.device)
    if y is not None:
        y = y.to(noise.device)
    cond = {"y": y, "uncond_y": uncond_y}

    def guided(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        eps = guided_eps(model, x, t, context, uncond_context, cfg_scale, **cond)
        if autoguidance_scale != 0.0:
            weak = guided_eps(guide, x, t, context, uncond_context, cfg_scale, **cond)
            eps = eps + autoguidance_scale * (eps - weak)
        return eps

    def plain(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return guided_eps(model, x, t, context, uncond_context, 0.0, **cond)

    eps_of = limited(guided, plain, diffusion, guidance_interval)

    def eps_fn(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        eps = eps_of(x, t)
        if on_step is not None:
            on_step()
        return eps

    return run_sampler(
        eps_fn, diffusion, noise, scheduler=scheduler, steps=steps, order=order,
        scheduler_kwargs=scheduler_kwargs, generator=generator, progress=progress,
    )


def class_conditions(cfg: Config, indices: Sequence[int], device: torch.device | str = "cpu",
                     label_fn: LabelFn | None = None) -> dict[str, torch.Tensor | int]:
    """`sample_images`' class arguments for samples `indices` of a class-conditional model
    ({} for the others): sample i shows class `label_fn([i])` (`uvic.sampling.labels`: the
    `--class-labels`, FID's draws), by default i mod K, K the real classes (all ids but the
    null class, the last, when the model was trained with one), so any batching gives the
    same images and N samples cover the classes evenly; guided against the null class."""
    m = cfg.model
    if m.num_classes <= 0:
        return {}
    real = real_classes(cfg)
    labels = label_fn(indices) if label_fn is not None else [i % real for i in indices]
    y = torch.as_tensor(labels, dtype=torch.long).to(device)
    return {"y": y, "uncond_y": m.num_classes - 1} if real < m.num_classes else {"y": y}


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


class SampleGrid:
    """Fixed initial noises (and prompts) sampled again and again: the training loop's
    periodic grids. Sample i is sample i of `uvic-sample` with the same seed (without
    autoguidance: its weaker model may not exist yet during training)."""

    def __init__(self, cfg: Config, device: torch.device | str, seed: int, n: int) -> None:
        m = cfg.model
        self.cfg, self.captions, self.context = cfg, None, None
        if m.clip_dim > 0:
            prompts, contexts = load_sample_prompts(cfg.data)
            n = min(n, len(prompts))
            self.captions, self.context = list(prompts[:n]), contexts[:n].to(device)
        self.assets = SamplingAssets.from_config(cfg, device)
        self.seed, self.n, self.device = seed, n, device
        self.shape = (m.in_chans, m.img_size, m.img_size)
        self._compiled: tuple[nn.Module, nn.Module] | None = None  # (model, its network)

    def network(self, model: nn.Module) -> nn.Module:
        """`model` compiled as `sample.compile` says, once for the grids of a run (the
        compiled network reads `model`'s weights as they are at each grid)."""
        if self._compiled is None or self._compiled[0] is not model:
            self._compiled = (model, compile_network(model, self.cfg.sample.compile))
        return self._compiled[1]

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
                self.network(model), diffusion, noise, context=self.context,
                uncond_context=self.assets.uncond, cfg_scale=effective_cfg_scale(self.cfg),
                scheduler=s.scheduler, steps=s.steps, order=s.order, generator=gens,
                scheduler_kwargs=s.scheduler_kwargs, guidance_interval=guidance_interval(self.cfg),
                **class_conditions(self.cfg, range(self.n), self.device))
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
    label_fn: LabelFn | None = None,
) -> Iterator[tuple[list[int], torch.Tensor]]:
    """Sample the images with global indices `indices` in batches of cfg.sample.batch_size.

    Yields (indices, images in [0, 1] on the CPU). Sampler settings come from cfg.sample
    (scheduler, steps, order, cfg_scale: see `effective_cfg_scale`; class labels from
    `class_conditions`, or `label_fn(indices)`;
    autoguidance_scale with the weaker model `guide`, see `load_guide`); the noise shape
    from cfg.model, which must be `model`'s. `context_fn(indices) -> (b, L, D)` gives the
    text context of each sample. Sample i is seeded by (seed, i) (`SampleGenerator`), so
    any split of `indices` into batches, processes or resumed runs gives the same images.
    With `progress`, one bar counts the solver's steps over all batches (steps per batch
    x batches: it moves at every network evaluation) and shows the images done.
    With `sample.compile` on, the networks are compiled once and the last batch is padded
    to the run's batch size (`static_batch`), so every network call has one shape.
    """
    s = cfg.sample
    shape = (cfg.model.in_chans, cfg.model.img_size, cfg.model.img_size)
    scale = effective_cfg_scale(cfg)
    batch = s.batch_size  # >= 1: uvic.config.validation
    chunks = [list(indices[i : i + batch]) for i in range(0, len(indices), batch)]
    per_batch = model_calls(diffusion, s.scheduler, s.steps, s.order, s.scheduler_kwargs)
    net = compile_network(model, s.compile)
    weak = compile_network(guide, s.compile) if guide is not None else None
    size = min(batch, len(indices))  # the one batch size of a compiled run
    done = 0
    with tqdm(total=per_batch * len(chunks), unit="step", disable=not progress,
              desc=f"sampling ({len(chunks)} x {per_batch} steps)") as bar:
        bar.set_postfix_str(f"images 0/{len(indices)}", refresh=False)
        for chunk in chunks:
            rows = chunk if s.compile == "off" else static_batch(chunk, size)
            gens = sample_generators(seed, rows)
            noise = make_noise(shape, gens, device)
            context = context_fn(rows).to(device) if context_fn is not None else None
            with autocast(device, precision):
                x0 = sample_images(
                    net, diffusion, noise, context=context, uncond_context=uncond_context,
                    cfg_scale=scale, scheduler=s.scheduler, steps=s.steps, order=s.order,
                    generator=gens, scheduler_kwargs=s.scheduler_kwargs,
                    guide=weak, autoguidance_scale=s.autoguidance_scale,
                    guidance_interval=guidance_interval(cfg), on_step=bar.update,
                    **class_conditions(cfg, rows, device, label_fn),
                )[: len(chunk)]
            with torch.inference_mode():
                images = to_pixels(cfg, x0, vae)
            done += len(chunk)
            bar.set_postfix_str(f"images {done}/{len(indices)}")
            yield chunk, images.cpu()


def sample_checkpoint(
    cfg: Config,
    ckpt: str | Path,
    indices: Sequence[int],
    *,
    seed: int,
    device: torch.device | str = "cpu",
    precision: str = "fp32",
    context_fn: Callable[[list[int]], torch.Tensor] | None = None,
    assets: SamplingAssets | None = None,
    progress: bool = False,
    choice: ModelChoice | None = None,
    say: Callable[[str], None] | None = None,
    label_fn: LabelFn | None = None,
) -> Iterator[tuple[list[int], torch.Tensor]]:
    """`generate` the samples `indices` of the checkpoint `ckpt`, built as `cfg.model` (the
    architecture `resolve_model` chose for it), guided by its autoguidance model
    (`load_guide`, resolved under `choice`; `say` gets its note) when
    `sample.autoguidance_scale` is set. `assets` (the VAE and empty context) are loaded
    from `cfg` unless given; `label_fn` gives class labels (`class_conditions`). Nothing
    is loaded before the first batch is asked for; the networks are freed when the last
    one is done.
    """
    model = load_model(cfg.model, ckpt, device)
    guide = load_guide(cfg, ckpt, device, choice, say=say)
    assets = assets or SamplingAssets.from_config(cfg, device)
    yield from generate(
        model, Diffusion(cfg.diffusion), cfg, indices, seed=seed, context_fn=context_fn,
        uncond_context=assets.uncond, vae=assets.vae, device=device, precision=precision,
        progress=progress, guide=guide, label_fn=label_fn)


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
