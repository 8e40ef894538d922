"""Copy-and-suppress: a toy task where the sign of an attention weight matters by construction.

Query Q1 asks to raise the group-1 token of the prompt and lower the group-2 one, Q2 the
reverse: the same key is added under one query and subtracted under the other, so heads
whose weights cannot be negative need two heads of opposite output signs, while one Cog
head can do both. Solved: on >= 99% of held-out prompts the raised token is the top
prediction and the lowered one the lowest among the group tokens (`CopySuppressTask`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from uvic.analysis.superposition.capacity import (
    TUNING_SEED,
    Grid,
    Ledger,
    ToyRecipe,
    run_jobs,
    train_to_plateau,
)
from uvic.analysis.superposition.skip_trigrams import LEARNT, design_cells, toy_model

SOLVED = LEARNT  # share of held-out prompts a model must get right


class CopySuppressTask:
    """Prompts and loss of the task; tokens: group 1, group 2, fillers, Q1, Q2, BOS."""

    def __init__(self, group: int = 4, fillers: int = 4, slots: int = 6) -> None:
        if group < 2 or fillers < 1 or slots < 2:
            raise ValueError(f"need group >= 2, fillers >= 1 and slots >= 2; got {group}, "
                             f"{fillers}, {slots}")
        self.group, self.fillers, self.slots = group, fillers, slots
        self.q1 = 2 * group + fillers
        self.q2, self.bos, self.vocab = self.q1 + 1, self.q1 + 2, self.q1 + 3

    def prompts(self, count: int, seed: int) -> torch.Tensor:
        """(count, slots + 2) prompts: BOS, the slots, then Q1 or Q2."""
        g = torch.Generator().manual_seed(seed)
        slots = 2 * self.group + torch.randint(0, self.fillers, (count, self.slots), generator=g)
        where = torch.rand(count, self.slots, generator=g).argsort(dim=1)[:, :2]
        rows = torch.arange(count)
        slots[rows, where[:, 0]] = torch.randint(0, self.group, (count,), generator=g)
        slots[rows, where[:, 1]] = self.group + torch.randint(0, self.group, (count,),
                                                              generator=g)
        query = self.q1 + torch.randint(0, 2, (count, 1), generator=g)
        return torch.cat([torch.full((count, 1), self.bos), slots, query], dim=1)

    def raised_lowered(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The token to raise and the one to lower, per prompt."""
        slots = tokens[:, 1:-1]
        x = slots.masked_fill(slots >= self.group, -1).amax(dim=1)
        y = slots.masked_fill((slots < self.group) | (slots >= 2 * self.group), -1).amax(dim=1)
        first = tokens[:, -1] == self.q1
        return torch.where(first, x, y), torch.where(first, y, x)

    def target(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token distributions (P, vocab): 1/2 on the raised token, 0 on the lowered,
        the other half spread over the other group tokens."""
        up, down = self.raised_lowered(tokens)
        target = torch.zeros(len(tokens), self.vocab)
        target[:, :2 * self.group] = 0.5 / (2 * self.group - 2)
        rows = torch.arange(len(tokens))
        target[rows, up], target[rows, down] = 0.5, 0.0
        return target

    def loss(self, model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        logits = model(tokens)[:, -1]
        return F.cross_entropy(logits, self.target(tokens))

    @torch.no_grad()
    def solved_share(self, model: torch.nn.Module, tokens: torch.Tensor) -> float:
        """Share of prompts whose raised token is on top and lowered token at the bottom
        of the group tokens."""
        logits = model(tokens)[:, -1, :2 * self.group]
        up, down = self.raised_lowered(tokens)
        right = (logits.argmax(-1) == up) & (logits.argmin(-1) == down)
        return float(right.double().mean())


def run_model(mode: str, heads: int, seed: int, recipe: ToyRecipe,
              task: CopySuppressTask) -> dict:
    """Train one model on the task to a plateau and score it on held-out prompts."""
    torch.manual_seed(seed)
    model = toy_model(task.vocab, heads, mode, recipe.head_dim, recipe.init_std, recipe.depth)
    fit = train_to_plateau(model, task, seed, recipe)
    share = task.solved_share(model, task.prompts(2000, seed=10**6 + seed))
    return {**fit, "share": share, "solved": share >= SOLVED}


def _job(job: tuple) -> dict:
    torch.set_num_threads(1)
    key, mode, heads, seed, recipe, task = job
    return {"key": key, **run_model(mode, heads, seed, ToyRecipe(**recipe),
                                     CopySuppressTask(**task))}


def copy_suppress_experiment(out: Path, modes: list[str], head_counts: list[int],
                             seeds: list[int], base: ToyRecipe, grid: Grid,
                             task: CopySuppressTask | None = None, workers: int = 1,
                             say: Callable[[str], None] = print) -> dict:
    """Every (mode, heads) tuned alike on its own seeds over ``grid``, then trained on the
    reported seeds; the share of seeds that solve the task. JSON-ready, resumable."""
    from uvic.evaluation.paired import proportion_interval

    base.check()
    task = task or CopySuppressTask()
    shape = {"group": task.group, "fillers": task.fillers, "slots": task.slots}
    ledger = Ledger(out / "models.jsonl")
    recipes = grid.recipes(base)
    tune_seeds = [TUNING_SEED + i for i in range(grid.seeds)]

    def jobs(name: str, ms: list[str], hs: list[int], ss: list[int]) -> list[tuple]:
        return [(f"{name}|{m}|{h}|{s}", m, h, s, asdict(recipes[name]), shape)
                for m, h in design_cells(ms, hs) for s in ss]

    run_jobs([j for name in recipes for j in jobs(name, modes, head_counts, tune_seeds)],
             ledger, workers, say, job=_job)

    def score(name: str, m: str, h: int) -> tuple[float, float]:
        runs = [ledger.done[f"{name}|{m}|{h}|{s}"] for s in tune_seeds]
        return sum(r["share"] for r in runs), -sum(r["loss"] for r in runs)

    chosen = {(m, h): max(recipes, key=lambda name: score(name, m, h))
              for m, h in design_cells(modes, head_counts)}
    run_jobs([j for (m, h), name in chosen.items() for j in jobs(name, [m], [h], seeds)],
             ledger, workers, say, job=_job)
    cells = []
    for (m, h), name in chosen.items():
        runs = [ledger.done[f"{name}|{m}|{h}|{s}"] for s in seeds]
        k = sum(r["solved"] for r in runs)
        cells.append({"mode": m, "heads": h, "recipe": name, "seeds": seeds, "solved": k,
                      "of": len(runs), "interval_95": list(proportion_interval(k, len(runs))),
                      "shares": [r["share"] for r in runs],
                      "not_converged": sum(not r["converged"] for r in runs)})
    return {"task": shape, "base": asdict(base), "grid": asdict(grid),
            "tuning_seeds": tune_seeds, "solved_at": SOLVED, "cells": cells}


def markdown(table: dict) -> str:
    """Seeds that solve the task per mode and head count, with exact 95% intervals."""
    head_counts = sorted({c["heads"] for c in table["cells"]})
    by = {(c["mode"], c["heads"]): c for c in table["cells"]}
    lines = ["| mode | " + " | ".join(f"{h} head{'s' * (h > 1)}" for h in head_counts) + " |",
             "|---" * (len(head_counts) + 1) + "|"]
    for mode in dict.fromkeys(c["mode"] for c in table["cells"]):
        cells = [by.get((mode, h)) for h in head_counts]
        lines.append(f"| {mode} | " + " | ".join(
            "—" if c is None else  # a design that cannot have this head count
            f"{c['solved']}/{c['of']} [{c['interval_95'][0]:.2f}, {c['interval_95'][1]:.2f}]"
            f" (mean share {sum(c['shares']) / len(c['shares']):.3f}, {c['recipe']})"
            for c in cells) + " |")
    return "\n".join(lines) + "\n"
