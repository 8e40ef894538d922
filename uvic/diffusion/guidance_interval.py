"""The guidance interval (Kynkaanniemi et al. 2024): classifier-free guidance and autoguidance
only where the noise level lies in (low, high] (`sample.guidance_interval`); the other steps
run the conditional model alone, one network call instead of two.

The noise level is EDM's sigma = sigma_t / alpha_t, one axis for every schedule and
objective (`edm_sigma`), so an interval carries over between them (docs/sampling.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from uvic.config import Config
from uvic.config.sampling import effective_cfg_scale, guidance_interval, passes_per_eval
from uvic.diffusion.samplers import model_calls, run_sampler
from uvic.diffusion.schedule import Diffusion

EpsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def edm_sigma(diffusion: Diffusion, net_t: torch.Tensor) -> torch.Tensor:
    """EDM's noise level sigma = sigma_t / alpha_t at the network's time input `net_t` (any
    shape; float64), the axis of `sample.guidance_interval`. A new schedule or objective
    adds its branch here (interpolants: linear t / (1 - t), trigonometric tan(pi t / 2)).

    vp_continuous: net time 999 t, log alpha_bar = -t^2 (beta_max - beta_min) / 2 -
    beta_min t. scaled_linear: net time n (the table's step n = k + 1, or N t in the
    release's "fast" solvers), log alpha_bar piecewise linear between the table's steps
    (as those solvers interpolate it, `uvic.diffusion.samplers.ContinuousSchedule`).
    """
    t = net_t.detach().to(torch.float64)
    cfg = diffusion.cfg
    if cfg.objective == "velocity":  # net time 999 t of the interpolant (uvic.diffusion.flow)
        s = t / 999.0
        if cfg.interpolant == "linear":
            return s / (1.0 - s)  # inf at t = 1
        return torch.tan(0.5 * math.pi * s)
    if cfg.schedule == "vp_continuous":
        s = t / 999.0
        minus_log_ab = 0.5 * s**2 * (cfg.beta_max - cfg.beta_min) + cfg.beta_min * s
    elif cfg.schedule == "scaled_linear":
        table = torch.log(diffusion.alphas_cumprod()).to(t.device)  # step n at index n - 1
        i = t.floor().clamp(1, len(table) - 1)  # the segment [i, i + 1], extended at the ends
        lo = table[i.long() - 1]
        minus_log_ab = -(lo + (table[i.long()] - lo) * (t - i))
    else:
        raise ValueError(f"no noise level for diffusion.schedule={cfg.schedule!r}")
    return torch.sqrt(torch.expm1(minus_log_ab))  # sqrt(1 / alpha_bar - 1), exact near 0


def sigma_of_time(diffusion: Diffusion, t: float) -> float:
    """sigma at continuous time t in (0, 1] (network time 999 t for vp_continuous and the
    interpolants, N t for scaled_linear): to state a time interval in sigma."""
    cfg = diffusion.cfg
    continuous = cfg.schedule == "vp_continuous" or cfg.objective == "velocity"
    scale = 999.0 if continuous else diffusion.num_timesteps
    return float(edm_sigma(diffusion, torch.tensor(scale * t, dtype=torch.float64)))


def inside(sigma: torch.Tensor, interval: Sequence[float]) -> torch.Tensor:
    """Where guidance applies: sigma in (low, high] (everywhere for an empty interval)."""
    if not interval:
        return torch.ones_like(sigma, dtype=torch.bool)
    low, high = interval
    return (sigma > low) & (sigma <= high)


def limited(guided: EpsFn, plain: EpsFn, diffusion: Diffusion,
            interval: Sequence[float]) -> EpsFn:
    """The noise prediction of a guidance interval: `guided(x, t)` at the network times
    whose sigma lies in `interval`, `plain(x, t)` (the conditional model alone) elsewhere;
    only the one needed is called. An empty interval returns `guided` itself (every step
    guided, bit for bit). Rows of one call at different noise levels (uvic's samplers
    give every row the same time) get each their own, both being computed."""
    if not interval:
        return guided
    low, high = (float(v) for v in interval)
    if not (0 <= low < high) or math.isnan(high):
        raise ValueError(f"guidance_interval={list(interval)} must be low,high with "
                         "0 <= low < high")

    def eps_fn(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        where = inside(edm_sigma(diffusion, t), (low, high))
        if bool(where.all()):
            return guided(x, t)
        if not bool(where.any()):
            return plain(x, t)
        rows = where.to(x.device).view(-1, *([1] * (x.dim() - 1)))
        return torch.where(rows, guided(x, t), plain(x, t))

    return eps_fn


def guided_calls(diffusion: Diffusion, interval: Sequence[float],
                 scheduler: str = "dpm_solver++", steps: int = 50, order: int = 2,
                 scheduler_kwargs: dict[str, Any] | None = None) -> tuple[int, int]:
    """(guided, all): how many of one sampler run's network evaluations fall in `interval`
    (those run the unconditional rows or the guide too) and how many there are: the
    sampler is run on one value with a zero prediction, to read the times it asks for."""
    times: list[torch.Tensor] = []

    def eps_fn(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        times.append(t[:1].detach().cpu())
        return torch.zeros_like(x)

    run_sampler(eps_fn, diffusion, torch.zeros(1, 1, 1, 1), scheduler=scheduler, steps=steps,
                order=order, scheduler_kwargs=scheduler_kwargs)
    sigma = edm_sigma(diffusion, torch.cat(times))
    return int(inside(sigma, interval).sum()), len(times)


def _passes_of(diffusion: Diffusion, interval: Sequence[float], scheduler: str, steps: int,
               order: int, scheduler_kwargs: dict[str, Any] | None,
               per_eval: int) -> tuple[int, int, int]:
    """(network passes, the solver's calls, those that are guided) of one sampler run: a
    guided call costs `per_eval` passes; every call is guided for an empty interval, none
    without guidance (`per_eval` 1)."""
    kw = {"steps": steps, "order": order, "scheduler_kwargs": scheduler_kwargs}
    if per_eval > 1 and interval:
        guided, calls = guided_calls(diffusion, interval, scheduler, **kw)
    else:
        calls = model_calls(diffusion, scheduler, **kw)
        guided = calls if per_eval > 1 else 0
    return calls + guided * (per_eval - 1), calls, guided


def network_passes(diffusion: Diffusion, interval: Sequence[float],
                   scheduler: str = "dpm_solver++", steps: int = 50, order: int = 2,
                   scheduler_kwargs: dict[str, Any] | None = None, *, cfg_guided: bool = False,
                   autoguided: bool = False) -> int:
    """Network passes per image of one sampler run (what its cost is counted in): the
    solver's calls (`model_calls`: e.g. 2 steps - 1 for Heun), each of those inside the
    guidance `interval` (every one for an empty interval) costing `passes_per_eval`."""
    return _passes_of(diffusion, interval, scheduler, steps, order, scheduler_kwargs,
                      passes_per_eval(cfg_guided, autoguided))[0]


def sampling_calls(cfg: Config, diffusion: Diffusion | None = None) -> tuple[int, int, int]:
    """Per image of the config's own sampling (`sample.*`, guidance as `generate` applies
    it): (network passes, the sampler's calls, those of them guided)."""
    s = cfg.sample
    per_eval = passes_per_eval(effective_cfg_scale(cfg) != 0, s.autoguidance_scale != 0)
    return _passes_of(diffusion or Diffusion(cfg.diffusion), guidance_interval(cfg),
                      s.scheduler, s.steps, s.order, s.scheduler_kwargs, per_eval)


def sampling_passes(cfg: Config, diffusion: Diffusion | None = None) -> int:
    """`network_passes` per image of the config's own sampling: the one count of every plan
    and cost estimate."""
    return sampling_calls(cfg, diffusion)[0]
