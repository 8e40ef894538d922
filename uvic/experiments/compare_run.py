"""`uvic-compare`'s stages on parsed arguments: plan (and the pairing check), train and
evaluate every run, then the report. On a CPU the runs go `--jobs` at a time, each in its
own process on its share of `--threads` (log: <out>/logs/<run>.log); under `accelerate
launch` with several processes they go one after another, every process taking part.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import signal
import sys
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import replace
from pathlib import Path
from typing import Any

from uvic.config import ConfigError
from uvic.experiments.compare_eval import CellTime, EvalSettings, RunStopped, train_and_evaluate
from uvic.experiments.compare_plan import SAMPLED, Plan, describe, make_plan, run_cells
from uvic.experiments.compare_report import write_report
from uvic.experiments.progress import Calibration, Clock, calibrate, probe_config
from uvic.experiments.quickstart_steps import run_logged
from uvic.experiments.runner import Job, check_unchanged
from uvic.training.stop import Interrupted

# settings that change the attention design only (a design may add weights of its own)
ATTENTION_KEYS = {"model.attention", "model.attention_backend", "model.output_gate",
                  "model.diff_lambda_init", "model.sigmoid_bias", "model.sigmoid_bias_learnable"}
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def jobs_of(plan: Plan) -> list[Job]:
    """One table-runner `Job` per run (variant x seed), in variant order."""
    return [Job(variant, f"seed {seed}", cfg, Path(cfg.train.output_dir),
                plan.out / "evals" / cfg.name, seed)
            for (variant, seed), cfg in plan.configs.items()]


def worker_count(args: argparse.Namespace, runs: int) -> int:
    """Runs at once: one under a multi-process launch, else `--jobs` (default `--threads`),
    at most `--threads` and the number of runs."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return 1
    return max(1, min(args.jobs or args.threads, args.threads, runs))


def dry_run_calibration(plan: Plan, args: argparse.Namespace) -> Calibration:
    """The dry run's rates: a few training steps and forwards of the cheapest run's model,
    timed here on one worker's share of `--threads`."""
    cfg = probe_config(list(plan.configs.values()))
    threads = max(1, args.threads // worker_count(args, len(plan.configs)))
    return calibrate(cfg, cfg.name, threads=threads)


def pairing_check(plan: Plan) -> dict[str, Any]:
    """Seed s of every variant must start from the same initial weights where they share
    parameters. Builds each variant's model as the trainer does (the first seed) and
    compares it with the first variant's. Variants that differ only in attention design must
    share every common weight, equal at initialisation (a design may add weights of its
    own): else a ConfigError naming them."""
    import torch
    from accelerate.utils import set_seed

    from uvic.models.uvit import build_model

    asked = {o.split("=", 1)[0].strip() for ov in plan.variants.values() for o in ov}
    attention_only = asked <= ATTENTION_KEYS
    seed, first = plan.seeds[0], next(iter(plan.variants))
    reference: dict[str, torch.Tensor] = {}
    counts, shared = {}, {}
    for variant in plan.variants:
        set_seed(seed)  # as the trainer: the initial weights depend on the seed only
        try:
            state = build_model(plan.configs[variant, seed].model).state_dict()
        except ValueError as err:
            raise ConfigError(f"variant {variant!r}: {err}") from err
        counts[variant] = sum(t.numel() for t in state.values())
        reference = reference or state
        common = [k for k in state if k in reference]
        same_shape = [k for k in common if state[k].shape == reference[k].shape]
        equal = sum(state[k].numel() for k in same_shape if torch.equal(state[k], reference[k]))
        shared[variant] = equal / max(sum(state[k].numel() for k in common), 1)
        if attention_only and (len(same_shape) != len(common) or not common):
            raise ConfigError(
                f"variant {variant!r} has {counts[variant]:,} parameters ({len(state)} tensors), "
                f"{first!r} {counts[first]:,} ({len(reference)}): variants that differ in "
                "attention only must share the model's weights")
        if attention_only and shared[variant] != 1.0:
            raise ConfigError(f"variant {variant!r} starts from other initial weights than "
                              f"{first!r} with train.seed={seed}: its differences would not "
                              "be paired")
    return {"seed_checked": seed, "attention_only": attention_only, "parameters": counts,
            "share_of_initial_weights_equal_to_first": shared}


def prepare_references(plan: Plan) -> None:
    """Reference statistics made once, here, before the workers need them."""
    from uvic.evaluation.reference import reference_statistics
    from uvic.evaluation.statistics import stand_in_features

    if any(m in SAMPLED for m in plan.metrics if m != "fid"):
        cfg = replace(plan.base, eval=replace(plan.base.eval, features="projection"))
        reference_statistics(cfg, stand_in_features(cfg.eval), stats_dir=plan.out / "fid_stats",
                             progress=False)


def run_all(jobs: list[Job], settings: EvalSettings, args: argparse.Namespace) -> None:
    """Train and evaluate every run: in this process (one job at a time, or several
    processes under accelerate launch) or in `--jobs` worker processes."""
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    workers = worker_count(args, len(jobs))
    main_process = int(os.environ.get("RANK", "0")) == 0
    cells = {job.cfg.name: dict(zip([None, *settings.grid], run_cells(
        job.cfg, job.steps_done(), settings.grid, settings.metrics, settings.heldout)))
        for job in jobs}
    clock = Clock([c for run in cells.values() for c in run.values()], workers)

    def progress(job: Job, times: list[CellTime]) -> str:
        """The progress line after `times` (cells of `job`) are done."""
        line = ""
        for t in times:
            line = clock.finished(cells[job.cfg.name][t.step], t.seconds, t.worked)
        return line

    if workers == 1:
        for job in jobs:
            threads = None if distributed else args.threads

            def on_cell(line: str, timed: CellTime, job: Job = job) -> None:
                print(line, flush=True)
                done = progress(job, [timed])
                if main_process:
                    print(done, flush=True)

            train_and_evaluate(job, settings, threads, on_cell)
        return
    logs = settings.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    per_job = max(1, args.threads // workers)
    print(f"{len(jobs)} runs, {workers} at a time ({per_job} thread(s) each; output in "
          f"{logs}/<run>.log)", flush=True)
    context = multiprocessing.get_context("spawn")  # no fork of a threaded parent
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=context)
    previous = {sig: signal.signal(sig, _stop_workers(pool)) for sig in STOP_SIGNALS}
    try:
        waiting, running = list(jobs), {}
        while waiting or running:
            while waiting and len(running) < workers:  # none queued beyond the workers:
                job = waiting.pop(0)                    # a stop leaves no run to start
                running[pool.submit(run_logged, logs / f"{job.cfg.name}.log",
                                    train_and_evaluate, job, settings, per_job)] = job
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                job = running.pop(future)
                try:
                    lines, times = future.result()
                except RunStopped as err:
                    raise Interrupted(err.signum, err.message) from None
                except Exception as err:
                    first = str(err).splitlines()[0] if str(err) else repr(err)
                    raise RuntimeError(f"{job.cfg.name}: {first} (full output: "
                                       f"{logs / job.cfg.name}.log)") from err
                print("\n".join([*lines, progress(job, times)]), flush=True)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # a stopped worker saves first
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop_workers(pool: ProcessPoolExecutor):
    """A SIGINT/SIGTERM handler: pass the signal on to the workers (each run stops after a
    step with its checkpoint, `uvic.training.stop`) and stop here (`Interrupted`)."""
    def handler(signum: int, frame: Any) -> None:
        for process in list(getattr(pool, "_processes", {}).values()):
            with contextlib.suppress(OSError):
                os.kill(process.pid, signum)
        raise Interrupted(signum, f"stopped by {signal.Signals(signum).name}")
    return handler


def run(args: argparse.Namespace, plan: Plan | None = None) -> None:
    """The comparison on parsed arguments (`plan`: theirs, made and checked already).
    Raises the error that stops it (a stop by signal: KeyboardInterrupt or RunStopped,
    every finished step kept)."""
    plan = plan or make_plan(args)
    jobs = jobs_of(plan)
    check_unchanged(jobs)
    # the dry run times one run's model here: every cell's time, before any run exists
    print(describe(plan, {(j.row, j.seed): j.step_time() for j in jobs},
                   {(j.row, j.seed): j.steps_done() for j in jobs},
                   dry_run_calibration(plan, args) if args.dry_run else None,
                   worker_count(args, len(jobs))), flush=True)
    pairing = pairing_check(plan)
    if "fid" in plan.metrics:  # before any training, not hours later
        from uvic.evaluation.statistics import check_inception

        check_inception(plan.base.eval, plan.base.eval.mode)
    if args.dry_run:
        return
    settings = EvalSettings(tuple(plan.metrics), tuple(plan.grid), plan.heldout, plan.out)
    if args.stage != "report":
        prepare_references(plan)
        if args.stage == "train":
            settings = EvalSettings((), (), plan.heldout, plan.out)
        run_all(jobs, settings, args)
    if args.stage in ("all", "report") and int(os.environ.get("RANK", "0")) == 0:
        for line in write_report(plan, pairing, sys.argv):
            print(line, flush=True)
