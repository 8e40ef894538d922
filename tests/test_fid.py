"""FID/KID evaluation: the Frechet distance against SciPy, the evaluator end to end on a tiny
model with a stand-in feature extractor, resuming, reference statistics, offline errors,
and the Table 3 builder."""

from __future__ import annotations

import io
import json
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import load_script
from datagen import make_cifar10, make_mscoco_features, patch_cifar10_checksums, tiny_vae_folder
from PIL import Image
from scipy import linalg
from torch import nn

import uvic.evaluation.fid as fid
import uvic.evaluation.reference as fid_ref
import uvic.evaluation.statistics as fid_stats
from uvic.config import (
    Config,
    ConfigError,
    DataConfig,
    EvalConfig,
    ModelConfig,
    SampleConfig,
    apply_overrides,
    load_config,
)
from uvic.diffusion.schedule import Diffusion
from uvic.evaluation.protocols import NOT_FID, RELEASE
from uvic.files import save_config
from uvic.models.uvit import build_model
from uvic.run.architecture import ModelChoice
from uvic.run.folder import checkpoint_step
from uvic.run.weights import load_weights, save_safetensors
from uvic.sampling.generate import generate
from uvic.sampling.images import to_uint8

REPO = Path(__file__).resolve().parents[1]



def tiny_features() -> fid_stats.ProjectionFeatures:
    """The deterministic stand-in for Inception (16 features, named "tiny16")."""
    return fid_stats.ProjectionFeatures("tiny16")

def reference_fid(mu1, s1, mu2, s2) -> float:
    """The formula with SciPy's general matrix square root (float64)."""
    covmean = linalg.sqrtm(s1 @ s2)
    return float(np.sum((mu1 - mu2) ** 2) + np.trace(s1) + np.trace(s2)
                 - 2 * np.trace(np.real(covmean)))


def gaussian_features(n: int, dim: int, seed: int, shift: float = 0.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mixing = rng.normal(size=(dim, dim)) / np.sqrt(dim)
    return rng.normal(size=(n, dim)) @ mixing + shift


# --------------------------------------------------------------------------- distances


def test_frechet_distance_matches_scipy() -> None:
    a = gaussian_features(400, 16, seed=0)
    b = gaussian_features(300, 16, seed=1, shift=0.3) * 1.5
    mu1, s1 = fid_stats.feature_statistics(a)
    mu2, s2 = fid_stats.feature_statistics(b)
    np.testing.assert_allclose(mu1, a.mean(0)) and np.testing.assert_allclose(s1, np.cov(a.T))
    got = fid_stats.frechet_distance(mu1, s1, mu2, s2)
    assert got == pytest.approx(reference_fid(mu1, s1, mu2, s2), rel=1e-9, abs=1e-9)
    assert got == pytest.approx(fid_stats.frechet_distance(mu2, s2, mu1, s1), rel=1e-9)  # symmetric


def test_frechet_distance_self_and_shift() -> None:
    feats = gaussian_features(500, 16, seed=2)
    mu, sigma = fid_stats.feature_statistics(feats)
    assert abs(fid_stats.frechet_distance(mu, sigma, mu, sigma)) < 1e-9
    # a pure shift d leaves the covariance: FID = |d|^2 exactly
    mu_s, sigma_s = fid_stats.feature_statistics(feats + 0.5)
    shifted = fid_stats.frechet_distance(mu, sigma, mu_s, sigma_s)
    assert shifted == pytest.approx(16 * 0.25, rel=1e-9)
    mu_w, sigma_w = fid_stats.feature_statistics(feats * 2.0)  # wider: also larger
    assert fid_stats.frechet_distance(mu, sigma, mu_w, sigma_w) > 1.0


def test_frechet_distance_singular_covariance() -> None:
    """Fewer samples than dimensions (rank-deficient covariances) stays finite and >= 0."""
    mu1, s1 = fid_stats.feature_statistics(gaussian_features(5, 32, seed=3))
    mu2, s2 = fid_stats.feature_statistics(gaussian_features(5, 32, seed=4))
    value = fid_stats.frechet_distance(mu1, s1, mu2, s2)
    assert np.isfinite(value) and value > 0
    assert value == pytest.approx(reference_fid(mu1, s1, mu2, s2), rel=1e-5)
    with pytest.raises(ValueError, match="do not match"):
        fid_stats.frechet_distance(mu1, s1, mu2[:3], s2[:3, :3])


def test_kid_is_seeded_and_keeps_global_rng() -> None:
    a, b = gaussian_features(60, 8, seed=5), gaussian_features(60, 8, seed=6, shift=1.0)
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    k1, k2 = fid_stats.kernel_distance(a, b, seed=0), fid_stats.kernel_distance(a, b, seed=0)
    assert k1 == k2 and k1 > fid_stats.kernel_distance(a, a, seed=0)
    np.testing.assert_array_equal(np.random.get_state()[1], before)


# --------------------------------------------------------------------------- stand-in features


def shapes_config(tmp_path: Path) -> Config:
    cfg = Config(
        name="tiny_shapes",
        model=ModelConfig(img_size=8, patch_size=2, embed_dim=32, depth=2, num_heads=2,
                          attention="uvic", attention_backend="torch"),
        data=DataConfig(name="shapes", root=""),
        sample=SampleConfig(steps=3, batch_size=4, cfg_scale=0.0),
        eval=EvalConfig(n_samples=12, ref_stats="shapes", ref_res=8,
                        inception_path=str(tmp_path / "no_inception.pt")),
    )
    torch.manual_seed(0)
    save_safetensors(build_model(cfg.model), tmp_path / "ema.safetensors")
    return cfg


def run_eval(cfg: Config, tmp_path: Path, n: int = 6, seed: int = 0, **kwargs) -> dict:
    cfg = apply_overrides(cfg, [f"eval.n_samples={n}", f"sample.seed={seed}"])
    kwargs = {"out_json": tmp_path / "results" / "shapes.json",
              "feat_extractor": tiny_features(), "stats_dir": tmp_path / "stats",
              "num_workers": 0, "progress": False, **kwargs}
    return fid.evaluate(cfg, tmp_path / "ema.safetensors", **kwargs)


def test_evaluate_builds_the_checkpoint_architecture(tmp_path: Path) -> None:
    """A U-ViC run scored under a U-ViT config is scored as U-ViC: its samples, the
    result's model and config; an explicit conflicting model.* is refused."""
    uvic = shapes_config(tmp_path)  # ema.safetensors of a U-ViC model
    save_config(uvic, tmp_path / "config.json")  # ... in its run folder
    uvit = apply_overrides(uvic, ["model.attention=uvit"])
    result = run_eval(uvit, tmp_path)
    assert result["model"] == "U-ViC" and result["attention"] == "uvic"
    assert result["config"]["model"]["attention"] == "uvic"
    assert result["model_source"] == str(tmp_path / "config.json")
    model = build_model(uvic.model)
    load_weights(model, tmp_path / "ema.safetensors")
    model.eval()
    expected = to_uint8(torch.cat([b for _, b in generate(
        model, Diffusion(uvic.diffusion), uvic, range(6), seed=0)])).numpy()
    samples = tmp_path / "results" / "shapes_samples"
    got = np.stack([np.asarray(Image.open(samples / f"{i:06d}.png")) for i in range(6)])
    np.testing.assert_array_equal(got, expected)
    with pytest.raises(ConfigError, match=r"model\.attention='uvit' \(--set\)"):
        run_eval(uvit, tmp_path, out_json=tmp_path / "other.json",
                 choice=ModelChoice(set_keys=("attention",)))


def test_evaluate_end_to_end_resume_and_table(tmp_path: Path, capsys) -> None:
    cfg = shapes_config(tmp_path)
    result = run_eval(cfg, tmp_path)
    samples = tmp_path / "results" / "shapes_samples"
    files = sorted(samples.glob("*.png"))
    assert [f.name for f in files] == [f"{i:06d}.png" for i in range(6)]
    assert Image.open(files[0]).size == (8, 8)
    saved = json.loads((tmp_path / "results" / "shapes.json").read_text())
    for key in ("fid", "kid", "n", "mode", "checkpoint", "sampler", "guidance", "versions",
                "wall_time_s", "device", "reference", "config"):
        assert key in saved, key
    assert saved["fid"] == result["fid"] and np.isfinite(saved["fid"]) and saved["fid"] > 0
    assert saved["n"] == 6 and saved["generated"] == 6 and saved["model"] == "U-ViC"
    assert saved["feature_extractor"] == "tiny16" and saved["sampler"]["steps"] == 3

    # FID recomputed by hand from the same features and the held-out reference images
    fx = tiny_features()
    feats = fid_stats.files_features(files, fx, progress=False)
    refs = fid_stats.list_images(tmp_path / "stats" / "shapes_seed1_n6_8px")
    assert len(refs) == 6  # Shapes' held-out reference: eval.n_samples images
    ref_feats = fid_stats.files_features(refs, fx, progress=False)
    expected = reference_fid(*fid_stats.feature_statistics(feats),
                             *fid_stats.feature_statistics(ref_feats))
    assert result["fid"] == pytest.approx(expected, rel=1e-6)

    # resume: nothing is regenerated, the files are untouched, the result is the same
    mtimes = {f.name: f.stat().st_mtime_ns for f in files}
    again = run_eval(cfg, tmp_path)
    assert again["generated"] == 0 and again["reused"] == 6 and again["fid"] == result["fid"]
    assert {f.name: f.stat().st_mtime_ns for f in files} == mtimes
    # an interrupted run: missing samples are regenerated identically
    original = files[2].read_bytes()
    files[2].unlink()
    files[4].unlink()
    third = run_eval(cfg, tmp_path)
    assert third["generated"] == 2 and files[2].read_bytes() == original
    assert third["fid"] == pytest.approx(result["fid"], rel=1e-9)
    # more samples: only the new indices are sampled
    assert run_eval(cfg, tmp_path, n=8)["generated"] == 2
    # other settings in the same folder are refused
    with pytest.raises(ValueError, match="seed"):
        run_eval(cfg, tmp_path, seed=1)

    # the protocol is recorded: sampler, steps, samples, mode, reference, features
    assert saved["protocol"]["label"] == ("dpm_solver++ order 2 3 steps, 6 samples, clean, "
                                          "ref shapes/train/8, features tiny16 (stand-in: "
                                          "NOT comparable with Inception FID)")

    # Table 3 from the results folder: a release-protocol CIFAR-10 result beside it
    other = dict(saved, model="U-ViT", dataset="cifar10", fid=3.5, n=50_000,
                 protocol=RELEASE["cifar10"].as_dict())
    (tmp_path / "results" / "cifar.json").write_text(json.dumps(other))
    table_path = tmp_path / "table.md"
    assert load_script("eval/fid_table.py").main([str(tmp_path / "results"), "--out",
                                                  str(table_path)]) == 0
    table = table_path.read_text()
    assert table == capsys.readouterr().out
    header = [c.strip() for c in table.splitlines()[0].split("|")[1:-1]]
    assert header[:3] == ["Model", "CIFAR-10 (P1)", "CIFAR-10 (paper)"]
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()
            if line.startswith("| U-Vi")}
    assert rows["U-ViT"].split("|")[2].strip() == "3.50"
    assert "3.39 (release 3.11)" in rows["U-ViT"] and "5.99 (release 5.95)" in rows["U-ViT"]
    assert "3.27" in rows["U-ViC"] and "5.85" in rows["U-ViC"]
    assert rows["U-ViC"].split("|")[2].strip() == "—"  # no U-ViC CIFAR-10 result
    assert f"- P1: {RELEASE['cifar10'].label()} — *release protocol*" in table
    assert header[-1] == "Shapes (P2, stand-in: not FID)"  # the stand-in: another protocol
    assert "features tiny16" in table
    latest = json.loads((tmp_path / "results" / "shapes.json").read_text())  # the n=8 run
    assert latest["n"] == 8 and f"{latest['fid']:.2f}" in rows["U-ViC"]


def test_evaluate_finds_the_checkpoint_of_a_runs_ema_weights(tmp_path: Path) -> None:
    """A run's top-level ema.safetensors is the copy in checkpoints/step_N/: step N."""
    cfg = shapes_config(tmp_path)  # writes tmp_path/ema.safetensors, as a run does
    older = tmp_path / "checkpoints" / "step_000004"
    latest = tmp_path / "checkpoints" / "step_000008"
    for folder, weights in ((older, b"not the same weights"),
                            (latest, (tmp_path / "ema.safetensors").read_bytes())):
        folder.mkdir(parents=True)
        (folder / "ema.safetensors").write_bytes(weights)
        (folder / "trainer_state.json").write_text(json.dumps({"step": int(folder.name[5:])}))
    assert checkpoint_step(tmp_path / "ema.safetensors") == 8
    assert checkpoint_step(older / "ema.safetensors") == 4  # the trainer state beside it
    assert run_eval(cfg, tmp_path, n=2)["step"] == 8
    (latest / "ema.safetensors").write_bytes(b"other")  # no copy left: unknown
    assert checkpoint_step(tmp_path / "ema.safetensors") is None



def test_evaluate_script_cli(tmp_path: Path, monkeypatch, capsys) -> None:
    """eval/fid.py: a missing Inception file stops it with one line, before any sampling."""
    cfg = shapes_config(tmp_path)
    config = tmp_path / "config.json"
    from uvic.files import save_config

    save_config(cfg, config)
    main = load_script("eval/fid.py").main
    samples = tmp_path / "s"
    code = main(["--config", str(config), "--ckpt", str(tmp_path / "ema.safetensors"),
                 "--n", "4", "--samples-dir", str(samples), "--stats-dir",
                 str(tmp_path / "stats"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert str(tmp_path / "no_inception.pt") in err and "inception-2015-12-05.pt" in err
    assert not samples.exists()


def fid_cli_error(capsys, tmp_path: Path, *extra: str) -> str:
    """eval/fid.py on the tiny shapes checkpoint must fail with one line; returns it."""
    config = tmp_path / "config.json"
    if not config.exists():
        from uvic.files import save_config

        save_config(shapes_config(tmp_path), config)
    main = load_script("eval/fid.py").main
    capsys.readouterr()
    code = main(["--config", str(config), "--ckpt", str(tmp_path / "ema.safetensors"),
                 "--n", "4", "--samples-dir", str(tmp_path / "s"), "--stats-dir",
                 str(tmp_path / "stats"), "--quiet", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


@pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")
def test_corrupt_inception_weights_stop_before_sampling(tmp_path: Path, capsys) -> None:
    """The weights are loaded (not only found) first."""
    weights = tmp_path / "no_inception.pt"
    weights.write_bytes(b"PK\x03\x04 not really a TorchScript archive")
    err = fid_cli_error(capsys, tmp_path)
    assert err.startswith(f"error: FID Inception weights at {weights} cannot be loaded (")
    assert "inception-2015-12-05.pt" in err
    assert not (tmp_path / "s").exists()
    assert weights.read_bytes() == b"PK\x03\x04 not really a TorchScript archive"


@pytest.mark.parametrize("flag, value, needle", [
    ("--batch-size", "0", "sample.batch_size=0 must be >= 1"),
    ("--order", "7", "sample.order=7 must be 1, 2 or 3 (DPM-Solver orders)"),
])
def test_sampler_flags_out_of_range_are_refused(tmp_path: Path, capsys, flag, value,
                                                needle) -> None:
    """Item 9: --batch-size 0 and --order 7 were clamped; both CLIs now refuse them."""
    (tmp_path / "no_inception.pt").write_bytes(b"unused")
    assert fid_cli_error(capsys, tmp_path, flag, value) == f"error: {needle}"
    assert not (tmp_path / "s").exists()

    from uvic.cli import sample as sample_cli

    out = tmp_path / "grid"
    code = sample_cli.main(["--config", str(tmp_path / "config.json"), "--ckpt",
                            str(tmp_path / "ema.safetensors"), "--n", "2", "--out", str(out),
                            "--quiet", flag, value])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == f"error: {needle}"
    assert not out.exists()


# --------------------------------------------------------------------------- offline errors


def test_missing_inception_weights(tmp_path: Path) -> None:
    cfg = shapes_config(tmp_path)
    with pytest.raises(fid_stats.InceptionWeightsMissing) as info:
        run_eval(cfg, tmp_path, feat_extractor=None)
    message = str(info.value)
    assert "no_inception.pt" in message and "nvlabs-fi-cdn.nvidia.com" in message
    assert not (tmp_path / "results").exists()  # nothing sampled
    legacy = apply_overrides(cfg, ["eval.mode=legacy_pytorch"])
    with pytest.raises(fid_stats.InceptionWeightsMissing, match="pt_inception-2015-12-05"):
        fid_stats.build_inception(legacy.eval, device="cpu")
    # the default file name is clean-fid's own (its folder: the user cache, below)
    default = apply_overrides(cfg, ["eval.inception_path="])
    assert fid_stats.inception_weights_path(default.eval)[0].name == fid_stats.INCEPTION_FILE


def test_inception_weights_default_to_the_user_cache(tmp_path: Path, monkeypatch) -> None:
    """The cache: not /tmp (emptied on reboot) but ~/.cache/uvic, or
    $XDG_CACHE_HOME/uvic; the missing-file line names that exact path and the URL."""
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("UVIC_FID_STATS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    expected = tmp_path / "home" / ".cache" / "uvic" / fid_stats.INCEPTION_FILE
    assert fid_stats.inception_weights_path(Config().eval)[0] == expected
    assert fid_ref.default_stats_dir() == tmp_path / "home" / ".cache" / "uvic" / "fid_stats"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    expected = tmp_path / "xdg" / "uvic" / fid_stats.INCEPTION_FILE
    assert fid_stats.inception_weights_path(Config().eval)[0] == expected
    assert fid_ref.default_stats_dir() == tmp_path / "xdg" / "uvic" / "fid_stats"
    with pytest.raises(fid_stats.InceptionWeightsMissing) as info:
        fid_stats.check_inception(Config().eval)
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert message.startswith(f"FID Inception weights not found at {expected}: download "
                              "https://nvlabs-fi-cdn.nvidia.com/")
    assert f"curl -L --create-dirs -o {expected} " in message  # the folder may not exist yet


class TinyInception(nn.Module):
    """A TorchScript stand-in with InceptionV3W's interface (`layers`, return_features)."""

    def __init__(self, layers: nn.Module) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x: torch.Tensor, return_features: bool = True) -> torch.Tensor:
        return self.layers(x)


@pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")
def test_download_goes_to_the_user_cache(tmp_path: Path, monkeypatch) -> None:
    """--download: clean-fid's own download code writes into the (new) cache folder; the
    network is replaced by a tiny TorchScript file served from memory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    payload = io.BytesIO()
    torch.jit.save(torch.jit.script(TinyInception(nn.Sequential(nn.AdaptiveAvgPool2d(1),
                                                                nn.Flatten()))), payload)
    urls = []

    def urlopen(url, *args, **kwargs):
        urls.append(url)
        return io.BytesIO(payload.getvalue())

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    extractor = fid_stats.build_inception(Config().eval, device="cpu", allow_download=True)
    assert urls == [fid_stats.inception_weights_path(Config().eval)[1]]
    assert (tmp_path / "xdg" / "uvic" / fid_stats.INCEPTION_FILE).is_file()
    assert extractor.base is not None


@pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")  # TorchScript, as clean-fid
def test_inception_from_configured_path(tmp_path: Path) -> None:
    """eval.inception_path with any file name reaches clean-fid's InceptionV3W (which
    wants a folder holding `inception-2015-12-05.pt`); here a tiny TorchScript stand-in."""

    class Base(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                        nn.Linear(3, 2048))

        def forward(self, x: torch.Tensor, return_features: bool = True) -> torch.Tensor:
            return self.layers(x)

    path = tmp_path / "my_weights.pt"
    torch.jit.script(Base()).save(str(path))
    cfg = Config(eval=EvalConfig(inception_path=str(path)))
    extractor = fid_stats.build_inception(cfg.eval, device="cpu")
    feats = extractor(torch.full((2, 3, 299, 299), 128.0))
    assert feats.shape == (2, 2048)


def test_missing_reference_statistics(tmp_path: Path) -> None:
    cfg = Config(model=ModelConfig(img_size=32), data=DataConfig(root=str(tmp_path / "none")),
                 eval=EvalConfig(ref_stats="cifar10_uvic_test_missing", inception_path=""))
    with pytest.raises(fid_ref.ReferenceStatsMissing) as info:
        fid_ref.reference_statistics(cfg, stats_dir=tmp_path)
    message = str(info.value)
    assert "cifar10_uvic_test_missing_clean_train_32.npz" in message
    assert fid_ref.STATS_URL in message and "eval.ref_images" in message
    with pytest.raises(fid_ref.ReferenceStatsMissing, match="does not exist"):
        fid_ref.reference_statistics(apply_overrides(cfg, [f"eval.ref_images={tmp_path}/x"]),
                                 stats_dir=tmp_path)


def test_wrong_reference_resolution(tmp_path: Path) -> None:
    cfg = apply_overrides(shapes_config(tmp_path), ["eval.ref_res=32"])
    with pytest.raises(ValueError, match=r"eval\.ref_res=32"):
        run_eval(cfg, tmp_path)


# --------------------------------------------------------------------------- stand-in FID


def tiny_cifar10_run(tmp_path: Path) -> tuple[Path, dict]:
    """configs/cifar10_uvic.py at toy size as a run folder (config.json beside its EMA
    weights), with the CIFAR-10 copy tests/datagen.py writes (10 train images) as data.root;
    the Inception weights point at a file that does not exist."""
    data = make_cifar10(tmp_path / "cifar", n_per_batch=2)
    cfg = load_config(REPO / "configs" / "cifar10_uvic.py", [
        "model.embed_dim=32", "model.depth=2", "model.num_heads=2",
        "model.attention_backend=torch", f"data.root={tmp_path / 'cifar'}",
        f"eval.inception_path={tmp_path / 'absent' / 'inception.pth'}"])
    run = tmp_path / "run"
    run.mkdir()
    save_config(cfg, run / "config.json")
    torch.manual_seed(0)
    save_safetensors(build_model(cfg.model), run / "ema.safetensors")
    return run, data


def projection_fid_cli(tmp_path: Path, run: Path, *extra: str) -> int:
    return load_script("eval/fid.py").main([
        "--config", str(run / "config.json"), "--ckpt", str(run / "ema.safetensors"),
        "--features", "projection", "--n", "4", "--steps", "2", "--batch-size", "4",
        "--out", str(tmp_path / "fid" / "cifar10_uvic.json"), "--stats-dir",
        str(tmp_path / "stats"), "--num-workers", "0", "--quiet", *extra])


def test_projection_fid_of_a_cifar10_checkpoint_without_downloads(tmp_path: Path, monkeypatch,
                                                                  capsys) -> None:
    """`--features projection` scores one's own CIFAR-10
    checkpoint with no Inception weights and no downloads, the reference statistics built
    with the same features from data.root's CIFAR-10 copy; the printed lines, the result
    and the table say the number is not comparable with Inception FID."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # must stay untouched
    run, data = tiny_cifar10_run(tmp_path)
    # the datagen copy fails torchvision's MD5 check: one line, before any sampling
    assert projection_fid_cli(tmp_path, run) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fail torchvision's MD5 check" in err, err
    assert not (tmp_path / "fid").exists()

    patch_cifar10_checksums(monkeypatch, tmp_path / "cifar")
    assert projection_fid_cli(tmp_path, run) == 0
    out = capsys.readouterr().out.splitlines()
    assert "attention uvic" in out[0] and "config.json" in out[0], out[0]  # what was built
    out = out[1:]
    result = json.loads((tmp_path / "fid" / "cifar10_uvic.json").read_text())
    assert out[0] == (f"U-ViC cifar10: stand-in FID (projection features, {NOT_FID}) "
                      f"{result['fid']:.3f}  KID {result['kid']:.5f}  (N=4, legacy_pytorch, "
                      "euler_maruyama 2 steps, guidance 0.0)")
    assert out[1] == f"protocol: {result['protocol']['label']}"
    assert result["protocol"]["label"].endswith(
        "legacy_pytorch, ref cifar10/train/32, features projection (stand-in: NOT comparable "
        "with Inception FID)")
    assert result["protocol"]["features"] == "projection" == result["feature_extractor"]
    assert result["protocol"]["comparable_with_inception_fid"] is False
    assert result["config"]["eval"]["features"] == "projection"
    assert result["reference"].startswith(f"CIFAR-10 train from {tmp_path / 'cifar'}, 10 images")
    assert not (tmp_path / "cache").exists()

    # the distance between the samples' and CIFAR-10 train's projection features
    fx = fid_stats.ProjectionFeatures()
    samples = sorted(Path(result["samples_dir"]).glob("*.png"))
    exported = fid_stats.list_images(tmp_path / "stats" / "cifar10_train_png")
    np.testing.assert_array_equal(np.stack([np.asarray(Image.open(f)) for f in exported]),
                                  data["train"])
    stats = [fid_stats.feature_statistics(fid_stats.files_features(
        files, fx, mode="legacy_pytorch", progress=False)) for files in (samples, exported)]
    assert result["fid"] == pytest.approx(reference_fid(*stats[0], *stats[1]), rel=1e-6)

    # the table: its own column, marked (the samples folder's samples.json is no result)
    capsys.readouterr()
    assert load_script("eval/fid_table.py").main([str(tmp_path / "fid")]) == 0
    table = capsys.readouterr().out
    assert "| CIFAR-10 (P1, stand-in: not FID) | CIFAR-10 (paper) |" in table
    assert f"their numbers are {NOT_FID}" in table
    assert f"U-ViC / CIFAR-10 (P1): stand-in FID (projection features) {result['fid']:.3f}" \
        in table


def test_features_option_is_validated(tmp_path: Path, capsys) -> None:
    run, _ = tiny_cifar10_run(tmp_path)
    main = load_script("eval/fid.py").main
    assert main(["--config", str(run / "config.json"), "--ckpt", str(run / "ema.safetensors"),
                 "--set", "eval.features=clip", "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: eval.features='clip' must be one of ('inception', 'projection')")


def test_quickstart_fid_column_names_stand_in_features() -> None:
    """The quickstart's FID column with --set eval.features=projection says it is no FID."""
    from uvic.experiments import quickstart_report as quickstart

    row = {"pattern": "SSS", "final_loss": 0.5, "heldout_loss": 0.05, "hf_ratio": 1.0,
           "palette_share": 0.9, "shape_share": 0.8}
    timing = {m: {"ms_per_step": 10.0, "images_per_s": 100.0} for m in ("U-ViT", "U-ViC")}
    table = quickstart.results_table([
        {**row, "model": "U-ViT", "fid": 1.234, "fid_features": "projection"},
        {**row, "model": "U-ViC", "fid": 5.678, "fid_features": "inception"}], timing)
    rows = {line.split("|")[1].strip(): line.split("|")[8].strip()
            for line in table.splitlines()[2:]}
    assert rows == {"U-ViT": "1.23 (projection stand-in: not Inception FID)", "U-ViC": "5.68"}


def test_quickstart_heldout_column_names_the_objective() -> None:
    """A quickstart under flow matching reports a held-out velocity MSE, never a noise MSE."""
    from uvic.config import load_config
    from uvic.experiments import quickstart_report as quickstart

    eps = load_config("configs/quickstart.py")
    flow = load_config("configs/quickstart.py", ["diffusion.objective=velocity",
                                                "diffusion.min_snr_gamma=0"])
    assert quickstart.heldout_name(eps.diffusion) == "noise MSE"
    assert quickstart.heldout_name(flow.diffusion) == "velocity MSE"
    table = quickstart.results_table([], {}, quickstart.heldout_name(flow.diffusion))
    assert "| held-out velocity MSE (EMA) |" in table and "noise" not in table


# --------------------------------------------------------------------------- fid_table input


@pytest.mark.parametrize("content", [None, {"name": "x", "steps": 3}, "not json"])
def test_fid_table_refuses_a_folder_without_results(tmp_path: Path, capsys, content) -> None:
    """An empty or wrong folder exits non-zero with one line
    (naming the folder, or the file that is no result) and prints no table."""
    folder = tmp_path / "runs"
    folder.mkdir()
    if content is not None:
        (folder / "x").mkdir()
        bad = folder / "x" / "config.json"
        bad.write_text(content if isinstance(content, str) else json.dumps(content))
    main = load_script("eval/fid_table.py").main
    assert main([str(folder), "--out", str(tmp_path / "table.md")]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == "" and len(err.splitlines()) == 1
    assert not (tmp_path / "table.md").exists()
    if content is None:
        assert err == (f"error: {folder}: holds no FID result JSONs (eval/fid.py --out writes "
                       "them); no table")
    else:
        assert err.startswith(f"error: {bad}: not ")


# --------------------------------------------------------------------------- reference images


def test_cifar10_reference_from_local_copy(tmp_path: Path, monkeypatch) -> None:
    data = make_cifar10(tmp_path / "cifar", n_per_batch=2)
    patch_cifar10_checksums(monkeypatch, tmp_path / "cifar")
    cfg = Config(model=ModelConfig(img_size=32), data=DataConfig(root=str(tmp_path / "cifar")),
                 eval=EvalConfig(ref_stats="cifar10", ref_split="train", ref_res=32))
    stats = fid_ref.reference_statistics(cfg, tiny_features(), stats_dir=tmp_path / "stats",
                                     progress=False)
    exported = fid_stats.list_images(tmp_path / "stats" / "cifar10_train_png")
    assert len(exported) == 10
    np.testing.assert_array_equal(np.asarray(Image.open(exported[3])), data["train"][3])
    assert stats.feats.shape == (10, 16) and "CIFAR-10 train" in stats.source
    # cached: the second call loads the file instead of recomputing features
    monkeypatch.setattr(fid_ref, "files_features", lambda *a, **k: pytest.fail("recomputed"))
    cached = fid_ref.reference_statistics(cfg, tiny_features(), stats_dir=tmp_path / "stats")
    np.testing.assert_allclose(cached.mu, stats.mu)
    np.testing.assert_allclose(cached.sigma, stats.sigma)


def test_center_crop_resize() -> None:
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, size=(40, 60, 3), dtype=np.uint8)
    out = fid_stats.crop_resize_array(image, 16)
    crop = Image.fromarray(image[:, 10:50]).resize((16, 16), Image.Resampling.LANCZOS)
    np.testing.assert_array_equal(out, np.asarray(crop))
    assert fid_stats.crop_resize_array(out, 16) is out


def test_mscoco_reference_and_text_to_image_fid(tmp_path: Path) -> None:
    """The COCO path: val captions drawn per sample, guidance, VAE decode, reference images
    center-cropped to eval.ref_res from a folder of JPEGs of mixed sizes."""
    features = make_mscoco_features(tmp_path / "coco", n_images={"val": 3}, resolution=64)
    cfg = Config(
        name="tiny_coco",
        model=ModelConfig(img_size=8, in_chans=4, patch_size=2, embed_dim=32, depth=2,
                          num_heads=2, clip_dim=32, attention="uvit",
                          attention_backend="torch"),
        data=DataConfig(name="mscoco", root=str(features), vae=str(tiny_vae_folder(
            tmp_path / "vae"))),
        sample=SampleConfig(steps=2, batch_size=2, cfg_scale=1.0, decode_batch_size=2),
        eval=EvalConfig(ref_stats=str(tmp_path / "stats" / "coco_val_64.npz"), ref_res=64,
                        ref_images=str(tmp_path / "coco" / "coco" / "val2014"),
                        captions=str(features / "val")),
    )
    cfg.diffusion.schedule = "scaled_linear"
    torch.manual_seed(0)
    save_safetensors(build_model(cfg.model), tmp_path / "ema.safetensors")
    # the caption contexts depend only on (seed, index)
    context_fn = fid.caption_context_fn(cfg, seed=0)
    torch.testing.assert_close(context_fn([0, 1, 2])[1:], context_fn([1, 2]))
    assert context_fn([0, 1, 2]).shape == (3, 77, 32)

    result = fid.evaluate(apply_overrides(cfg, ["eval.n_samples=3"]),
                          tmp_path / "ema.safetensors", out_json=tmp_path / "coco.json",
                          feat_extractor=tiny_features(),
                          stats_dir=tmp_path / "cache", num_workers=0, progress=False)
    assert result["guidance"] == 1.0 and np.isfinite(result["fid"])
    assert Image.open(tmp_path / "coco_samples" / "000000.png").size == (64, 64)
    assert "val2014" in result["reference"]
