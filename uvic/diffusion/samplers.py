"""Samplers by name: our fast DPM-Solver++, the U-ViT release's two FID protocols, or any
diffusers scheduler, all run by one loop on a noise-prediction function.

* `dpm_solver++` (ours): multistep DPM-Solver++ of order `sample.order` on a logSNR-uniform
  grid, ending with a denoising step to t = 0. `DPMSolverMultistepScheduler(
  algorithm_type="dpmsolver++", solver_order=order, final_sigmas_type="zero",
  use_lu_lambdas=True)`.
* `dpm_solver`: the same with noise-space updates (`algorithm_type="dpmsolver"`,
  `final_sigmas_type="sigma_min"`, which diffusers requires there).
* `dpm_solver_fast`: the release's MS-COCO protocol, `DPM_Solver(predict_x0=True).sample(
  x, steps=50, eps=1/N, T=1)`: singlestep DPM-Solver++ of order 3 ("fast": 16 order-3 steps
  and one order-2 step for 50 model calls) on a time-uniform grid from t = 1 to t = 1/N,
  without a final denoising step; intermediate points at 1/3 and 2/3 (order 2: 1/2) of each
  step in logSNR, network time N t (continuous). Written here (`dpm_solver_fast`): diffusers'
  `DPMSolverSinglestepScheduler(algorithm_type="dpmsolver++", solver_order=3,
  final_sigmas_type="sigma_min")` has the same orders and end point but places the
  intermediate points on its integer timestep grid; on Gaussian data it lands 4.7e-2
  (relative L2) from the release's result (`python tests/test_samplers.py`).
* `euler_maruyama`: the release's CIFAR-10 protocol, Euler-Maruyama on the reverse VP SDE
  from t = 1 to t = 1/steps, keeping the noiseless mean at the last step. diffusers'
  `ScoreSdeVpScheduler(beta_min, beta_max, sampling_eps=1/steps)` (found wherever the
  installed diffusers keeps it); the network sees 999 t.
* any other name: a diffusers scheduler class (also one of `diffusers.schedulers.deprecated`),
  built with the schedule's table and `clip_sample=False` where it has that argument.

`sample.scheduler_kwargs` is passed on to the constructor last, so it can change any of
the arguments above (e.g. `{"use_lu_lambdas": false}` for diffusers' time-uniform grid).

Euler-Maruyama detail: diffusers' step uses dt = -1/steps, the release's grid spacing is
(1 - eps) / (steps - 1) with eps = 1e-3. With `sampling_eps = 1/steps` the two grids are the
same for every step count, and at the release's 1000 steps eps is its 1e-3.

Stochastic samplers draw their per-step noise from the per-sample generators
(`uvic.sampling.generate.sample_generators`): sample i is the same image in any batch.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import diffusers
import torch
from diffusers import DPMSolverMultistepScheduler
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from tqdm.auto import tqdm

from uvic.diffusion.schedule import Diffusion

# The names `sample.scheduler` understands besides diffusers class names.
NAMED = ("dpm_solver++", "dpm_solver", "dpm_solver_fast", "euler_maruyama")
# diffusers moves retired schedulers here; their classes still work (ScoreSdeVpScheduler).
DEPRECATED_MODULES = (
    "diffusers.schedulers.deprecated.scheduling_sde_vp",
    "diffusers.schedulers.deprecated.scheduling_karras_ve",
)

EpsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def diffusers_class(name: str) -> type[SchedulerMixin]:
    """A diffusers scheduler class by name, from diffusers or its deprecated schedulers."""
    cls = getattr(diffusers, name, None)
    for module in DEPRECATED_MODULES:
        if cls is not None:
            break
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
    if not (isinstance(cls, type) and issubclass(cls, SchedulerMixin)):
        raise ValueError(f"sample.scheduler={name!r} is neither one of {list(NAMED)} "
                         "nor a diffusers scheduler class name")
    return cls


def _check_kwargs(cls: type, kwargs: dict[str, Any]) -> None:
    params = inspect.signature(cls.__init__).parameters  # diffusers wraps __init__
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise ValueError(f"sample.scheduler_kwargs: {cls.__name__} takes no {unknown[0]!r}")


def make_scheduler(
    diffusion: Diffusion,
    name: str = "dpm_solver++",
    order: int = 2,
    steps: int = 50,
    scheduler_kwargs: dict[str, Any] | None = None,
) -> SchedulerMixin:
    """A fresh diffusers scheduler for `name` on this schedule (table in the module doc)."""
    extra = dict(scheduler_kwargs or {})
    table = diffusion.scheduler_kwargs()
    if name in ("dpm_solver++", "dpm_solver"):
        cls: type[SchedulerMixin] = DPMSolverMultistepScheduler
        # diffusers refuses final_sigmas_type="zero" for "dpmsolver"
        kwargs = {**table, "algorithm_type": name.replace("_", ""), "solver_order": order,
                  "final_sigmas_type": "zero" if name == "dpm_solver++" else "sigma_min",
                  "use_lu_lambdas": True}
    elif name == "dpm_solver_fast":
        raise ValueError("dpm_solver_fast is not a diffusers scheduler: use run_sampler")
    elif name == "euler_maruyama":
        if diffusion.cfg.schedule != "vp_continuous":
            raise ValueError("sample.scheduler='euler_maruyama' needs "
                             f"diffusion.schedule='vp_continuous', got {diffusion.cfg.schedule!r}")
        cls = diffusers_class("ScoreSdeVpScheduler")
        kwargs = {"num_train_timesteps": diffusion.num_timesteps,
                  "beta_min": diffusion.cfg.beta_min, "beta_max": diffusion.cfg.beta_max,
                  "sampling_eps": 1.0 / steps}
    else:
        cls = diffusers_class(name)
        params = inspect.signature(cls.__init__).parameters
        kwargs = {k: v for k, v in table.items() if k in params}
        if "clip_sample" in params:
            kwargs["clip_sample"] = False
    _check_kwargs(cls, extra)
    return cls(**{**kwargs, **extra})


def net_time_of(diffusion: Diffusion, sched: SchedulerMixin, k: torch.Tensor) -> torch.Tensor:
    """The network's time input at scheduler timestep `k` (scalar tensor).

    ScoreSdeVpScheduler counts continuous time t in (0, 1]: the network sees 999 t (the
    release's `ScoreModel`). Every other scheduler counts table indices (`Diffusion.net_time`).
    """
    if hasattr(sched, "step_pred"):
        return 999.0 * k.to(torch.float32)
    return diffusion.net_time(k)


def model_calls(
    diffusion: Diffusion,
    scheduler: str | SchedulerMixin = "dpm_solver++",
    steps: int = 50,
    order: int = 2,
    scheduler_kwargs: dict[str, Any] | None = None,
) -> int:
    """How many times `run_sampler` calls `eps_fn` for one batch (its solver steps):
    `steps` for `dpm_solver_fast` (its steps are model calls), else the length of the
    scheduler's timestep list (e.g. 2 steps - 1 for diffusers' Heun)."""
    if isinstance(scheduler, str) and scheduler == "dpm_solver_fast":
        return steps
    sched = scheduler_for(diffusion, scheduler, order, steps, scheduler_kwargs)
    sched.set_timesteps(steps)
    return len(sched.timesteps)


def scheduler_for(
    diffusion: Diffusion,
    scheduler: str | SchedulerMixin,
    order: int = 2,
    steps: int = 50,
    scheduler_kwargs: dict[str, Any] | None = None,
) -> SchedulerMixin:
    """The scheduler `run_sampler` steps with: a name's (`make_scheduler`), or the given
    diffusers scheduler object itself (a pipeline's `pipe.scheduler`, already configured)."""
    if isinstance(scheduler, str):
        return make_scheduler(diffusion, scheduler, order, steps, scheduler_kwargs)
    if scheduler_kwargs:
        raise ValueError(f"scheduler_kwargs={scheduler_kwargs!r} are for a scheduler given by "
                         f"name, not for the {type(scheduler).__name__} object given")
    return scheduler


@torch.inference_mode()
def run_sampler(
    eps_fn: EpsFn,
    diffusion: Diffusion,
    noise: torch.Tensor,
    *,
    scheduler: str | SchedulerMixin = "dpm_solver++",
    steps: int = 50,
    order: int = 2,
    scheduler_kwargs: dict[str, Any] | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """Solve from x_T = `noise` (B, ...) to x_0 with `eps_fn(x, net_time) -> eps`, float32.

    `scheduler` is a name (module docstring) or a diffusers scheduler object, which is
    stepped as it is configured (`uvic.pipelines`: any scheduler swapped into a pipeline).
    `net_time` is the network's time input, shape (B,). `generator` (one per sample) feeds
    the step noise of stochastic samplers; without one they draw from a private generator
    seeded 0, never from torch's global RNG (training draws its data and noise from that,
    and its periodic grids must not shift it).
    """
    if steps < 1:
        raise ValueError(f"sample.steps must be >= 1, got {steps}")
    if isinstance(scheduler, str) and scheduler == "dpm_solver_fast":
        if scheduler_kwargs:
            raise ValueError(f"sample.scheduler_kwargs={scheduler_kwargs!r}: dpm_solver_fast "
                             "takes none")
        return dpm_solver_fast(eps_fn, diffusion, noise, steps, progress=progress)
    sched = scheduler_for(diffusion, scheduler, order, steps, scheduler_kwargs)
    sched.set_timesteps(steps, device=noise.device)
    gens = list(generator) if isinstance(generator, Sequence) else generator
    if gens is None:
        gens = torch.Generator().manual_seed(0)
    b = noise.shape[0]
    x = noise.float() * getattr(sched, "init_noise_sigma", 1.0)
    if hasattr(sched, "step_pred"):  # ScoreSdeVpScheduler: Euler-Maruyama
        for k in tqdm(sched.timesteps, desc="sampling", disable=not progress, leave=False):
            t = net_time_of(diffusion, sched, k).reshape(1).expand(b)
            x, mean = sched.step_pred(eps_fn(x, t).float(), x, k, generator=gens)
        return mean  # the last step keeps its noiseless mean
    step_kwargs = {}
    if gens is not None and "generator" in inspect.signature(sched.step).parameters:
        step_kwargs["generator"] = gens
    for k in tqdm(sched.timesteps, desc="sampling", disable=not progress, leave=False):
        x_in = sched.scale_model_input(x, k)
        t = net_time_of(diffusion, sched, k.reshape(1)).expand(b).to(noise.device)
        x = sched.step(eps_fn(x_in, t).float(), k, x, **step_kwargs).prev_sample
    return x


# --------------------------------------------------------------------------- DPM-Solver "fast"


class ContinuousSchedule:
    """log alpha(t), sigma(t), lambda(t) = log(alpha / sigma) and its inverse, t in (0, 1],
    in float64, the way the release's DPM-Solver sees each schedule.

    vp_continuous: closed form, network time 999 t. scaled_linear: log alpha linear between
    the table's points t_n = n / N (the release's `NoiseScheduleVP("discrete")`), network
    time N t.
    """

    def __init__(self, diffusion: Diffusion) -> None:
        self.continuous = diffusion.cfg.schedule == "vp_continuous"
        self.b0, self.b1 = diffusion.cfg.beta_min, diffusion.cfg.beta_max
        self.n = diffusion.num_timesteps
        self.t_table = diffusion.grid_times()  # n / N, n = 1..N
        self.log_alpha_table = 0.5 * torch.log(diffusion.alphas_cumprod())
        self.t_end = 1.0 / self.n

    def log_alpha(self, t: float) -> float:
        if self.continuous:
            return -0.25 * t**2 * (self.b1 - self.b0) - 0.5 * t * self.b0
        return float(_interp(t, self.t_table, self.log_alpha_table))

    def sigma(self, t: float) -> float:
        return math.sqrt(-math.expm1(2.0 * self.log_alpha(t)))

    def lam(self, t: float) -> float:
        return self.log_alpha(t) - math.log(self.sigma(t))

    def inverse_lambda(self, lam: float) -> float:
        log_alpha = -0.5 * float(torch.logaddexp(torch.tensor(0.0, dtype=torch.float64),
                                                 torch.tensor(-2.0 * lam, dtype=torch.float64)))
        if self.continuous:
            d = self.b1 - self.b0
            return (-0.5 * self.b0 + math.sqrt(0.25 * self.b0**2 - d * log_alpha)) / (0.5 * d)
        return float(_interp(log_alpha, self.log_alpha_table.flip(0), self.t_table.flip(0)))

    def net_time(self, t: float) -> float:
        return 999.0 * t if self.continuous else self.n * t


def _interp(x: float, xp: torch.Tensor, fp: torch.Tensor) -> float:
    """Piecewise-linear interpolation on increasing `xp`, extended linearly at both ends."""
    i = int(torch.searchsorted(xp, torch.tensor(x, dtype=xp.dtype)).clamp(1, len(xp) - 1))
    x0, x1, y0, y1 = float(xp[i - 1]), float(xp[i]), float(fp[i - 1]), float(fp[i])
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def fast_orders(steps: int) -> list[int]:
    """Orders of the "fast" method for `steps` model calls: order-3 steps, then one step
    of order 2 or 1 (or 2 and 1) for the remainder; e.g. 50 -> [3] * 16 + [2]."""
    k = steps // 3 + 1
    if steps % 3 == 0:
        return [3] * (k - 2) + [2, 1]
    if steps % 3 == 1:
        return [3] * (k - 1) + [1]
    return [3] * (k - 1) + [2]


@torch.inference_mode()
def dpm_solver_fast(
    eps_fn: EpsFn, diffusion: Diffusion, noise: torch.Tensor, steps: int = 50,
    progress: bool = False,
) -> torch.Tensor:
    """The release's `DPM_Solver(predict_x0=True).sample(x, steps, eps=1/N, T=1)` (method
    "fast", order 3, time-uniform grid, no final denoising): singlestep DPM-Solver++ with
    data prediction x0 = (x - sigma eps) / alpha. Coefficients in float64, x in float32."""
    sch = ContinuousSchedule(diffusion)
    b = noise.shape[0]
    x = noise.float()

    def data_pred(x: torch.Tensor, t: float) -> torch.Tensor:
        net_t = torch.full((b,), sch.net_time(t), dtype=torch.float32, device=x.device)
        eps = eps_fn(x, net_t).float()
        return (x - sch.sigma(t) * eps) / math.exp(sch.log_alpha(t))

    orders = fast_orders(steps)
    grid = torch.linspace(1.0, sch.t_end, len(orders) + 1, dtype=torch.float64).tolist()
    for order, s, t in tqdm(list(zip(orders, grid[:-1], grid[1:])), desc="sampling",
                            disable=not progress, leave=False):
        lam_s = sch.lam(s)
        h = sch.lam(t) - lam_s
        a_t, sig_s, sig_t = math.exp(sch.log_alpha(t)), sch.sigma(s), sch.sigma(t)
        phi_1 = math.expm1(-h)
        m_s = data_pred(x, s)
        if order == 1:
            x = sig_t / sig_s * x - a_t * phi_1 * m_s
            continue
        r1 = 0.5 if order == 2 else 1.0 / 3.0
        s1 = sch.inverse_lambda(lam_s + r1 * h)
        x_s1 = sch.sigma(s1) / sig_s * x - math.exp(sch.log_alpha(s1)) * math.expm1(-r1 * h) * m_s
        m_s1 = data_pred(x_s1, s1)
        if order == 2:
            x = sig_t / sig_s * x - a_t * phi_1 * m_s - (0.5 / r1) * a_t * phi_1 * (m_s1 - m_s)
            continue
        r2 = 2.0 / 3.0
        s2 = sch.inverse_lambda(lam_s + r2 * h)
        a_s2 = math.exp(sch.log_alpha(s2))
        phi_22 = math.expm1(-r2 * h) / (r2 * h) + 1.0
        x_s2 = (sch.sigma(s2) / sig_s * x - a_s2 * math.expm1(-r2 * h) * m_s
                + (r2 / r1) * a_s2 * phi_22 * (m_s1 - m_s))
        m_s2 = data_pred(x_s2, s2)
        phi_2 = phi_1 / h + 1.0
        x = sig_t / sig_s * x - a_t * phi_1 * m_s + (1.0 / r2) * a_t * phi_2 * (m_s2 - m_s)
    return x
