"""Skip-trigram experiments: the gated-block reproduction and the capacity table per mode.

* :func:`reproduce`: train a one-layer model with ``heads`` heads on ``trigrams``
  OV-incoherent skip trigrams, then a gated block (``expansion`` x the heads) on its
  attention block; report, for both, which trigrams one head encodes alone and which
  need several heads together (superposition), and the gated block's gates from each
  trigram's B to its A. :data:`SETTINGS` holds Mathwin et al.'s three settings.
* :func:`capacity_cell`: for one attention mode and head count, train models on 1, 2, ...
  trigrams (each seed its own init and prompts) and find per seed the largest number all
  learnt to >= 99% accuracy; then distil the largest such model into a gated block.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from uvic.analysis.gated import (
    OPEN_GATE,
    GatedAttentionBlock,
    expanded_heads,
    fit,
    gate_report,
    start_at_mean,
)
from uvic.analysis.skip_trigrams import (
    LEARNT,
    ToyAttentionModel,
    TrigramData,
    hand_built_model,
    head_encodings,
    logit_accuracy,
    make_prompts,
    train_toy,
    trigram_accuracy,
    trigram_gates,
)


@dataclass(frozen=True)
class ToySettings:
    """How the one-layer models and their gated blocks are trained."""

    steps: int = 300  # Adam steps of the one-layer model (fresh prompts each step)
    batch: int = 128
    lr: float = 1e-2
    eval_prompts: int = 2000
    gated_epochs: int = 60  # passes over gated_batches batches of gated_batch prompts
    gated_batches: int = 16
    gated_batch: int = 64
    gated_lr: float = 1e-2  # the paper's 1e-3 (or 5e-4) is for its 100,000 steps
    coef: float = 3e-1  # L0.6 coefficient
    warmup: float = 0.3  # share of the gated epochs over which the coefficient ramps up
    expansion: int = 2
    compile: bool = False  # the gated fit through torch.compile (long runs)
    report_every: int = 0  # every so many gated epochs, which heads encode each trigram


# Mathwin et al.'s settings: (heads, trigrams) -> L0.6 coefficient, learning rate; their
# gated blocks train 1,000 epochs of 100 batches x 1,000 prompts.
SETTINGS = {"4x5": (4, 5, 3e-1, 1e-3), "2x3": (2, 3, 5e-1, 5e-4), "3x4": (3, 4, 1e-1, 5e-4),
            "2x2": (2, 2, 3e-1, 1e-3)}  # 2x2: ours, the smallest case of superposition
PAPER = ToySettings(steps=1500, gated_epochs=1000, gated_batches=100, gated_batch=1000,
                    warmup=0.0, compile=True, report_every=50)
# the hand-built model's gated block: a short run (see `fit`'s warm-up)
HAND_BUILT = ToySettings(gated_epochs=100, gated_batches=16, gated_lr=1e-2, warmup=0.3)
# seconds per Adam step on one thread of a 2-core CPU (docs/gated_attention.md): a
# 4-head model, batch 128; an 8-head gated block, batch 64 (compiled, batch 1,000: 0.03)
STEP_SECONDS = {"toy": 0.005, "gated": 0.01}


def estimate_seconds(cfg: ToySettings, models: int, gated: int) -> float:
    """Rough single-thread time of ``models`` one-layer models and ``gated`` gated blocks."""
    return (models * cfg.steps * STEP_SECONDS["toy"]
            + gated * cfg.gated_epochs * cfg.gated_batches * STEP_SECONDS["gated"])


def train_original(mode: str, heads: int, trigrams: int, seed: int,
                   cfg: ToySettings) -> tuple[ToyAttentionModel, TrigramData, list[float]]:
    """A one-layer model trained on ``trigrams`` trigrams; returns it, held-out prompts and
    the per-trigram accuracy on them."""
    torch.manual_seed(seed)
    data = make_prompts(trigrams, cfg.steps * cfg.batch, seed=2 * seed)
    held_out = make_prompts(trigrams, cfg.eval_prompts, seed=2 * seed + 1)
    model = ToyAttentionModel(data.vocab, heads, mode)
    train_toy(model, data, epochs=1, batch_size=cfg.batch, lr=cfg.lr, seed=seed)
    return model, held_out, trigram_accuracy(model, held_out)


def distil(model: ToyAttentionModel, held_out: TrigramData, seed: int, cfg: ToySettings,
           on_epoch: Callable | None = None,
           say: Callable[[str], None] = print) -> tuple[GatedAttentionBlock, dict]:
    """Train a gated block on ``model``'s attention block; return it and its report
    (with, every ``cfg.report_every`` epochs, which heads encode each trigram)."""
    torch.manual_seed(seed)
    data = make_prompts(held_out.num_trigrams, cfg.gated_batches * cfg.gated_batch,
                        seed=seed + 7919)
    with torch.no_grad():
        x = model.embed(data.tokens[:, :-1])
        y = model.attn(x)
    block = GatedAttentionBlock(model.vocab, model.vocab, expanded_heads(model.num_heads,
                                cfg.expansion), model.head_dim, mode=model.mode, causal=True)

    def batches():
        for start in range(0, len(x), cfg.gated_batch):
            yield x[start:start + cfg.gated_batch], y[start:start + cfg.gated_batch]

    with torch.no_grad():
        hx = model.embed(held_out.tokens[:, :-1])
    progress = []

    def encodings(heads: torch.Tensor) -> dict:  # the block in the model's place
        return head_encodings(heads, hx + block.b_O, held_out)

    def epoch_done(epoch: int, rec: float, l0: float) -> None:
        if on_epoch is not None:
            on_epoch(epoch, rec, l0)
        if cfg.report_every and (epoch + 1) % cfg.report_every == 0:
            with torch.no_grad():
                enc = encodings(block.head_outputs(hx))
            progress.append({"epoch": epoch + 1, "reconstruction": rec, "l0_6": l0,
                             "single": enc["single"], "shared": enc["shared"]})
            say(f"  gated epoch {epoch + 1}: reconstruction {rec:.3g}, L0.6 {l0:.3g}, "
                f"alone {enc['single']}, shared {enc['shared']}")

    variance = start_at_mean(block, y)
    log = fit(block, batches, cfg.gated_epochs, cfg.gated_lr, cfg.coef, cfg.warmup,
              epoch_done, variance, cfg.compile)
    with torch.no_grad():
        report = gate_report(block, hx, model.attn(hx))
        report["progress"] = progress
        report["gated_heads"] = block.num_heads
        heads = block.head_outputs(hx)
        gates = trigram_gates(block.last_gate, held_out, OPEN_GATE)
        report["encodings"] = encodings(heads)
        # the paper's test: the heads' summed outputs alone, without embedding or bias
        report["encodings_heads_only"] = head_encodings(heads, torch.zeros_like(hx), held_out)
        report["open_heads_b_to_a"] = gates
        report["final_loss"] = {"reconstruction": log.reconstruction[-1], "l0_6": log.l0[-1]}
        # the model's logits with the block in its attention's place (= hx + block(hx))
        report["accuracy"] = logit_accuracy(hx + heads.sum(dim=2) + block.b_O, held_out)
    return block, report


def original_encodings(model: ToyAttentionModel, held_out: TrigramData) -> dict:
    """``head_encodings`` of a one-layer model on its held-out prompts."""
    with torch.no_grad():
        x = model.embed(held_out.tokens[:, :-1])
        return head_encodings(model.attn_heads(x), x + model.b_O, held_out)


def reproduce(mode: str, heads: int, trigrams: int, seed: int, cfg: ToySettings,
              say: Callable[[str], None] = print, superposed: bool = False,
              tries: int = 10) -> dict:
    """Train a one-layer model (SGD), then its gated block, on one setting; JSON-ready.

    ``superposed``: the paper distils models that learnt every trigram and hold some in
    superposition; seeds ``seed``, ``seed + 1``, ... (at most ``tries``) are trained until
    one such model comes out, and the seeds passed over are reported (``skipped_seeds``).
    """
    start = time.perf_counter()
    skipped = []
    for candidate in range(seed, seed + (tries if superposed else 1)):
        model, held_out, acc = train_original(mode, heads, trigrams, candidate, cfg)
        if not superposed:
            break
        shared = original_encodings(model, held_out)["shared"]
        if min(acc) >= LEARNT and shared:
            break
        say(f"seed {candidate}: accuracy {[round(a, 3) for a in acc]}, shared {shared}: not "
            "a model with every trigram learnt and one in superposition; next seed")
        skipped.append(candidate)
    else:
        raise ValueError(f"no seed in {seed}..{seed + tries - 1} gave a {heads}-head {mode} "
                         f"model that learnt all {trigrams} trigrams with one in "
                         "superposition; try another --seed or more --steps")
    result = _gate_model(model, held_out, acc, candidate, cfg, say, start)
    result["skipped_seeds"] = skipped
    return result


def reproduce_models(mode: str, heads: int, trigrams: int, seed: int, cfg: ToySettings,
                     models: int, say: Callable[[str], None] = print) -> dict:
    """:func:`reproduce` on ``models`` different models in superposition (seeds from
    ``seed`` on), and how many of their gated blocks hold each trigram in one head: the
    share, with its exact 95% interval. JSON-ready."""
    from uvic.evaluation.paired import proportion_interval

    results, next_seed = [], seed
    for _ in range(models):
        result = reproduce(mode, heads, trigrams, next_seed, cfg, say, superposed=True)
        results.append(result)
        next_seed = result["seed"] + 1
    resolved = sum(r["each_trigram_in_one_head"] for r in results)
    low, high = proportion_interval(resolved, models)
    say(f"each trigram in one gated head: {resolved} of {models} models (seeds "
        f"{[r['seed'] for r in results]}; exact 95% interval {low:.2f} to {high:.2f})")
    return {"mode": mode, "heads": heads, "trigrams": trigrams, "settings": asdict(cfg),
            "seeds": [r["seed"] for r in results], "resolved": resolved, "models": results,
            "share": resolved / models, "interval_95": [low, high]}


def reproduce_hand_built(seed: int, cfg: ToySettings,
                         say: Callable[[str], None] = print) -> dict:
    """The gated block of :func:`hand_built_model` (2 heads, 3 trigrams, one shared)."""
    start = time.perf_counter()
    model = hand_built_model()
    held_out = make_prompts(3, cfg.eval_prompts, seed=2 * seed + 1)
    return _gate_model(model, held_out, trigram_accuracy(model, held_out), seed, cfg, say,
                       start)


def _gate_model(model: ToyAttentionModel, held_out: TrigramData, acc: list[float], seed: int,
                cfg: ToySettings, say: Callable[[str], None], start: float) -> dict:
    heads, trigrams = model.num_heads, held_out.num_trigrams
    say(f"{model.mode} {heads} heads, {trigrams} trigrams: accuracy "
        f"{[round(a, 3) for a in acc]}")
    orig = original_encodings(model, held_out)
    say(f"  original: heads encoding each trigram alone {orig['single']}, "
        f"shared by several heads {orig['shared']}")
    _, report = distil(model, held_out, seed, cfg, say=say)
    enc = report["encodings"]
    say(f"  gated, {report['gated_heads']} heads (relative error "
        f"{report['relative_error']:.3g}, L0.6 {report['l0_6']:.3g}): "
        f"alone {enc['single']}, shared {enc['shared']}, open heads B->A "
        f"{[round(g, 2) for g in report['open_heads_b_to_a']]}")
    alone = report["encodings_heads_only"]
    say(f"  gated, the paper's test (heads' outputs alone): alone {alone['single']}, "
        f"shared {alone['shared']}")
    return {"mode": model.mode, "heads": heads, "trigrams": trigrams, "seed": seed,
            "settings": asdict(cfg), "original_accuracy": acc, "original_encodings": orig,
            "gated": report, "each_trigram_in_one_head": _one_head_each(enc),
            "each_trigram_in_one_head_heads_only": _one_head_each(alone),
            "seconds": time.perf_counter() - start}


def _one_head_each(encodings: dict) -> bool:
    """Every trigram encoded by some head alone, and none only by several together."""
    return all(len(e) >= 1 for e in encodings["single"]) and not encodings["shared"]


def capacity_cell(mode: str, heads: int, seeds: list[int], max_trigrams: int,
                  cfg: ToySettings, say: Callable[[str], None] = print) -> dict:
    """Largest number of trigrams learnt to >= 99% (per seed), and the gated head counts.

    For each seed, n = 1, 2, ... until a model fails or ``max_trigrams`` is reached; a
    seed's capacity is the last n whose model learnt every trigram (0 if n = 1 fails).
    The largest such model of the first seed reaching the best capacity is distilled.
    """
    start = time.perf_counter()
    caps, best = [], None
    for seed in seeds:
        cap = 0
        for n in range(1, max_trigrams + 1):
            model, held_out, acc = train_original(mode, heads, n, seed, cfg)
            if min(acc) < LEARNT:
                break
            cap = n
            if best is None or n > best[0]:
                best = (n, model, held_out, seed)
        caps.append(cap)
        say(f"{mode:>10} {heads} heads seed {seed}: capacity {cap}")
    cell = {"mode": mode, "heads": heads, "seeds": seeds, "capacity": caps,
            "mean": statistics.fmean(caps),
            "std": statistics.stdev(caps) if len(caps) > 1 else 0.0,
            "min": min(caps), "max": max(caps), "hit_max": max(caps) == max_trigrams}
    if best is not None:
        n, model, held_out, seed = best
        orig = original_encodings(model, held_out)
        _, report = distil(model, held_out, seed, cfg)
        cell["distilled"] = {
            "trigrams": n, "seed": seed, "original_single": orig["single"],
            "original_shared": orig["shared"], "gated_single": report["encodings"]["single"],
            "gated_shared": report["encodings"]["shared"],
            "gated_open_heads_b_to_a": report["open_heads_b_to_a"],
            "gated_relative_error": report["relative_error"], "gated_l0_6": report["l0_6"]}
    cell["seconds"] = time.perf_counter() - start
    return cell


def _cell_job(job: tuple) -> dict:
    """One cell in a worker process (one thread each: the workers share the cores)."""
    torch.set_num_threads(1)
    mode, heads, seeds, max_trigrams, cfg = job
    return capacity_cell(mode, heads, seeds, max_trigrams, cfg)


def capacity_table(modes: list[str], head_counts: list[int], seeds: list[int],
                   max_trigrams: int, cfg: ToySettings, workers: int = 1,
                   say: Callable[[str], None] = print) -> dict:
    """Every (mode, heads) cell of the capacity table, ``workers`` cells at a time;
    JSON-ready. Each cell's result depends only on its seeds, not on the workers."""
    jobs = [(mode, heads, seeds, max_trigrams, cfg) for mode in modes for heads in head_counts]
    if workers > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=context) as pool:
            cells = list(pool.map(_cell_job, jobs))
    else:
        cells = [capacity_cell(*job, say=say) for job in jobs]
    return {"settings": asdict(cfg), "seeds": seeds, "max_trigrams": max_trigrams,
            "learnt_at": LEARNT, "cells": cells}


def trainings_bound(head_counts: list[int], seeds: list[int], max_trigrams: int) -> int:
    """At most how many one-layer models one mode trains (a seed stops at its first failure)."""
    return len(head_counts) * len(seeds) * max_trigrams


def markdown_table(table: dict) -> str:
    """The capacity table as markdown: capacity mean ± std [min, max] per mode and head
    count; then, for each cell's distilled model, its trigrams held by one head or shared
    by several, and its gated block's open heads per trigram and relative error."""
    head_counts = sorted({c["heads"] for c in table["cells"]})
    modes = list(dict.fromkeys(c["mode"] for c in table["cells"]))
    lines = ["| mode | " + " | ".join(f"{h} head{'s' * (h > 1)}" for h in head_counts) + " |",
             "|---" * (len(head_counts) + 1) + "|"]
    detail = ["| mode | heads | trigrams | original: one head / shared | gated: open heads "
              "B->A per trigram | gated: one head / shared | gated relative error |",
              "|---|---|---|---|---|---|---|"]
    for mode in modes:
        row = []
        for h in head_counts:
            c = next(c for c in table["cells"] if c["mode"] == mode and c["heads"] == h)
            more = "+" if c["hit_max"] else ""
            row.append(f"{c['mean']:.2f} ± {c['std']:.2f} [{c['min']}, {c['max']}{more}]")
            d = c.get("distilled")
            if d:
                def count(encoders: list) -> int:
                    return sum(len(e) > 0 for e in encoders)
                detail.append(
                    f"| {mode} | {h} | {d['trigrams']} | {count(d['original_single'])} / "
                    f"{len(d['original_shared'])} | "
                    f"{statistics.fmean(d['gated_open_heads_b_to_a']):.2f} | "
                    f"{count(d['gated_single'])} / {len(d['gated_shared'])} | "
                    f"{d['gated_relative_error']:.3g} |")
        lines.append(f"| {mode} | " + " | ".join(row) + " |")
    paired = paired_table(table)
    return ("\n".join(lines) + "\n\n" + "\n".join(detail) + "\n"
            + (f"\n{paired}" if paired else ""))


def paired_table(table: dict, base: str = "softmax") -> str:
    """Each mode's capacity minus ``base``'s, seed by seed (a seed's models of every mode
    see the same prompts): mean with its 95% Student-t interval and the paired t-test p.
    ``>=`` marks a difference whose mode reached the trigram limit in some seed (its
    capacity there is a lower bound). Empty with one seed or without ``base``."""
    from uvic.evaluation.paired import paired_difference

    cells = {(c["mode"], c["heads"]): c for c in table["cells"]}
    head_counts = sorted({h for _, h in cells})
    modes = [m for m in dict.fromkeys(m for m, _ in cells) if m != base]
    if (len(table.get("seeds", ())) < 2 or not modes
            or any((base, h) not in cells for h in head_counts)):
        return ""
    lines = [f"| mode - {base} | " + " | ".join(f"{h} head{'s' * (h > 1)}"
                                               for h in head_counts) + " |",
             "|---" * (len(head_counts) + 1) + "|"]
    for mode in modes:
        row = []
        for h in head_counts:
            a, b = cells[(base, h)], cells.get((mode, h))
            if b is None:
                row.append("")
                continue
            d = paired_difference(dict(zip(a["seeds"], a["capacity"])),
                                  dict(zip(b["seeds"], b["capacity"])), (base, mode))
            bound = ">= " if b["hit_max"] else ""
            row.append(f"{bound}{d.mean:+.2f} ± {d.t_half_width:.2f} (p {d.t_p:.2g})")
        lines.append(f"| {mode} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"
