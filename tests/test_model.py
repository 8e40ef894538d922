"""U-ViT / U-ViC backbone and checkpoint loading, checked against independent references.

The references here are written from the architecture facts of docs/conventions.md
(key names, shapes, token order, long skips, unpatchify) and the attention formulas of
section 1, in float64 with plain torch.nn.functional calls; they never call the model.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor

import uvic_kernels
from uvic.config import load_config
from uvic.config.models import uvit_size
from uvic.models.uvit import UViT, build_model, resolve_attention, timestep_embedding
from uvic.run.weights import (
    CheckpointError,
    LoadResult,
    load_weights,
    read_state_dict,
    save_safetensors,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

# Tiny architectures (img 8, patch 2 -> 16 patches) for the three conditioning modes.
TINY = {
    "uncond": dict(img_size=8, patch_size=2, in_chans=3, embed_dim=32, depth=2, num_heads=2),
    "class": dict(img_size=8, patch_size=2, in_chans=3, embed_dim=32, depth=4, num_heads=2,
                  num_classes=5, mlp_time_embed=True),
    "text": dict(img_size=8, patch_size=2, in_chans=4, embed_dim=32, depth=2, num_heads=2,
                 clip_dim=12, num_clip_token=7),
}


def tiny(kind: str, **overrides) -> UViT:
    torch.manual_seed(0)
    return UViT(**{**TINY[kind], "attention_backend": "torch", **overrides})


def inputs(kind: str, batch: int = 2, dtype: torch.dtype = torch.float32, seed: int = 1):
    """(x, t, context, y) for a tiny architecture; t is on the CIFAR scale 999 * U(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    a = TINY[kind]
    x = torch.randn(batch, a["in_chans"], a["img_size"], a["img_size"], generator=g, dtype=dtype)
    t = 999 * torch.rand(batch, generator=g, dtype=dtype)
    context = y = None
    if a.get("clip_dim", 0) > 0:
        context = torch.randn(batch, a["num_clip_token"], a["clip_dim"], generator=g, dtype=dtype)
    if a.get("num_classes", -1) > 0:
        y = torch.randint(0, a["num_classes"], (batch,), generator=g)
    return x, t, context, y


# --------------------------------------------------------------------------- references


def release_keys(
    img_size: int, patch_size: int, in_chans: int, embed_dim: int, depth: int,
    mlp_ratio: float = 4.0, qkv_bias: bool = False, mlp_time_embed: bool = False,
    num_classes: int = -1, clip_dim: int = 0, num_clip_token: int = 77, conv: bool = True,
    **_: object,
) -> dict[str, tuple[int, ...]]:
    """Parameter names -> shapes of the released U-ViT, from docs/conventions.md (its H
    models have `conv=False`: no final 3x3 convolution)."""
    D, p, C = embed_dim, patch_size, in_chans
    hidden = int(D * mlp_ratio)
    extras = 1 + (num_classes > 0) + (num_clip_token if clip_dim > 0 else 0)
    keys: dict[str, tuple[int, ...]] = {
        "pos_embed": (1, extras + (img_size // p) ** 2, D),
        "patch_embed.proj.weight": (D, C, p, p),
        "patch_embed.proj.bias": (D,),
    }
    if mlp_time_embed:
        keys |= {"time_embed.0.weight": (4 * D, D), "time_embed.0.bias": (4 * D,),
                 "time_embed.2.weight": (D, 4 * D), "time_embed.2.bias": (D,)}
    if num_classes > 0:
        keys["label_emb.weight"] = (num_classes, D)
    if clip_dim > 0:
        keys |= {"context_embed.weight": (D, clip_dim), "context_embed.bias": (D,)}

    def block(prefix: str, skip: bool) -> None:
        keys.update({f"{prefix}.norm1.weight": (D,), f"{prefix}.norm1.bias": (D,)})
        keys[f"{prefix}.attn.qkv.weight"] = (3 * D, D)
        if qkv_bias:
            keys[f"{prefix}.attn.qkv.bias"] = (3 * D,)
        keys.update({f"{prefix}.attn.proj.weight": (D, D), f"{prefix}.attn.proj.bias": (D,),
                     f"{prefix}.norm2.weight": (D,), f"{prefix}.norm2.bias": (D,),
                     f"{prefix}.mlp.fc1.weight": (hidden, D), f"{prefix}.mlp.fc1.bias": (hidden,),
                     f"{prefix}.mlp.fc2.weight": (D, hidden), f"{prefix}.mlp.fc2.bias": (D,)})
        if skip:
            keys.update({f"{prefix}.skip_linear.weight": (D, 2 * D),
                         f"{prefix}.skip_linear.bias": (D,)})

    for i in range(depth // 2):
        block(f"in_blocks.{i}", skip=False)
    block("mid_block", skip=False)
    for i in range(depth // 2):
        block(f"out_blocks.{i}", skip=True)
    keys |= {"norm.weight": (D,), "norm.bias": (D,),
             "decoder_pred.weight": (p * p * C, D), "decoder_pred.bias": (p * p * C,)}
    if conv:
        keys |= {"final_layer.weight": (C, C, 3, 3), "final_layer.bias": (C,)}
    return keys


def random_release_state_dict(arch: dict, seed: int = 0) -> dict[str, Tensor]:
    """Release-named float64 tensors with random values (every bias and norm non-trivial)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, shape in release_keys(**arch).items():
        w = 0.2 * torch.randn(shape, generator=g, dtype=torch.float64)
        sd[name] = w + 1.0 if name.endswith(("norm1.weight", "norm2.weight", "norm.weight")) else w
    return sd


def ref_attention(q: Tensor, k: Tensor, v: Tensor, mode: str, bias: Tensor | None = None
                  ) -> Tensor:
    """Softmax, Cog, expressive or sigmoid attention (docs/cog_attention.md) on (B, H, N, d);
    sigmoid's bias: ``bias`` per head, else -log N."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mode == "sigmoid":
        b = -math.log(k.shape[-2]) if bias is None else bias.reshape(-1, 1, 1)
        a = torch.sigmoid(s + b)
    elif mode == "softmax":
        a = torch.softmax(s, dim=-1)
    elif mode == "expressive":
        e = s * s / (1 + s * s)
        a = e / e.sum(dim=-1, keepdim=True)  # no all-zero rows here
    else:
        a = torch.sign(s) * torch.softmax(s.abs(), dim=-1)
    return a @ v


def ref_time_embedding(t: Tensor, dim: int) -> Tensor:
    """[cos(t w_0..w_{h-1}), sin(...)] with w_i = 10000^(-i/h), h = dim // 2 (float64)."""
    half = dim // 2
    out = torch.zeros(t.shape[0], dim, dtype=torch.float64)
    for i in range(half):
        w = 10000.0 ** (-i / half)
        out[:, i] = torch.cos(t.double() * w)
        out[:, half + i] = torch.sin(t.double() * w)
    return out


def ref_uvit(sd: dict[str, Tensor], arch: dict, modes: list[str], x, t, context=None, y=None):
    """The released U-ViT forward written out with functional calls on a state dict."""
    D, p, C, heads = arch["embed_dim"], arch["patch_size"], arch["in_chans"], arch["num_heads"]
    B, H = x.shape[0], arch["img_size"]
    n = H // p
    ln = lambda h, name: F.layer_norm(h, (D,), sd[f"{name}.weight"], sd[f"{name}.bias"])  # noqa: E731
    lin = lambda h, name: F.linear(h, sd[f"{name}.weight"], sd.get(f"{name}.bias"))  # noqa: E731

    patches = F.conv2d(x, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=p)
    patches = patches.reshape(B, D, n * n).transpose(1, 2)
    time = ref_time_embedding(t, D)
    if "time_embed.0.weight" in sd:
        time = lin(F.silu(lin(time, "time_embed.0")), "time_embed.2")
    tokens = [time[:, None]]
    if y is not None:
        tokens = [sd["label_emb.weight"][y][:, None], *tokens]
    if context is not None:
        tokens.append(lin(context, "context_embed"))
    h = torch.cat([*tokens, patches], dim=1) + sd["pos_embed"]
    extras = h.shape[1] - n * n

    def block(h, name, mode, skip=None):
        if skip is not None:
            h = lin(torch.cat([h, skip], dim=-1), f"{name}.skip_linear")
        qkv = lin(ln(h, f"{name}.norm1"), f"{name}.attn.qkv")
        qkv = qkv.reshape(B, h.shape[1], 3, heads, D // heads).permute(2, 0, 3, 1, 4)
        a = ref_attention(qkv[0], qkv[1], qkv[2], mode, sd.get(f"{name}.attn.sigmoid_bias"))
        a = a.transpose(1, 2).reshape(B, -1, D)
        h = h + lin(a, f"{name}.attn.proj")
        m = lin(F.gelu(lin(ln(h, f"{name}.norm2"), f"{name}.mlp.fc1")), f"{name}.mlp.fc2")
        return h + m

    half = arch["depth"] // 2
    names = [f"in_blocks.{i}" for i in range(half)]
    names += ["mid_block"] + [f"out_blocks.{i}" for i in range(half)]
    stack = []
    for i in range(half):
        h = block(h, names[i], modes[i])
        stack.append(h)
    h = block(h, "mid_block", modes[half])
    for i in range(half):
        h = block(h, names[half + 1 + i], modes[half + 1 + i], skip=stack.pop())
    h = lin(ln(h, "norm"), "decoder_pred")[:, extras:]  # (B, n*n, p*p*C), features (p1 p2 C)
    img = h.reshape(B, n, n, p, p, C).permute(0, 5, 1, 3, 2, 4).reshape(B, C, H, H)
    if "final_layer.weight" not in sd:  # conv=False
        return img
    return F.conv2d(img, sd["final_layer.weight"], sd["final_layer.bias"], padding=1)


# --------------------------------------------------------------------------- architecture


def test_build_model_takes_the_model_section_whole() -> None:
    """Every ModelConfig field is a UViT argument of the same name (build_model passes the
    section as it is): a new field cannot be left out of the network."""
    import dataclasses
    import inspect

    from uvic.config import ModelConfig

    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    assert sorted(fields) == sorted(inspect.signature(UViT).parameters)
    cfg = ModelConfig(img_size=8, patch_size=2, embed_dim=16, depth=2, num_heads=2,
                      attention="uvic", attention_backend="torch", mlp_ratio=2.0,
                      pos_embed_init="sincos")
    model = build_model(cfg)
    assert model.attention_modes == ["softmax", "cog", "softmax"]
    assert model.blocks()[0].mlp.fc1.out_features == 32  # mlp_ratio reached the blocks


@pytest.mark.parametrize(("name", "count"), [
    ("cifar10_uvit", 44_255_328), ("cifar10_uvic", 44_255_328),
    ("mscoco_uvit", 44_692_644), ("mscoco_uvic", 44_692_644),
])
def test_parameter_count_and_release_keys(name: str, count: int) -> None:
    cfg = load_config(CONFIGS / f"{name}.py")
    with torch.device("meta"):
        model = build_model(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == count
    expected = release_keys(**dataclasses.asdict(cfg.model))
    assert sum(math.prod(s) for s in expected.values()) == count  # the key list itself
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == expected and list(got) == list(expected)  # same names, shapes and order


@pytest.mark.parametrize("kind", ["class", "text"])
def test_tiny_release_keys(kind: str) -> None:
    model = tiny(kind)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == release_keys(**TINY[kind])


def test_attention_presets_and_lists() -> None:
    uvic = resolve_attention("uvic", 12)
    assert len(uvic) == 13 and uvic.count("cog") == 11
    assert uvic[0] == uvic[-1] == "softmax" and set(uvic[1:-1]) == {"cog"}
    assert resolve_attention("uvit", 12) == ["softmax"] * 13
    assert resolve_attention(" UViC ", 2) == ["softmax", "cog", "softmax"]
    assert resolve_attention("cog, softmax,cog", 2) == ["cog", "softmax", "cog"]
    assert resolve_attention(["cog", "cog", "cog"], 2) == ["cog"] * 3
    assert resolve_attention("uvie", 3) == ["softmax", "expressive", "expressive", "softmax"]
    assert resolve_attention("uvis", 2) == ["softmax", "sigmoid", "softmax"]
    assert resolve_attention("sigmoid,cog,softmax", 2) == ["sigmoid", "cog", "softmax"]

    model = build_model(load_config(CONFIGS / "cifar10_uvic.py").model)
    assert model.attention_modes == uvic
    assert model.in_blocks[0].attn.mode == "softmax" and model.out_blocks[-1].attn.mode == "softmax"
    assert model.mid_block.attn.mode == "cog" and model.in_blocks[1].attn.mode == "cog"
    model.set_attention("uvit", backend="triton")
    assert model.attention_modes == ["softmax"] * 13
    assert {blk.attn.backend for blk in model.blocks()} == {"triton"}


@pytest.mark.parametrize(("spec", "needle"), [
    ("uvitt", "'uvitt'"), ("cog,softmax", "2 entries"), ("cog", "1 entries"),
    ("softmax,linear,cog", "'linear'"), ("", "''"),
])
def test_bad_attention_spec(spec: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        resolve_attention(spec, 2)
    with pytest.raises(ValueError, match=r"model\.attention"):
        tiny("uncond", attention=spec)


@pytest.mark.parametrize(("overrides", "needle"), [
    (dict(depth=3), "model.depth=3"), (dict(num_heads=3), "model.num_heads=3"),
    (dict(patch_size=3), "model.patch_size=3"), (dict(attention_backend="cuda"), "'cuda'"),
    (dict(num_classes=10, clip_dim=8), "num_classes and model.clip_dim"),
    (dict(pos_embed_init="rope"), "model.pos_embed_init='rope'"),
    (dict(pos_embed_init="sincos", embed_dim=18, num_heads=2), "divisible by 4, got 18"),
    (dict(sigmoid_bias=float("nan")), "model.sigmoid_bias=nan: must be a finite number"),
])
def test_bad_architecture(overrides: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        tiny("uncond", **overrides)


def test_uvit_size_presets() -> None:
    assert uvit_size("small") == {"embed_dim": 512, "depth": 12, "num_heads": 8}
    assert uvit_size("M") == {"embed_dim": 768, "depth": 16, "num_heads": 12}
    assert uvit_size("large") == {"embed_dim": 1024, "depth": 20, "num_heads": 16}
    assert uvit_size("H") == {"embed_dim": 1152, "depth": 28, "num_heads": 16}
    cfg = load_config(CONFIGS / "cifar10_uvit.py").model
    assert uvit_size("S") == {"embed_dim": cfg.embed_dim, "depth": cfg.depth,
                              "num_heads": cfg.num_heads}
    with pytest.raises(ValueError, match="'XL'"):
        uvit_size("XL")


def test_release_initialisation() -> None:
    torch.manual_seed(0)
    model = build_model(load_config(CONFIGS / "cifar10_uvit.py").model)
    sd = model.state_dict()
    qkv = torch.cat([sd[f"in_blocks.{i}.attn.qkv.weight"].flatten() for i in range(6)])
    assert abs(qkv.std().item() - 0.02) < 5e-4 and qkv.abs().max() < 2.0
    assert abs(sd["pos_embed"].std().item() - 0.02) < 1e-3
    assert torch.all(sd["out_blocks.3.skip_linear.bias"] == 0)
    assert torch.all(sd["norm.weight"] == 1) and torch.all(sd["mid_block.norm2.bias"] == 0)
    # Convs keep PyTorch's default (kaiming-uniform): bound 1/sqrt(fan_in) = 1/sqrt(3*2*2).
    w = sd["patch_embed.proj.weight"]
    assert w.abs().max() <= 1 / math.sqrt(12) and w.std() > 0.1
    assert model.no_weight_decay() == {"pos_embed"}


def test_sincos_position_init() -> None:
    """pos_embed_init="sincos": patch rows hold the 2D sine-cosine code (written out here
    per patch and channel), everything else is drawn exactly as with the release's init."""
    grid, dim = 4, 16
    normal = tiny("class", img_size=8, patch_size=2, embed_dim=dim, num_heads=2)
    sincos = tiny("class", img_size=8, patch_size=2, embed_dim=dim, num_heads=2,
                  pos_embed_init="sincos")
    a, b = normal.state_dict(), sincos.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        if key != "pos_embed":
            assert torch.equal(a[key], b[key]), key
    extras = sincos.extras  # time and label tokens keep their trunc-normal rows
    assert torch.equal(a["pos_embed"][0, :extras], b["pos_embed"][0, :extras])
    code = b["pos_embed"][0, extras:]
    assert code.shape == (grid * grid, dim)
    quarter = dim // 4
    for patch in range(grid * grid):
        row, col = divmod(patch, grid)  # PatchEmbed flattens row-major
        for k in range(quarter):
            w = 10000.0 ** (-k / quarter)
            expect = [math.sin(col * w), math.cos(col * w), math.sin(row * w), math.cos(row * w)]
            got = [code[patch, k], code[patch, quarter + k], code[patch, 2 * quarter + k],
                   code[patch, 3 * quarter + k]]
            for g, e in zip(got, expect):
                assert abs(g.item() - e) < 1e-6, (patch, k)
    assert sincos.pos_embed.requires_grad  # still learned


def test_timestep_embedding_formula() -> None:
    t = torch.tensor([0.0, 0.37, 1.0, 17.5, 998.999], dtype=torch.float64)
    for dim in (32, 33, 512):
        emb = timestep_embedding(t, dim)
        ref = ref_time_embedding(t, dim)
        assert emb.dtype == torch.float64 and emb.shape == (5, dim)
        torch.testing.assert_close(emb, ref, rtol=0, atol=1e-12)
    # The float32 path (the release's precision) stays close on the CIFAR scale 999 t.
    torch.testing.assert_close(timestep_embedding(t.float(), 512).double(),
                               ref_time_embedding(t, 512), rtol=0, atol=2e-4)


# --------------------------------------------------------------------------- forward


@pytest.mark.parametrize("kind", ["uncond", "class", "text"])
def test_forward_matches_reference(kind: str, tmp_path: Path) -> None:
    """A release-format .pth loads strictly; the model (float32, the kernels' widest dtype)
    equals the float64 functional reference on the same weights."""
    arch = TINY[kind]
    sd = random_release_state_dict(arch)
    torch.save(sd, tmp_path / "nnet_ema.pth")
    model = tiny(kind)
    load_weights(model, tmp_path / "nnet_ema.pth")
    sd = {k: v.double() for k, v in model.state_dict().items()}  # the float32-rounded weights
    x, t, context, y = inputs(kind, dtype=torch.float64)
    for spec in ("uvit", "uvic", "uvie", "uvis", ",".join(["cog"] * (arch["depth"] + 1))):
        model.set_attention(spec)
        modes = resolve_attention(spec, arch["depth"])
        with torch.no_grad():
            out = model(x.float(), t, context=None if context is None else context.float(),
                            y=y).sample
        ref = ref_uvit(sd, arch, modes, x, t, context, y)
        assert out.shape == x.shape and out.dtype == torch.float32
        assert ref.abs().max() > 0.5  # a non-trivial output
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("kind", ["uncond", "class", "text"])
def test_backward_reaches_every_parameter(kind: str) -> None:
    model = tiny(kind, attention="uvic")
    x, t, context, y = inputs(kind)
    out = model(x, t, context=context, y=y).sample
    assert out.shape == x.shape
    out.square().mean().backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert no_grad == []


def test_scalar_time_and_input_errors() -> None:
    model = tiny("uncond")
    x, t, _, _ = inputs("uncond")
    with torch.no_grad():
        torch.testing.assert_close(model(x, 500.0).sample, model(x, torch.full((2,), 500.0)).sample)
        with pytest.raises(ValueError, match=r"t must be a scalar or shape \(2,\)"):
            model(x, torch.ones(3))
        with pytest.raises(ValueError, match=r"x must have shape \(B, 3, 8, 8\)"):
            model(x[:, :2], t)
        with pytest.raises(ValueError, match="not text-conditional"):
            model(x, t, context=torch.zeros(2, 7, 12))
        with pytest.raises(ValueError, match="not class-conditional"):
            model(x, t, y=torch.zeros(2, dtype=torch.long))
        text = tiny("text")
        xt, tt, ctx, _ = inputs("text")
        with pytest.raises(ValueError, match="needs context"):
            text(xt, tt)
        with pytest.raises(ValueError, match=r"context must have shape \(2, 7, 12\)"):
            text(xt, tt, context=ctx[:, :5])
        with pytest.raises(ValueError, match="needs y"):
            tiny("class")(x, t)


def test_uvit_and_uvic_weights_interchange() -> None:
    uvit, uvic = tiny("text", attention="uvit"), tiny("text", attention="uvic")
    torch.manual_seed(5)
    uvic_fresh = tiny("text", attention="uvic")
    uvic_fresh.load_state_dict(uvit.state_dict(), strict=True)
    uvit.load_state_dict(uvic.state_dict(), strict=True)
    assert uvic_fresh.attention_modes == ["softmax", "cog", "softmax"]  # loading keeps modes
    x, t, ctx, _ = inputs("text")
    with torch.no_grad():
        a, b = uvit(x, t, context=ctx).sample, uvic(x, t, context=ctx).sample
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    assert (a - b).abs().max() > 1e-4  # same weights, different attention


def test_sigmoid_bias_settings(tmp_path: Path) -> None:
    """U-ViS: the fixed bias (default -log N, N the model's tokens) and the learnable one,
    a parameter (h,) per sigmoid block only, starting at that value, which trains, saves
    and loads, and equals the functional reference; U-ViT weights load into it with
    strict=False only for the new parameters."""
    x, t, _, _ = inputs("uncond", dtype=torch.float64)
    fixed = tiny("uncond", attention="uvis")
    n_tokens = 1 + (8 // 2) ** 2
    assert fixed.mid_block.attn.sigmoid_bias is None  # -log N at run time
    assert tiny("uncond", attention="uvis", sigmoid_bias=2.0).mid_block.attn.sigmoid_bias == 2.0
    assert not any("sigmoid_bias" in k for k in fixed.state_dict())
    learnable = tiny("uncond", attention="uvis", sigmoid_bias_learnable=True)
    params = {k: v for k, v in learnable.state_dict().items() if "sigmoid_bias" in k}
    assert list(params) == ["mid_block.attn.sigmoid_bias"]  # blocks 0 and 2: softmax
    assert torch.equal(params["mid_block.attn.sigmoid_bias"],
                       torch.full((2,), -math.log(n_tokens)))
    with torch.no_grad():  # same start: the same function as the fixed -log N
        torch.testing.assert_close(learnable(x.float(), t).sample, fixed(x.float(), t).sample)
    out = learnable(x.float(), t).sample
    out.square().mean().backward()
    assert learnable.mid_block.attn.sigmoid_bias.grad.abs().min() > 0
    # a given bias; the functional reference with the learned values
    other = tiny("uncond", attention="uvis", sigmoid_bias=-1.0, sigmoid_bias_learnable=True)
    assert torch.equal(other.mid_block.attn.sigmoid_bias, torch.full((2,), -1.0))
    with torch.no_grad():
        other.mid_block.attn.sigmoid_bias.copy_(torch.tensor([0.5, -3.0]))
        sd = {k: v.double() for k, v in other.state_dict().items()}
        ref = ref_uvit(sd, TINY["uncond"], ["softmax", "sigmoid", "softmax"], x, t)
        torch.testing.assert_close(other(x.float(), t).sample.double(), ref, rtol=0,
                                   atol=2e-5)
    # diffusers save / load keeps the setting and the learned values
    other.save_pretrained(tmp_path / "uvis")
    loaded = UViT.from_pretrained(tmp_path / "uvis")
    assert loaded.config.sigmoid_bias == -1.0 and loaded.config.sigmoid_bias_learnable
    assert torch.equal(loaded.mid_block.attn.sigmoid_bias,
                       other.mid_block.attn.sigmoid_bias)
    # switching a learnable model's blocks to sigmoid gives them a bias of their own
    other.set_attention("sigmoid,sigmoid,softmax")
    assert torch.equal(other.in_blocks[0].attn.sigmoid_bias, torch.full((2,), -1.0))
    missing = tiny("uncond", attention="uvis", sigmoid_bias_learnable=True).load_state_dict(
        tiny("uncond").state_dict(), strict=False).missing_keys
    assert missing == ["mid_block.attn.sigmoid_bias"]


def test_triton_kernel_matches_torch_path() -> None:
    """The fused kernel (Triton interpreter on CPU, set by conftest) gives the same output."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, t, _, _ = (v.to(device) if v is not None else v for v in inputs("uncond", batch=1))
    for spec in ("uvic", "uvis"):
        model = tiny("uncond", attention=spec).to(device)
        with torch.no_grad():
            ref = model(x, t).sample
            model.set_attention(spec, backend="triton")
            out = model(x, t).sample
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_grad_checkpointing_same_gradients() -> None:
    grads, saved = [], []
    for ckpt in (False, True):
        model = tiny("text", attention="uvic", grad_checkpointing=ckpt)
        x, t, ctx, _ = inputs("text")
        count = [0]

        def pack(tensor: Tensor, count: list[int] = count) -> Tensor:
            count[0] += 1
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model(x, t, context=ctx).sample.square().mean()
        loss.backward()
        saved.append(count[0])
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert saved[1] < saved[0] / 2  # block activations are recomputed, not stored
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)


def test_autocast_bf16_attention_runs_in_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    kernel = uvic_kernels.attention

    def recording(q, k, v, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype, kwargs["mode"]))
        return kernel(q, k, v, **kwargs)

    monkeypatch.setattr(uvic_kernels, "attention", recording)
    model = tiny("uncond", attention="uvic", grad_checkpointing=True)
    x, t, _, _ = inputs("uncond")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, t).sample
    out.float().square().mean().backward()
    # 3 blocks forward + 3 recomputed by checkpointing in backward
    assert len(seen) == 6 and {s[:3] for s in seen} == {(torch.bfloat16,) * 3}
    assert [s[3] for s in seen[:3]] == ["softmax", "cog", "softmax"]
    assert torch.isfinite(out).all() and model.in_blocks[0].attn.qkv.weight.grad is not None


@pytest.mark.slow
def test_torch_compile_training_step_matches_eager() -> None:
    """Forward and backward through inductor (the kernel's fake ops must match the real
    ones, strides included) give the eager model's gradients, in one graph with gradient
    checkpointing too (the blocks' recomputation is traced, not a graph break; the plain
    path's compiled training: tests/test_compile.py)."""
    model = tiny("uncond", attention="uvic", grad_checkpointing=True)
    x, t, _, _ = inputs("uncond")
    x = x.permute(0, 1, 3, 2)  # non-contiguous input: q/k/v and grads take odd strides
    model(x, t).sample.square().mean().backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    compiled(x, t).sample.square().mean().backward()
    for p, g in zip(model.parameters(), eager):
        torch.testing.assert_close(p.grad, g)


@pytest.mark.slow
def test_torch_compile_matches_eager(tmp_path: Path) -> None:
    model = tiny("uncond", attention="uvic").eval()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    x, t, _, _ = inputs("uncond")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, t).sample, model(x, t).sample)
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    torch.save(compiled.state_dict(), tmp_path / "compiled.pth")  # `_orig_mod.` keys
    fresh = _different("uncond")
    fresh.set_attention("uvic")
    load_weights(fresh, tmp_path / "compiled.pth")
    with torch.no_grad():
        torch.testing.assert_close(fresh(x, t).sample, model(x, t).sample, rtol=0, atol=0)


# --------------------------------------------------------------------------- checkpoints


def _different(kind: str) -> UViT:
    torch.manual_seed(123)
    return UViT(**{**TINY[kind], "attention_backend": "torch"})


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_checkpoint_round_trip(suffix: str, tmp_path: Path) -> None:
    src, dst = tiny("text"), _different("text")
    path = tmp_path / f"weights{suffix}"
    if suffix == ".pth":
        torch.save(src.state_dict(), path)
    else:
        save_safetensors(src, path, metadata={"step": "7"})
        with safe_open(str(path), "pt") as f:
            assert f.metadata() == {"step": "7"}
    assert isinstance(load_weights(dst, path), LoadResult)
    for (name, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(a, b), name
    x, t, ctx, _ = inputs("text")
    with torch.no_grad():
        assert torch.equal(src(x, t, context=ctx).sample, dst(x, t, context=ctx).sample)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left


def test_checkpoint_wrappers_and_prefixes(tmp_path: Path) -> None:
    src = tiny("uncond")
    sd = src.state_dict()
    torch.save({"ema": {f"module.{k}": v for k, v in sd.items()}, "step": torch.tensor(3)},
               tmp_path / "wrapped.pth")
    dst = _different("uncond")
    load_weights(dst, tmp_path / "wrapped.pth")
    assert all(torch.equal(sd[k], v) for k, v in dst.state_dict().items())

    torch.save({"model": sd, "ema": sd}, tmp_path / "both.pth")
    with pytest.raises(CheckpointError, match=r"several state dicts \['ema', 'model'\]|"
                                              r"several state dicts \['model', 'ema'\]"):
        load_weights(dst, tmp_path / "both.pth")
    load_weights(dst, tmp_path / "both.pth", key="ema")
    torch.save({"optimizer": {"lr": 1.0}}, tmp_path / "other.pth")
    with pytest.raises(CheckpointError, match="not a plain state dict"):
        read_state_dict(tmp_path / "other.pth")


def test_checkpoint_mismatches_named(tmp_path: Path) -> None:
    sd = tiny("uncond").state_dict()
    sd.pop("mid_block.attn.proj.bias")
    sd["extra.weight"] = torch.zeros(2)
    torch.save(sd, tmp_path / "bad.pth")
    dst = _different("uncond")
    with pytest.raises(CheckpointError) as err:
        load_weights(dst, tmp_path / "bad.pth")
    msg = str(err.value)
    assert "missing keys (1): mid_block.attn.proj.bias" in msg
    assert "unexpected keys (1): extra.weight" in msg and "\n" not in msg

    before = dst.state_dict()["mid_block.attn.proj.bias"].clone()
    result = load_weights(dst, tmp_path / "bad.pth", strict=False)
    assert result == LoadResult(missing=["mid_block.attn.proj.bias"], unexpected=["extra.weight"])
    assert torch.equal(dst.state_dict()["mid_block.attn.proj.bias"], before)
    assert torch.equal(dst.state_dict()["pos_embed"], sd["pos_embed"])

    # A model of another shape: the mismatch names key and both shapes.
    save_safetensors(tiny("uncond", embed_dim=64), tmp_path / "wide.safetensors")
    with pytest.raises(CheckpointError, match=r"pos_embed: file \(1, 17, 64\) vs model "
                                              r"\(1, 17, 32\)"):
        load_weights(dst, tmp_path / "wide.safetensors", strict=False)


def test_checkpoint_file_errors(tmp_path: Path) -> None:
    model = tiny("uncond")
    with pytest.raises(CheckpointError, match=r"checkpoint not found: .*nope\.pth"):
        load_weights(model, tmp_path / "nope.pth")
    (tmp_path / "w.npz").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"unknown checkpoint format '\.npz'"):
        load_weights(model, tmp_path / "w.npz")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match=r"junk\.safetensors: not a readable"):
        load_weights(model, tmp_path / "junk.safetensors")
    (tmp_path / "junk.pth").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match=r"junk\.pth: torch\.load failed"):
        load_weights(model, tmp_path / "junk.pth")


def test_save_safetensors_is_atomic(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_safetensors({"a": torch.ones(2)}, path)
    with pytest.raises(CheckpointError, match="entry 'b' is not a tensor"):
        save_safetensors({"a": torch.zeros(2), "b": 3}, path)
    with pytest.raises(CheckpointError, match="metadata 'step' must map str to str"):
        save_safetensors({"a": torch.zeros(2)}, path, metadata={"step": 3})
    assert torch.equal(read_state_dict(path)["a"], torch.ones(2))  # old file untouched
    compiled_keys = {"_orig_mod.a": torch.full((2,), 2.0)}
    save_safetensors(compiled_keys, path)  # overwrite; wrapper prefix stripped
    assert list(read_state_dict(path)) == ["a"] and len(list(tmp_path.iterdir())) == 1


def test_sdpa_backend_runs_softmax_blocks_and_refuses_cog() -> None:
    """attention_backend='sdpa' (PyTorch's softmax attention) as a baseline for U-ViT:
    same outputs as our kernels' softmax; a Cog block refuses it, naming the blocks."""
    model = tiny("text", attention="uvit")
    x, t, context, _ = inputs("text")
    with torch.no_grad():
        ours = model(x, t, context=context).sample
        model.set_attention("uvit", backend="sdpa")
        baseline = model(x, t, context=context).sample
    assert torch.allclose(baseline, ours, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError,
                       match=r"'sdpa' runs softmax, differential and differential_v2 "
                             r"attention only.*blocks \[1\]"):
        model.set_attention("uvic")
    with pytest.raises(ValueError, match=r"attention_backend='sdpa'.*'cog'"):
        tiny("uncond", attention="uvic", attention_backend="sdpa")


def test_the_models_settings_are_one_list() -> None:
    """ModelConfig's fields are UViT's signature (names, defaults, keyword-only) and the
    config diffusers records; an unknown setting is refused by name."""
    import dataclasses
    import inspect

    from uvic.config import ModelConfig

    fields = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    parameters = list(inspect.signature(UViT.__init__).parameters.values())[1:]
    assert {p.name: p.default for p in parameters} == fields
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters)
    model = UViT(img_size=8, patch_size=2, embed_dim=16, depth=2, num_heads=2)
    assert {k: v for k, v in model.config.items() if not k.startswith("_")} == {
        **fields, "img_size": 8, "patch_size": 2, "embed_dim": 16, "depth": 2, "num_heads": 2}
    with pytest.raises(TypeError, match="embed_dims"):
        UViT(embed_dims=16)
