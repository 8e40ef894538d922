"""FD-DINOv2 and precision/recall beside FID (eval.metrics): precision/recall against a
brute-force float64 reference and closed cases, the DINOv2 encoder (timm's class, tiny and
randomly initialised, from a local file, the original checkpoint layout and a hub cache)
against a float64 ViT written here, cached reference statistics keyed by the encoder,
defaults unchanged, and one-line errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from conftest import load_script
from PIL import Image
from safetensors.torch import save_file
from test_fid import reference_fid, run_eval, shapes_config, tiny_features

import uvic.evaluation.statistics as fid_stats
from uvic.config import ConfigError, apply_overrides
from uvic.config.validation import validate
from uvic.evaluation import dinov2
from uvic.evaluation.precision_recall import precision_recall
from uvic.evaluation.statistics import feature_statistics
from uvic.files import save_config

# --------------------------------------------------------------------------- precision/recall


def brute_force_pr(real: np.ndarray, fake: np.ndarray, k: int) -> tuple[float, float]:
    """The paper's definition on full float64 distance matrices."""
    def inside(centres: np.ndarray, queries: np.ndarray) -> float:
        own = np.sqrt(((centres[:, None] - centres[None]) ** 2).sum(-1))
        radii = np.sort(own, axis=1)[:, k]  # column 0 is the point itself
        d = np.sqrt(((queries[:, None] - centres[None]) ** 2).sum(-1))
        return float((d <= radii[None]).any(1).mean())

    return inside(real, fake), inside(fake, real)


@pytest.mark.parametrize("k, n_real, n_fake, shift", [(3, 40, 30, 0.5), (1, 25, 25, 0.0),
                                                       (5, 33, 50, 1.5)])
def test_precision_recall_matches_brute_force(k: int, n_real: int, n_fake: int,
                                              shift: float) -> None:
    rng = np.random.default_rng(k)
    real = rng.normal(size=(n_real, 6))
    fake = rng.normal(size=(n_fake, 6)) * 1.3 + shift
    want = brute_force_pr(real, fake, k)
    assert 0 < want[0] < 1 or 0 < want[1] < 1  # not a degenerate case
    # blocks of a few hundred bytes: many row and column blocks
    assert precision_recall(real, fake, k, max_bytes=300) == pytest.approx(want, abs=1e-12)
    assert precision_recall(real, fake, k) == pytest.approx(want, abs=1e-12)


def test_precision_recall_closed_cases() -> None:
    rng = np.random.default_rng(0)
    real = rng.normal(size=(50, 8))
    assert precision_recall(real, real.copy(), 3, max_bytes=512) == (1.0, 1.0)
    assert precision_recall(real, real + 1e3, 3) == (0.0, 0.0)  # far apart
    subset = real[::2]  # inside the real manifold (each a centre): precision 1
    precision, recall = precision_recall(real, subset, 3)
    assert precision == 1.0 and recall < 1.0
    with pytest.raises(ValueError, match="k=3 needs more than k points, got 3"):
        precision_recall(real[:3], real, 3)


# --------------------------------------------------------------------------- the encoder


def tiny_state(seed: int, registers: int = 0) -> dict[str, torch.Tensor]:
    """A randomly initialised tiny DINOv2 of timm's class (64 wide, 2 blocks, 37x37 grid as
    the released 518-pixel checkpoints), its weights drawn at random (layer scales too, so
    every block counts)."""
    torch.manual_seed(seed)
    extra = {"reg_tokens": registers, "no_embed_class": True} if registers else {}
    model = timm.create_model("vit_small_patch14_dinov2", pretrained=False, embed_dim=64,
                              depth=2, num_heads=1, img_size=518, num_classes=0, **extra)
    assert type(model).__name__ == "VisionTransformer" and model.pos_embed.shape[1] == \
        37 * 37 + (0 if registers else 1)
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * 0.2 + (1.0 if k.endswith(("norm1.weight",
            "norm2.weight", "norm.weight")) else 0.0) for k, v in model.state_dict().items()}


def vit_reference(state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """CLS token after the final norm, in float64, written out from DINOv2's definition
    (pre-norm blocks with layer scale, 64-wide heads, GELU MLP, LayerNorm eps 1e-6; position
    embeddings of the patch grid resized bicubically with DINOv2's +0.1 scale factor)."""
    s = {k: v.double() for k, v in state.items()}
    width, x = s["cls_token"].shape[-1], x.double()
    tokens = F.conv2d(x, s["patch_embed.proj.weight"], s["patch_embed.proj.bias"], stride=14)
    grid = tokens.shape[-1]
    tokens = tokens.flatten(2).transpose(1, 2)
    pos = s["pos_embed"]
    old = math.isqrt(pos.shape[1])
    patches = pos[:, pos.shape[1] - old * old:].reshape(1, old, old, width).permute(0, 3, 1, 2)
    patches = F.interpolate(patches, scale_factor=((grid + 0.1) / old,) * 2, mode="bicubic")
    patches = patches.permute(0, 2, 3, 1).reshape(1, grid * grid, width)
    cls = s["cls_token"] + (pos[:, :1] if pos.shape[1] > old * old else 0)
    t = torch.cat([cls.expand(len(x), -1, -1), tokens + patches], 1)
    if "reg_token" in s:
        t = torch.cat([t[:, :1], s["reg_token"].expand(len(x), -1, -1), t[:, 1:]], 1)
    heads = width // 64
    for i in range(1 + max(int(k.split(".")[1]) for k in s if k.startswith("blocks."))):
        b = {k.split(".", 2)[2]: v for k, v in s.items() if k.startswith(f"blocks.{i}.")}
        h = F.layer_norm(t, (width,), b["norm1.weight"], b["norm1.bias"], 1e-6)
        q, k, v = (h @ b["attn.qkv.weight"].T + b["attn.qkv.bias"]).reshape(
            len(x), -1, 3, heads, 64).permute(2, 0, 3, 1, 4)
        a = torch.softmax(q @ k.transpose(-1, -2) / 8.0, -1) @ v
        a = a.transpose(1, 2).reshape(len(x), -1, width) @ b["attn.proj.weight"].T
        t = t + b["ls1.gamma"] * (a + b["attn.proj.bias"])
        h = F.layer_norm(t, (width,), b["norm2.weight"], b["norm2.bias"], 1e-6)
        h = F.gelu(h @ b["mlp.fc1.weight"].T + b["mlp.fc1.bias"])
        t = t + b["ls2.gamma"] * (h @ b["mlp.fc2.weight"].T + b["mlp.fc2.bias"])
    return F.layer_norm(t, (width,), s["norm.weight"], s["norm.bias"], 1e-6)[:, 0]


def preprocess(path: Path) -> torch.Tensor:
    """dgm-eval's input: PIL bicubic 224x224, [0, 1], ImageNet mean and std (float64)."""
    image = Image.open(path).convert("RGB").resize((224, 224), Image.Resampling.BICUBIC)
    x = torch.from_numpy(np.asarray(image, dtype=np.float64) / 255).permute(2, 0, 1)
    mean = torch.tensor([0.485, 0.456, 0.406], dtype=torch.float64)[:, None, None]
    std = torch.tensor([0.229, 0.224, 0.225], dtype=torch.float64)[:, None, None]
    return (x - mean) / std


def image_files(folder: Path, n: int, size: int = 20) -> list[Path]:
    rng = np.random.default_rng(1)
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(n):
        files.append(folder / f"{i}.png")
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(files[-1])
    return files


def reference_features(state: dict[str, torch.Tensor], files: list[Path]) -> np.ndarray:
    return vit_reference(state, torch.stack([preprocess(f) for f in files])).numpy()


@pytest.mark.parametrize("registers", [0, 4])
def test_encoder_matches_a_float64_vit(tmp_path: Path, registers: int) -> None:
    """timm's DINOv2 class loaded from a local file (and, the same weights, from the original
    checkpoint's layout and from a Hugging Face cache) gives the CLS features of the
    float64 ViT above."""
    state = tiny_state(0, registers)
    torch.save(state, tmp_path / "tiny.pth")
    files = image_files(tmp_path / "images", 3)
    want = reference_features(state, files)
    encoder = dinov2.DINOv2Encoder(tmp_path / "tiny.pth")
    got = dinov2.files_features(files, encoder, batch_size=2, progress=False)
    assert got.shape == (3, 64) and np.abs(want).max() > 0.5
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    if registers == 0:  # the original torch.hub checkpoint's layout: a mask token more
        torch.save({**state, "mask_token": torch.zeros(1, 64)}, tmp_path / "orig.pth")
        original = dinov2.DINOv2Encoder(tmp_path / "orig.pth")
        np.testing.assert_allclose(dinov2.files_features(files, original, progress=False),
                                   got, rtol=0, atol=1e-6)


def test_hub_name_reads_the_local_cache(tmp_path: Path, monkeypatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--timm--vit_tiny_dinov2"
    with pytest.raises(dinov2.DINOv2WeightsMissing, match="timm/vit_tiny_dinov2 not in the "
                       "local Hugging Face cache"):
        dinov2.resolve_weights("timm/vit_tiny_dinov2")
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    save_file(tiny_state(1), repo / "snapshots" / "abc123" / "model.safetensors")
    for name in ("timm/vit_tiny_dinov2", "hf-hub:timm/vit_tiny_dinov2"):
        path = dinov2.resolve_weights(name)
        assert path == repo / "snapshots" / "abc123" / "model.safetensors"
    assert dinov2.DINOv2Encoder(path).dim == 64


def test_weights_errors_are_one_line(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "torchhub"))
    default = tmp_path / "torchhub" / "checkpoints" / "dinov2_vitl14_pretrain.pth"
    for spec, path in (("", default), (str(tmp_path / "gone.pth"), tmp_path / "gone.pth")):
        with pytest.raises(dinov2.DINOv2WeightsMissing) as err:
            dinov2.resolve_weights(spec)
        assert f"DINOv2 weights not found at {path}: " in str(err.value)
        assert "\n" not in str(err.value)
    bad = tmp_path / "bad.pth"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(dinov2.DINOv2WeightsInvalid, match=f"at {bad} cannot be read"):
        dinov2.DINOv2Encoder(bad)
    torch.save({"weight": torch.zeros(2)}, bad)
    with pytest.raises(dinov2.DINOv2WeightsInvalid, match="not a DINOv2 ViT state dict"):
        dinov2.DINOv2Encoder(bad)


# --------------------------------------------------------------------------- uvic-fid


def metrics_config(tmp_path: Path, weights: Path, *extra: str):
    return apply_overrides(shapes_config(tmp_path), [
        "eval.metrics=fid,fd_dinov2,precision_recall", f"eval.dinov2_path={weights}", *extra])


def test_evaluate_reports_fd_dinov2_and_precision_recall(tmp_path: Path) -> None:
    """End to end on a tiny model: FD-DINOv2 is the Frechet distance of the float64 ViT's
    features of samples and reference images; precision/recall are the brute force on FID's
    (stand-in) features; FID itself is unchanged; the protocol records the settings."""
    state = tiny_state(2)
    torch.save(state, tmp_path / "dino.pth")
    plain = run_eval(shapes_config(tmp_path), tmp_path, n=12)  # 12 reference images too
    assert not {"fd_dinov2", "precision", "recall"} & plain.keys()
    assert "metrics" not in plain["protocol"] and "metrics" not in plain["wall_time_s"]
    result = run_eval(metrics_config(tmp_path, tmp_path / "dino.pth", "eval.pr_n_ref=6"),
                      tmp_path, n=12, out_json=tmp_path / "results" / "metrics.json",
                      samples_dir=tmp_path / "results" / "shapes_samples")
    assert result["reused"] == 12 and (result["fid"], result["kid"]) == (plain["fid"],
                                                                        plain["kid"])
    samples = [tmp_path / "results" / "shapes_samples" / f"{i:06d}.png" for i in range(12)]
    stats = tmp_path / "stats"
    refs = sorted((stats / "shapes_seed1_n12_8px").glob("*.png"))
    assert len(refs) == 12
    fake, real = reference_features(state, samples), reference_features(state, refs)
    mu1, s1 = feature_statistics(fake)
    mu2, s2 = feature_statistics(real)
    assert result["fd_dinov2"] == pytest.approx(reference_fid(mu1, s1, mu2, s2), rel=1e-3)
    assert result["fd_dinov2"] > 0.1

    # precision/recall on FID's features: the samples' as FID extracts them, the reference's
    # from its cached statistics, a subset of 6 (eval.pr_n_ref) of its 12 drawn with the seed
    cached = np.load(stats / "shapes_seed1_n12_8px_clean_tiny16_8.npz")["feats"]
    fake_pr = fid_stats.files_features(samples, tiny_features(), progress=False)
    pick = np.sort(np.random.default_rng([0, 3]).choice(12, 6, replace=False))
    want = brute_force_pr(cached[pick].astype(np.float64), fake_pr, 3)
    assert (result["precision"], result["recall"]) == pytest.approx(want, abs=1e-12)
    saved = json.loads((tmp_path / "results" / "metrics.json").read_text())
    record = saved["protocol"]["metrics"]
    assert record["precision_recall"] == {"features": "tiny16", "k": 3, "n_ref": 6,
                                          "n_samples": 12, "distance": "euclidean, float64"}
    fd = record["fd_dinov2"]
    assert fd["features"] == "dinov2 vit_small_patch14_dinov2 (64 wide, 2 deep)"
    assert fd["weights_file"] == str(tmp_path / "dino.pth") and len(fd["weights"]) == 16
    assert fd["preprocessing"] == dinov2.PROTOCOL and fd["reference_digest"]
    assert saved["fd_dinov2"] == result["fd_dinov2"]


def test_dinov2_reference_cache_is_keyed_by_the_encoder(tmp_path: Path) -> None:
    for seed in (3, 4):
        torch.save(tiny_state(seed), tmp_path / f"dino{seed}.pth")
    args = {"samples_dir": tmp_path / "samples", "n": 4}

    def fd(seed: int) -> tuple[float, str]:
        cfg = metrics_config(tmp_path, tmp_path / f"dino{seed}.pth", "eval.metrics=fid,"
                             "fd_dinov2")
        r = run_eval(cfg, tmp_path, out_json=tmp_path / f"r{seed}.json", **args)
        return r["fd_dinov2"], r["protocol"]["metrics"]["fd_dinov2"]["reference_digest"]

    first = fd(3)
    caches = sorted((tmp_path / "stats").glob("*dinov2*.npz"))
    assert len(caches) == 1
    mtime = caches[0].stat().st_mtime_ns
    assert fd(3) == first and caches[0].stat().st_mtime_ns == mtime  # reused
    other = fd(4)
    assert other[0] != first[0] and other[1] != first[1]
    assert len(sorted((tmp_path / "stats").glob("*dinov2*.npz"))) == 2  # its own file


@pytest.mark.parametrize("setting, needle", [
    ("eval.metrics=fid,fdd", "eval.metrics: 'fdd' is not one of ('fid', 'fd_dinov2', "
     "'precision_recall')"),
    ("eval.metrics=fd_dinov2", "eval.metrics=fd_dinov2 must include fid"),
    ("eval.metrics=fid,fid", "names a metric twice"),
    ("eval.pr_k=0", "eval.pr_k=0 must be >= 1"),
    ("eval.pr_features=clip", "eval.pr_features='clip' must be one of ('inception', 'dinov2')"),
    ("eval.pr_n_ref=-1", "eval.pr_n_ref=-1 must be >= 0"),
])
def test_bad_metric_settings_are_one_line(tmp_path: Path, setting: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=None) as err:
        validate(apply_overrides(shapes_config(tmp_path), [setting]))
    assert needle in str(err.value) and "\n" not in str(err.value)


def fid_cli(tmp_path: Path, capsys, *extra: str) -> tuple[int, str, str]:
    cfg = shapes_config(tmp_path)
    save_config(apply_overrides(cfg, ["eval.features=projection"]), tmp_path / "config.json")
    capsys.readouterr()
    code = load_script("eval/fid.py").main([
        "--config", str(tmp_path / "config.json"), "--ckpt", str(tmp_path / "ema.safetensors"),
        "--n", "4", "--samples-dir", str(tmp_path / "s"), "--stats-dir",
        str(tmp_path / "stats"), "--out", str(tmp_path / "r.json"), "--quiet", *extra])
    out, err = capsys.readouterr()
    return code, out, err.strip()


@pytest.mark.slow
def test_cli_reports_the_metrics_and_refuses_missing_weights(tmp_path: Path, capsys) -> None:
    code, _, err = fid_cli(tmp_path, capsys, "--metrics", "fid,fd_dinov2",
                           "--dinov2-path", str(tmp_path / "missing.pth"))
    assert code == 2 and err.splitlines() == [err] and err.startswith(
        f"error: DINOv2 weights not found at {tmp_path / 'missing.pth'}: ")
    assert not (tmp_path / "s").exists()  # before any sampling
    code, _, err = fid_cli(tmp_path, capsys, "--metrics", "fid,psnr")
    assert code == 2 and err == ("error: eval.metrics: 'psnr' is not one of ('fid', "
                                 "'fd_dinov2', 'precision_recall')")
    torch.save(tiny_state(5), tmp_path / "dino.pth")
    code, out, _ = fid_cli(tmp_path, capsys, "--metrics", "fid,fd_dinov2,precision_recall",
                           "--dinov2-path", str(tmp_path / "dino.pth"), "--set",
                           "eval.pr_k=1", "--set", "eval.pr_features=dinov2")
    assert code == 0, out
    line = next(x for x in out.splitlines() if x.startswith("FD-DINOv2 "))
    result = json.loads((tmp_path / "r.json").read_text())
    assert f"FD-DINOv2 {result['fd_dinov2']:.3f} (dinov2 vit_small_patch14_dinov2" in line
    assert f"precision {result['precision']:.4f}  recall {result['recall']:.4f} (k=1, " \
           "dinov2 vit_small_patch14_dinov2 (64 wide, 2 deep) features, 4 reference " \
           "images)" in line


def test_inception_precision_recall_needs_reference_features(tmp_path: Path, capsys) -> None:
    """A statistics file of mu and sigma alone cannot give precision/recall on Inception
    features: one line naming it, before any sampling (and before Inception is loaded)."""
    (tmp_path / "inception.pt").write_bytes(b"never loaded")
    stats = tmp_path / "ref_stats.npz"
    np.savez(stats, mu=np.zeros(2048), sigma=np.eye(2048))
    cfg = apply_overrides(shapes_config(tmp_path), [
        f"eval.inception_path={tmp_path / 'inception.pt'}", f"eval.ref_stats={stats}",
        "eval.metrics=fid,precision_recall"])
    save_config(cfg, tmp_path / "config.json")
    code = load_script("eval/fid.py").main([
        "--config", str(tmp_path / "config.json"), "--ckpt", str(tmp_path / "ema.safetensors"),
        "--n", "4", "--samples-dir", str(tmp_path / "s"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.splitlines() == [err]
    assert err.startswith(f"error: precision/recall needs the reference's features, and "
                          f"{stats} holds only mu and sigma")
    assert not (tmp_path / "s").exists()
