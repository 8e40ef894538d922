"""Samplers by name, all run by `run_sampler` on a noise-prediction function: diffusers'
multistep DPM-Solver++ (`dpm_solver++`, ours), the U-ViT release's FID protocols
(`euler_maruyama`, and the two "fast" DPM-Solvers written here), or any diffusers scheduler
class. Velocity models go to `uvic.diffusion.flow`; docs/sampling.md has the table of names.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import DPMSolverMultistepScheduler
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from tqdm.auto import tqdm

from uvic.config.diffusion import FAST_LOGSNR, FAST_TIME_UNIFORM, RELEASE_FAST, diffusers_class
from uvic.diffusion.flow import FLOW_SCHEDULERS, flow_model_calls, flow_sample
from uvic.diffusion.schedule import Diffusion

EpsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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
    """A fresh diffusers scheduler for `name` on this schedule (docs/sampling.md): any other
    diffusers class gets the schedule's table and `clip_sample=False` where it takes them;
    `scheduler_kwargs` go to the constructor last."""
    extra = dict(scheduler_kwargs or {})
    table = diffusion.scheduler_kwargs()
    if name in ("dpm_solver++", "dpm_solver"):
        cls: type[SchedulerMixin] = DPMSolverMultistepScheduler
        # diffusers refuses final_sigmas_type="zero" for "dpmsolver"
        kwargs = {**table, "algorithm_type": name.replace("_", ""), "solver_order": order,
                  "final_sigmas_type": "zero" if name == "dpm_solver++" else "sigma_min",
                  "use_lu_lambdas": True}
    elif name in RELEASE_FAST:
        raise ValueError(f"{name} is not a diffusers scheduler: use run_sampler")
    elif name == "euler_maruyama":
        if diffusion.cfg.schedule != "vp_continuous":
            raise ValueError("sample.scheduler='euler_maruyama' needs "
                             f"diffusion.schedule='vp_continuous', got {diffusion.cfg.schedule!r}")
        # its dt = -1/steps is the release's spacing (1 - eps) / (steps - 1) for eps = 1/steps
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
    `steps` for the release's "fast" protocols (their steps are model calls), else the
    length of the scheduler's timestep list (e.g. 2 steps - 1 for diffusers' Heun)."""
    if diffusion.cfg.objective == "velocity" or scheduler in FLOW_SCHEDULERS:
        return flow_model_calls(diffusion.cfg, scheduler, steps, scheduler_kwargs)
    if isinstance(scheduler, str) and scheduler in RELEASE_FAST:
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

    `scheduler` is a name (docs/sampling.md) or a diffusers scheduler object, which is
    stepped as it is configured (`uvic.pipelines`: any scheduler swapped into a pipeline).
    `net_time` is the network's time input, shape (B,). `generator` (one per sample) feeds
    the step noise of stochastic samplers; without one they draw from a private generator
    seeded 0, never from torch's global RNG (training draws its data and noise from that,
    and its periodic grids must not shift it).
    """
    if steps < 1:
        raise ValueError(f"sample.steps must be >= 1, got {steps}")
    if diffusion.cfg.objective == "velocity" or scheduler in FLOW_SCHEDULERS:  # eps_fn gives v
        return flow_sample(eps_fn, diffusion.cfg, noise, scheduler, steps, scheduler_kwargs,
                           generator, progress)
    if isinstance(scheduler, str) and scheduler in RELEASE_FAST:
        if scheduler_kwargs:
            raise ValueError(f"sample.scheduler_kwargs={scheduler_kwargs!r}: {scheduler} "
                             "takes none")
        return release_fast(eps_fn, diffusion, noise, scheduler, steps, progress=progress)
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


# --------------------------------------------------------------- the release's "fast" DPM-Solvers
#
# The U-ViT release samples for FID with two different DPM-Solver files, both called "fast"
# (K = steps // 3 + 1 singlestep updates of order 3, closed by one of order 2 or 1, for
# `steps` network evaluations), which differ in what they predict, in their time grid and
# in where they place each update's intermediate points:
#
# * `dpm_solver_pytorch.py`, `DPM_Solver(model_fn, NoiseScheduleVP("linear")).sample(x,
#   steps, eps=1e-4, fast_version=True)` (eval.py, eval_ldm.py): noise prediction; K + 1
#   grid points uniform in lambda = log(alpha / sigma) from t = 1 to t = 1e-4, one update
#   per interval; intermediate points at 1/3 and 2/3 (order 2: 1/2) of the interval in
#   lambda. Here `dpm_solver_fast_logsnr`.
# * `dpm_solver_pp.py`, `DPM_Solver(model_fn, NoiseScheduleVP("discrete", betas),
#   predict_x0=True).sample(x, steps, eps=1/N, T=1)` (method "fast", order 3, skip_type
#   "time_uniform", solver_type "dpm_solver"; eval_t2i_discrete.py, eval_ldm_discrete.py):
#   data prediction (DPM-Solver++); `steps` + 1 grid points uniform in t from 1 to 1/N;
#   an update of order k spans k consecutive intervals and evaluates the network at the
#   grid points it spans (its r1, r2 are those points' fractions of the span in lambda).
#   Here `dpm_solver++_fast_time_uniform`.
# (Neither takes a final denoising step; the network sees 999 t (vp_continuous) or N t.)

# The end time t_0 of each protocol: the release's `eps` argument (None: 1 / N).
FAST_END = {FAST_LOGSNR: 1e-4, FAST_TIME_UNIFORM: None}


class ContinuousSchedule:
    """log alpha(t), sigma(t), lambda(t) = log(alpha / sigma) and its inverse, t in (0, 1],
    in float64, the way the release's DPM-Solvers see each schedule.

    vp_continuous: closed form (`NoiseScheduleVP("linear")`), network time 999 t.
    scaled_linear: log alpha piecewise linear between the table's points t_n = n / N,
    extended linearly beyond them (`NoiseScheduleVP("discrete")`), network time N t.
    """

    def __init__(self, diffusion: Diffusion) -> None:
        self.continuous = diffusion.cfg.schedule == "vp_continuous"
        self.b0, self.b1 = diffusion.cfg.beta_min, diffusion.cfg.beta_max
        self.n = diffusion.num_timesteps
        self.t_table = diffusion.grid_times()  # n / N, n = 1..N
        self.log_alpha_table = 0.5 * torch.log(diffusion.alphas_cumprod())

    def log_alpha(self, t: float) -> float:
        if self.continuous:
            return -0.25 * t**2 * (self.b1 - self.b0) - 0.5 * t * self.b0
        return _interp(t, self.t_table, self.log_alpha_table)

    def alpha(self, t: float) -> float:
        return math.exp(self.log_alpha(t))

    def sigma(self, t: float) -> float:
        return math.sqrt(-math.expm1(2.0 * self.log_alpha(t)))

    def lam(self, t: float) -> float:
        return self.log_alpha(t) - math.log(self.sigma(t))

    def inverse_lambda(self, lam: float) -> float:
        """t with lambda(t) = lam: log alpha = -log(1 + e^(-2 lam)) / 2, then t from log
        alpha (VP: the root of the quadratic, in the cancellation-free form)."""
        two_log_alpha = -(max(0.0, -2.0 * lam) + math.log1p(math.exp(-abs(2.0 * lam))))
        if self.continuous:
            d = self.b1 - self.b0
            tmp = -2.0 * d * two_log_alpha
            return tmp / (math.sqrt(self.b0**2 + tmp) + self.b0) / d
        return _interp(0.5 * two_log_alpha, self.log_alpha_table.flip(0), self.t_table.flip(0))

    def net_time(self, t: float) -> float:
        return 999.0 * t if self.continuous else self.n * t


def _interp(x: float, xp: torch.Tensor, fp: torch.Tensor) -> float:
    """Piecewise-linear interpolation on increasing `xp`, extended linearly at both ends."""
    i = int(torch.searchsorted(xp, torch.tensor(x, dtype=xp.dtype)).clamp(1, len(xp) - 1))
    x0, x1, y0, y1 = float(xp[i - 1]), float(xp[i]), float(fp[i - 1]), float(fp[i])
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def fast_orders(steps: int) -> list[int]:
    """Orders of the "fast" updates for `steps` network evaluations (both release files):
    order-3 updates, then one of order 2 or 1 (or 2 and 1) for the rest; 50 -> [3] * 16 + [2]."""
    k = steps // 3 + 1
    if steps % 3 == 0:
        return [3] * (k - 2) + [2, 1]
    if steps % 3 == 1:
        return [3] * (k - 1) + [1]
    return [3] * (k - 1) + [2]


@dataclass(frozen=True)
class FastStep:
    """One singlestep update from time `s` to `t` (< s) of order len(mids) + 1: the network
    is evaluated at `s`, then at each intermediate time in `mids`."""

    s: float
    mids: tuple[float, ...]
    t: float

    @property
    def order(self) -> int:
        return len(self.mids) + 1


def fast_plan(diffusion: Diffusion, name: str, steps: int) -> list[FastStep]:
    """The updates of protocol `name` (one of `RELEASE_FAST`) for `steps` evaluations."""
    sch = ContinuousSchedule(diffusion)
    orders = fast_orders(steps)
    t_end = FAST_END[name] or 1.0 / sch.n
    if name == FAST_LOGSNR:
        lam_0, lam_1 = sch.lam(1.0), sch.lam(t_end)
        grid = [1.0] + [sch.inverse_lambda(lam_0 + (lam_1 - lam_0) * i / len(orders))
                        for i in range(1, len(orders))] + [t_end]
        fractions = {1: (), 2: (0.5,), 3: (1.0 / 3.0, 2.0 / 3.0)}
        plan = []
        for order, s, t in zip(orders, grid[:-1], grid[1:], strict=True):
            lam_s, h = sch.lam(s), sch.lam(t) - sch.lam(s)
            plan.append(FastStep(s, tuple(sch.inverse_lambda(lam_s + r * h)
                                          for r in fractions[order]), t))
        return plan
    if name == FAST_TIME_UNIFORM:
        grid = torch.linspace(1.0, t_end, steps + 1, dtype=torch.float64).tolist()
        starts = [sum(orders[:i]) for i in range(len(orders))]
        return [FastStep(grid[i], tuple(grid[i + 1:i + order]), grid[i + order])
                for i, order in zip(starts, orders, strict=True)]
    raise ValueError(f"sample.scheduler={name!r} is not one of {list(RELEASE_FAST)}")


def _transfer(
    sch: ContinuousSchedule, s: float, u: float, data_prediction: bool
) -> tuple[float, float, float]:
    """Coefficients (a, b, c) of the exact solution of the diffusion ODE from s to u when the
    prediction D is linear in lambda: x_u = a x_s + b D(s) + c h dD/dlambda, h = lambda_u -
    lambda_s (the integrals of the variation-of-constants formula, DPM-Solver eq. 3.4 and
    DPM-Solver++ eq. 9).

    noise (D = eps):  a = alpha_u / alpha_s, b = -sigma_u (e^h - 1),
                      c = -sigma_u ((e^h - 1) / h - 1)
    data (D = x0):    a = sigma_u / sigma_s, b = -alpha_u (e^-h - 1),
                      c = alpha_u ((e^-h - 1) / h + 1)
    """
    h = sch.lam(u) - sch.lam(s)
    if data_prediction:
        a_u = sch.alpha(u)
        return sch.sigma(u) / sch.sigma(s), -a_u * math.expm1(-h), a_u * (math.expm1(-h) / h + 1)
    sig_u = sch.sigma(u)
    return (math.exp(sch.log_alpha(u) - sch.log_alpha(s)), -sig_u * math.expm1(h),
            -sig_u * (math.expm1(h) / h - 1))


def _singlestep(
    predict: Callable[[torch.Tensor, float], torch.Tensor], sch: ContinuousSchedule,
    x: torch.Tensor, step: FastStep, data_prediction: bool,
) -> torch.Tensor:
    """One singlestep DPM-Solver update (both release files, solver_type "dpm_solver").

    With r_i = (lambda(s_i) - lambda(s)) / h the fractions of the intermediate points:
    order 1: x_t = a x + b D_s;
    order 2: u_1 first-order to s_1, x_t = a x + b D_s + b (D_1 - D_s) / (2 r_1);
    order 3: u_1 first-order to s_1; u_2 = a_2 x + b_2 D_s + (r_2 / r_1) c_2 (D_1 - D_s)
             (slope (D_1 - D_s) / (r_1 h) over r_2 h); x_t = a x + b D_s + c (D_2 - D_s) / r_2.
    """
    lam_s = sch.lam(step.s)
    h = sch.lam(step.t) - lam_s
    r = [(sch.lam(m) - lam_s) / h for m in step.mids]
    a, b, c = _transfer(sch, step.s, step.t, data_prediction)
    d_s = predict(x, step.s)
    if step.order == 1:
        return a * x + b * d_s
    a1, b1, _ = _transfer(sch, step.s, step.mids[0], data_prediction)
    d_1 = predict(a1 * x + b1 * d_s, step.mids[0])
    if step.order == 2:
        return a * x + b * d_s + (0.5 / r[0]) * b * (d_1 - d_s)
    a2, b2, c2 = _transfer(sch, step.s, step.mids[1], data_prediction)
    d_2 = predict(a2 * x + b2 * d_s + (r[1] / r[0]) * c2 * (d_1 - d_s), step.mids[1])
    return a * x + b * d_s + (1.0 / r[1]) * c * (d_2 - d_s)


@torch.inference_mode()
def release_fast(
    eps_fn: EpsFn, diffusion: Diffusion, noise: torch.Tensor, name: str, steps: int = 50,
    progress: bool = False,
) -> torch.Tensor:
    """Run the release's "fast" protocol `name` (`RELEASE_FAST`, see the comment above)
    from x_1 = `noise` with `steps` evaluations of `eps_fn`. `dpm_solver_fast_logsnr`
    updates with the noise prediction, `dpm_solver++_fast_time_uniform` with the data
    prediction x0 = (x - sigma eps) / alpha. Coefficients in float64, x in float32."""
    sch = ContinuousSchedule(diffusion)
    data_prediction = name == FAST_TIME_UNIFORM
    b = noise.shape[0]

    def predict(x: torch.Tensor, t: float) -> torch.Tensor:
        net_t = torch.full((b,), sch.net_time(t), dtype=torch.float32, device=x.device)
        eps = eps_fn(x, net_t).float()
        return (x - sch.sigma(t) * eps) / sch.alpha(t) if data_prediction else eps

    x = noise.float()
    for step in tqdm(fast_plan(diffusion, name, steps), desc="sampling", disable=not progress,
                     leave=False):
        x = _singlestep(predict, sch, x, step, data_prediction)
    return x
