"""The gated-block reproduction on skip trigrams, in any attention mode.

:func:`reproduce` trains a one-layer model with ``heads`` heads on ``trigrams``
OV-incoherent skip trigrams, then a gated block (``expansion`` x the heads) on its
attention block, and reports for both which trigrams one head encodes alone and which
need several heads together (superposition). :data:`SETTINGS` holds Mathwin et al.'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from uvic.analysis.superposition.gated import (
    OPEN_GATE,
    GatedAttentionBlock,
    expanded_heads,
    fit,
    gate_report,
    start_at_mean,
)
from uvic.analysis.superposition.paper import paper_head_test
from uvic.analysis.superposition.skip_trigrams import (
    LEARNT,
    ToyAttentionModel,
    TrigramData,
    hand_built_model,
    head_encodings,
    learnt_trigrams,
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
    # where uvic's recipe departs from the paper's (True/"normal": uvic's)
    init: str = "normal"  # the original's init: N(0, 0.02) weights, or "xavier" (the paper)
    output_bias: bool = True  # a trained output bias in the original
    gated_output_bias: bool = True  # and in the gated block
    relative_fit: bool = True  # the gated MSE divided by the teacher's variance


# Mathwin et al.'s settings: (heads, trigrams) -> L0.6 coefficient, learning rate; their
# gated blocks train 1,000 epochs of 100 batches x 1,000 prompts.
SETTINGS = {"4x5": (4, 5, 3e-1, 1e-3), "2x3": (2, 3, 5e-1, 5e-4), "3x4": (3, 4, 1e-1, 5e-4),
            "2x2": (2, 2, 3e-1, 1e-3)}  # 2x2: ours, the smallest case of superposition
PAPER = ToySettings(steps=1500, gated_epochs=1000, gated_batches=100, gated_batch=1000,
                    warmup=0.0, compile=True, report_every=50)
PROMPTS_UP_FRONT = 2**21  # longer runs draw fresh prompts as they train
# the paper's recipe in full: originals of 100,000 Adam steps x 1,000 fresh prompts at
# 1e-3 from Xavier-normal weights and biases, no output bias anywhere, plain MSE
EXACT = replace(PAPER, steps=100_000, batch=1000, lr=1e-3, init="xavier", output_bias=False,
                gated_output_bias=False, relative_fit=False)
# the hand-built model's gated block: a short run (see `fit`'s warm-up)
HAND_BUILT = ToySettings(gated_epochs=100, gated_batches=16, gated_lr=1e-2, warmup=0.3)


def train_original(mode: str, heads: int, trigrams: int, seed: int,
                   cfg: ToySettings) -> tuple[ToyAttentionModel, TrigramData, list[float]]:
    """A one-layer model trained on ``trigrams`` trigrams; returns it, held-out prompts and
    the per-trigram accuracy on them."""
    torch.manual_seed(seed)
    held_out = make_prompts(trigrams, cfg.eval_prompts, seed=2 * seed + 1)
    model = ToyAttentionModel(2 * trigrams + 2, heads, mode, output_bias=cfg.output_bias,
                              init=cfg.init)
    if cfg.steps * cfg.batch <= PROMPTS_UP_FRONT:  # one pass over prompts drawn up front
        data = make_prompts(trigrams, cfg.steps * cfg.batch, seed=2 * seed)
        train_toy(model, data, epochs=1, batch_size=cfg.batch, lr=cfg.lr, seed=seed)
    else:  # long runs: fresh prompts drawn as they go, no early stop
        from uvic.analysis.superposition.capacity import ToyRecipe, TrigramTask, train_to_plateau

        recipe = ToyRecipe(lr=cfg.lr, batch=cfg.batch, max_steps=cfg.steps,
                           check_every=1000, patience=cfg.steps)
        train_to_plateau(model, TrigramTask(trigrams), 2 * seed, recipe)
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
                                cfg.expansion), model.head_dim, mode=model.mode, causal=True,
                                output_bias=cfg.gated_output_bias)

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

    variance = start_at_mean(block, y) if cfg.relative_fit else None
    log = fit(block, batches, cfg.gated_epochs, cfg.gated_lr, cfg.coef, cfg.warmup,
              epoch_done, variance, cfg.compile)
    with torch.no_grad():
        report = gate_report(block, hx, model.attn(hx))
        report["progress"] = progress
        report["gated_heads"] = block.num_heads
        heads = block.head_outputs(hx)
        gates = trigram_gates(block.last_gate, held_out, OPEN_GATE)
        report["encodings"] = encodings(heads)
        # uvic's test on the heads' summed outputs alone, without embedding or bias
        report["encodings_heads_only"] = head_encodings(heads, torch.zeros_like(hx), held_out)
        report["paper_test"] = paper_head_test(heads, held_out)  # one-trigram prompts
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
              tries: int = 10, allow_unlearnt: bool = False) -> dict:
    """Train a one-layer model (SGD), then its gated block, on one setting; JSON-ready.

    ``superposed``: the paper distils models that learnt every trigram and hold some in
    superposition; seeds ``seed``, ``seed + 1``, ... (at most ``tries``) are trained until
    one such model comes out, and the seeds passed over are reported (``skipped_seeds``).
    Otherwise an original that did not learn every trigram is refused (a ValueError) unless
    ``allow_unlearnt``: its gated block would distil what it never held.
    """
    start = time.perf_counter()
    skipped = []
    for candidate in range(seed, seed + (tries if superposed else 1)):
        model, held_out, acc = train_original(mode, heads, trigrams, candidate, cfg)
        if not superposed:
            if not allow_unlearnt and min(acc) < LEARNT:
                raise ValueError(
                    f"seed {candidate}: the {heads}-head {mode} model did not learn every "
                    f"trigram (accuracy {[round(a, 3) for a in acc]}, below {LEARNT}); "
                    "distilling it would "
                    "explain what it never held: train longer (--steps), search seeds "
                    "(--paper), or pass --allow-unlearnt to distil it anyway")
            break
        shared = original_encodings(model, held_out)["shared"]
        if all(learnt_trigrams(model, held_out)) and shared:
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
    if heads > 1:
        with torch.no_grad():
            orig["paper_test"] = paper_head_test(
                model.attn_heads(model.embed(held_out.tokens[:, :-1])), held_out)
    say(f"  original: heads encoding each trigram alone {orig['single']}, "
        f"shared by several heads {orig['shared']}, the paper's test "
        f"{orig.get('paper_test', 'needs >= 2 heads')}")
    _, report = distil(model, held_out, seed, cfg, say=say)
    enc = report["encodings"]
    say(f"  gated, {report['gated_heads']} heads (relative error "
        f"{report['relative_error']:.3g}, L0.6 {report['l0_6']:.3g}): "
        f"alone {enc['single']}, shared {enc['shared']}, open heads B->A "
        f"{[round(g, 2) for g in report['open_heads_b_to_a']]}")
    alone = report["encodings_heads_only"]
    say(f"  gated, heads' outputs alone: alone {alone['single']}, shared {alone['shared']}; "
        f"the paper's test: {report['paper_test']}")
    return {"mode": model.mode, "heads": heads, "trigrams": trigrams, "seed": seed,
            "settings": asdict(cfg), "original_accuracy": acc, "original_encodings": orig,
            "gated": report, "each_trigram_in_one_head": _one_head_each(enc),
            "each_trigram_in_one_head_heads_only": _one_head_each(alone),
            "seconds": time.perf_counter() - start}


def _one_head_each(encodings: dict) -> bool:
    """Every trigram encoded by some head alone, and none only by several together."""
    return all(len(e) >= 1 for e in encodings["single"]) and not encodings["shared"]
