"""Noise schedules: the one definition that training and sampling share (docs/conventions.md).

Two schedules, as in the U-ViT release: ``vp_continuous`` (CIFAR-10; t ~ U(0, 1), the
network sees ``999 t``, and diffusers' solvers get it as an exact table on the grid
t_i = (i + 1) / T) and ``scaled_linear`` (MS-COCO; Stable Diffusion's discrete betas, the
network sees the step k + 1). Both train noise prediction, optionally Min-SNR-gamma
weighted; `diffusion.objective="velocity"` is flow matching (`uvic.diffusion.flow`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler
from torch import Tensor, nn

from uvic.config import DiffusionConfig
from uvic.config.diffusion import check_diffusion
from uvic.diffusion.flow import sample_times, velocity_inputs

# The DiffusionConfig fields only one schedule reads (the other schedule ignores them).
SCHEDULE_FIELDS = {"vp_continuous": ("beta_min", "beta_max"),
                   "scaled_linear": ("beta_start", "beta_end")}


def schedule_settings(cfg: DiffusionConfig) -> dict[str, Any]:
    """The settings of `cfg` that apply to its schedule (what an export records): every
    field but those of the other schedules (the objective's included)."""
    other = {name for schedule, names in SCHEDULE_FIELDS.items() if schedule != cfg.schedule
             for name in names}
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in other}


class Diffusion:
    """Forward process, training inputs and the diffusers schedule table of one schedule
    (samplers are built from it by `uvic.diffusion.samplers.make_scheduler`)."""

    def __init__(self, cfg: DiffusionConfig) -> None:
        check_diffusion(cfg)
        self.cfg = cfg
        self.num_timesteps = cfg.num_train_timesteps
        # The discrete table used by diffusers (training add_noise and every sampler).
        self.train_scheduler = DDPMScheduler(**self.scheduler_kwargs())

    # ------------------------------------------------------------------ schedule table

    def vp_alpha_bar(self, t: torch.Tensor) -> torch.Tensor:
        """alpha_bar(t) of the continuous VP schedule (any dtype, t in [0, 1])."""
        b0, b1 = self.cfg.beta_min, self.cfg.beta_max
        return torch.exp(-0.5 * t**2 * (b1 - b0) - b0 * t)

    def grid_times(self) -> torch.Tensor:
        """Continuous times t_i = (i + 1) / T of the discrete grid (float64)."""
        return torch.arange(1, self.num_timesteps + 1, dtype=torch.float64) / self.num_timesteps

    def alphas_cumprod(self) -> torch.Tensor:
        """alpha_bar at every discrete timestep, float64, shape (T,)."""
        if self.cfg.schedule == "vp_continuous":
            return self.vp_alpha_bar(self.grid_times())
        betas = torch.linspace(
            math.sqrt(self.cfg.beta_start), math.sqrt(self.cfg.beta_end), self.num_timesteps,
            dtype=torch.float64,
        ) ** 2
        return torch.cumprod(1.0 - betas, dim=0)

    def scheduler_kwargs(self) -> dict[str, Any]:
        """Constructor arguments that give any diffusers scheduler this schedule."""
        kwargs: dict[str, Any] = {
            "num_train_timesteps": self.num_timesteps,
            "prediction_type": "epsilon",
        }
        if self.cfg.schedule == "vp_continuous":
            alpha_bar = self.alphas_cumprod()
            previous = torch.cat([torch.ones(1, dtype=torch.float64), alpha_bar[:-1]])
            # the exact table; the linear schedule it discretizes, beta(t) / T, is recorded
            # alongside (schedulers read trained_betas only, when it is given)
            kwargs.update(trained_betas=(1.0 - alpha_bar / previous).tolist(),
                          beta_schedule="linear", beta_start=self.cfg.beta_min / self.num_timesteps,
                          beta_end=self.cfg.beta_max / self.num_timesteps)
        else:
            kwargs.update(
                beta_schedule="scaled_linear",
                beta_start=self.cfg.beta_start,
                beta_end=self.cfg.beta_end,
            )
        return kwargs

    # ------------------------------------------------------------------ network time

    def net_time(self, timesteps: torch.Tensor) -> torch.Tensor:
        """Network time input for diffusers timesteps k (the release's conventions)."""
        k = timesteps.to(torch.float32)
        if self.cfg.schedule == "vp_continuous":
            return 999.0 * (k + 1.0) / self.num_timesteps
        return k + 1.0

    def snr(self, net_t: torch.Tensor) -> torch.Tensor:
        """Signal-to-noise ratio alpha_bar / (1 - alpha_bar) at network times `net_t`."""
        if self.cfg.schedule == "vp_continuous":
            alpha_bar = self.vp_alpha_bar(net_t.double() / 999.0)
        else:
            table = self.alphas_cumprod().to(net_t.device)
            alpha_bar = table[net_t.round().long() - 1]
        return (alpha_bar / (1.0 - alpha_bar)).float()

    # ------------------------------------------------------------------ training

    def training_inputs(
        self, x0: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draw a noise level and noise for each sample.

        Returns ``(x_t, net_t, target)``: the noised input, the network's time input
        (shape (B,), float32) and what the network must predict: the noise, or under
        objective "velocity" the interpolant's velocity (`uvic.diffusion.flow`).
        """
        if self.cfg.objective == "velocity":
            return velocity_inputs(self.cfg, x0, generator)
        b = x0.shape[0]
        noise = torch.randn(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
        if self.cfg.schedule == "vp_continuous":
            t = sample_times(self.cfg, b, generator, x0.device)  # U(0, 1) or logit-normal
            alpha_bar = self.vp_alpha_bar(t).view(-1, *([1] * (x0.dim() - 1)))
            x_t = alpha_bar.sqrt() * x0 + (1.0 - alpha_bar).sqrt() * noise
            return x_t, 999.0 * t, noise
        k = torch.randint(0, self.num_timesteps, (b,), generator=generator, device=x0.device)
        x_t = self.train_scheduler.add_noise(x0, noise, k)
        return x_t, self.net_time(k), noise


# --------------------------------------------------------------------------- objective


def diffusion_loss(
    model: nn.Module,
    diffusion: Diffusion,
    batch: dict[str, Tensor],
    generator: torch.Generator,
    *,
    empty_context: Tensor | None = None,
    p_uncond: float = 0.0,
    null_class: int | None = None,
) -> Tensor:
    """Noise-prediction (or, objective "velocity", velocity) MSE of `model` on `batch`
    ({"x", optional "context", "y"}).

    Classifier-free training: with p_uncond > 0, each sample's condition is dropped with
    probability p_uncond (drawn from `generator` first): a "context" is replaced by
    `empty_context` (L, D), a class label "y" by `null_class` (the release's ImageNet
    models reserve the last class id for it).
    With `diffusion.cfg.min_snr_gamma` > 0, each sample's MSE is weighted by
    min(SNR, gamma) / SNR at its noise level before the batch mean.
    """
    x0 = batch["x"]
    kwargs: dict[str, Tensor] = {}
    context, y = batch.get("context"), batch.get("y")
    drop = None  # which samples lose their condition (one draw serves either kind)
    if p_uncond > 0 and (context is not None or y is not None):
        drop = torch.rand(x0.shape[0], generator=generator, device=x0.device) < p_uncond
    if context is not None:
        if drop is not None:
            if empty_context is None:
                raise ValueError("p_uncond > 0 needs the empty-prompt context")
            empty = empty_context.to(device=context.device, dtype=context.dtype)
            context = torch.where(drop[:, None, None], empty[None], context)
        kwargs["context"] = context
    if y is not None:
        if drop is not None:
            if null_class is None:
                raise ValueError("p_uncond > 0 with class labels needs the null class")
            y = torch.where(drop, torch.full_like(y, null_class), y)
        kwargs["y"] = y
    x_t, net_t, target = diffusion.training_inputs(x0, generator)
    pred = model(x_t, net_t, return_dict=False, **kwargs)[0]  # diffusers' cheap form
    gamma = diffusion.cfg.min_snr_gamma
    if gamma <= 0:
        return F.mse_loss(pred.float(), target.float())
    per_sample = (pred.float() - target.float()).square().flatten(1).mean(1)
    snr = diffusion.snr(net_t)
    return (per_sample * snr.clamp(max=gamma) / snr).mean()
