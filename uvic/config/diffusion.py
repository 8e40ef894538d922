"""The rules on `diffusion.*` values and the sampler names `sample.scheduler` accepts.

Read by `Diffusion`, by `uvic.diffusion.samplers` and by `uvic.config.validation`; no torch
here: a scheduler given by its class name is checked against the names the installed
diffusers exports, read from its source (`diffusers_scheduler_names`), and diffusers is
imported only to build one, so a wrong name answers before any heavy import.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import math
from pathlib import Path
from typing import TYPE_CHECKING

from uvic.config import ConfigError, DiffusionConfig, require

if TYPE_CHECKING:
    from diffusers.schedulers.scheduling_utils import SchedulerMixin

SCHEDULES = ("vp_continuous", "scaled_linear")
# The U-ViT release's two DPM-Solver "fast" protocols, named after what they run
# (`uvic.diffusion.samplers`): dpm_solver_pp.py's and dpm_solver_pytorch.py's.
FAST_TIME_UNIFORM = "dpm_solver++_fast_time_uniform"
FAST_LOGSNR = "dpm_solver_fast_logsnr"
RELEASE_FAST = (FAST_LOGSNR, FAST_TIME_UNIFORM)
# The names `sample.scheduler` understands besides diffusers class names
# (`uvic.diffusion.samplers` says what each runs).
# Flow-matching samplers (`uvic.diffusion.flow`), for diffusion.objective="velocity" only.
FLOW_NAMED = ("flow_euler", "flow_heun", "flow_euler_maruyama")
NAMED = ("dpm_solver++", "dpm_solver", FAST_TIME_UNIFORM, FAST_LOGSNR, "euler_maruyama",
         *FLOW_NAMED)
OBJECTIVES = ("eps", "velocity")
INTERPOLANTS = ("linear", "trigonometric")
TIMESTEP_SAMPLING = ("uniform", "logit_normal")
# diffusers' flow-matching scheduler that steps a velocity model on the linear interpolant
# (its sigma is t; `uvic.diffusion.flow.run_flow_scheduler`)
FLOW_DIFFUSERS = ("FlowMatchEulerDiscreteScheduler",)
# Names no longer run, and why; results recorded under them keep their own protocol label
# (`uvic.evaluation.protocols.OLD_SAMPLERS`).
RETIRED = {
    "dpm_solver_fast": (
        "sample.scheduler='dpm_solver_fast' is retired: it was not the release's MS-COCO "
        f"protocol; use {FAST_TIME_UNIFORM!r} (the release's dpm_solver_pp.py: "
        f"MS-COCO, ImageNet H/2 and H/4) or {FAST_LOGSNR!r} (its dpm_solver_pytorch.py: "
        "ImageNet 64, ImageNet L/2 and L/4)"),
}
DPM_SOLVER_NAMES = ("dpm_solver++", "dpm_solver")  # multistep DPM-Solver: sample.order 1-3
# diffusers moves retired schedulers here; their classes still work (ScoreSdeVpScheduler).
DEPRECATED_MODULES = (
    "diffusers.schedulers.deprecated.scheduling_sde_vp",
    "diffusers.schedulers.deprecated.scheduling_karras_ve",
)


def check_diffusion(diffusion: DiffusionConfig) -> None:
    """The rules on `diffusion.*` values."""
    require([
        (diffusion.schedule in SCHEDULES,
         f"diffusion.schedule={diffusion.schedule!r} must be one of {SCHEDULES}"),
        (0.0 <= diffusion.p_uncond < 1.0,
         f"diffusion.p_uncond={diffusion.p_uncond} must be in [0, 1)"),
        (diffusion.min_snr_gamma >= 0.0,
         f"diffusion.min_snr_gamma={diffusion.min_snr_gamma} must be >= 0 (0: off)"),
    ])
    check_noise_range(diffusion)
    check_objective(diffusion)


def check_noise_range(diffusion: DiffusionConfig) -> None:
    """The noise schedule in use must not end below its start (its fields swapped, say)
    and must add noise: 0 <= beta_min <= beta_max, beta_max > 0 (vp_continuous),
    0 < beta_start <= beta_end < 1 (scaled_linear); at least 2 training timesteps."""
    d = diffusion
    rules = [(d.num_train_timesteps >= 2,
              f"diffusion.num_train_timesteps={d.num_train_timesteps} must be >= 2")]
    if d.schedule == "vp_continuous":
        rules.append((0.0 <= d.beta_min <= d.beta_max < math.inf and d.beta_max > 0,
                      f"diffusion.beta_min={d.beta_min}, diffusion.beta_max={d.beta_max}: "
                      "the noise schedule must not end below its start (0 <= beta_min <= "
                      "beta_max, beta_max > 0 and finite)"))
    elif d.schedule == "scaled_linear":
        rules.append((0.0 < d.beta_start <= d.beta_end < 1.0,
                      f"diffusion.beta_start={d.beta_start}, diffusion.beta_end={d.beta_end}: "
                      "the noise schedule must not end below its start (0 < beta_start <= "
                      "beta_end < 1)"))
    require(rules)


def check_objective(diffusion: DiffusionConfig) -> None:
    """The rules on the objective, the interpolant and how training draws its times."""
    velocity = diffusion.objective == "velocity"
    require([
        (diffusion.objective in OBJECTIVES,
         f"diffusion.objective={diffusion.objective!r} must be one of {OBJECTIVES}"),
        (diffusion.interpolant in INTERPOLANTS,
         f"diffusion.interpolant={diffusion.interpolant!r} must be one of {INTERPOLANTS}"),
        (diffusion.timestep_sampling in TIMESTEP_SAMPLING,
         f"diffusion.timestep_sampling={diffusion.timestep_sampling!r} must be one of "
         f"{TIMESTEP_SAMPLING}"),
        (math.isfinite(diffusion.logit_normal_mean),
         f"diffusion.logit_normal_mean={diffusion.logit_normal_mean} must be finite"),
        (0.0 < diffusion.logit_normal_std < math.inf,
         f"diffusion.logit_normal_std={diffusion.logit_normal_std} must be > 0 and finite"),
        (velocity or diffusion.interpolant == "linear",
         f"diffusion.interpolant={diffusion.interpolant!r} is for "
         "diffusion.objective='velocity' (eps uses diffusion.schedule)"),
        (not velocity or diffusion.schedule == "vp_continuous",
         f"diffusion.schedule={diffusion.schedule!r} with diffusion.objective='velocity': the "
         "interpolant replaces the schedule, leave diffusion.schedule='vp_continuous'"),
        (not velocity or diffusion.min_snr_gamma == 0.0,
         f"diffusion.min_snr_gamma={diffusion.min_snr_gamma} weights the noise MSE; it has "
         "no meaning with diffusion.objective='velocity' (set it to 0)"),
        (velocity or diffusion.timestep_sampling == "uniform"
         or diffusion.schedule == "vp_continuous",
         f"diffusion.timestep_sampling={diffusion.timestep_sampling!r} needs continuous "
         f"time: diffusion.schedule={diffusion.schedule!r} draws discrete steps "
         "(use 'vp_continuous' or diffusion.objective='velocity')"),
    ])


def sampler_calls(name: str, steps: int) -> int:
    """Network calls per sample of the named sampler `name` for `steps` steps, where the
    name alone says: 2 steps - 1 for `flow_heun` (Heun, the last step Euler), else steps."""
    return 2 * steps - 1 if name == "flow_heun" else steps


def objective_label(diffusion: DiffusionConfig) -> str:
    """What a protocol adds to its sampler's name for the objective: "" for noise
    prediction (every result before flow matching), else e.g. " (velocity, linear
    interpolant)"."""
    if diffusion.objective == "eps":
        return ""
    return f" ({diffusion.objective}, {diffusion.interpolant} interpolant)"


def check_sampler_objective(diffusion: DiffusionConfig, name: str) -> None:
    """`sample.scheduler` fits the objective: flow samplers (FLOW_NAMED, FLOW_DIFFUSERS on
    the linear interpolant) for velocity models, the others for noise prediction."""
    flow = name in FLOW_NAMED or name in FLOW_DIFFUSERS
    if diffusion.objective == "velocity":
        if not flow:
            raise ConfigError(f"sample.scheduler={name!r} samples noise-prediction models; "
                              "diffusion.objective='velocity' takes one of "
                              f"{list(FLOW_NAMED + FLOW_DIFFUSERS)}")
        if name in FLOW_DIFFUSERS and diffusion.interpolant != "linear":
            raise ConfigError(f"sample.scheduler={name!r} assumes the linear interpolant; "
                              f"diffusion.interpolant={diffusion.interpolant!r} takes one "
                              f"of {list(FLOW_NAMED)}")
    elif flow:
        raise ConfigError(f"sample.scheduler={name!r} samples velocity models: it needs "
                          "diffusion.objective='velocity' (this config predicts noise)")


def check_scheduler(name: str, order: int) -> None:
    """`sample.scheduler` is one of NAMED or a diffusers scheduler class (by the names its
    source exports: no import); DPM-Solver's `sample.order` is 1, 2 or 3."""
    if name in DPM_SOLVER_NAMES:
        if order not in (1, 2, 3):
            raise ConfigError(f"sample.order={order} must be 1, 2 or 3 (DPM-Solver orders)")
    elif name in RETIRED:
        raise ConfigError(RETIRED[name])
    elif name not in NAMED:
        known = diffusers_scheduler_names()
        if not known:  # diffusers' source not found as expected: ask diffusers itself
            diffusers_class(name)
        elif name not in known:
            raise ConfigError(_unknown_scheduler(name))


def check_scheduler_loads(name: str) -> None:
    """A diffusers scheduler named by its class loads here (its optional dependencies,
    such as torchsde, installed). Imports diffusers: for code that loads torch anyway (the
    trainer, whose first sample grid needs the scheduler hours into a run)."""
    if name not in NAMED:
        diffusers_class(name)


# Where diffusers lists the scheduler classes `diffusers_class` finds (relative to its
# package): its top-level exports (`_import_structure["schedulers"]`) and the deprecated ones.
DIFFUSERS_SCHEDULER_LISTS = ("__init__.py", "schedulers/deprecated/__init__.py")


@functools.cache
def diffusers_scheduler_names() -> frozenset[str]:
    """The scheduler class names the installed diffusers exports, read from its source
    (importing diffusers imports torch, which takes seconds); empty when its top-level
    list is not found (the caller then asks diffusers itself)."""
    spec = importlib.util.find_spec("diffusers")
    folders = list(spec.submodule_search_locations or []) if spec else []
    found: list[set[str]] = []
    for relative, key in zip(DIFFUSERS_SCHEDULER_LISTS, ("schedulers", None)):
        names: set[str] = set()
        for folder in folders:
            try:
                text = (Path(folder) / relative).read_text(encoding="utf-8")
                names |= _listed(ast.parse(text), key)
            except (OSError, SyntaxError, ValueError):  # not there, or not as expected
                continue
        found.append({n for n in names if n.endswith("Scheduler") and not n.startswith("Flax")})
    top, deprecated = found
    return frozenset(top | deprecated) if top else frozenset()


def _listed(tree: ast.Module, key: str | None) -> set[str]:
    """The strings a diffusers `__init__` puts under `_import_structure[key]` (any key for
    None), by assignment or `.extend`."""
    def is_entry(node: ast.AST) -> bool:
        return (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
                and node.value.id == "_import_structure" and isinstance(node.slice, ast.Constant)
                and (key is None or node.slice.value == key))

    values: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(is_entry(t) for t in node.targets):
            values.append(node.value)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "extend" and is_entry(node.func.value)):
            values.extend(node.args)
    return {c.value for v in values for c in ast.walk(v)
            if isinstance(c, ast.Constant) and isinstance(c.value, str)}


def _unknown_scheduler(name: str) -> str:
    return (f"sample.scheduler={name!r} is neither one of {list(NAMED)} nor a diffusers "
            "scheduler class name")


def diffusers_class(name: str) -> type[SchedulerMixin]:
    """A diffusers scheduler class by name, from diffusers or its deprecated schedulers
    (a retired name of ours: why, and its replacements)."""
    if name in RETIRED:
        raise ConfigError(RETIRED[name])
    import diffusers  # here: only a scheduler named by its class needs diffusers
    from diffusers.schedulers.scheduling_utils import SchedulerMixin

    cls = getattr(diffusers, name, None)
    for module in DEPRECATED_MODULES:
        if cls is not None:
            break
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
    if not (isinstance(cls, type) and issubclass(cls, SchedulerMixin)):
        raise ConfigError(_unknown_scheduler(name))
    return cls
