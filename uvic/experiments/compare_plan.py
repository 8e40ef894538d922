"""What `uvic-compare` runs: its variants (an attention preset by name, or `--set` overrides
named by `--variant` or a variant file), seeds and evaluation grid, every run's config, the
checks that refuse a comparison that would not be one, and the plan it states. Seed s of
every variant gets `train.seed=s`, so the variants' numbers pair by seed. No torch at import.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from uvic.config import Config, ConfigError, DataConfig, DiffusionConfig, SampleConfig, load_config
from uvic.config.models import ATTENTION_PRESETS
from uvic.config.sampling import short_run_guide
from uvic.config.validation import start_config, validate
from uvic.experiments.progress import (
    EVAL,
    TRAIN,
    Calibration,
    Cell,
    duration,
    estimate,
    forward_cost,
    sampling_cost,
    train_cost,
)
from uvic.experiments.runner import seeds_from
from uvic.presets import preset_path

# keys a variant may not set: the comparison sets them for every run alike
RESERVED = ("name", "train.seed", "train.max_steps", "train.output_dir", "train.keep_steps")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# metric -> (what it is, which way is better: `uvic.evaluation.paired.BETTER`)
METRICS = {
    "heldout_mse": ("held-out noise MSE of the EMA weights", "lower"),  # `metric_what`
    "standin_fid": ("stand-in FID (projection features; NOT comparable with FID)", "lower"),
    "fid": ("FID", "lower"),
    "hf_ratio": ("high-frequency energy relative to real images", "one"),
    "palette_share": ("share of pixels on their image's 3 dominant colours", "higher"),
    "shape_share": ("share of samples holding a shape", "higher"),
}
QUALITY = ("hf_ratio", "palette_share", "shape_share")  # `uvic.evaluation.quality`
SAMPLED = ("standin_fid", "fid", *QUALITY)  # metrics of generated samples
BETTER_TEXT = {"lower": "lower is better", "higher": "higher is better", "one": "1 is ideal"}


def metric_what(metric: str, diffusion: DiffusionConfig) -> str:
    """What `metric` is for runs of these diffusion settings: the held-out MSE is the error of
    the objective the runs trained on (noise, or under flow matching the velocity of the
    interpolant, on fixed draws of its times and noise), so it is named by it: a velocity
    MSE never reads as a noise MSE."""
    d = diffusion
    if metric == "heldout_mse" and d.objective == "velocity":
        return (f"held-out velocity MSE of the EMA weights ({d.interpolant} interpolant, "
                f"{d.timestep_sampling.replace('_', '-')} times; NOT comparable with a noise MSE)")
    return METRICS[metric][0]


def heldout_draws(diffusion: DiffusionConfig) -> dict[str, Any]:
    """What the held-out MSE's draws and target depend on: the diffusion settings but its
    loss weighting (`uvic.evaluation.heldout` scores the plain MSE) and condition dropping
    (the held-out MSE drops none)."""
    d = asdict(diffusion)
    for key in ("min_snr_gamma", "p_uncond"):
        d.pop(key)
    return d


def check_heldout_comparable(configs: dict[tuple[str, int], Config]) -> None:
    """Refuse a held-out MSE across variants that score different errors (e.g. noise and
    velocity MSE, or two interpolants): their numbers do not compare."""
    first = next(iter(configs.values()))
    for (variant, _), cfg in configs.items():
        differ = sorted(k for k, v in heldout_draws(cfg.diffusion).items()
                        if heldout_draws(first.diffusion)[k] != v)
        if differ:
            key = differ[0]
            raise ConfigError(
                f"--metrics heldout_mse: variant {variant!r} has diffusion.{key}="
                f"{getattr(cfg.diffusion, key)!r}, not {getattr(first.diffusion, key)!r}: "
                "its held-out MSE scores another error and does not compare; drop "
                "heldout_mse from --metrics")


def variant_list(names: list[str], defined: dict[str, tuple[str, ...]]
                 ) -> dict[str, tuple[str, ...]]:
    """The compared variants (name -> overrides) in order: `names` (default: the ones
    defined, else every attention preset), each a preset or a defined variant."""
    chosen = names or list(defined) or list(ATTENTION_PRESETS)
    out = {}
    for name in chosen:
        if name in defined:
            out[name] = defined[name]
        elif name in ATTENTION_PRESETS:
            out[name] = (f"model.attention={name}",)
        else:
            raise ConfigError(f"unknown variant {name!r}: an attention preset "
                              f"({', '.join(ATTENTION_PRESETS)}) or one defined with "
                              "--variant NAME:KEY=VALUE or --variant-file")
    if len(out) < 2 or len(out) != len(chosen):
        raise ConfigError(f"variants {chosen}: a comparison needs 2 or more different ones")
    return out


def parse_variants(flags: list[str], file: str | None) -> dict[str, tuple[str, ...]]:
    """Variants defined by `--variant NAME:KEY=VALUE[;KEY=VALUE...]` and a variant file."""
    defined: dict[str, tuple[str, ...]] = {}
    if file:
        try:
            data = json.loads(Path(file).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"--variant-file {file}: {err}") from err
        if not isinstance(data, dict) or not all(
                isinstance(v, list) and all(isinstance(o, str) for o in v) for v in data.values()):
            raise ConfigError(f"--variant-file {file}: expected a JSON object "
                              '{"name": ["section.key=value", ...]}')
        defined.update({k: tuple(v) for k, v in data.items()})
    for flag in flags:
        name, sep, rest = flag.partition(":")
        if not sep or not rest:
            raise ConfigError(f"--variant {flag!r}: expected NAME:KEY=VALUE[;KEY=VALUE...]")
        defined[name] = tuple(o.strip() for o in rest.split(";") if o.strip())
    for name, overrides in defined.items():
        if not NAME.match(name):
            raise ConfigError(f"variant name {name!r}: letters, digits, '_', '-', '.' only")
        for o in overrides:
            key = o.split("=", 1)[0].strip()
            if key in RESERVED:
                raise ConfigError(f"variant {name!r} sets {key}: the comparison sets it for "
                                  "every run alike (--seeds, --steps, --out)")
    return defined


def seed_list(base: int, n: int) -> list[int]:
    """The seeds of a comparison of `n` seeds: base, base + 1, ... (base: train.seed)."""
    if n < 2:
        raise ConfigError(f"--seeds {n}: one seed gives no interval and no paired test; "
                          "use --seeds 2 or more (3 is the default)")
    return seeds_from(base, n)


def step_grid(max_steps: int, every: int | None, steps: list[int]) -> list[int]:
    """The evaluation grid: `steps`, or every `every` steps, and always the last step."""
    if every is not None and every < 1:
        raise ConfigError(f"--every {every}: must be >= 1")
    grid = set(steps) | ({*range(every, max_steps + 1, every)} if every else set())
    bad = [s for s in sorted(grid) if not 0 < s <= max_steps]
    if bad:
        raise ConfigError(f"evaluation step {bad[0]} is outside the run (1 to "
                          f"train.max_steps={max_steps})")
    return sorted(grid | {max_steps})


def table_steps(grid: list[int], asked: list[int]) -> list[int]:
    """The steps the tables show (default the last); each must be on the grid."""
    for step in asked:
        if step not in grid:
            raise ConfigError(f"--table-steps {step}: not on the evaluation grid "
                              f"({', '.join(map(str, grid))}); add it with --steps")
    return sorted(set(asked)) or [grid[-1]]


def guide_step(sample: SampleConfig) -> int | None:
    """The training step of the run's own autoguidance checkpoint, if it samples with one."""
    if sample.autoguidance_scale == 0:
        return None
    found = re.fullmatch(r"checkpoints/step_(\d+)/ema\.safetensors", sample.autoguidance_ckpt)
    return int(found.group(1)) if found else None


@dataclass
class Plan:
    """A comparison: base config, variants, seeds, grid, metrics and every run's config."""

    base: Config
    variants: dict[str, tuple[str, ...]]
    seeds: list[int]
    grid: list[int]
    table_steps: list[int]
    metrics: list[str]
    configs: dict[tuple[str, int], Config]
    out: Path
    heldout: int  # held-out images of the held-out MSE
    best: bool  # also report each run's best step, selected on the metric itself
    margins: dict[str, float] = field(default_factory=dict)  # metric -> equivalence margin
    notes: list[str] = field(default_factory=list)  # what the plan changed, said before it

    def run_name(self, variant: str, seed: int) -> str:
        return f"{variant}_seed{seed}"

    def what(self, metric: str) -> str:
        """What `metric` is in this comparison (`metric_what`: the held-out MSE names the
        objective, which every run shares: `check_heldout_comparable`)."""
        return metric_what(metric, next(iter(self.configs.values()), self.base).diffusion)


def metric_names(text: str) -> list[str]:
    """`--metrics`' names in order, `quality` expanded to the three quality figures."""
    out: list[str] = []
    for name in (n.strip() for n in text.split(",") if n.strip()):
        for m in QUALITY if name == "quality" else (name,):
            if m not in METRICS:
                raise ConfigError(f"--metrics {name!r}: choose from "
                                  f"{', '.join(['quality', *METRICS])}")
            out += [m] if m not in out else []
    if not out:
        raise ConfigError("--metrics: name at least one metric")
    return out


def metric_values(flags: list[str], option: str, metrics: list[str] | None = None
                  ) -> dict[str, float]:
    """`--margin`/`--target METRIC=VALUE` flags: metric -> a finite number > 0, each metric
    known (and among `metrics` where given); else a ConfigError naming the flag."""
    out: dict[str, float] = {}
    for flag in flags:
        metric, _, text = flag.partition("=")
        metric = metric.strip()
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if metric not in METRICS or (metrics is not None and metric not in metrics):
            known = ", ".join(metrics if metrics is not None else METRICS)
            raise ConfigError(f"{option} {flag!r}: {metric!r} is not a compared metric "
                              f"({known})")
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{option} {flag!r}: expected METRIC=VALUE with a number > 0")
        out[metric] = value
    return out


def metric_list(text: str, data: DataConfig) -> list[str]:
    """`--metrics`: comma-separated metric names, `quality` for the three quality figures."""
    out = metric_names(text)
    if any(m in QUALITY for m in out) and data.name != "shapes":
        raise ConfigError(f"--metrics quality: the quality figures are for the Shapes data, "
                          f"not data.name={data.name!r}")
    return out


def make_plan(args: Any) -> Plan:
    """The comparison that `uvic-compare`'s arguments ask for, checked (every run's config
    by a training run's start check, `start_config`): no torch, so that a mistake answers
    at once."""
    config = args.config or preset_path("quickstart")
    # a comparison of runs that end before their own autoguidance guide samples unguided
    base, guide_note = short_run_guide(validate(load_config(config, list(args.set))))
    variants = variant_list(args.variants, parse_variants(args.variant, args.variant_file))
    seeds = seed_list(base.train.seed, args.seeds)
    grid = step_grid(base.train.max_steps, args.every, args.steps)
    metrics = metric_list(args.metrics, base.data)
    guide = guide_step(base.sample)
    if guide is not None and any(m in SAMPLED for m in metrics) and grid[0] <= guide:
        raise ConfigError(f"evaluation step {grid[0]}: its samples would be guided by the "
                          f"run's own step-{guide} weights (sample.autoguidance_ckpt), not an "
                          f"earlier model; evaluate steps after {guide} or set "
                          "sample.autoguidance_scale=0")
    out = Path(args.out)
    keep = sorted(set(base.train.keep_steps) | set(grid))
    configs = {}
    for variant, overrides in variants.items():
        for seed in seeds:
            name = f"{variant}_seed{seed}"
            cfg = load_config(config, [*args.set, *overrides])
            cfg.name, cfg.train.seed = name, seed
            cfg.train.output_dir, cfg.train.keep_steps = str(out / "runs" / name), tuple(keep)
            try:
                configs[variant, seed] = start_config(cfg)[0]
            except ConfigError as err:
                raise ConfigError(f"variant {variant!r}: {err}") from err
    if "heldout_mse" in metrics:
        check_heldout_comparable(configs)
    return Plan(base, variants, seeds, grid, table_steps(grid, args.table_steps), metrics,
                configs, out, args.heldout, args.best,
                metric_values(args.margin, "--margin", metrics), [*filter(None, [guide_note])])


def run_cells(cfg: Config, steps_done: int, grid: Sequence[int], metrics: Sequence[str],
              heldout: int) -> list[Cell]:
    """A run's cells: its training (what is left of it) and its evaluation at each step of
    `grid` (sampling as the run's protocol, the held-out images' forwards)."""
    sampled = any(m in SAMPLED for m in metrics)
    per_eval = sampling_cost(cfg, cfg.eval.n_samples) if sampled else 0.0
    per_eval += forward_cost(cfg.model, heldout) if "heldout_mse" in metrics else 0.0
    return [Cell(f"{cfg.name}: train", TRAIN, train_cost(cfg, steps_done)),
            *[Cell(f"{cfg.name}: step {step}", EVAL, per_eval) for step in grid]]


def describe(plan: Plan, step_times: dict[tuple[str, int], float | None],
             trained: dict[tuple[str, int], int], calibration: Calibration | None = None,
             workers: int = 1) -> str:
    """The compute before anything starts: runs x steps x evaluations, the time where a
    run has measured its step time, and with `calibration` (the dry run's) the time of
    every cell on `workers` workers."""
    from uvic.diffusion.guidance_interval import sampling_passes

    cfg = plan.base
    runs = len(plan.configs)
    evaluations = runs * len(plan.grid)
    sampled = [m for m in plan.metrics if m in SAMPLED]
    calls = sampling_passes(cfg) if sampled else 0
    n = cfg.eval.n_samples
    lines = [
        f"Plan: {len(plan.variants)} variants ({', '.join(plan.variants)}) x {len(plan.seeds)} "
        f"seeds ({', '.join(map(str, plan.seeds))}) = {runs} runs",
        f"- training: {runs} runs x {cfg.train.max_steps:,} steps x {cfg.train.batch_size} "
        f"images = {runs * cfg.train.max_steps:,} steps "
        f"({sum(max(0, cfg.train.max_steps - s) for s in trained.values()):,} still to run)",
        f"- evaluations: {runs} runs x {len(plan.grid)} steps "
        f"({', '.join(map(str, plan.grid))}) = {evaluations}; metrics: "
        f"{', '.join(plan.metrics)}",
    ]
    if "heldout_mse" in plan.metrics:
        lines.append(f"    held-out MSE: {plan.heldout} images, one forward each")
    if sampled:
        lines.append(f"    samples: {n:,} x {calls} network calls = {n * calls:,} image forwards "
                     f"per evaluation, {evaluations * n * calls:,} in all")
    known = [t for t in step_times.values() if t]
    if known:
        mean = sum(known) / len(known)
        left = sum(max(0, cfg.train.max_steps - s) for s in trained.values())
        lines.append(f"- training time left: ~{left * mean / 60:.1f} min of one worker at the "
                     f"measured {mean * 1000:.0f} ms/step (divide by --jobs)")
    if calibration is not None:
        cells = [cell for key, run in plan.configs.items() for cell in run_cells(
            run, trained.get(key, 0), plan.grid, plan.metrics, plan.heldout)]
        rates = calibration.rates()
        train = estimate([c for c in cells if c.kind == TRAIN], rates, workers)
        evals = estimate([c for c in cells if c.kind == EVAL], rates, workers)
        lines.append(f"- time: ~{duration(train + evals)} on {workers} worker"
                     f"{'s' * (workers != 1)} (training ~{duration(train)}, evaluations "
                     f"~{duration(evals)} of network time); {calibration.text()}")
    lines.append(f"- tables at step(s) {', '.join(map(str, plan.table_steps))}")
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


def pilot_file(plan_arg: str, out: str) -> Path:
    """The compare.json that `--plan [FILE]` reads: FILE, FILE/compare.json for a folder,
    or <--out>/compare.json."""
    path = Path(plan_arg or out)
    return path / "compare.json" if path.is_dir() or not plan_arg else path


def _pilot_pairs(path: Path) -> tuple[dict[str, Any], list[tuple[str, dict, str, list]]]:
    """The pilot's report and, per metric and table step, its pairs; ConfigError naming
    the file where it is missing or not a `uvic-compare` report."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"--plan {path}: {err}") from err
    try:
        steps = data.get("table_steps") or data["grid"][-1:]
        found = [(metric, s, str(step), s["steps"][str(step)]["pairs"])
                 for metric, s in data["summary"].items() for step in steps]
        for p in (p for *_, pairs in found for p in pairs):
            int(p["n"]), float(p["mean"]), float(p.get("sd", p["t_half_width"]))
    except (AttributeError, KeyError, IndexError, TypeError, ValueError) as err:
        raise ConfigError(f"--plan {path}: not the compare.json of a finished uvic-compare "
                          f"run (bad or missing {err})") from None
    if not any(pairs for *_, pairs in found):
        raise ConfigError(f"--plan {path}: no paired differences in it (a finished run of "
                          "2 or more variants with 2 or more seeds)")
    return data, found


def power_plan(plan_arg: str, out: str, targets: list[str]) -> str:
    """Seeds to plan from a pilot's compare.json: per metric, table step and pair, the sd
    of the paired differences, the MDE at the pilot's seeds and the seeds that find the
    target difference (`--target`, default the pilot's mean difference) at 80% power."""
    from uvic.evaluation.paired import (
        CONFIDENCE,
        POWER,
        minimum_detectable_difference,
        seeds_for_difference,
        t_quantile,
    )

    path = pilot_file(plan_arg, out)
    data, found = _pilot_pairs(path)
    wanted = metric_values(targets, "--target", list(data["summary"]))
    lines = [f"Seeds to plan from the pilot {path} ({len(data.get('seeds', []))} seeds per "
             f"variant): paired t-test, {CONFIDENCE:.0%} confidence, {POWER:.0%} power"]
    for metric, s, step, pairs in found:
        if not pairs:
            continue
        better = BETTER_TEXT.get(s.get("better", ""), "")
        lines += ["", f"## {s.get('what', metric)} ({better}), step {step}", "",
                  "| Pair (B − A) | seeds | mean difference | sd of differences | MDE at these "
                  "seeds | target difference | seeds for the target |", "|---" * 7 + "|"]
        for p in pairs:
            n, mean = int(p["n"]), float(p["mean"])
            sd = float(p["sd"]) if "sd" in p else (  # a report without sd: from the interval
                float(p["t_half_width"]) * math.sqrt(n) / t_quantile(n))
            mde = minimum_detectable_difference(sd, n)  # checks n and sd
            target = wanted.get(metric, abs(mean))
            label = f"{target:.3g}" + ("" if metric in wanted else " (observed)")
            if target == 0:
                need = "— (no difference observed: give --target)"
            else:
                try:
                    need = str(seeds_for_difference(sd, target))
                except ValueError:
                    need = "> 10,000"
            lines.append(f"| {p.get('b', 'B')} − {p.get('a', 'A')} | {n} | {mean:+.3g} | "
                         f"{sd:.3g} | {mde:.3g} | {label} | {need} |")
    return "\n".join(lines)
