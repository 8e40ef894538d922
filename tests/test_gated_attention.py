"""Gated attention blocks and the OV-incoherent skip-trigram toy models.

Oracles: the plain reference formulas of every attention mode (patterns), closed forms
(the L0.6 penalty, the dataset's rules), a hand-built 2-head model whose superposition
is known by construction, and the captured module itself (distillation inputs).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from uvic.analysis.superposition import gated as G
from uvic.analysis.superposition import reproduction as E
from uvic.analysis.superposition import skip_trigrams as S
from uvic.analysis.superposition.distil import capture, distil_module, module_attention, uvit_block
from uvic.analysis.superposition.figures import capacity_figure, gate_figure
from uvic.cli.gated_attention import main
from uvic.config import load_config
from uvic.models.uvit import build_model
from uvic_kernels import reference
from uvic_kernels.modes import MODES as KERNEL_MODES

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.img_size=8", "model.patch_size=2", "model.embed_dim=16", "model.depth=2",
        "model.num_heads=2", "model.attention_backend=torch", "data.num_images=4"]


def hand_built_io(num_prompts: int) -> tuple[S.TrigramData, torch.Tensor, torch.Tensor]:
    """Prompts of the hand-built model's 3 trigrams, its inputs (one-hot) and the outputs
    of its attention block: what a gated block is fitted to."""
    teacher = S.hand_built_model()
    data = S.make_prompts(3, num_prompts, seed=5)
    x = teacher.embed(data.tokens[:, :-1])
    with torch.no_grad():
        return data, x, teacher.attn(x)


def reference_of(mode: str):
    """The plain formula of a mode (``<mode>_attention_reference``), independent of the
    kernel's torch path that ``attention_pattern`` runs."""
    return getattr(reference, f"{mode}_attention_reference")


@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_pattern_is_the_modes_formula(mode):
    """A @ v equals the reference formula, non-causal (keys over one identity block and
    over two) and causal (row i: the formula on keys 0..i); gradients flow to q and k."""
    torch.manual_seed(0)
    for n_keys in (7, 130):
        q, k = torch.randn(2, 2, 5, 4, dtype=torch.float64), torch.randn(2, 2, n_keys, 4)
        v = torch.randn(2, 2, n_keys, 3)
        a = G.attention_pattern(q.float(), k, mode, 0.5)
        assert a.shape == (2, 2, 5, n_keys)
        want = reference_of(mode)(q, k.double(), v.double(), 0.5)
        torch.testing.assert_close(a.double() @ v.double(), want, atol=1e-5, rtol=1e-5)
    q = torch.randn(1, 2, 6, 3, requires_grad=True)
    k = torch.randn(1, 2, 6, 3, requires_grad=True)
    a = G.attention_pattern(q, k, mode, 1.0, causal=True)
    assert torch.all(torch.triu(a, diagonal=1) == 0)
    for i in range(6):
        row = reference_of(mode)(q[..., i:i + 1, :].double(), k[..., :i + 1, :].double(),
                                 torch.eye(i + 1, dtype=torch.float64), 1.0)
        torch.testing.assert_close(a[..., i:i + 1, :i + 1].double(), row, atol=1e-5, rtol=1e-5)
    a.pow(2).sum().backward()
    assert q.grad.abs().sum() > 0 and k.grad.abs().sum() > 0


@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_causal_weights_have_exact_gradients(mode):
    """The batched causal weights (masked keys: weight 0, no share of a row's
    denominator) pass autograd's float64 gradient check, with no NaN from the masked
    -inf scores; sigmoid attention's learnt per-head bias gets its gradient too."""
    torch.manual_seed(1)
    q = torch.randn(1, 2, 5, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 5, 3, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(2, dtype=torch.float64, requires_grad=True) if mode == "sigmoid" else None

    def weights(q, k, *b):
        return reference.attention_weights(q, k, mode, 0.7, *b, causal=True)

    args = (q, k) if bias is None else (q, k, bias)
    assert torch.autograd.gradcheck(weights, args)


@pytest.mark.slow
def test_share_of_models_resolved_over_seeds(tmp_path, capsys):
    """``--models N`` distils N different models in superposition (seeds from --seed on,
    none twice) and reports the share whose gated block holds each trigram in one head,
    with its exact interval; the hand-built setting (one model) is refused."""
    cfg = E.ToySettings(eval_prompts=500, gated_epochs=1, gated_batches=1, gated_batch=16)
    summary = E.reproduce_models("softmax", 2, 2, 0, cfg, 2, say=lambda _: None)
    seeds = summary["seeds"]
    assert len(set(seeds)) == 2 and seeds == sorted(seeds)
    assert summary["resolved"] == sum(m["each_trigram_in_one_head"] for m in summary["models"])
    low, high = summary["interval_95"]
    assert 0 <= low <= summary["share"] <= high <= 1
    with pytest.raises(SystemExit):
        main(["trigrams", "--setting", "hand-built", "--models", "2", "--out", str(tmp_path)])
    assert "hand-built setting is one model" in capsys.readouterr().err


def test_attention_weights_refuses_bad_input():
    q = torch.randn(1, 1, 3, 2)
    with pytest.raises(ValueError, match="as many keys as queries"):
        reference.attention_weights(q, torch.randn(1, 1, 4, 2), "cog", causal=True)
    with pytest.raises(ValueError, match="only sigmoid attention takes a bias, not 'cog'"):
        reference.attention_weights(q, q, "cog", bias=0.5)
    with pytest.raises(ValueError, match="unknown attention mode 'bogus'"):
        reference.attention_weights(q, q, "bogus")


@pytest.mark.slow
def test_compiled_fit_is_the_same_fit():
    """``fit(compile=True)`` runs the same losses and steps as the eager fit (to float
    rounding), with the coefficient's warm-up changing every epoch (no recompiling)."""
    _, x, y = hand_built_io(64)
    logs = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        block = G.GatedAttentionBlock(8, 8, 4, 1, causal=True)
        variance = G.start_at_mean(block, y)
        logs[compiled] = G.fit(block, lambda: [(x[:32], y[:32]), (x[32:], y[32:])], 4, 1e-2,
                               0.3, warmup=0.5, variance=variance, compile=compiled)
    for key in ("reconstruction", "l0"):
        torch.testing.assert_close(getattr(logs[True], key), getattr(logs[False], key),
                                   rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_paper_runs_distil_a_model_in_superposition():
    """The paper's settings distil a model that learnt every trigram and holds one in
    superposition: seeds that gave no such model are passed over and reported, and one
    line names the seeds when none does."""
    cfg = E.ToySettings(eval_prompts=500, gated_epochs=1, gated_batches=1, gated_batch=16)
    said = []
    result = E.reproduce("softmax", 2, 3, 0, cfg, say=said.append, superposed=True)
    assert result["skipped_seeds"] and result["seed"] == result["skipped_seeds"][-1] + 1
    assert min(result["original_accuracy"]) >= S.LEARNT
    assert result["original_encodings"]["shared"]
    assert sum("next seed" in line for line in said) == len(result["skipped_seeds"])
    with pytest.raises(ValueError, match=r"no seed in 0\.\.0 gave a 2-head softmax model"):
        E.reproduce("softmax", 2, 3, 0, cfg, say=said.append, superposed=True, tries=1)


def test_l0_penalty_closed_form():
    """(sum_h g^0.6)^(1/0.6) per (query, key), averaged: one open head costs 1, two 2^(5/3)."""
    gate = torch.zeros(1, 4, 1, 3)
    gate[0, 0, 0, 0] = 1.0  # one head open
    gate[0, :2, 0, 1] = 1.0  # two heads open
    assert G.l0_penalty(gate).item() == pytest.approx((1 + 2 ** (1 / 0.6) + 0) / 3)


def test_gated_block_recipe():
    """Value and output weights enter normalised (scaling them changes nothing), the gate
    weights start orthonormal, and closed gates leave only the output bias."""
    torch.manual_seed(0)
    block = G.GatedAttentionBlock(6, 5, num_heads=3, head_dim=2, mode="cog")
    x = torch.randn(2, 4, 6)
    out = block(x)
    with torch.no_grad():
        block.W_V.mul_(7.0)
        block.W_O.mul_(0.1)
    torch.testing.assert_close(block(x), out)
    rows = block.W_gate_Q.reshape(3, 6)
    torch.testing.assert_close(rows @ rows.T, torch.eye(3), atol=1e-5, rtol=0)
    with torch.no_grad():
        block.b_gate_Q.fill_(-100.0)
        block.W_gate_Q.zero_()
        block.b_gate_K.fill_(1.0)
        block.W_gate_K.zero_()
        block.b_O.copy_(torch.arange(5.0))
    assert torch.equal(block(x), torch.arange(5.0).expand(2, 4, 5))
    assert torch.equal(block.last_gate, torch.zeros(2, 3, 4, 4))


def test_prompts_follow_the_rules():
    """BOS first; a C follows exactly the first B after an unused A, and no A is drawn
    while one is unused; the same seed gives the same prompts."""
    n = 4
    data = S.make_prompts(n, 500, seed=3)
    assert data.tokens.shape == (500, S.PROMPT_LENGTH) and data.vocab == 10
    assert torch.equal(data.tokens, S.make_prompts(n, 500, seed=3).tokens)
    assert torch.all(data.tokens[:, 0] == 2 * n + 1)
    assert torch.all(data.tokens[:, 1:] <= 2 * n)
    for row, forced in zip(data.tokens.tolist(), data.forced.tolist()):
        pending = False
        for pos in range(1, len(row)):
            tok = row[pos]
            if pos > 1 and forced[pos]:
                assert row[pos - 1] in range(1, n + 1) and tok == row[pos - 1] + n
            elif pending and 1 <= row[pos - 1] <= n:
                raise AssertionError(f"no C after B at {pos - 1}: {row}")
            if pending:
                assert tok != 0, row
            if forced[pos]:
                pending = False
            if tok == 0:
                pending = True
            elif pending and 1 <= tok <= n:
                pass  # its C is checked at the next position
    assert data.forced.sum() > 100  # trigrams are common enough to learn from


@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_toy_model_runs_every_mode(mode):
    """Every uvic mode makes a causal toy model: changing a later token leaves earlier
    logits unchanged, and a few Adam steps lower the loss."""
    torch.manual_seed(0)
    data = S.make_prompts(3, 64, seed=0)
    model = S.ToyAttentionModel(data.vocab, 2, mode, init_std=0.3)
    tokens = data.tokens[:4, :-1].clone()
    before = model(tokens)
    tokens[:, -1] = (tokens[:, -1] + 1) % data.vocab
    torch.testing.assert_close(model(tokens)[:, :-1], before[:, :-1])
    losses = S.train_toy(model, data, epochs=3, batch_size=64, lr=3e-2)
    assert losses[-1] < losses[0]


def test_hand_built_model_is_in_superposition():
    """The hand-built model gets all 3 trigrams right; B1 and B2 are one head's each and
    B3's C needs both heads (removing either loses it)."""
    model = S.hand_built_model()
    data = S.make_prompts(3, 1500, seed=5)
    assert min(S.trigram_accuracy(model, data)) == 1.0
    enc = E.original_encodings(model, data)
    assert enc == {"single": [[0], [1], []], "shared": [2], "bias": []}


def tiny_uvit(attention: str = "uvic"):
    cfg = load_config(ROOT / "configs/quickstart.py", [*TINY, f"model.attention={attention}"])
    torch.manual_seed(0)
    return cfg, build_model(cfg).eval()


def test_distil_a_uvit_block():
    """The captured inputs are what the block's attention receives (its output is the
    module applied to them); the gated block takes the module's mode and 2x its heads,
    and its report has the reconstruction error, L0.6 and open heads per (query, key)."""
    _, model = tiny_uvit("uvic")
    module = uvit_block(model, "mid_block")
    assert module_attention(module) == ("cog", 2)
    x, t = torch.randn(3, 3, 8, 8), torch.rand(3) * 999
    inputs, outputs = capture(module, lambda: model(x, t))
    n = model.extras + 16
    assert inputs.shape == outputs.shape == (3, n, 16)
    torch.testing.assert_close(module(inputs), outputs)
    before = G.gate_report(G.GatedAttentionBlock(16, 16, 4, 8, mode="cog"), inputs, outputs)
    block, report = distil_module(module, inputs, outputs, epochs=30, lr=1e-2, batch=3)
    assert (block.num_heads, block.mode, report["gated_heads"]) == (4, "cog", 4)
    assert report["reconstruction_mse"] < before["reconstruction_mse"]
    assert len(report["open_heads"]) == n and len(report["open_heads"][0]) == n
    assert sum(report["open_histogram"]) == pytest.approx(1.0)
    assert math.isfinite(report["l0_6"]) and math.isfinite(report["relative_error"])
    with pytest.raises(ValueError, match=r"out_blocks\.0"):
        uvit_block(model, "block7")


@pytest.mark.parametrize(("attention", "gate"), [("uvid", "none"), ("uvic", "headwise")])
def test_distil_the_control_designs(attention: str, gate: str) -> None:
    """A differential block distils into softmax heads (its two maps per head), a gated one
    in its own mode; the gated block reconstructs better than before training."""
    cfg = load_config(ROOT / "configs/quickstart.py", [*TINY, f"model.attention={attention}",
                                                         f"model.output_gate={gate}"])
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    module = uvit_block(model, "mid_block")
    mode, heads = module_attention(module)
    assert (mode, heads) == (("softmax", 2) if attention == "uvid" else ("cog", 2))
    x, t = torch.randn(3, 3, 8, 8), torch.rand(3) * 999
    inputs, outputs = capture(module, lambda: model(x, t))
    torch.testing.assert_close(module(inputs), outputs)
    before = G.gate_report(G.GatedAttentionBlock(16, 16, 4, 8, mode=mode), inputs, outputs)
    block, report = distil_module(module, inputs, outputs, epochs=30, lr=1e-2, batch=3)
    assert (block.mode, report["teacher_heads"]) == (mode, heads)
    assert report["reconstruction_mse"] < before["reconstruction_mse"]


def test_distil_a_diffusers_attention():
    """A diffusers DiT's self-attention is captured with its own processor's mode."""
    from diffusers import DiTTransformer2DModel

    from uvic.models.attention_processor import set_cog_attention

    torch.manual_seed(0)
    dit = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=4, in_channels=4,
                                num_layers=2, sample_size=4, patch_size=2,
                                num_embeds_ada_norm=10).eval()
    set_cog_attention(dit, "expressive", blocks=[1])
    attn = dit.transformer_blocks[1].attn1
    assert module_attention(attn) == ("expressive", 2)
    assert module_attention(dit.transformer_blocks[0].attn1)[0] == "softmax"
    run = lambda: dit(torch.randn(2, 4, 4, 4), timestep=torch.tensor([3, 5]),  # noqa: E731
                      class_labels=torch.tensor([1, 2]))
    inputs, outputs = capture(attn, run)
    assert inputs.shape == (2, 4, 8) and outputs.shape == (2, 4, 8)
    torch.testing.assert_close(attn(inputs), outputs)
    _, report = distil_module(attn, inputs, outputs, epochs=2)
    assert report["mode"] == "expressive" and report["gated_heads"] == 4


def test_figures(tmp_path):
    report = {"gate_mean": torch.rand(3, 5, 5).tolist(), "open_heads": torch.rand(5, 5).tolist(),
              "threshold": 0.1, "l0_6": 0.5, "relative_error": 0.1}
    assert gate_figure(report, tmp_path / "g.png").stat().st_size > 1000
    cells = [{"mode": m, "heads": h, "success": [
        {"n": n, "learnt": 1, "of": 2, "interval_95": [0.01, 0.99]} for n in (1, 2)]}
        for m in ("softmax", "cog") for h in (1, 2)]
    assert capacity_figure({"cells": cells}, tmp_path / "c.png").stat().st_size > 1000


@pytest.mark.parametrize("bad", [
    ["capacity", "--modes", "softmax,foo"], ["capacity", "--heads", "0,2"],
    ["capacity", "--seeds", "0"], ["capacity", "--depth", "2"], ["capacity", "--lr", "0.1,0"],
    ["sensitivity", "--margin", "-1"], ["trigrams", "--coef", "-1"],
    ["trigrams", "--setting", "5x9"], ["trigrams", "--mode", "linear"]])
def test_cli_refuses_bad_input_in_one_line(bad, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main([*bad, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and err[-1].count("error") == 1 and bad[1] in err[-1]
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_cli_distil_and_dry_run(tmp_path, capsys):
    """distil: one line for a missing checkpoint or block; a tiny U-ViC block end to end.
    capacity --dry-run states the compute and writes nothing."""
    _, model = tiny_uvit("uvic")
    ckpt = tmp_path / "m.safetensors"
    save_file(model.state_dict(), str(ckpt))
    sets = [a for item in [*TINY, "model.attention=uvic"] for a in ("--set", item)]
    base = ["distil", "--config", str(ROOT / "configs/quickstart.py"), *sets]
    assert main([*base, "--checkpoint", str(tmp_path / "none.pt"), "--out", str(tmp_path)]) == 2
    assert "none.pt" in capsys.readouterr().err
    assert main([*base, "--checkpoint", str(ckpt), "--block", "x", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--block 'x'" in err[0]
    out = tmp_path / "out"
    assert main([*base, "--checkpoint", str(ckpt), "--num-images", "2", "--epochs", "2",
                 "--out", str(out)]) == 0, capsys.readouterr().err
    result = json.loads((out / "gated.json").read_text())
    assert result["block"] == "mid_block" and result["mode"] == "cog"
    assert (out / "gated_gates.png").is_file()
    assert main(["capacity", "--dry-run", "--seeds", "2", "--modes", "softmax", "--heads", "1",
                 "--max-trigrams", "1", "--max-steps", "100", "--out", str(tmp_path / "c")]) == 0
    said = capsys.readouterr().out
    assert "compute: 6 models; one (softmax, 1 heads, n = 1) took" in said
    assert not (tmp_path / "c").exists()


def gated_copy_of_hand_built(resolved: bool) -> G.GatedAttentionBlock:
    """A 4-head gated block that reproduces :func:`hand_built_model` exactly, with B3's
    trigram either in one head of its own (``resolved``) or in heads 0 and 1 together,
    as the original holds it (superposition)."""
    a, bos, b1, b2, b3, c1, c2, c3 = 0, 7, 1, 2, 3, 4, 5, 6
    e = torch.eye(8)
    heads = [((b1,) if resolved else (b1, b3), e[c1] + 0.6 * e[c3]),
             ((b2,) if resolved else (b2, b3), e[c2] + 0.6 * e[c3])]
    if resolved:
        heads.append(((b3,), e[c1] + e[c2] + 1.2 * e[c3]))
    block = G.GatedAttentionBlock(8, 8, num_heads=4, head_dim=1, mode="softmax", causal=True)
    with torch.no_grad():
        for p in block.parameters():
            p.zero_()
        block.b_O[b1:b3 + 1] = -1.0
        for h, (queries, out) in enumerate(heads):
            block.W_Q[h, :, 0] = -10.0
            block.W_K[h, a, 0], block.W_K[h, bos, 0] = 1.0, -1.0
            block.W_V[h, a, 0] = 1.0
            block.b_V[h, 0] = out.norm() - 1  # A's value is |out|: W_O is normalised
            block.W_O[h, 0] = out
            block.W_gate_K[h, a, 0] = 1.0
            for q in queries:
                block.W_Q[h, q, 0] = 10.0
                block.W_gate_Q[h, q, 0] = 1.0
    return block


def test_gating_prefers_one_head_per_trigram():
    """The mechanism, on the paper's 2-head / 3-trigram superposition: a gated block can
    reproduce the original exactly either by copying its superposition (B3's C from two
    heads) or with each trigram in one head; both reconstruct equally (error ~0), and the
    L0.6 penalty is lower for the single-head block, so the recipe's loss prefers it for
    every coefficient > 0. The head-ablation test tells the two apart."""
    data, x, y = hand_built_io(1500)
    with torch.no_grad():
        found = {}
        for resolved in (False, True):
            block = gated_copy_of_hand_built(resolved)
            assert (block(x) - y).abs().max() < 1e-5
            found[resolved] = (G.l0_penalty(block.last_gate).item(),
                               S.head_encodings(block.head_outputs(x), x + block.b_O, data),
                               S.trigram_gates(block.last_gate, data, G.OPEN_GATE))
            # the paper's test (the heads' outputs alone) sees the same: one head writes
            # C1 + 0.6 C3 at B3, both together C1 + C2 + 1.2 C3
            alone = S.head_encodings(block.head_outputs(x), torch.zeros_like(x), data)
            assert alone == found[resolved][1]
    assert found[True][0] < found[False][0]
    assert found[False][1] == {"single": [[0], [1], []], "shared": [2], "bias": []}
    assert found[True][1] == {"single": [[0], [1], [2]], "shared": [], "bias": []}
    assert found[False][2] == [1.0, 1.0, 2.0] and found[True][2] == [1.0, 1.0, 1.0]


@pytest.mark.slow
def test_cli_trigrams(tmp_path, capsys):
    """trigrams runs a setting end to end (here shortened to a few steps): the JSON has
    the original's accuracy and encodings and the gated block's report, and the figure."""
    out = tmp_path / "t"
    assert main(["trigrams", "--setting", "hand-built", "--gated-epochs", "1",
                 "--out", str(out)]) == 0, capsys.readouterr().err
    result = json.loads((out / "trigrams.json").read_text())
    assert result["original_accuracy"] == [1.0, 1.0, 1.0]
    assert result["original_encodings"]["shared"] == [2]
    assert result["gated"]["gated_heads"] == 4 and len(result["gated"]["open_heads_b_to_a"]) == 3
    assert result["settings"]["gated_epochs"] == 1 and (out / "trigrams_gates.png").is_file()
    assert main(["trigrams", "--setting", "2x3", "--mode", "cog", "--steps", "2",
                 "--gated-epochs", "1", "--out", str(out)]) == 2  # 2 steps learn nothing
    err = capsys.readouterr().err.strip()
    assert "did not learn every trigram" in err and "--allow-unlearnt" in err
    assert "\n" not in err
    assert main(["trigrams", "--setting", "2x3", "--mode", "cog", "--steps", "2",
                 "--gated-epochs", "1", "--allow-unlearnt", "--out", str(out)]) == 0
    result = json.loads((out / "trigrams.json").read_text())
    assert (result["mode"], result["heads"], result["trigrams"]) == ("cog", 2, 3)
    assert result["settings"]["coef"] == 5e-1


@pytest.mark.slow
def test_fit_is_relative_to_the_originals_scale():
    """The fit starts at the original's mean output and divides its error by the
    original's variance, so a short trained run predicts better than the mean (relative
    error < 1); the plain recipe at the same budget (lr 1e-3, 160 steps of 32 prompts) is still far
    above 1, as the output bias has not reached the mean (the hand-built model writes -1
    on every B: a mean square of 0.38 against a variance of 0.033)."""
    _, x, y = hand_built_io(256)
    flat = y.reshape(-1, 8).double()
    errors = {}
    for relative in (False, True):
        torch.manual_seed(0)
        block = G.GatedAttentionBlock(8, 8, 4, 1, causal=True)
        variance = G.start_at_mean(block, y) if relative else 1.0
        if relative:
            torch.testing.assert_close(block.b_O.double(), flat.mean(0), atol=1e-6, rtol=0)
            assert variance == pytest.approx(float(flat.var(0, correction=0).mean()), rel=1e-5)

        def batches():
            for start in range(0, len(x), 32):
                yield x[start:start + 32], y[start:start + 32]

        G.fit(block, batches, 20, 1e-3, 0.3, variance=variance)
        errors[relative] = G.gate_report(block, x, y)["relative_error"]
    assert errors[True] < 1 < 5 < errors[False]


@pytest.mark.slow
def test_trained_gated_block_takes_a_trigram_out_of_superposition():
    """Trained end to end at reduced size (the capacity table's softmax cell with 2 heads,
    seed 1: 300 steps for the model, 960 for its gated block; 6 s): the model learns both
    trigrams, the first only in its two heads together (superposition); its trained gated
    block (4 heads) reconstructs it (relative error < 0.05) with each trigram in exactly
    one gated head and none shared. One seed: other seeds' models learnt one trigram
    only, or their gated blocks lost one (docs/gated_attention.md)."""
    result = E.reproduce("softmax", 2, 2, 1, E.ToySettings(), say=lambda _: None)
    assert min(result["original_accuracy"]) >= S.LEARNT
    assert result["original_encodings"]["shared"] == [0]
    gated = result["gated"]
    assert gated["relative_error"] < 0.05
    assert [len(heads) for heads in gated["encodings"]["single"]] == [1, 1]
    assert gated["encodings"]["shared"] == [] and gated["encodings"]["bias"] == []
    assert result["each_trigram_in_one_head"]


@pytest.mark.slow
def test_exact_recipe_switches_reach_the_models(monkeypatch):
    """The paper's recipe: Xavier-normal originals without output bias, trained on fresh
    prompts; a gated block without output bias fitted by the plain MSE; the paper's head
    test in the report."""
    monkeypatch.setattr(E, "PROMPTS_UP_FRONT", 0)
    cfg = replace(E.EXACT, steps=20, batch=32, eval_prompts=300, gated_epochs=1,
                  gated_batches=1, gated_batch=16, compile=False, report_every=0)
    model, held_out, acc = E.train_original("cog", 2, 2, 0, cfg)
    assert "b_O" not in dict(model.named_parameters()) and len(acc) == 2
    assert float(model.b_Q.detach().abs().sum()) > 0  # Xavier-normal biases, not zeros
    block, report = E.distil(model, held_out, 0, cfg, say=lambda _: None)
    assert "b_O" not in dict(block.named_parameters())
    assert len(report["paper_test"]) == 2
