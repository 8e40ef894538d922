"""Gated attention blocks and the OV-incoherent skip-trigram toy models.

Oracles: the plain reference formulas of every attention mode (patterns), closed forms
(the L0.6 penalty, the dataset's rules), a hand-built 2-head model whose superposition
is known by construction, and the captured module itself (distillation inputs).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from uvic.analysis import gated as G
from uvic.analysis import skip_trigrams as S
from uvic.analysis import trigram_experiments as E
from uvic.analysis.gated_distil import capture, distil_module, module_attention, uvit_block
from uvic.analysis.gated_figures import capacity_figure, gate_figure
from uvic.cli.gated_attention import main
from uvic.config import load_config
from uvic.models.checks import ATTENTION_MODES
from uvic.models.uvit import build_model
from uvic_kernels import reference

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.img_size=8", "model.patch_size=2", "model.embed_dim=16", "model.depth=2",
        "model.num_heads=2", "model.attention_backend=torch", "data.num_images=4"]


def reference_of(mode: str):
    """The plain formula of a mode (``<mode>_attention_reference``), independent of the
    kernel's torch path that ``attention_pattern`` runs."""
    return getattr(reference, f"{mode}_attention_reference")


@pytest.mark.parametrize("mode", ATTENTION_MODES)
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


@pytest.mark.parametrize("mode", ATTENTION_MODES)
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
    assert enc == {"single": [[0], [1], []], "shared": [2]}
