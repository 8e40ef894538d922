"""Differential attention (both versions) and the output gate against float64 formulas
written out here:
weights, outputs and gradients (any N, head width, strided inputs, both kernel backends),
in U-ViT (presets, training steps, save/load) and refused in one line where they cannot
apply."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from uvic.config import ConfigError, DiffusionConfig
from uvic.diffusion.schedule import Diffusion, diffusion_loss
from uvic.models.uvit import Attention, DifferentialAttention, DifferentialV2Attention, UViT
from uvic_kernels import differential_attention_reference, differential_v2_attention_reference
from uvic_kernels.modes import DESIGN, MODES
from uvic_kernels.reference import lambda_init_at

BACKENDS = ["torch", "triton"]  # triton: the interpreter on a CPU, compiled on a GPU


def double(t: torch.Tensor) -> torch.Tensor:
    return t.detach().double().requires_grad_(t.requires_grad)


def linear(x: torch.Tensor, layer: torch.nn.Linear, params: dict) -> torch.Tensor:
    w, b = params[id(layer.weight)], layer.bias
    return x @ w.T + (params[id(b)] if b is not None else 0)


def gate64(x: torch.Tensor, y: torch.Tensor, attn: torch.nn.Module, params: dict,
           heads: int) -> torch.Tensor:
    """Y * sigmoid(X W_g + b), one gate per channel or per head (Qiu et al. 2025)."""
    if attn.gate is None:
        return y
    g = torch.sigmoid(x @ params[id(attn.gate.weight)].T + params[id(attn.gate.bias)])
    if attn.gate.kind == "headwise":
        g = g.repeat_interleave(y.shape[-1] // heads, dim=-1)
    return y * g


def differential64(attn: DifferentialAttention, x: torch.Tensor, params: dict,
                   layer: int) -> torch.Tensor:
    """The paper's equations, head by head, in float64 from the module's weights."""
    D, H = x.shape[-1], attn.num_heads
    d = D // (2 * H)
    q, k, v = linear(x, attn.qkv, params).split(D, dim=-1)
    diff = attn.diff
    lam = (torch.exp(params[id(diff.lambda_q1)] @ params[id(diff.lambda_k1)])
           - torch.exp(params[id(diff.lambda_q2)] @ params[id(diff.lambda_k2)])
           + 0.8 - 0.6 * math.exp(-0.3 * (layer - 1)))
    heads = []
    for i in range(H):
        q1, q2 = q[..., 2 * i * d:(2 * i + 1) * d], q[..., (2 * i + 1) * d:(2 * i + 2) * d]
        k1, k2 = k[..., 2 * i * d:(2 * i + 1) * d], k[..., (2 * i + 1) * d:(2 * i + 2) * d]
        a = (torch.softmax(q1 @ k1.transpose(-1, -2) / math.sqrt(d), -1)
             - lam * torch.softmax(q2 @ k2.transpose(-1, -2) / math.sqrt(d), -1))
        o = a @ v[..., 2 * i * d:(2 * i + 2) * d]
        o = o / torch.sqrt(o.square().mean(-1, keepdim=True) + 1e-5) * params[id(diff.norm.weight)]
        heads.append(o * (1 - lambda_init_at(layer)))
    y = gate64(x, torch.cat(heads, dim=-1), attn, params, H)
    return linear(y, attn.proj, params)


def differential_v2_64(attn: DifferentialV2Attention, x: torch.Tensor,
                       params: dict) -> torch.Tensor:
    """The authors' second version, head by head, in float64 from the module's weights:
    softmax(q1 k^T / sqrt d) - sigmoid(x . w_i) softmax(q2 k^T / sqrt d) weighing v."""
    D, H = x.shape[-1], attn.num_heads
    d = D // H
    q1, k, v = linear(x, attn.qkv, params).split(D, dim=-1)
    q2 = x @ params[id(attn.q2_weight)].T
    if attn.q2_bias is not None:
        q2 = q2 + params[id(attn.q2_bias)]
    lam = torch.sigmoid(x @ params[id(attn.lambda_weight)].T)  # (B, N, H)
    heads = []
    for i in range(H):
        part = slice(i * d, (i + 1) * d)
        a = (torch.softmax(q1[..., part] @ k[..., part].transpose(-1, -2) / math.sqrt(d), -1)
             - lam[..., i:i + 1]
             * torch.softmax(q2[..., part] @ k[..., part].transpose(-1, -2) / math.sqrt(d), -1))
        heads.append(a @ v[..., part])
    y = gate64(x, torch.cat(heads, dim=-1), attn, params, H)
    return linear(y, attn.proj, params)


def attention64(attn: Attention, x: torch.Tensor, params: dict) -> torch.Tensor:
    """A kernel mode's block in float64: its weights by the float64 reference, then the gate."""
    from uvic_kernels import reference

    D, h = x.shape[-1], attn.num_heads
    q, k, v = (t.unflatten(-1, (h, D // h)).transpose(1, 2)
               for t in linear(x, attn.qkv, params).split(D, dim=-1))
    a = reference.attention_weights(q, k, attn.mode, attn.scale)
    y = gate64(x, (a @ v).transpose(1, 2).flatten(2), attn, params, h)
    return linear(y, attn.proj, params)


def compare(module: torch.nn.Module, x: torch.Tensor, formula) -> None:
    """Outputs and the gradients of every parameter and of x, against the float64 formula."""
    x = x.requires_grad_()
    out = module(x)
    weight = torch.randn_like(out)
    (out * weight).sum().backward()
    params = {id(p): double(p) for p in module.parameters()}
    x64 = double(x)
    ref = formula(x64, params)
    (ref * weight.double()).sum().backward()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-5)
    for p in module.parameters():
        torch.testing.assert_close(p.grad.double(), params[id(p)].grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("dim", "heads", "n"), [(32, 4, 1), (32, 4, 17), (48, 2, 33)])
@pytest.mark.parametrize("gate", ["none", "headwise"])
def test_differential_matches_its_equations(backend: str, dim: int, heads: int, n: int,
                                            gate: str) -> None:
    torch.manual_seed(0)
    layer = 3
    attn = DifferentialAttention(dim, heads, qkv_bias=True, layer=layer, backend=backend,
                                 gate=gate)
    wide = torch.randn(2, n, 2 * dim)
    x = wide[..., ::2]  # strided input
    compare(attn, x, lambda x64, p: differential64(attn, x64, p, layer))


def test_differential_weights_are_signed_and_give_the_output() -> None:
    torch.manual_seed(1)
    attn = DifferentialAttention(32, 4, layer=12, backend="torch")  # lambda near 0.8
    x = 4 * torch.randn(2, 9, 32)  # sharp maps: where map 2 peaks, the weight is negative
    a = attn.weights(x)  # (B, h/2, N, N)
    assert a.shape == (2, 2, 9, 9) and bool((a < 0).any())
    lam = float(attn.diff.lam().detach())
    torch.testing.assert_close(a.sum(-1), torch.full((2, 2, 9), 1 - lam), rtol=0, atol=1e-5)
    q1, k1, q2, k2, v = attn._qkv(x)
    ref = differential_attention_reference(*(t.double() for t in (q1, k1, q2, k2, v)), lam,
                                           attn.scale)
    torch.testing.assert_close(a.double() @ v.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("dim", "heads", "n"), [(32, 4, 1), (24, 3, 17), (48, 2, 33)])
@pytest.mark.parametrize("gate", ["none", "elementwise"])
def test_differential_v2_matches_its_equations(backend: str, dim: int, heads: int, n: int,
                                               gate: str) -> None:
    torch.manual_seed(5)
    attn = DifferentialV2Attention(dim, heads, qkv_bias=True, backend=backend, gate=gate)
    wide = torch.randn(2, n, 2 * dim)
    compare(attn, wide[..., ::2], lambda x64, p: differential_v2_64(attn, x64, p))


def test_differential_v2_weights_are_signed_and_give_the_output() -> None:
    """Rows sum to 1 - lambda, a different lambda per query token and head, in (0, 1)."""
    torch.manual_seed(6)
    attn = DifferentialV2Attention(32, 4, backend="torch")
    with torch.no_grad():
        attn.lambda_weight.normal_(0, 0.1)  # lambdas spread away from 1/2
    x = 4 * torch.randn(2, 9, 32)
    a = attn.weights(x)  # (B, h, N, N)
    assert a.shape == (2, 4, 9, 9) and bool((a < 0).any())
    q1, q2, k, v, lam = attn._maps(x)
    assert lam.shape == (2, 4, 9) and lam.std() > 0.05 and bool(((lam > 0) & (lam < 1)).all())
    torch.testing.assert_close(a.sum(-1), 1 - lam, rtol=0, atol=1e-5)
    ref = differential_v2_attention_reference(*(t.double() for t in (q1, q2, k, v, lam)),
                                              attn.scale)
    torch.testing.assert_close(a.double() @ v.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
def test_output_gate_on_every_kernel_mode(mode: str, gate: str) -> None:
    torch.manual_seed(2)
    attn = Attention(24, 3, mode=mode, backend="torch", gate=gate)
    compare(attn, torch.randn(2, 11, 24), lambda x64, p: attention64(attn, x64, p))


def test_lambda_init_follows_the_depth_schedule() -> None:
    assert lambda_init_at(1) == pytest.approx(0.2)
    assert lambda_init_at(2) == pytest.approx(0.8 - 0.6 * math.exp(-0.3))
    model = tiny(attention="uvid", depth=4)
    assert [round(b.attn.diff.lambda_init, 6) for b in model.blocks()[1:-1]] == [
        round(lambda_init_at(layer), 6) for layer in (2, 3, 4)]
    fixed = tiny(attention="uvid", diff_lambda_init=0.5)
    assert fixed.mid_block.attn.diff.lambda_init == 0.5


TINY = {"img_size": 8, "patch_size": 2, "embed_dim": 32, "depth": 2, "num_heads": 4,
        "num_classes": 4, "attention_backend": "torch"}


def tiny(**changes: object) -> UViT:
    torch.manual_seed(0)
    return UViT(**{**TINY, **changes})


def loss_of(model: UViT, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    batch = {"x": torch.randn(4, 3, 8, 8, generator=g), "y": torch.randint(0, 4, (4,), generator=g)}
    return diffusion_loss(model, Diffusion(DiffusionConfig()), batch, g)


@pytest.mark.parametrize(("attention", "gate"), [
    ("uvid", "none"), ("uvid", "headwise"), ("uvid2", "none"), ("uvit", "elementwise"),
    ("uvic", "headwise")])
def test_presets_train_and_round_trip(tmp_path: Path, attention: str, gate: str) -> None:
    """A few optimizer steps lower nothing to NaN and reach the new weights; the saved model
    rebuilds the same function."""
    model = tiny(attention=attention, output_gate=gate).train()
    inner = {d.preset: d.name for d in DESIGN.values()}.get(attention, "softmax")
    expected = ["softmax", inner, "softmax"]
    assert model.attention_modes == expected
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(3):
        opt.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    new = {n for n in before if "lambda_" in n or ".gate" in n or "diff.norm" in n
           or "q2_" in n}
    assert new and new <= moved
    model.eval().save_pretrained(tmp_path)
    loaded = UViT.from_pretrained(tmp_path).eval()
    g = torch.Generator().manual_seed(9)
    x, t = torch.randn(2, 3, 8, 8, generator=g), torch.rand(2, generator=g) * 999
    y = torch.tensor([0, 3])
    with torch.no_grad():
        assert torch.equal(loaded(x, t, y=y).sample, model(x, t, y=y).sample)


@pytest.mark.parametrize(("changes", "message"), [
    ({"output_gate": "sometimes"}, "model.output_gate='sometimes'"),
    ({"attention": "uvic", "diff_lambda_init": 0.5}, "model.diff_lambda_init=0.5"),
    ({"attention": "uvid", "num_heads": 2, "embed_dim": 24, "diff_lambda_init": "x"},
     "model.diff_lambda_init='x'"),
    ({"attention": "uvid", "num_heads": 1}, "model.num_heads=1"),
    ({"attention": "uvid", "embed_dim": 320, "num_heads": 4}, "model.num_heads=4"),
])
def test_bad_settings_are_one_line(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        tiny(**changes)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_switching_to_or_from_differential_is_refused_and_changes_nothing() -> None:
    model = tiny(attention="uvic")
    with pytest.raises(ValueError, match="differential") as err:
        model.set_attention("uvid")
    assert "\n" not in str(err.value) and model.attention_modes == ["softmax", "cog", "softmax"]
    differential = tiny(attention="uvid")
    with pytest.raises(ValueError, match="differential"):
        differential.set_attention("uvic")
    differential.set_attention("uvid", backend="sdpa")  # two softmax maps: SDPA runs them
    assert differential.mid_block.attn.backend == "sdpa"
    second = tiny(attention="uvid2")
    for other in ("uvid", "uvic"):
        with pytest.raises(ValueError, match="differential"):
            second.set_attention(other)
    assert second.attention_modes == ["softmax", "differential_v2", "softmax"]


@pytest.mark.parametrize(("attention", "gate"), [("uvid", "none"), ("uvid2", "none"),
                                                 ("uvic", "headwise")])
def test_attention_analysis_reads_the_new_designs(attention: str, gate: str) -> None:
    """The analysis hooks measure every block: differential blocks report h/2 heads whose
    rows sum to 1 - lambda, gated Cog blocks their signed weights, every block its massive
    activations."""
    from uvic.analysis.capture import BlockRecorder, token_layout

    model = tiny(attention=attention, output_gate=gate, depth=2).eval()
    layout = token_layout(model)
    g = torch.Generator().manual_seed(4)
    x, t = 3 * torch.randn(2, 3, 8, 8, generator=g), torch.rand(2, generator=g) * 999
    with BlockRecorder(model, layout, [(0, 0), (1, 2)]) as recorder, torch.no_grad():
        model(x, t, y=torch.tensor([1, 2]))
    blocks = recorder.means()
    heads = [len(b["heads"]["entropy"]) for b in blocks]
    assert heads == ([4, 2, 4] if attention == "uvid" else [4, 4, 4])
    assert blocks[0]["heads"]["negative_mass"] == [0.0] * 4
    if attention == "uvid":
        lam = float(model.mid_block.attn.diff.lam().detach())
        assert blocks[1]["heads"]["row_sum"] == pytest.approx([1 - lam] * 2, abs=1e-5)
    elif attention == "uvid2":  # rows sum to 1 - lambda, about 1/2 at the initial weights
        assert all(0.4 < s < 0.6 for s in blocks[1]["heads"]["row_sum"])
    else:
        assert all(m > 0 for m in blocks[1]["heads"]["negative_mass"])
    assert all(math.isfinite(b["massive"]["ratio"]) for b in blocks)


def test_flop_count_of_the_new_designs() -> None:
    """Differential blocks weigh values of twice the width in two maps (one more N^2 D
    product each); a gate is one more projection per block, D or one per head wide."""
    from uvic.config import ModelConfig
    from uvic.models.flops import forward_flops, num_tokens

    base = ModelConfig(img_size=32, patch_size=2, embed_dim=512, depth=12, num_heads=8)
    N, D = num_tokens(base), 512

    def flops(**changes: object) -> int:
        return forward_flops(dataclasses.replace(base, **changes))

    assert flops(attention="uvid") - flops() == 11 * 2 * N * N * D
    # V2: a second query (D x D), its scores and weights x V, the lambda projection (h)
    assert flops(attention="uvid2") - flops() == 11 * (2 * N * D * D + 4 * N * N * D
                                                        + 2 * N * D * 8)
    assert flops(attention="uvic") == flops()
    assert flops(output_gate="elementwise") - flops() == 13 * 2 * N * D * D
    assert flops(output_gate="headwise") - flops() == 13 * 2 * N * D * 8
    assert (flops(attention="uvid", output_gate="headwise") - flops(attention="uvid")
            == (2 * 8 + 11 * 4) * 2 * N * D)


@pytest.mark.parametrize(("attention", "gate"), [("uvid", "none"), ("uvit", "headwise"),
                                                 ("uvid", "elementwise"), ("uvid2", "headwise")])
def test_shared_weights_start_as_the_design_free_models(attention: str, gate: str) -> None:
    """Same seed, same shared weights as U-ViT: a design's own weights are drawn after them,
    so comparisons stay paired."""
    plain = tiny(attention="uvit").state_dict()
    model = tiny(attention=attention, output_gate=gate).state_dict()
    shared = [k for k in model if k in plain]
    assert len(shared) == len(plain)
    assert all(torch.equal(model[k], plain[k]) for k in shared)
    own = [k for k in model if k not in plain]
    assert own and all(model[k].std() > 0 or k.endswith(("bias", "norm.weight")) for k in own)


# --------------------------------------------------------------------------- diffusers models


def tiny_dit(seed: int = 0):
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(seed)
    return DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                 num_layers=3, sample_size=8, patch_size=2,
                                 num_embeds_ada_norm=10).eval()


def dit_out(model) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return model(torch.randn(2, 4, 8, 8, generator=g), timestep=torch.tensor([3, 700]),
                 class_labels=torch.tensor([1, 7])).sample


@pytest.mark.parametrize("mode", ["softmax", "cog"])
@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
def test_a_gate_in_a_pretrained_model_starts_as_the_identity_and_learns(mode: str,
                                                                        gate: str) -> None:
    from uvic.models.attention_processor import set_cog_attention

    model = tiny_dit()
    set_cog_attention(model, mode, backend="torch")
    before = dit_out(model).detach()
    changed = set_cog_attention(model, mode, backend="torch", gate=gate)
    assert len(changed) == 3
    out = dit_out(model)
    assert torch.equal(out.detach(), before)  # 2 sigmoid(0) = 1 exactly
    out.square().mean().backward()
    gates = [m.output_gate for m in model.modules() if hasattr(m, "output_gate")]
    assert len(gates) == 3 and all(g.weight.grad.abs().sum() > 0 for g in gates)


def test_differential_in_a_diffusers_module_matches_its_equations() -> None:
    """On diffusers' Attention (separate q, k, v projections): heads 2i and 2i + 1 pair up,
    as the authors' layout; outputs and gradients against the float64 equations."""
    from diffusers.models.attention_processor import Attention as DiffusersAttention

    from uvic.models.attention_processor import set_cog_attention

    torch.manual_seed(3)
    attn = DiffusersAttention(query_dim=24, heads=4, dim_head=6, bias=True).eval()
    holder = torch.nn.ModuleList([torch.nn.ModuleDict({"attn": attn})])
    set_cog_attention(holder, "differential", backend="torch", gate="headwise")
    diff = attn.differential
    with torch.no_grad():  # a gate away from the identity, so that it is checked too
        attn.output_gate.weight.normal_(0, 0.3)

    def formula(x64: torch.Tensor, p: dict) -> torch.Tensor:
        q, k, v = (linear(x64, lin, p) for lin in (attn.to_q, attn.to_k, attn.to_v))
        lam = (torch.exp(p[id(diff.lambda_q1)] @ p[id(diff.lambda_k1)])
               - torch.exp(p[id(diff.lambda_q2)] @ p[id(diff.lambda_k2)]) + lambda_init_at(1))
        heads = []
        for i in range(2):
            q1, q2 = q[..., 12 * i:12 * i + 6], q[..., 12 * i + 6:12 * i + 12]
            k1, k2 = k[..., 12 * i:12 * i + 6], k[..., 12 * i + 6:12 * i + 12]
            a = (torch.softmax(q1 @ k1.transpose(-1, -2) / math.sqrt(6), -1)
                 - lam * torch.softmax(q2 @ k2.transpose(-1, -2) / math.sqrt(6), -1))
            o = a @ v[..., 12 * i:12 * i + 12]
            o = o / torch.sqrt(o.square().mean(-1, keepdim=True) + 1e-5) * p[id(diff.norm.weight)]
            heads.append(o * (1 - lambda_init_at(1)))
        y = torch.cat(heads, dim=-1)
        g = 2 * torch.sigmoid(x64 @ p[id(attn.output_gate.weight)].T
                              + p[id(attn.output_gate.bias)])
        return linear(y * g.repeat_interleave(12, dim=-1), attn.to_out[0], p)

    compare(attn, torch.randn(2, 7, 24), formula)


def test_differential_processor_refuses_what_it_cannot_pair() -> None:
    from uvic.models.attention_processor import DifferentialAttnProcessor, set_cog_attention

    model = tiny_dit()
    with pytest.raises(ValueError, match="gate must be") as err:
        set_cog_attention(model, "cog", gate="everywhere")
    assert "\n" not in str(err.value)
    attn = model.transformer_blocks[0].attn1
    with pytest.raises(ValueError, match="no differential weights"):
        DifferentialAttnProcessor("torch")(attn, torch.randn(1, 16, 16))
    from diffusers.models.attention_processor import Attention as DiffusersAttention

    odd = torch.nn.ModuleList([torch.nn.ModuleDict({"attn": DiffusersAttention(12, heads=3,
                                                                               dim_head=4)})])
    with pytest.raises(ValueError, match="pairs them") as err:
        set_cog_attention(odd, "differential")
    assert not hasattr(odd[0]["attn"], "differential")


# --------------------------------------------------------------------------- toy experiments


def test_toy_differential_and_gate_match_their_equations() -> None:
    """The toy models' differential heads and output gate, against the equations written
    with plain loops (causal, head width 2)."""
    from uvic.analysis.superposition.skip_trigrams import ToyAttentionModel

    torch.manual_seed(5)
    model = ToyAttentionModel(vocab=6, num_heads=2, mode="differential+gate", head_dim=2,
                              init_std=0.5)
    tokens = torch.randint(0, 6, (3, 5))
    x = torch.nn.functional.one_hot(tokens, 6).double()
    p = {n: t.detach().double() for n, t in model.named_parameters()}
    q, k, v = (torch.einsum("bnd,hde->bhne", x, p[f"W_{n}"]) + p[f"b_{n}"][None, :, None]
               for n in "QKV")
    lq1, lk1, lq2, lk2 = p["lambdas"]
    lam = torch.exp(lq1 @ lk1) - torch.exp(lq2 @ lk2) + lambda_init_at(1)
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)

    def softmax_map(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        s = (a @ b.transpose(-1, -2) / math.sqrt(2)).masked_fill(causal, -math.inf)
        return torch.softmax(s, -1)

    a = softmax_map(q[:, 0], k[:, 0]) - lam * softmax_map(q[:, 1], k[:, 1])
    z = a @ torch.cat([v[:, 0], v[:, 1]], -1)  # (P, N, 4)
    z = z / torch.sqrt(z.square().mean(-1, keepdim=True) + 1e-5) * p["norm_weight"]
    z = z * (1 - lambda_init_at(1)) * torch.sigmoid(x @ p["gate"] + p["gate_bias"])
    out = (torch.einsum("bne,eo->bno", z[..., :2], p["W_O"][0])
           + torch.einsum("bne,eo->bno", z[..., 2:], p["W_O"][1]) + p["b_O"])
    torch.testing.assert_close(model(tokens).double(), x + out, rtol=1e-5, atol=1e-6)


def test_toy_designs_share_the_initial_weights_and_learn_a_trigram() -> None:
    from uvic.analysis.superposition import capacity

    recipe = capacity.ToyRecipe(max_steps=600)
    states = {}
    for design in ("softmax", "differential", "cog+gate"):
        torch.manual_seed(11)
        states[design] = dict(capacity.toy_model(6, 2, design, 1, 0.02).named_parameters())
    shared = states["softmax"]
    for state in states.values():
        assert all(torch.equal(state[n], shared[n]) for n in shared)
    row = capacity.run_model("differential", 2, 1, seed=0, recipe=recipe)
    assert row["learnt"] == [True]
    with pytest.raises(ValueError, match="pairs heads"):
        capacity.toy_model(6, 1, "differential", 1, 0.02)
