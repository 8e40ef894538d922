"""The resumable runner of the tables built by command (`uvic.experiments.tables`, run by
`uvic-table3`, `uvic-release-table` and `uvic-recipes-table`), whose runs and training step
the comparison shares: for every row of a `Table`, train, then FID, then the table.

Every stage resumes: training continues from the run's newest checkpoint and is skipped at
train.max_steps, FID reuses the samples on disk and is skipped when a result for the same
checkpoint and protocol exists, and the table is rebuilt from every result in <out>/fid.
Outputs: <out>/runs/<row>_<model>/, <out>/fid/<row>_<model>.json and <out>/<table>.md.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from uvic.config import Config, ConfigError, apply_overrides, load_config
from uvic.config.compare import config_diff
from uvic.config.data import LATENT_DATASETS
from uvic.config.validation import validate
from uvic.evaluation.protocols import load_results, protocol_of
from uvic.experiments.progress import (
    EVAL,
    TRAIN,
    Calibration,
    Cell,
    Clock,
    calibrate,
    duration,
    estimate,
    probe_config,
    sampling_cost,
    train_cost,
)
from uvic.presets import preset_path

if TYPE_CHECKING:
    import numpy as np


# Sets a smoke run's fields on its preset's config; the Path: the smoke data folder, <out>/data.
Adapt = Callable[[Config, Path], None]


@dataclass(frozen=True)
class Row:
    """One run of a table: row name, model (uvit or uvic), preset and, for a smoke run,
    what it changes in the preset (`Adapt`)."""

    row: str
    model: str
    preset: str
    adapt: Adapt | None = None


def twin_rows(rows: Mapping[str, Any], adapt: Mapping[str, Adapt] | None = None
              ) -> tuple[Row, ...]:
    """A U-ViT and a U-ViC run for each of `rows` (key -> a row with `uvit` and `uvic`
    presets); with `adapt` (key -> its smoke changes), only the rows it names, in its
    order."""
    chosen = {key: None for key in rows} if adapt is None else adapt
    return tuple(Row(key, model, getattr(rows[key], model), change)
                 for key, change in chosen.items() for model in ("uvit", "uvic"))


@dataclass(frozen=True)
class Table:
    """What a table program runs and writes: `name` (default output runs/<name>, the table
    <name>.md), its rows, its smoke rows and how to write their data, the renderer of a
    list of result JSONs."""

    name: str
    description: str
    rows: tuple[Row, ...]
    smoke_rows: tuple[Row, ...]
    smoke_help: str
    render: Callable[[list[dict[str, Any]]], str]
    prepare_smoke: Callable[[Path], None] | None = None


@dataclass(frozen=True)
class TableOptions:
    """How a table program runs: output folder, smoke rows or the real ones, the rows
    `only` picks, up to which stage, training seeds per row, config overrides for every
    row, progress bars."""

    out: str
    smoke: bool = False
    only: tuple[str, ...] = ()
    stage: str = "all"  # train, fid, table or all
    seeds: int = 1
    dry_run: bool = False
    overrides: tuple[str, ...] = ()
    quiet: bool = False


@dataclass
class Job:
    """One row's run: its config, run folder and FID result file (`seed`: the training
    seed of a row run with several seeds, else None)."""

    row: str
    model: str
    cfg: Config
    run_dir: Path
    result: Path
    seed: int | None = None

    @property
    def label(self) -> str:
        """"row / model" (and " / seed N" for a row run with several seeds)."""
        return f"{self.row} / {self.model}" + (f" / seed {self.seed}" if self.seed is not None
                                               else "")

    @property
    def ckpt(self) -> Path:
        from uvic.run.folder import RunFolder

        return RunFolder(self.run_dir).ema

    def _summary(self) -> dict[str, Any]:
        from uvic.run.folder import RunFolder

        summary = RunFolder(self.run_dir).summary
        return json.loads(summary.read_text()) if summary.is_file() else {}

    def trained_steps(self) -> int:
        return int(self._summary().get("steps", 0))

    def steps_done(self) -> int:
        """Steps the run has done: its summary's, or its newest checkpoint's (a stopped run)."""
        from uvic.run.folder import RunFolder

        latest = RunFolder(self.run_dir).latest_checkpoint()
        return max(self.trained_steps(), int(latest.name.rsplit("_", 1)[1]) if latest else 0)

    def cells(self) -> tuple[Cell, Cell]:
        """Its training (what is left of it) and its FID, as cells of the experiment."""
        return (Cell(f"{self.label}: train", TRAIN, train_cost(self.cfg, self.steps_done())),
                Cell(f"{self.label}: {fid_name(self.cfg)}", EVAL,
                     sampling_cost(self.cfg, self.cfg.eval.n_samples)))

    def step_time(self) -> float | None:
        """Measured seconds per training step of this run so far, if any."""
        value = self._summary().get("mean_step_time_s")
        return float(value) if isinstance(value, int | float) and value == value else None


# Settings an existing run may change without changing what it trained: its length (a
# longer run continues), name, folder, threads, logging and kernels; sample.* and eval.*
# decide only what is made of it.
FREE_TO_CHANGE = frozenset({
    "name", "train.output_dir", "train.max_steps", "train.threads", "train.log_every",
    "train.sample_every", "train.ckpt_every", "train.keep_last", "train.n_grid",
    "train.log_with", "data.num_workers", "model.attention_backend"})


def changed_training(job: Job) -> list[str]:
    """The settings that decide what `job`'s run trains and differ from those its folder
    last trained with, "key: old -> new" each ([] for a run not started)."""
    from uvic.run.folder import RunFolder

    saved = RunFolder(job.run_dir).config
    if not saved.is_file():
        return []
    return [f"{key}: {old!r} -> {new!r}"
            for key, (old, new) in config_diff(load_config(saved), job.cfg).items()
            if key.split(".")[0] not in ("sample", "eval") and key not in FREE_TO_CHANGE]


def check_unchanged(jobs: Sequence[Job]) -> None:
    """Refuse (ConfigError) runs that exist with other training settings: a finished one
    would be skipped, a stopped one continued, and its results would claim settings it was
    not trained with."""
    for job in jobs:
        if changed := changed_training(job):
            more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
            raise ConfigError(f"{job.run_dir} was trained with other settings "
                              f"({'; '.join(changed[:3])}{more}): use another --out, or "
                              "delete that folder to train it afresh")


def selected(rows: Sequence[Row], only: Sequence[str]) -> list[Row]:
    """The rows `--only` picks: a row name, a model, or a row-name prefix (`imagenet256`)."""
    return [r for r in rows if not only or any(
        name in (r.row, r.model) or r.row.startswith(name + "_") for name in only)]


def seeds_from(base: int, n: int) -> list[int]:
    """The training seeds of `n` runs of one config: base, base + 1, ... (base: its
    train.seed)."""
    if n < 1:
        raise ConfigError(f"--seeds {n}: must be >= 1")
    return [base + i for i in range(n)]


def make_jobs(table: Table, options: TableOptions) -> list[Job]:
    """The table's runs (its smoke runs with --smoke) that --only picks, configured and
    checked (`validate`: before any heavy import); with --seeds N, N runs of each
    (the first keeps the row's folder and seed, run k the seed train.seed + k in
    <row>_<model>_seed<seed>)."""
    rows = selected(table.smoke_rows if options.smoke else table.rows, options.only)
    if not rows:
        raise ConfigError(f"--only {list(options.only)}: matches no row of {table.name} "
                          f"({', '.join(dict.fromkeys(r.row for r in table.rows))})")
    out = Path(options.out)
    jobs = []
    for r in rows:
        name = f"{r.row}_{r.model}"
        cfg = load_config(preset_path(r.preset))
        if r.adapt is not None:
            r.adapt(cfg, out / "data")
        cfg.name, cfg.train.output_dir = name, str(out / "runs" / name)
        # the command's --set last; checked before any heavy import
        cfg = validate(apply_overrides(cfg, options.overrides))
        seeds = seeds_from(cfg.train.seed, options.seeds)
        for seed in seeds:
            run = name if seed == seeds[0] else f"{name}_seed{seed}"
            run_cfg = replace(cfg, train=replace(cfg.train, output_dir=str(out / "runs" / run),
                                                 seed=seed))
            jobs.append(Job(r.row, r.model, run_cfg, out / "runs" / run,
                            out / "fid" / f"{run}.json", seed if len(seeds) > 1 else None))
    return jobs


def interval_note(calls: int, guided: int) -> str:
    """" (N sampler calls, M of them guided: ...)" where a guidance interval leaves some of
    a guided sampler's calls unguided, else "" (the counts: `sampling_calls`)."""
    return (f" ({calls} sampler calls, {guided} of them guided: those in the guidance "
            "interval)" if 0 < guided < calls else "")


def repa_cost(cfg: Config) -> str:
    """What REPA adds to training, in words ("" without it): the frozen encoder's forward
    on every training image (pixel data), or features read beside the latents."""
    t = cfg.train
    if not t.repa_encoder:
        return ""
    if cfg.data.name in LATENT_DATASETS:
        return (f"    REPA: {t.repa_encoder} features read from {cfg.data.root} (extracted "
                "once, one encoder forward per dataset image); the projector's forward and "
                "backward per training image")
    images = t.max_steps * t.batch_size
    return (f"    REPA: + {images:,} forwards of the frozen {t.repa_encoder} (no grad), one "
            "per training image, and the projector's forward and backward")


def plan(jobs: list[Job], calibration: Calibration | None = None) -> str:
    """The compute each stage needs: training images (and REPA's encoder) and network calls
    for sampling, with times from this run's measured step time where one exists, else
    from `calibration` (the dry run's), and then the total."""
    from uvic.diffusion.guidance_interval import sampling_calls

    lines = ["Plan (train -> FID -> table):"]
    rates = calibration.rates() if calibration is not None else None
    times: dict[str, float] = {TRAIN: 0.0, EVAL: 0.0}
    for job in jobs:
        t = job.cfg.train
        remaining = max(0, t.max_steps - job.steps_done())
        step_time = job.step_time()
        train_cell, fid_cell = job.cells()
        fid_time = ""
        if step_time is not None:
            seconds = remaining * step_time
            train_time = f"~{duration(seconds)} at the measured {step_time:.3f} s/step"
        elif rates is not None:
            seconds = estimate([train_cell], rates)
            train_time = f"~{duration(seconds)} (calibrated)"
        else:
            train_time = "time not measured yet (a short run here measures it)"
        if rates is not None:
            fid_seconds = estimate([fid_cell], rates)
            times[TRAIN] += seconds
            times[EVAL] += fid_seconds
            fid_time = f"; ~{duration(fid_seconds)} (calibrated)"
        protocol = protocol_of(job.cfg)
        evals, calls, guided = sampling_calls(job.cfg)
        how = interval_note(calls, guided)
        n = job.cfg.eval.n_samples
        lines += [f"- {job.label}: train {remaining:,} of {t.max_steps:,} steps "
                  f"x {t.batch_size} images; {train_time}",
                  *filter(None, [repa_cost(job.cfg)]),
                  f"    FID: {n:,} samples x {evals} network calls = {n * evals:,} image "
                  f"forwards{how}; protocol: {protocol.label()}{fid_time}"]
    if calibration is not None:
        lines += [f"Time: ~{duration(sum(times.values()))} in all, one row after another "
                  f"(training ~{duration(times[TRAIN])}, FID ~{duration(times[EVAL])} of "
                  "network time); " + calibration.text()]
    return "\n".join(lines)


def dry_run_calibration(jobs: list[Job]) -> Calibration:
    """The dry run's rates: a few training steps and forwards of the cheapest row's model
    (`uvic.experiments.progress.calibrate`), timed here."""
    cfg = probe_config([job.cfg for job in jobs])
    job = next(job for job in jobs if job.cfg is cfg)
    return calibrate(cfg, job.label)


def run_train(job: Job) -> str:
    """Train the row's model to train.max_steps (resumed; skipped once there)."""
    from uvic.training.trainer import train

    if job.ckpt.is_file() and job.trained_steps() >= job.cfg.train.max_steps:
        return "trained (skipped)"
    train(job.cfg, resume="latest-or-new")  # the first time: a new run
    return f"trained to step {job.trained_steps()}"


def fid_name(cfg: Config) -> str:
    """"FID", or "stand-in FID" when eval.features is not Inception."""
    return "FID" if protocol_of(cfg).inception else "stand-in FID"


def run_fid(job: Job, options: TableOptions) -> str:
    """The row's FID (skipped when a result for the same checkpoint and protocol exists)."""
    from uvic.evaluation.fid import evaluate
    from uvic.run.weights import file_sha256

    what = fid_name(job.cfg)
    if job.result.is_file():
        old = json.loads(job.result.read_text())
        label = protocol_of(job.cfg).label()
        if (old.get("checkpoint_sha256") == file_sha256(job.ckpt)
                and old.get("protocol", {}).get("label") == label):
            return f"{what} {old['fid']:.3f} (skipped: result exists)"
    result = evaluate(job.cfg, job.ckpt, out_json=job.result,
                      stats_dir=Path(options.out) / "fid_stats",
                      num_workers=0 if options.smoke else None, progress=not options.quiet)
    return f"{what} {result['fid']:.3f}" if result else f"{what} (other process)"


def _samples(result: Path) -> np.ndarray:
    """The uint8 samples (N, H, W, 3) a result JSON was computed from."""
    import numpy as np
    from PIL import Image

    data = json.loads(result.read_text())
    folder = Path(data["samples_dir"])
    return np.stack([np.asarray(Image.open(folder / f"{i:06d}.png").convert("RGB"))
                     for i in range(int(data["n"]))])


def smoke_note(jobs: list[Job]) -> str:
    """Why a smoke row's U-ViT and U-ViC numbers agree, measured on their samples, for each
    row where both have a result ("" if none; "Smoke note (<row>): " with several rows).
    Both start from the same initial weights (the seed decides them, and softmax and Cog
    blocks have the same parameters), see the same batches and the same sampling noise, and
    a few steps barely move them: their samples are nearly the same pixels, most clipped to
    0 or 255, so their distances agree to about 1e-3."""
    import numpy as np

    rows = list(dict.fromkeys(job.row for job in jobs))
    notes = []
    for row in rows:
        done = {job.model: job for job in jobs if job.row == row and job.result.is_file()}
        if not {"uvit", "uvic"} <= done.keys():
            continue
        a, b = _samples(done["uvit"].result), _samples(done["uvic"].result)
        fids = [json.loads(done[m].result.read_text())["fid"] for m in ("uvit", "uvic")]
        clipped = np.mean([(x == 0) | (x == 255) for x in (a, b)])
        what = fid_name(done["uvic"].cfg)
        head = f"Smoke note ({row}): " if len(rows) > 1 else "Smoke note: "
        notes.append(
            f"{head}U-ViT and U-ViC score alike ({what} {fids[0]:.4f} vs {fids[1]:.4f}) "
            f"because their samples are {np.mean(a == b):.1%} identical pixels "
            f"({clipped:.1%} clipped to 0 or 255): both models start from the same weights "
            "(same seed; softmax and Cog blocks have the same parameters), see the same "
            f"batches and sampling noise, and train only {done['uvic'].cfg.train.max_steps} "
            "steps. The smoke checks the chain (train, FID, table, resume), not the models.\n")
    return "".join(notes)


def run_table(table: Table, options: TableOptions) -> None:
    """Plan, then every stage of every job, then the table. Raises the error that stops it
    (a stop by signal: KeyboardInterrupt, every finished cell kept)."""
    jobs = make_jobs(table, options)  # the configs need no torch: a wrong --set ends at once
    check_unchanged(jobs)
    # the dry run times one row's model here: every row's time, before any run exists
    print(plan(jobs, dry_run_calibration(jobs) if options.dry_run else None), flush=True)
    if options.dry_run:
        return
    out = Path(options.out)
    main_process = int(os.environ.get("RANK", "0")) == 0
    stages = [i for i, stage in enumerate(("train", "fid")) if options.stage in ("all", stage)]
    cells = {job.label: job.cells() for job in jobs}
    clock = Clock([cells[job.label][i] for job in jobs for i in stages])
    if options.smoke and table.prepare_smoke is not None:
        table.prepare_smoke(out / "data")
    for job in jobs:
        for i in stages:  # each cell saved when done: a rerun skips it
            start = time.monotonic()
            line = run_train(job) if i == 0 else run_fid(job, options)
            print(f"{job.label}: {line}", flush=True)
            progress = clock.finished(cells[job.label][i], time.monotonic() - start,
                                      worked="skipped" not in line)
            if main_process:
                print(progress, flush=True)
    if options.stage in ("all", "table") and main_process:
        text = table.render(load_results(out / "fid"))
        if options.smoke and (note := smoke_note(jobs)):
            text += "\n" + note
        path = out / f"{table.name}.md"
        path.write_text(text)
        print(text, end="")
        print(f"table: {path}")
