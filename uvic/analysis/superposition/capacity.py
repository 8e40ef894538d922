"""How many skip trigrams an attention layer holds, per mode and head count.

Every (mode, heads, seed, n) model is trained to a plateau and judged by one rule,
:func:`~uvic.analysis.superposition.skip_trigrams.learnt_trigrams`, on the same number of
scored sites per trigram at every n. Every n up to the maximum is trained for every seed (no stop at
the first failure). Each mode gets the same grid of learning rates and initial scales,
chosen on seeds of its own that the table does not report. Every finished model is
appended at once to a ledger in the output folder, so a stopped run resumes where it was.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from uvic.analysis.superposition.skip_trigrams import (
    LEARNT,
    balanced_prompts,
    design_cells,
    learnt_trigrams,
    logit_accuracy,
    make_prompts,
    toy_model,
)

TUNING_SEED = 10_000  # tuning seeds are TUNING_SEED, TUNING_SEED + 1, ...: never reported


@dataclass(frozen=True)
class ToyRecipe:
    """How one toy model is built, trained to a plateau and judged."""

    lr: float = 1e-2  # Adam
    init_std: float = 0.02  # weights drawn from N(0, init_std^2)
    head_dim: int = 1
    depth: int = 1  # 1, or >= 3 layers with softmax in the first and last
    batch: int = 128  # fresh prompts every step
    max_steps: int = 4000
    check_every: int = 100  # held-out loss every so many steps
    patience: int = 5  # stop after this many checks without a relative gain of tol
    tol: float = 1e-3
    sites: int = 200  # scored forced and free B's per trigram

    def check(self) -> None:
        """Refuse settings that cannot mean what they say, in one line."""
        for name in ("lr", "init_std", "tol"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0")
        for name in ("head_dim", "batch", "max_steps", "check_every", "patience", "sites"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.depth < 1 or self.depth == 2:
            raise ValueError(f"depth={self.depth}: use 1, or >= 3 (softmax first and last "
                             "leaves no middle layer at depth 2)")


class TrigramTask:
    """Next-token prediction on prompts of ``num_trigrams`` skip trigrams."""

    def __init__(self, num_trigrams: int) -> None:
        self.num_trigrams, self.vocab = num_trigrams, 2 * num_trigrams + 2

    def prompts(self, count: int, seed: int) -> torch.Tensor:
        return make_prompts(self.num_trigrams, count, seed=seed).tokens

    def loss(self, model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train_to_plateau(model: torch.nn.Module, task, seed: int, recipe: ToyRecipe) -> dict:
    """Adam on fresh prompts of ``task`` until the held-out loss stops improving (or
    max_steps); ``task`` has ``prompts(count, seed)`` and ``loss(model, prompts)``."""
    opt = torch.optim.Adam(model.parameters(), lr=recipe.lr)
    held = task.prompts(1024, seed=2 * seed + 1)
    best, stale, step, loss = math.inf, 0, 0, math.inf
    chunk = recipe.check_every
    while step < recipe.max_steps and stale < recipe.patience:
        data = task.prompts(chunk * recipe.batch, seed=2 * seed + 2 + step)
        for i in range(chunk):
            train = task.loss(model, data[i * recipe.batch:(i + 1) * recipe.batch])
            opt.zero_grad(set_to_none=True)
            train.backward()
            opt.step()
        step += chunk
        with torch.no_grad():
            loss = float(task.loss(model, held))
        if loss < best * (1 - recipe.tol):
            best, stale = loss, 0
        else:
            stale += 1
    return {"steps": step, "converged": stale >= recipe.patience, "loss": loss}


def run_model(mode: str, heads: int, num_trigrams: int, seed: int, recipe: ToyRecipe) -> dict:
    """Train one toy model and judge every trigram; JSON-ready. The seed fixes the initial
    weights and the prompts, the same for every mode (the models pair by seed)."""
    start = time.perf_counter()
    torch.manual_seed(seed * 1009 + num_trigrams)
    model = toy_model(2 * num_trigrams + 2, heads, mode, recipe.head_dim, recipe.init_std,
                      recipe.depth)
    fit = train_to_plateau(model, TrigramTask(num_trigrams), seed * 1009 + num_trigrams, recipe)
    scored = balanced_prompts(num_trigrams, recipe.sites,
                              seed=10**6 + seed * 1009 + num_trigrams)  # unseen in training
    with torch.no_grad():
        accuracy = logit_accuracy(model(scored.tokens[:, :-1]), scored)
    learnt = learnt_trigrams(model, scored)
    return {**fit, "learnt": learnt, "all_learnt": all(learnt), "accuracy": accuracy,
            "seconds": time.perf_counter() - start}


def model_key(setting: str, mode: str, heads: int, num_trigrams: int, seed: int) -> str:
    """The ledger's name of one model."""
    return f"{setting}|{mode}|{heads}|{num_trigrams}|{seed}"


class Ledger:
    """Finished models, one JSON line each, appended (and flushed) as they finish."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: dict[str, dict] = {}
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a stop: that model reruns
                    continue
                self.done[record["key"]] = record
        path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.done[record["key"]] = record


def _job(job: tuple) -> dict:
    torch.set_num_threads(1)
    key, mode, heads, n, seed, recipe = job
    return {"key": key, **run_model(mode, heads, n, seed, ToyRecipe(**recipe))}


def run_jobs(jobs: list[tuple], ledger: Ledger, workers: int,
             say: Callable[[str], None] = print, job: Callable[[tuple], dict] = _job) -> None:
    """Run the jobs the ledger lacks (``job`` of each, in a worker of one thread),
    ``workers`` at a time; progress with an ETA."""
    todo = [j for j in jobs if j[0] not in ledger.done]
    if not todo:
        return
    say(f"{len(todo)} models to train ({len(jobs) - len(todo)} done before)")
    start = time.perf_counter()
    if workers > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        results: Iterable[dict] = pool.map(job, todo)
    else:
        pool, results = None, map(job, todo)
    try:
        for i, record in enumerate(results, 1):
            ledger.add(record)
            rate = (time.perf_counter() - start) / i
            if i == len(todo) or i % max(1, len(todo) // 20) == 0:
                say(f"  {i}/{len(todo)} models, {rate:.1f} s each, about "
                    f"{rate * (len(todo) - i) / 60:.0f} min left")
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)


@dataclass(frozen=True)
class Grid:
    """The tuning grid every mode gets alike, and how many tuning seeds judge it."""

    lrs: tuple[float, ...] = (1e-2, 1e-1)
    init_stds: tuple[float, ...] = (0.02, 0.5)
    seeds: int = 1

    def recipes(self, base: ToyRecipe) -> dict[str, ToyRecipe]:
        return {f"lr={lr:g},init={s:g}": replace(base, lr=lr, init_std=s)
                for lr, s in itertools.product(self.lrs, self.init_stds)}


def _jobs(setting: str, recipe: ToyRecipe, modes: list[str], head_counts: list[int],
          seeds: list[int], max_trigrams: int) -> list[tuple]:
    return [(model_key(setting, m, h, n, s), m, h, n, s, asdict(recipe))
            for m, h in design_cells(modes, head_counts) for s in seeds
            for n in range(1, max_trigrams + 1)]


def capacity_experiment(out: Path, modes: list[str], head_counts: list[int], seeds: list[int],
                        max_trigrams: int, base: ToyRecipe, grid: Grid, workers: int = 1,
                        margin: float = 1.0, say: Callable[[str], None] = print) -> dict:
    """Tune each (mode, heads) on its own seeds over ``grid``, then train every n for every
    reported seed with the chosen recipe; JSON-ready, resumable from ``out``."""
    base.check()
    ledger = Ledger(out / "models.jsonl")
    tune_seeds = [TUNING_SEED + i for i in range(grid.seeds)]
    recipes = grid.recipes(base)
    say(f"tuning: {len(recipes)} recipes x {len(modes)} modes x {len(head_counts)} head "
        f"counts on seeds {tune_seeds}")
    run_jobs([j for name, r in recipes.items()
              for j in _jobs(f"tune:{name}", r, modes, head_counts, tune_seeds, max_trigrams)],
             ledger, workers, say)
    chosen, tuning = {}, []
    for m, h in design_cells(modes, head_counts):
        scores = {}
        for name in recipes:
            runs = [ledger.done[model_key(f"tune:{name}", m, h, n, s)]
                    for s in tune_seeds for n in range(1, max_trigrams + 1)]
            # most trigrams learnt over every n, then the lower held-out loss
            scores[name] = (sum(sum(r["learnt"]) for r in runs),
                            -sum(r["loss"] for r in runs))
        best = max(scores, key=scores.get)
        chosen[(m, h)] = best
        tuning.append({"mode": m, "heads": h, "chosen": best,
                       "learnt_per_recipe": {k: v[0] for k, v in scores.items()}})
        say(f"  {m} {h} heads: {best} ({scores[best][0]} trigrams learnt over n = 1.."
            f"{max_trigrams})")
    jobs = []
    for (m, h), name in chosen.items():
        jobs += _jobs(name, recipes[name], [m], [h], seeds, max_trigrams)
    run_jobs(jobs, ledger, workers, say)
    cells = [summarise(m, h, seeds, max_trigrams,
                       [[ledger.done[model_key(chosen[(m, h)], m, h, n, s)]
                         for n in range(1, max_trigrams + 1)] for s in seeds])
             for m, h in design_cells(modes, head_counts)]
    for cell, t in zip(cells, tuning):
        cell["recipe"] = asdict(recipes[t["chosen"]])
    return {"base": asdict(base), "grid": asdict(grid), "tuning_seeds": tune_seeds,
            "tuning": tuning, "seeds": seeds, "max_trigrams": max_trigrams,
            "learnt_at": LEARNT, "margin": margin, "cells": cells}


def summarise(mode: str, heads: int, seeds: list[int], max_trigrams: int,
              runs: list[list[dict]]) -> dict:
    """One cell: per n the share of seeds that learnt all n trigrams (exact interval); per
    seed its capacity (the largest n learnt in full) and the most trigrams any one of its
    models held (a lower bound that needs no n learnt in full), each with a t interval.
    ``runs[seed][n - 1]`` is the record of that seed's model on n trigrams."""
    from uvic.evaluation.paired import proportion_interval

    success = []
    for n in range(1, max_trigrams + 1):
        k = sum(r[n - 1]["all_learnt"] for r in runs)
        success.append({"n": n, "learnt": k, "of": len(runs),
                        "interval_95": list(proportion_interval(k, len(runs))),
                        "not_converged": sum(not r[n - 1]["converged"] for r in runs)})
    capacity = [max([n for n in range(1, max_trigrams + 1) if r[n - 1]["all_learnt"]],
                    default=0) for r in runs]
    learnt = [[sum(x["learnt"]) for x in r] for r in runs]
    held = [max(counts) for counts in learnt]
    cell = {"mode": mode, "heads": heads, "seeds": seeds, "capacity": capacity,
            "most_held": held, "success": success, "hit_max": max(capacity) == max_trigrams,
            "held_max": max(held) == max_trigrams, "trigrams_learnt": learnt}
    if len(capacity) > 1:
        from uvic.evaluation.paired import t_interval

        for key, values in (("capacity", capacity), ("most_held", held)):
            cell[f"{key}_interval"] = t_interval(values, what=f"{mode} {heads}").as_dict()
    return cell


# One change at a time from the base recipe, the same for every mode.
SENSITIVITY = {"base": {}, "lr 0.1": {"lr": 0.1}, "init 0.5": {"init_std": 0.5},
               "width 4": {"head_dim": 4}, "depth 3": {"depth": 3}}


def sensitivity_experiment(out: Path, modes: list[str], head_counts: list[int],
                           seeds: list[int], max_trigrams: int, base: ToyRecipe,
                           changes: dict[str, dict] | None = None, workers: int = 1,
                           margin: float = 1.0, say: Callable[[str], None] = print) -> dict:
    """Every mode under each setting of ``changes`` (one field changed from ``base`` for
    all modes alike): does the mode ordering hold? JSON-ready, resumable from ``out``."""
    changes = SENSITIVITY if changes is None else changes
    recipes = {name: replace(base, **change) for name, change in changes.items()}
    for recipe in recipes.values():
        recipe.check()
    ledger = Ledger(out / "models.jsonl")
    run_jobs([j for name, r in recipes.items()
              for j in _jobs(f"sens:{name}", r, modes, head_counts, seeds, max_trigrams)],
             ledger, workers, say)
    settings = []
    for name, recipe in recipes.items():
        cells = [summarise(m, h, seeds, max_trigrams,
                           [[ledger.done[model_key(f"sens:{name}", m, h, n, s)]
                             for n in range(1, max_trigrams + 1)] for s in seeds])
                 for m, h in design_cells(modes, head_counts)]
        settings.append({"setting": name, "recipe": asdict(recipe), "cells": cells})
    return {"base": asdict(base), "changes": changes, "seeds": seeds,
            "max_trigrams": max_trigrams, "learnt_at": LEARNT, "margin": margin,
            "settings": settings}


def _heads(h: int) -> str:
    return f"{h} head{'s' * (h > 1)}"


BOUND = {"capacity": "hit_max", "most_held": "held_max"}  # which flag marks the limit


def sign_test_p(a: list[float], b: list[float]) -> float:
    """Exact two-sided sign test of b - a (ties dropped): no assumption on the spread, so
    its smallest p is 2 / 2^n (0.0625 with 5 seeds); 1 when every pair ties."""
    from scipy.stats import binomtest

    d = [y - x for x, y in zip(a, b) if y != x]
    return float(binomtest(sum(v > 0 for v in d), len(d)).pvalue) if d else 1.0


def _capacity_text(cell: dict | None, key: str = "capacity") -> str:
    if cell is None:  # a design that cannot have this head count
        return "—"
    more = "+" if cell[BOUND[key]] else ""
    iv = cell.get(f"{key}_interval")
    values = cell[key]
    spread = f" ± {iv['half_width']:.2f}" if iv else ""
    return f"{sum(values) / len(values):.2f}{spread} [{min(values)}, {max(values)}{more}]"


def paired_rows(cells: list[dict], margin: float, base: str = "softmax",
                key: str = "capacity") -> list[str]:
    """Markdown rows: each mode's ``key`` (capacity or most_held) minus ``base``'s, paired
    by seed, with its t interval, the minimum detectable difference at 80% power and what
    it supports (equivalence only by two one-sided tests within ±``margin`` trigrams)."""
    from uvic.evaluation.paired import paired_difference, verdict

    by = {(c["mode"], c["heads"]): c for c in cells}
    head_counts = sorted({h for _, h in by})
    rows = [f"| {key.replace('_', ' ')}: mode - {base} | heads | mean ± 95% t | t p | "
            "sign p | MDE (80%) | reads as |", "|---|---|---|---|---|---|---|"]
    for mode in dict.fromkeys(m for m, _ in by):
        for h in head_counts:
            a, b = by.get((base, h)), by.get((mode, h))
            if mode == base or a is None or b is None or len(a["seeds"]) < 2:
                continue
            d = paired_difference(dict(zip(a["seeds"], a[key])),
                                  dict(zip(b["seeds"], b[key])), (base, mode), margin=margin)
            limit = b[BOUND[key]] or a[BOUND[key]]
            reads = ("a seed at the trigram limit: raise --max-trigrams" if limit else
                     verdict(d).replace("B higher", "more").replace("B lower", "fewer"))
            rows.append(f"| {mode} | {h} | {'>= ' * limit}{d.mean:+.2f} ± {d.t_half_width:.2f} "
                        f"| {d.t_p:.2g} | {sign_test_p(a[key], b[key]):.2g} | {d.mde:.2f} | "
                        f"{reads} |")
    return rows if len(rows) > 2 else []


def capacity_markdown(table: dict) -> str:
    """The tuned capacity table, its success rates per n and the paired differences."""
    cells = table["cells"]
    head_counts = sorted({c["heads"] for c in cells})
    modes = list(dict.fromkeys(c["mode"] for c in cells))
    by = {(c["mode"], c["heads"]): c for c in cells}
    out = ["| mode | " + " | ".join(_heads(h) for h in head_counts) + " |",
           "|---" * (len(head_counts) + 1) + "|"]
    out += [f"| {m} | " + " | ".join(_capacity_text(by.get((m, h))) for h in head_counts) + " |"
            for m in modes]
    out += ["", "Most trigrams one model held (any n):", "",
            "| mode | " + " | ".join(_heads(h) for h in head_counts) + " |",
            "|---" * (len(head_counts) + 1) + "|"]
    out += [f"| {m} | " + " | ".join(_capacity_text(by.get((m, h)), "most_held")
                                      for h in head_counts) + " |" for m in modes]
    n_max = table["max_trigrams"]
    out += ["", "Seeds that learnt all n trigrams, per n:", "",
            "| mode | heads | recipe | " + " | ".join(f"n={n}" for n in range(1, n_max + 1))
            + " |", "|---" * (n_max + 3) + "|"]
    for m, h in design_cells(modes, head_counts):
        c, t = by[(m, h)], next(t for t in table["tuning"]
                                if t["mode"] == m and t["heads"] == h)
        out.append(f"| {m} | {h} | {t['chosen']} | " + " | ".join(
            f"{s['learnt']}/{s['of']}" + ("*" if s["not_converged"] else "")
            for s in c["success"]) + " |")
    for key in BOUND:
        paired = paired_rows(cells, table["margin"], key=key)
        out += ["", *paired] if paired else []
    return "\n".join(out) + "\n"


def sensitivity_markdown(table: dict) -> str:
    """Per setting and head count: the modes ordered by mean capacity, then the paired rows."""
    def order(cells: list[dict], key: str) -> str:
        mean = {c["mode"]: sum(c[key]) / len(c[key]) for c in cells}
        return ", ".join(f"{m} {v:.2f}" for m, v in sorted(mean.items(), key=lambda kv: -kv[1]))

    out = ["| setting | heads | capacity, most first | most held, most first |",
           "|---|---|---|---|"]
    for s in table["settings"]:
        for h in sorted({c["heads"] for c in s["cells"]}):
            cells = [c for c in s["cells"] if c["heads"] == h]
            out.append(f"| {s['setting']} | {h} | {order(cells, 'capacity')} | "
                       f"{order(cells, 'most_held')} |")
    for s in table["settings"]:
        for key in BOUND:
            rows = paired_rows(s["cells"], table["margin"], key=key)
            if rows:
                out += ["", *rows] if key != "capacity" else ["", f"{s['setting']}:", "", *rows]
    return "\n".join(out) + "\n"


def summary_markdown(table: dict, base: str = "softmax", mode: str = "cog") -> str:
    """The README's two tables: capacity and most held per mode and head count side by
    side, then ``mode`` minus ``base`` paired by seed for each, where no seed hit the limit."""
    from uvic.evaluation.paired import paired_difference

    cells = table["cells"]
    by = {(c["mode"], c["heads"]): c for c in cells}
    head_counts = sorted({c["heads"] for c in cells})
    rows = [f"| {m} | " + " | ".join(_capacity_text(by.get((m, h)), key) for key in BOUND
                                     for h in head_counts) + " |"
            for m in dict.fromkeys(c["mode"] for c in cells)]
    shown = [h for h in head_counts if (base, h) in by and (mode, h) in by
             and not any(by[(m, h)][BOUND[k]] for m in (base, mode) for k in BOUND)]
    pairs = [f"| {mode} - {base} | " + " | ".join(_heads(h) for h in shown) + " |",
             "|---" * (len(shown) + 1) + "|"]
    for key in BOUND:
        out = []
        for h in shown:
            a, b = by[(base, h)], by[(mode, h)]
            d = paired_difference(dict(zip(a["seeds"], a[key])), dict(zip(b["seeds"], b[key])),
                                  (base, mode))
            out.append(f"{d.mean:+.2f} ± {d.t_half_width:.2f} (t p {d.t_p:.2g}, sign p "
                       f"{sign_test_p(a[key], b[key]):.2g}, MDE {d.mde:.2f})")
        pairs.append(f"| {key.replace('_', ' ')} | " + " | ".join(out) + " |")
    return "\n".join(rows) + "\n\n" + "\n".join(pairs) + "\n"
