"""Flow matching (`diffusion.objective="velocity"`): the interpolants between data (t = 0) and
noise (t = 1), the velocity training inputs, and the samplers `flow_euler`, `flow_heun` and
`flow_euler_maruyama` (docs/recipes.md, "Flow matching").

The network sees 999 t, the continuous VP schedule's time input, so both objectives share
one time embedding; guidance is linear in the network output, so it applies to v unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from diffusers.utils.torch_utils import randn_tensor
from tqdm.auto import tqdm

from uvic.config import DiffusionConfig
from uvic.config.diffusion import (
    FLOW_DIFFUSERS,
    FLOW_NAMED,
    check_sampler_objective,
    diffusers_class,
    sampler_calls,
)

VFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, net time (B,)) -> v
NET_TIME_SCALE = 999.0  # the network sees 999 t
SDE_LAST_T = 0.04  # flow_euler_maruyama's last noisy time (REPA's), then one step to 0
FLOW_SCHEDULERS = FLOW_NAMED + FLOW_DIFFUSERS  # the names that sample velocity models


class Interpolant:
    """alpha(t), sigma(t) and their derivatives for one `diffusion.interpolant` (any tensor
    t in [0, 1], computed in its dtype)."""

    def __init__(self, name: str) -> None:
        if name not in ("linear", "trigonometric"):
            raise ValueError(f"diffusion.interpolant={name!r} must be linear or trigonometric")
        self.name = name

    def coefficients(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(alpha, sigma, d alpha / dt, d sigma / dt) at `t`."""
        if self.name == "linear":
            return 1.0 - t, t, -torch.ones_like(t), torch.ones_like(t)
        half_pi = 0.5 * math.pi
        cos, sin = torch.cos(half_pi * t), torch.sin(half_pi * t)
        return cos, sin, -half_pi * sin, half_pi * cos

    def noise_from_velocity(self, x: torch.Tensor, v: torch.Tensor,
                            t: torch.Tensor) -> torch.Tensor:
        """The noise e_hat that `v` implies at (x, t): x = alpha x0 + sigma e and
        v = alpha' x0 + sigma' e solved for e (for the exact v: E[e | x_t = x])."""
        a, s, da, ds = self.coefficients(t)
        return (a * v - da * x) / (a * ds - da * s)


def _per_sample(c: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return c.view(-1, *([1] * (like.dim() - 1)))


def sample_times(cfg: DiffusionConfig, n: int, generator: torch.Generator | None = None,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """`n` training times in [0, 1], float32: U(0, 1) or sigmoid(N(mean, std^2))."""
    if cfg.timestep_sampling == "logit_normal":
        z = torch.randn(n, generator=generator, device=device, dtype=torch.float32)
        return torch.sigmoid(cfg.logit_normal_mean + cfg.logit_normal_std * z)
    return torch.rand(n, generator=generator, device=device, dtype=torch.float32)


def velocity_inputs(
    cfg: DiffusionConfig, x0: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_t, network time 999 t, target velocity) for a batch of data `x0`."""
    noise = torch.randn(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
    t = sample_times(cfg, x0.shape[0], generator, x0.device)
    a, s, da, ds = (_per_sample(c, x0) for c in Interpolant(cfg.interpolant).coefficients(t))
    return a * x0 + s * noise, NET_TIME_SCALE * t, da * x0 + ds * noise


# --------------------------------------------------------------------------- samplers


def time_grid(name: str, steps: int) -> torch.Tensor:
    """The times (float64, from 1 down to 0) a named flow sampler visits."""
    if name == "flow_euler_maruyama":
        return torch.cat([torch.linspace(1.0, SDE_LAST_T, steps, dtype=torch.float64),
                          torch.zeros(1, dtype=torch.float64)])
    return torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)


def flow_model_calls(cfg: DiffusionConfig, scheduler: str | SchedulerMixin, steps: int,
                     scheduler_kwargs: dict[str, Any] | None = None) -> int:
    """Network calls of `flow_sample` for one batch (a name that does not fit the objective
    is refused, as `flow_sample` refuses it)."""
    if isinstance(scheduler, str):
        check_sampler_objective(cfg, scheduler)
    if isinstance(scheduler, str) and scheduler in FLOW_NAMED:
        return sampler_calls(scheduler, steps)
    sched = flow_scheduler(scheduler, scheduler_kwargs) if isinstance(scheduler, str) else scheduler
    sched.set_timesteps(steps)
    return len(sched.timesteps)


def _velocity(v_fn: VFn, x: torch.Tensor, t: float) -> torch.Tensor:
    net_t = torch.full((x.shape[0],), NET_TIME_SCALE * t, dtype=torch.float32, device=x.device)
    return v_fn(x, net_t).float()


def ode_solve(v_fn: VFn, x: torch.Tensor, grid: Sequence[float], heun: bool = False,
              progress: bool = False) -> torch.Tensor:
    """Euler (or Heun, the last step Euler) for dx/dt = v on the times `grid`."""
    x = x.float()
    for i in tqdm(range(len(grid) - 1), desc="sampling", disable=not progress, leave=False):
        t, t_next = grid[i], grid[i + 1]
        v = _velocity(v_fn, x, t)
        x_next = x + (t_next - t) * v
        if heun and i < len(grid) - 2:
            x_next = x + 0.5 * (t_next - t) * (v + _velocity(v_fn, x_next, t_next))
        x = x_next
    return x


def sde_solve(v_fn: VFn, x: torch.Tensor, grid: Sequence[float], interpolant: Interpolant,
              generator: torch.Generator | list[torch.Generator],
              progress: bool = False) -> torch.Tensor:
    """Euler-Maruyama over `grid` on the reverse SDE with the ODE's marginals, dx = (v - g^2 / 2
    score) dt + g dW with g^2 = 2 sigma(t): the drift is v + e_hat (`noise_from_velocity`).
    The last step keeps its noiseless mean."""
    x = x.float()
    for i in tqdm(range(len(grid) - 1), desc="sampling", disable=not progress, leave=False):
        t, h = grid[i], grid[i + 1] - grid[i]  # h < 0
        v = _velocity(v_fn, x, t)
        tt = torch.tensor(t, dtype=torch.float64)
        x = x + h * (v + interpolant.noise_from_velocity(x.double(), v.double(), tt).float())
        if i < len(grid) - 2:
            g = math.sqrt(2.0 * float(interpolant.coefficients(tt)[1]) * -h)
            x = x + g * randn_tensor(x.shape, generator=generator, device=x.device,
                                     dtype=x.dtype)
    return x


def flow_scheduler(name: str, scheduler_kwargs: dict[str, Any] | None = None) -> SchedulerMixin:
    """A diffusers flow-match scheduler by class name (`FLOW_DIFFUSERS`), defaults but
    `scheduler_kwargs`."""
    return diffusers_class(name)(**dict(scheduler_kwargs or {}))


def run_flow_scheduler(v_fn: VFn, sched: SchedulerMixin, x: torch.Tensor, steps: int,
                       progress: bool = False) -> torch.Tensor:
    """Step a diffusers flow-match scheduler (sigma = t, timestep = N t) on `v_fn`."""
    inner = getattr(sched, "_scheduler", sched)  # a pipeline's callback wrapper holds it
    if type(inner).__name__ not in FLOW_DIFFUSERS:
        raise ValueError(f"a velocity model samples with one of {list(FLOW_SCHEDULERS)}, "
                         f"not the {type(inner).__name__} given")
    sched.set_timesteps(steps, device=x.device)
    x = x.float()
    n = sched.config.num_train_timesteps
    for k in tqdm(sched.timesteps, desc="sampling", disable=not progress, leave=False):
        t = (NET_TIME_SCALE * k.to(torch.float32) / n).reshape(1).expand(x.shape[0])
        x = sched.step(v_fn(x, t).float(), k, x).prev_sample
    return x


@torch.inference_mode()
def flow_sample(
    v_fn: VFn,
    cfg: DiffusionConfig,
    noise: torch.Tensor,
    scheduler: str | SchedulerMixin = "flow_euler",
    steps: int = 50,
    scheduler_kwargs: dict[str, Any] | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """Samples x_0 of a velocity model from x_1 = `noise` (float32): a named flow sampler
    or a diffusers flow-match scheduler (a name or the object); stochastic steps draw from
    `generator` (one per sample), else from a private generator seeded 0."""
    if isinstance(scheduler, str):
        check_sampler_objective(cfg, scheduler)
    if isinstance(scheduler, str) and scheduler in FLOW_NAMED:
        if scheduler_kwargs:
            raise ValueError(f"sample.scheduler_kwargs={scheduler_kwargs!r}: {scheduler} "
                             "takes none")
        grid = time_grid(scheduler, steps).tolist()
        if scheduler == "flow_euler_maruyama":
            gens = list(generator) if isinstance(generator, Sequence) else generator
            return sde_solve(v_fn, noise, grid, Interpolant(cfg.interpolant),
                             gens if gens is not None else torch.Generator().manual_seed(0),
                             progress)
        return ode_solve(v_fn, noise, grid, heun=scheduler == "flow_heun", progress=progress)
    if isinstance(scheduler, str):
        scheduler = flow_scheduler(scheduler, scheduler_kwargs)
    elif scheduler_kwargs:
        raise ValueError(f"scheduler_kwargs={scheduler_kwargs!r} are for a scheduler given by "
                         f"name, not for the {type(scheduler).__name__} object given")
    return run_flow_scheduler(v_fn, scheduler, noise, steps, progress)
