"""Post-hoc EMA (EDM2: Karras et al. 2024, section 3 and appendix C): power-function EMA
profiles kept during training (`PosthocEMA`, `train.posthoc_ema_stds`) and saved as
snapshots, from which `uvic.training.posthoc_reconstruct` builds the EMA of any length.

A profile of exponent gamma averages the run's weights up to step t with
p_t(tau) = (gamma + 1) tau^gamma / t^(gamma + 1); its length sigma_rel is the profile's
standard deviation relative to t (docs/training.md, "Post-hoc EMA").
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from torch import Tensor, nn

from uvic.config import Config, ConfigError, TrainConfig
from uvic.config.training import check_sigma_rel, snapshot_tag
from uvic.run.architecture import model_metadata
from uvic.run.folder import RunFolder, resume_config_path
from uvic.run.prepare import read_run_config
from uvic.run.weights import save_safetensors, unwrap_model

POSTHOC_METADATA_KEY = "uvic.posthoc_ema"  # safetensors metadata: step, sigma_rel, gamma


# --------------------------------------------------------------------------- closed forms


def gamma_to_sigma(gamma: float) -> float:
    """The relative standard deviation of the power-function profile of exponent `gamma`."""
    return math.sqrt((gamma + 1.0) / ((gamma + 2.0) ** 2 * (gamma + 3.0)))


def sigma_to_gamma(sigma_rel: float) -> float:
    """The exponent gamma > 0 of the profile of relative standard deviation `sigma_rel`
    (in (0, sqrt(1/12))): the largest real root of the cubic that sigma_rel^2 =
    (g + 1) / ((g + 2)^2 (g + 3)) is, g^3 + 7 g^2 + (16 - s) g + (12 - s) = 0 with
    s = sigma_rel^-2, polished by Newton steps."""
    check_sigma_rel(sigma_rel, "posthoc EMA")
    s = sigma_rel ** -2.0
    coeffs = [1.0, 7.0, 16.0 - s, 12.0 - s]
    gamma = max(r.real for r in np.roots(coeffs) if abs(r.imag) <= 1e-7 * max(1.0, abs(r)))
    for _ in range(3):
        value = ((gamma + 7.0) * gamma + 16.0 - s) * gamma + 12.0 - s
        slope = (3.0 * gamma + 14.0) * gamma + 16.0 - s
        if slope != 0.0:
            gamma -= value / slope
    return float(gamma)


def beta(gamma: float, step: int) -> float:
    """The decay of the power-function EMA at optimizer step `step` >= 1 (beta_1 = 0: the first
    update copies the weights). The recursion gives step tau the integral of p_t over
    [tau - 1, tau], so `profile_products` hold exactly for what training computes."""
    return (1.0 - 1.0 / step) ** (gamma + 1.0)


def profile_products(t_a: np.ndarray, g_a: np.ndarray, t_b: np.ndarray,
                     g_b: np.ndarray) -> np.ndarray:
    """The L2 inner products of the profiles (t_a, g_a) and (t_b, g_b) (broadcast):

        int_0^min p_a p_b = (g_a + 1)(g_b + 1) / (g_a + g_b + 1) / hi * (lo / hi)^g_hi

    with lo, hi = the shorter and longer end steps and g_hi the exponent of the longer
    profile (float64). The Gram matrix of EDM2's least-squares reconstruction."""
    t_a, g_a, t_b, g_b = (np.asarray(x, dtype=np.float64) for x in (t_a, g_a, t_b, g_b))
    lo, hi = np.minimum(t_a, t_b), np.maximum(t_a, t_b)
    g_hi = np.where(t_a < t_b, g_b, g_a)
    return (g_a + 1.0) * (g_b + 1.0) / (g_a + g_b + 1.0) / hi * (lo / hi) ** g_hi


def solve_coefficients(steps: np.ndarray, gammas: np.ndarray, step: int,
                       gamma: float) -> tuple[np.ndarray, float]:
    """EDM2's post-hoc reconstruction: the weights x of the snapshots (end steps `steps`,
    exponents `gammas`) whose combination sum_i x_i p_i is closest in L2 to the target
    profile (`step`, `gamma`), normalised to sum to 1 (every profile integrates to 1, so
    the combination is an average); and the fit, ||sum_i x_i p_i - p|| / ||p||.

    Least squares on the Gram matrix (`numpy.linalg.lstsq`, which also copes with nearly
    dependent snapshots); steps are measured in units of `step` so the products are O(1)."""
    t = np.asarray(steps, dtype=np.float64) / step
    g = np.asarray(gammas, dtype=np.float64)
    gram = profile_products(t[:, None], g[:, None], t[None, :], g[None, :])
    target = profile_products(t, g, 1.0, gamma)
    x = np.linalg.lstsq(gram, target, rcond=None)[0]
    x = x / x.sum()
    norm2 = float(profile_products(1.0, gamma, 1.0, gamma))
    residual2 = float(x @ gram @ x - 2.0 * x @ target) + norm2
    return x, math.sqrt(max(residual2, 0.0) / norm2)


# --------------------------------------------------------------------------- snapshots


def snapshot_name(step: int, sigma_rel: float) -> str:
    """The file name of the snapshot of profile `sigma_rel` at `step`."""
    return f"step_{step:07d}_{snapshot_tag(sigma_rel)}.safetensors"


def snapshot_count(step: int, interval: int) -> int:
    """Snapshots at the multiples of `interval` up to `step`, plus one at `step`."""
    return step // interval + (step % interval != 0)


def kept_steps(step: int, every: int, keep: int) -> Callable[[int], bool]:
    """Which snapshot steps stay on disk once `step` is saved: `step` itself and the
    multiples of an interval. keep 0: every multiple of `every` (a snapshot of a session's
    last step that is none goes at the next save). Bounded, the interval doubles (every,
    2 every, 4 every, ...) until at most `keep` snapshots are left: the kept ones stay
    spread over the whole run, as the reconstruction of long EMAs needs, and thin out as
    it grows. A pure function of `step`: a resumed run keeps the same files as an
    uninterrupted one."""
    interval = every
    while keep > 0 and snapshot_count(step, interval) > keep and interval <= step:
        interval *= 2
    return lambda s: s == step or s % interval == 0


def snapshot_steps(folder: Path) -> dict[int, list[Path]]:
    """The snapshot files of `folder` by step (from their names)."""
    found: dict[int, list[Path]] = {}
    for path in sorted(folder.glob("step_*_std*.safetensors")):
        number = path.name.split("_")[1]
        if number.isdigit():
            found.setdefault(int(number), []).append(path)
    return found


def snapshot_bytes(model: nn.Module) -> int:
    """Bytes of one snapshot: the model's state in float32 (the header aside)."""
    return sum(4 * v.numel() for v in unwrap_model(model).state_dict().values())


def describe_plan(t: TrainConfig, nbytes: int) -> str:
    """One line on the profiles and the disk their snapshots take (said at the start), for
    snapshots of `nbytes` each (`snapshot_bytes`)."""
    profiles = ", ".join(f"{s:g} (gamma {sigma_to_gamma(s):.2f})" for s in t.posthoc_ema_stds)
    per_save = len(t.posthoc_ema_stds) * nbytes
    saves = snapshot_count(t.max_steps, t.posthoc_ema_every)
    if t.posthoc_ema_keep:
        saves = min(saves, t.posthoc_ema_keep)
    bound = f"at most {t.posthoc_ema_keep} per profile" if t.posthoc_ema_keep else "all kept"
    return (f"post-hoc EMA: sigma_rel {profiles}; snapshots every {t.posthoc_ema_every} "
            f"steps, {_size(per_save)} each time ({bound}): {_size(saves * per_save)} on "
            f"disk by step {t.max_steps}")


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


# --------------------------------------------------------------------------- training


class PosthocEMA:
    """The power-function EMA profiles of a run (float32 copies of the model, one per
    sigma_rel) and their snapshots; `update(model)` after every optimizer step. Registered
    with Accelerate, its state (the profiles and their step) is saved and restored with
    every checkpoint."""

    def __init__(self, model: nn.Module, stds: tuple[float, ...],
                 device: torch.device | str = "cpu") -> None:
        self.stds = tuple(float(s) for s in stds)
        self.gammas = [sigma_to_gamma(s) for s in self.stds]
        base = copy.deepcopy(unwrap_model(model)).float().eval().requires_grad_(False)
        self.profiles = [copy.deepcopy(base).to(device) for _ in self.stds]
        self.step = 0
        # when snapshots are due (every process) and where they go (the main process's
        # folder), set by `posthoc_ema_for`: folder, interval, bound, last step
        self.folder: Path | None = None
        self.every, self.keep, self.max_steps = 0, 0, 0
        self.metadata: dict[str, str] = {}

    @torch.no_grad()
    def update(self, model: nn.Module, before_save: Callable[[], None] | None = None) -> None:
        """One optimizer step more: every profile moves towards the weights of `model` by
        1 - beta(gamma, step) (buffers are copied); then the snapshots due at this step,
        after `before_save()` (the trainer's finite check: it raises rather than let a
        diverged run write NaN snapshots; called on every process, the writer being one)."""
        self.step += 1
        source = unwrap_model(model)
        params = [p.detach() if p.dtype == torch.float32 else p.detach().float()
                  for p in source.parameters()]
        for gamma, profile in zip(self.gammas, self.profiles):
            torch._foreach_lerp_(list(profile.parameters()), params,
                                 1.0 - beta(gamma, self.step))
            for mine, buf in zip(profile.buffers(), source.buffers()):
                mine.copy_(buf)
        if self.every and (self.step % self.every == 0 or self.step == self.max_steps):
            if before_save is not None:
                before_save()
            if self.folder is not None:
                self.save_snapshots()

    def save_snapshots(self) -> None:
        """Write every profile at the current step (atomically), then drop the snapshots
        `kept_steps` lets go."""
        assert self.folder is not None
        self.folder.mkdir(parents=True, exist_ok=True)
        for sigma_rel, gamma, profile in zip(self.stds, self.gammas, self.profiles):
            record = {"step": self.step, "sigma_rel": sigma_rel, "gamma": gamma}
            save_safetensors(profile, self.folder / snapshot_name(self.step, sigma_rel),
                             metadata={**self.metadata,
                                       POSTHOC_METADATA_KEY: json.dumps(record)})
        keep = kept_steps(self.step, self.every, self.keep)
        for step, paths in snapshot_steps(self.folder).items():
            if not keep(step):
                for path in paths:
                    path.unlink()

    def forget_after(self, step: int) -> list[int]:
        """Delete the snapshots of steps after `step` (a resume from an earlier checkpoint:
        they belong to a run that is being replaced); returns their steps."""
        if self.folder is None or not self.folder.is_dir():
            return []
        later = {s: paths for s, paths in snapshot_steps(self.folder).items() if s > step}
        for paths in later.values():
            for path in paths:
                path.unlink()
        return sorted(later)

    def state_dict(self) -> dict[str, Tensor]:
        """The step and every profile's weights, keyed `<std tag>.<name>` (tensors only)."""
        state = {"step": torch.tensor(self.step, dtype=torch.int64)}
        for sigma_rel, profile in zip(self.stds, self.profiles):
            tag = snapshot_tag(sigma_rel)
            state.update({f"{tag}.{k}": v for k, v in profile.state_dict().items()})
        return state

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Restore `state_dict()` (strict). Snapshots written after the restored step are
        deleted (see `forget_after`)."""
        self.step = int(state["step"])
        for sigma_rel, profile in zip(self.stds, self.profiles):
            prefix = f"{snapshot_tag(sigma_rel)}."
            profile.load_state_dict({k[len(prefix):]: v for k, v in state.items()
                                     if k.startswith(prefix)})
        self.forget_after(self.step)


def posthoc_ema_for(cfg: Config, model: nn.Module, run: RunFolder, resume_from: Path | None,
                    acc: Accelerator, say: Callable[[str], None]) -> PosthocEMA | None:
    """The post-hoc EMA of a training run of `cfg` (None when train.posthoc_ema_stds is
    empty), on the run's device, its snapshots written by the main process into
    `run.posthoc_ema`. The profiles average the whole run and their snapshots follow one
    interval: a resume that changes train.posthoc_ema_stds or (with profiles)
    train.posthoc_ema_every is refused (one line); train.posthoc_ema_keep may change."""
    t = cfg.train
    if resume_from is not None:
        saved = read_run_config(resume_config_path(resume_from))[0].train
        if tuple(saved.posthoc_ema_stds) != tuple(t.posthoc_ema_stds):
            raise ConfigError(
                f"train.posthoc_ema_stds={list(t.posthoc_ema_stds)} but {resume_from} was "
                f"written with {list(saved.posthoc_ema_stds)}: the profiles average the whole "
                "run, they cannot start or change at a resume")
        if t.posthoc_ema_stds and saved.posthoc_ema_every != t.posthoc_ema_every:
            raise ConfigError(
                f"train.posthoc_ema_every={t.posthoc_ema_every} but {resume_from} was written "
                f"with {saved.posthoc_ema_every}: a resume keeps the snapshot interval (a new "
                "one would delete snapshots already saved)")
    if not t.posthoc_ema_stds:
        return None
    tracker = PosthocEMA(model, t.posthoc_ema_stds, acc.device)
    tracker.every, tracker.keep, tracker.max_steps = (
        t.posthoc_ema_every, t.posthoc_ema_keep, t.max_steps)
    if acc.is_main_process:
        tracker.folder = run.posthoc_ema
        tracker.metadata = model_metadata(cfg.model, cfg.diffusion)
        if resume_from is None:  # a start from step 0 (latest-or-new after an early kill)
            tracker.forget_after(0)
    say(describe_plan(cfg.train, snapshot_bytes(model)))
    return tracker
