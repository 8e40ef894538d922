"""Attention analysis: metrics on hand-made matrices, hook capture, schema, end to end, CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import load_script
from safetensors.torch import save_file

from uvic.analysis import (
    HEAD_METRICS,
    analyze,
    attention_weights,
    check_result,
    load_inputs,
    load_models,
    save_figures,
    spread_timesteps,
)
from uvic.analysis import metrics as M
from uvic.analysis.capture import TokenLayout, row_metrics, token_layout
from uvic.config import load_config
from uvic.files import save_config, write_json
from uvic.models.uvit import Attention, build_model
from uvic_kernels.modes import MODES as KERNEL_MODES

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.img_size=8", "model.patch_size=2", "model.embed_dim=16", "model.depth=2",
        "model.num_heads=2", "model.attention_backend=torch", "data.num_images=4"]


def tiny_cfg(attention: str = "uvit", text: bool = False):
    if text:  # latent + text layout: 4 latent channels, 5 context tokens of width 12
        return load_config(ROOT / "configs/mscoco_uvit.py", [
            *TINY, "model.in_chans=4", "model.clip_dim=12", "model.num_clip_token=5",
            "model.mlp_time_embed=false", f"model.attention={attention}"])
    return load_config(ROOT / "configs/quickstart.py", [*TINY, f"model.attention={attention}"])


def tiny_model(attention: str, text: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    return build_model(tiny_cfg(attention, text))


# --------------------------------------------------------------------------- metrics


def test_uniform_row_has_entropy_log_n():
    a = torch.full((1, 1, 3, 10), 0.1)
    assert torch.allclose(M.entropy(a), torch.full((1, 1, 3), math.log(10)))
    assert torch.allclose(M.effective_tokens(a), torch.full((1, 1, 3), 10.0))
    assert M.negative_mass(a).abs().max() == 0 and M.negative_fraction(a).abs().max() == 0


def test_one_hot_row():
    a = torch.zeros(1, 1, 1, 6)
    a[..., 2] = 1.0
    assert M.entropy(a).item() == pytest.approx(0.0, abs=1e-7)
    assert M.effective_tokens(a).item() == pytest.approx(1.0)
    assert M.key_share(a, 2).item() == 1.0 and M.key_share(a, 0).item() == 0.0
    assert M.key_share(a, slice(1, 4)).item() == 1.0


def test_row_with_known_negative_share():
    a = torch.tensor([0.5, -0.25, 0.25, 0.0]).view(1, 1, 1, 4)
    assert M.negative_mass(a).item() == pytest.approx(0.25)
    assert M.negative_fraction(a).item() == pytest.approx(0.25)
    assert M.entropy(a).item() == pytest.approx(1.5 * math.log(2))  # |A| = (1/2, 1/4, 1/4, 0)
    assert M.key_share(a, 1).item() == pytest.approx(0.25)  # a share of |A|, not signed
    # unnormalised rows give the same shares: the metrics normalise |A| per row
    assert M.entropy(4 * a).item() == pytest.approx(M.entropy(a).item())


def test_all_zero_row_counts_as_no_attention():
    a = torch.zeros(1, 1, 2, 5)
    for fn in (M.negative_mass, M.negative_fraction, M.entropy):
        assert torch.equal(fn(a), torch.zeros(1, 1, 2))


def test_sink_share_counts_heads_strictly_above_threshold():
    assert M.sink_share(torch.tensor([0.5, 0.1, 0.31, 0.3])) == 0.5
    assert M.sink_share(torch.tensor([0.5, 0.1]), threshold=0.05) == 1.0


def test_mean_pairwise_cosine():
    same = torch.ones(1, 5, 4)
    assert M.mean_pairwise_cosine(same).item() == pytest.approx(1.0)
    orthogonal = torch.eye(4).unsqueeze(0)
    assert M.mean_pairwise_cosine(orthogonal).item() == pytest.approx(0.0, abs=1e-7)
    opposite = torch.tensor([[[1.0, 2.0], [-2.0, -4.0]]])
    assert M.mean_pairwise_cosine(opposite).item() == pytest.approx(-1.0)
    x = torch.randn(3, 7, 5)
    unit = torch.nn.functional.normalize(x, dim=-1)
    gram = unit @ unit.transpose(1, 2)
    brute = (gram.sum(dim=(1, 2)) - 7) / 42
    assert torch.allclose(M.mean_pairwise_cosine(x), brute, atol=1e-6)


# --------------------------------------------------------------------------- capture


@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_attention_weights_reproduce_the_module(mode):
    """Every mode of the kernels: the captured weights times the module's values, through
    its projection, give the module's output (run by the kernel's torch path)."""
    torch.manual_seed(0)
    attn = Attention(16, num_heads=2, mode=mode, backend="torch")
    x = torch.randn(3, 9, 16)
    a = attention_weights(attn, x)  # (B, h, N, N)
    assert a.shape == (3, 2, 9, 9)
    if mode != "sigmoid":  # the normalised modes' rows sum (in |A|) to 1
        assert torch.allclose(a.abs().sum(-1), torch.ones(3, 2, 9), atol=1e-5)
    assert bool((a < 0).any()) == (mode == "cog")
    v = attn.qkv(x)[..., 32:].reshape(3, 9, 2, 8).transpose(1, 2)  # (B, h, N, d)
    out = attn.proj((a @ v).transpose(1, 2).reshape(3, 9, 16))
    assert torch.allclose(out, attn(x), atol=1e-5)


def test_unknown_mode_is_named():
    attn = Attention(16, num_heads=2)
    attn.mode = "bogus"
    with pytest.raises(ValueError, match="'bogus'"):
        attention_weights(attn, torch.randn(1, 4, 16))


def test_unnormalised_rows_key_weights_and_row_sum():
    """Sigmoid rows: the first/time/text weights are the weights themselves (Gu et al.'s (2024)
    sink measure), not shares; row_sum says what a row adds up to. Normalised rows: the
    two agree and row_sum is 1."""
    layout = TokenLayout(num_tokens=4, num_extras=1, time_index=0, text=(1, 3), grid=(1, 1))
    a = torch.tensor([[0.5, 0.1, 0.1, 0.3], [0.02, 0.01, 0.01, 0.01]])
    raw, shares = row_metrics(a, layout, normalised=False), row_metrics(a, layout)
    assert raw["first_token_weight"].tolist() == pytest.approx([0.5, 0.02])
    assert shares["first_token_weight"].tolist() == pytest.approx([0.5, 0.4])
    assert raw["text_weight"].tolist() == pytest.approx([0.2, 0.02])
    assert raw["row_sum"].tolist() == pytest.approx([1.0, 0.05])
    assert raw["entropy"].tolist() == shares["entropy"].tolist()  # a row's shape either way
    # a sigmoid head that gives the first token 0.02 of weight is no sink, whatever its share
    assert M.sink_share(raw["first_token_weight"][1:]) == 0.0
    assert M.sink_share(shares["first_token_weight"][1:]) == 1.0


def test_sigmoid_blocks_weights_and_bias():
    """attention_weights of a sigmoid block is sigmoid(S + b) with the block's bias: the
    default -log N, a fixed one, or the learned one per head."""
    torch.manual_seed(0)
    x = torch.randn(2, 9, 16)
    attn = Attention(16, num_heads=2, mode="sigmoid")
    q, k, _ = attn.qkv(x).reshape(2, 9, 3, 2, 8).permute(2, 0, 3, 1, 4)
    s = attn.scale * q @ k.transpose(-2, -1)
    with torch.no_grad():
        torch.testing.assert_close(attention_weights(attn, x), torch.sigmoid(s - math.log(9)))
        attn.sigmoid_bias = 1.0
        torch.testing.assert_close(attention_weights(attn, x), torch.sigmoid(s + 1.0))
        attn.sigmoid_bias = torch.nn.Parameter(torch.tensor([-2.0, 3.0]))
        b = torch.tensor([-2.0, 3.0]).reshape(2, 1, 1)
        torch.testing.assert_close(attention_weights(attn, x), torch.sigmoid(s + b))


@pytest.mark.slow
def test_sigmoid_model_end_to_end(tmp_path):
    """U-ViS in the analysis: no negative weights, rows summing to about 1 at init (bias
    -log N), key weights the weights themselves; U-ViT's softmax rows sum to 1."""
    cfg = tiny_cfg()
    images, _ = load_inputs(cfg, 2)
    models = {"U-ViT": tiny_model("uvit"), "U-ViS": tiny_model("uvis")}
    result = analyze(models, cfg, images, num_levels=2)
    check_result(result)
    uvis, uvit = result["models"]["U-ViS"], result["models"]["U-ViT"]
    assert uvis["attention_modes"] == ["softmax", "sigmoid", "softmax"]
    sig = uvis["blocks"][1]
    assert sig["mode"] == "sigmoid" and all(v == 0 for v in sig["mean"]["negative_mass"])
    # scores near 0 at init: each weight ~ sigmoid(-log 17) = 1 / 18, a row ~ 17 / 18
    assert all(0.8 < r < 1.1 for r in sig["mean"]["row_sum"])
    assert all(0.03 < w < 0.08 for w in sig["mean"]["first_token_weight"])
    assert all(r == pytest.approx(1.0) for blk in uvit["blocks"] for r in blk["mean"]["row_sum"])
    assert uvis["blocks"][0]["mean"] == uvit["blocks"][0]["mean"]  # the same softmax block
    paths = save_figures(result, tmp_path / "figures", map_levels=[0])
    assert "heatmap_row_sum" in paths


def test_token_layouts():
    pixel = token_layout(tiny_model("uvit"))
    assert (pixel.num_tokens, pixel.num_extras, pixel.time_index, pixel.text) == (17, 1, 0, None)
    text = token_layout(tiny_model("uvit", text=True))
    assert (text.num_tokens, text.num_extras, text.text, text.grid) == (22, 6, (1, 6), (4, 4))


def test_spread_timesteps():
    assert spread_timesteps(5, 1000) == [99, 299, 499, 699, 899]
    assert spread_timesteps(1, 1000) == [499]


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def pixel_result():
    cfg = tiny_cfg()
    images, contexts = load_inputs(cfg, 4)
    assert contexts is None and images.shape == (4, 3, 8, 8)
    models = {"U-ViT": tiny_model("uvit"), "U-ViC": tiny_model("uvic"),
              "U-ViC again": tiny_model("uvic")}
    result = analyze(models, cfg, images, num_levels=2, batch_size=3)
    for model in models.values():  # hooks are gone, the model is left as it was
        assert all(not blk.attn._forward_pre_hooks and not blk._forward_hooks
                   for blk in model.blocks())
        assert model.training
    return result


@pytest.mark.slow
def test_pixel_models_end_to_end(pixel_result, tmp_path):
    check_result(pixel_result)
    assert pixel_result["noise_levels"][0]["timestep"] == 249
    assert pixel_result["metrics"] == list(HEAD_METRICS)
    uvit, uvic = pixel_result["models"]["U-ViT"], pixel_result["models"]["U-ViC"]
    assert uvic["attention_modes"] == ["softmax", "cog", "softmax"]
    assert len(uvic["sink_share"]) == 2 and all(0 <= s <= 1 for s in uvic["sink_share"])
    assert all(v == 0 for blk in uvit["blocks"] for v in blk["mean"]["negative_mass"])
    cog = uvic["blocks"][1]
    assert cog["mode"] == "cog" and min(cog["mean"]["negative_mass"]) > 0.1
    for blk in uvit["blocks"]:
        assert all(0 < e <= math.log(17) + 1e-6 for e in blk["mean"]["entropy"])
        assert blk["mean"]["time_weight"] == blk["mean"]["first_token_weight"]
        assert all(-1 <= c <= 1 for c in blk["collapse"])
    # every model sees the same images and noise: equal weights give equal numbers
    assert pixel_result["models"]["U-ViC again"]["blocks"] == uvic["blocks"]
    # the JSON round-trips and the figures come from it
    loaded = json.loads(write_json(tmp_path / "a.json", pixel_result, indent=1).read_text())
    check_result(loaded)
    paths = save_figures(loaded, tmp_path / "figures", map_levels=[1])
    assert "overview" in paths and "heatmap_negative_mass" in paths
    assert "massive_activations" in paths and "heatmap_massive_ratio" in paths
    assert "heatmap_text_weight" not in paths  # no text tokens here
    assert sorted(p for p in paths if p.startswith("maps_")) == [
        "maps_U-ViC_again_t749", "maps_U-ViC_t749", "maps_U-ViT_t749"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths.values())


def test_check_result_names_the_bad_key(pixel_result):
    broken = json.loads(json.dumps(pixel_result))
    broken["models"]["U-ViT"]["blocks"][0]["heads"]["entropy"].pop()
    with pytest.raises(ValueError, match=r"models.U-ViT.blocks\[0\].heads.entropy"):
        check_result(broken)
    broken = json.loads(json.dumps(pixel_result))
    del broken["models"]["U-ViT"]["blocks"][1]["heads"]["entropy"]
    with pytest.raises(ValueError, match="'entropy'"):
        check_result(broken)
    del broken["layout"]
    with pytest.raises(ValueError, match="'layout'"):
        check_result(broken)


def test_latent_text_models_end_to_end():
    cfg = tiny_cfg(text=True)
    images, contexts = torch.randn(3, 4, 8, 8), torch.randn(3, 5, 12)
    models = {"uvit": tiny_model("uvit", text=True), "uvic": tiny_model("uvic", text=True)}
    result = analyze(models, cfg, images, contexts, timesteps=[10, 900], queries=[(0, 3)])
    check_result(result)
    assert result["layout"]["text"] == [1, 6] and result["queries"] == [[0, 3]]
    assert [lv["net_time"] for lv in result["noise_levels"]] == [11.0, 901.0]
    blk = result["models"]["uvic"]["blocks"][1]
    assert blk["mode"] == "cog" and min(blk["mean"]["text_weight"]) > 0
    assert len(blk["maps"][0][0]) == 16
    with pytest.raises(ValueError, match="outside"):
        analyze(models, cfg, images, contexts, queries=[(4, 0)])


def test_load_models_takes_an_explicit_pattern(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file(tiny_model("uvit").state_dict(), str(path))
    models = load_models(tiny_cfg(), {"a": path, "b": path}, {"a": "cog,softmax,cog"})
    assert models["a"].attention_modes == ["cog", "softmax", "cog"]
    assert models["b"].attention_modes == ["softmax"] * 3  # the config's pattern
    assert not models["a"].training
    with pytest.raises(ValueError, match="'bogus'"):
        load_models(tiny_cfg(), {"a": path}, {"a": "bogus"})


def test_release_format_checkpoint_and_expressive_pattern(tmp_path):
    """A checkpoint in the U-ViT release's format (a torch.save'd state dict with the
    release's names, as nnet_ema.pth) is analysed under any pattern, expressive too."""
    path = tmp_path / "nnet_ema.pth"
    torch.save({k: v.clone() for k, v in tiny_model("uvit", seed=3).state_dict().items()}, path)
    cfg = tiny_cfg()
    models = load_models(cfg, {"release": path, "as U-ViE": path}, {"as U-ViE": "uvie"})
    images, _ = load_inputs(cfg, 2)
    result = analyze(models, cfg, images, num_levels=2)
    check_result(result)
    release, uvie = result["models"]["release"], result["models"]["as U-ViE"]
    assert release["attention_modes"] == ["softmax"] * 3
    assert uvie["attention_modes"] == ["softmax", "expressive", "softmax"]
    # expressive weights are >= 0: no negative mass; the first block is the same softmax
    assert all(v == 0 for blk in uvie["blocks"] for v in blk["mean"]["negative_mass"])
    assert uvie["blocks"][0]["mean"] == release["blocks"][0]["mean"]
    assert uvie["blocks"][1]["mean"]["entropy"] != release["blocks"][1]["mean"]["entropy"]


# --------------------------------------------------------------------------- command line


def _cli():
    return load_script("scripts/analyze_attention.py").main


@pytest.mark.slow
def test_cli_on_tiny_checkpoints(tmp_path, capsys):
    run = tmp_path / "run_uvic"
    run.mkdir()
    save_file(tiny_model("uvit").state_dict(), str(tmp_path / "uvit.safetensors"))
    save_file(tiny_model("uvic", seed=1).state_dict(), str(run / "ema.safetensors"))
    save_config(tiny_cfg("uvic"), run / "config.json")  # the run's own, as training writes
    sets = [arg for item in TINY for arg in ("--set", item)]
    main = _cli()
    out = tmp_path / "out"
    rc = main(["--config", str(ROOT / "configs/quickstart.py"), *sets, "--num-images", "2",
               "--levels", "1", "--checkpoint", f"U-ViT={tmp_path / 'uvit.safetensors'}",
               str(run / "ema.safetensors"), "--query", "1,2", "--out", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    result = json.loads((out / "attention.json").read_text())
    check_result(result)
    assert result["models"]["run_uvic"]["attention_modes"] == ["softmax", "cog", "softmax"]
    assert result["models"]["U-ViT"]["attention_modes"] == ["softmax"] * 3
    assert (out / "overview.png").is_file() and (out / "massive_activations.png").is_file()
    # the massive activations beside the sink share: one table row per model and block
    rows = {(row[0], row[1]): row for row in map(str.split, printed.out.splitlines())
            if row and row[0] in result["models"]}
    assert len(rows) == 6 and rows["run_uvic", "mid_block"][2] == "cog"
    mid = result["models"]["run_uvic"]["blocks"][1]
    assert float(rows["run_uvic", "mid_block"][4]) == pytest.approx(mid["massive_ratio"][0],
                                                                   abs=0.006)
    assert "massive activations" in printed.out
    rc = main(["--config", str(ROOT / "configs/quickstart.py"), *sets, "--checkpoint",
               f"x={tmp_path / 'missing.safetensors'}", "--out", str(out)])
    assert rc == 2 and "missing.safetensors" in capsys.readouterr().err
    # an explicit --set model.* against the run's own config is refused in one line
    rc = main(["--config", str(ROOT / "configs/quickstart.py"), *sets, "--set",
               "model.attention=uvit", str(run / "ema.safetensors"), "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "model.attention='uvit' (--set)" in err and "model.attention='uvic'" in err
    # unless asked for: then the run's weights are analysed as U-ViT
    rc = main(["--config", str(ROOT / "configs/quickstart.py"), *sets, "--set",
               "model.attention=uvit", "--model-from-config", "--num-images", "2",
               "--levels", "1", str(run / "ema.safetensors"), "--out", str(tmp_path / "o2")])
    assert rc == 0, capsys.readouterr().err
    result = json.loads((tmp_path / "o2" / "attention.json").read_text())
    assert result["models"]["run_uvic"]["attention_modes"] == ["softmax"] * 3


@pytest.mark.parametrize("bad", [["--num-images", "0"], ["--num-images", "-1"],
                                 ["--levels", "0"], ["--batch-size", "0"],
                                 ["--sink-threshold", "nan"], ["--sink-threshold", "2"],
                                 ["--query", "a,b"], ["--levels", "1001"]])
def test_cli_numeric_arguments_fail_in_one_line(tmp_path, capsys, bad):
    """A bad number is one line naming the option, never a traceback, and nothing runs."""
    path = tmp_path / "w.safetensors"
    save_file(tiny_model("uvit").state_dict(), str(path))
    sets = [arg for item in TINY for arg in ("--set", item)]
    main = _cli()
    try:
        rc = main(["--config", str(ROOT / "configs/quickstart.py"), *sets, str(path),
                   "--num-images", "2", *bad, "--out", str(tmp_path / "out")])
    except SystemExit as stop:  # argparse's usage error
        rc = stop.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].count("error") == 1 and not (tmp_path / "out").exists()
    assert bad[0] in err[-1] or "num_levels" in err[-1]
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize("interpolant", ["linear", "trigonometric"])
def test_velocity_models_are_noised_by_their_interpolant(interpolant):
    """A velocity run is analysed at x_t = alpha(t) x0 + sigma(t) e, t = (k + 1) / T, with
    network time 999 t: the same noise draws as the VP levels, read back from them."""
    from uvic.analysis.core import noised_inputs

    eps_cfg = load_config("configs/quickstart.py")
    flow_cfg = load_config("configs/quickstart.py", ["diffusion.objective=velocity",
                                                    "diffusion.min_snr_gamma=0",
                                                    f"diffusion.interpolant={interpolant}"])
    images = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(1)) * 2 - 1
    steps = [99, 499, 899]
    for (x_vp, _, rec_vp), (x_fm, net_t, rec_fm), k in zip(
            noised_inputs(eps_cfg.diffusion, images, steps, seed=5),
            noised_inputs(flow_cfg.diffusion, images, steps, seed=5), steps):
        ab = torch.tensor(rec_vp["alpha_bar"], dtype=torch.float64)
        noise = (x_vp.double() - ab.sqrt() * images.double()) / (1 - ab).sqrt()
        t = (k + 1) / 1000
        a, s = ((1 - t, t) if interpolant == "linear"
                else (math.cos(math.pi * t / 2), math.sin(math.pi * t / 2)))
        torch.testing.assert_close(x_fm.double(), a * images.double() + s * noise,
                                   atol=1e-5, rtol=0)
        assert torch.allclose(net_t, torch.full((2,), 999.0 * t))
        assert rec_fm["alpha_bar"] == pytest.approx(a * a / (a * a + s * s))
