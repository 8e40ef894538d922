"""Reference statistics uvic builds from local files are cached under the fingerprint of
what they were built from (uvic.evaluation.fingerprint), not only under a name: a changed
file, another CIFAR-10 copy or a cache from an older uvic is rebuilt with one line saying
why; unchanged data is reused; every FID result records the reference's digest."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from datagen import make_cifar10, patch_cifar10_checksums
from PIL import Image

import uvic.evaluation.fid as fid
import uvic.evaluation.fingerprint as fingerprint
import uvic.evaluation.reference as fid_ref
import uvic.evaluation.statistics as fid_stats
from uvic.config import Config, DataConfig, EvalConfig, ModelConfig, SampleConfig, apply_overrides
from uvic.models.uvit import build_model
from uvic.run.weights import save_safetensors


def tiny_features() -> fid_stats.ProjectionFeatures:
    return fid_stats.ProjectionFeatures("tiny16")


def image_folder(folder: Path, n: int, seed: int = 0) -> Path:
    """`n` random 8x8 PNGs `000000.png`..."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), np.uint8)).save(folder / f"{i:06d}.png")
    return folder


def rewrite(path: Path, seed: int) -> None:
    """Replace an image with other pixels, written a second after the file it replaces (a
    later write, whatever the file system's clock granularity)."""
    before = path.stat().st_mtime_ns
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (8, 8, 3), np.uint8)).save(path)
    os.utime(path, ns=(before + 10**9, before + 10**9))


def folder_config(folder: Path, **eval_fields) -> Config:
    return Config(model=ModelConfig(img_size=8), data=DataConfig(name="shapes", root=""),
                  eval=EvalConfig(**{"ref_images": str(folder), "ref_res": 8,
                                     "ref_stats": "ref", **eval_fields}))


def expected_stats(folder: Path, extractor=None) -> tuple[np.ndarray, np.ndarray]:
    feats = fid_stats.files_features(fid_stats.list_images(folder), extractor or tiny_features(),
                                     progress=False)
    return fid_stats.feature_statistics(feats)


def build(cfg: Config, tmp_path: Path, **kwargs) -> fid_ref.ReferenceStats:
    kwargs = {"stats_dir": tmp_path / "stats", "progress": False, **kwargs}
    return fid_ref.reference_statistics(cfg, kwargs.pop("extractor", tiny_features()), **kwargs)


class Counted:
    """`files_features`, counting its calls (how often statistics were computed)."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        monkeypatch.setattr(fid_ref, "files_features", self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return fid_stats.files_features(*args, **kwargs)


def test_a_changed_reference_image_rebuilds_the_statistics(tmp_path: Path, monkeypatch,
                                                           capsys) -> None:
    folder = image_folder(tmp_path / "ref", 6)
    cfg, computed = folder_config(folder), Counted(monkeypatch)
    first = build(cfg, tmp_path)
    assert computed.calls == 1 and len(first.digest) == 16
    # unchanged data: the cache is used, nothing is said
    again = build(cfg, tmp_path)
    assert computed.calls == 1 and again.digest == first.digest
    np.testing.assert_array_equal(again.mu, first.mu)
    assert capsys.readouterr().err == ""

    rewrite(folder / "000003.png", seed=7)
    changed = build(cfg, tmp_path)
    assert computed.calls == 2 and changed.digest != first.digest
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("rebuilding the reference statistics "), err
    assert "changed 000003.png (" in err[0] and "modified" in err[0], err[0]
    mu, sigma = expected_stats(folder)
    np.testing.assert_allclose(changed.mu, mu)
    np.testing.assert_allclose(changed.sigma, sigma)
    assert not np.allclose(changed.mu, first.mu)
    assert build(cfg, tmp_path).digest == changed.digest and computed.calls == 2  # reused

    # an image added, one removed (regenerated smoke data of another size)
    image_folder(tmp_path / "other", 1, seed=3)
    (tmp_path / "other" / "000000.png").rename(folder / "extra.png")
    (folder / "000001.png").unlink()
    rebuilt = build(cfg, tmp_path)
    assert computed.calls == 3
    line = capsys.readouterr().err.strip()
    assert "(6 -> 6 files): added extra.png; removed 000001.png" in line, line
    np.testing.assert_allclose(rebuilt.mu, expected_stats(folder)[0])


def test_another_resolution_extractor_or_an_old_cache_is_not_reused(tmp_path: Path,
                                                                   monkeypatch, capsys) -> None:
    folder = image_folder(tmp_path / "ref", 6)
    computed = Counted(monkeypatch)
    small = build(folder_config(folder), tmp_path)
    large = build(folder_config(folder, ref_res=16), tmp_path)  # another cache file
    other = build(folder_config(folder), tmp_path, extractor=fid_stats.ProjectionFeatures())
    assert computed.calls == 3 and len({small.digest, large.digest, other.digest}) == 3
    # a cache file from before fingerprints (same name, wrong numbers): rebuilt, not reused
    stale = next((tmp_path / "stats").glob("ref-*_clean_tiny16_8.npz"))
    np.savez(stale, mu=np.zeros(16), sigma=np.eye(16), source=np.array("old"))
    capsys.readouterr()
    fresh = build(folder_config(folder), tmp_path)
    assert "built by an older uvic" in capsys.readouterr().err
    np.testing.assert_allclose(fresh.mu, small.mu)
    assert fresh.digest == small.digest


def test_a_regenerated_or_another_cifar10_copy_is_exported_and_scored_again(
        tmp_path: Path, monkeypatch, capsys) -> None:
    """CIFAR-10 statistics and their PNG export are keyed by the batch files, not by the
    split's name: the regenerated copy (same sizes, other images) is used, and another
    copy in another root too."""
    root = tmp_path / "cifar"
    make_cifar10(root, n_per_batch=2, seed=0)
    patch_cifar10_checksums(monkeypatch, root)
    cfg = Config(model=ModelConfig(img_size=32), data=DataConfig(root=str(root)),
                 eval=EvalConfig(ref_stats="cifar10", ref_split="train", ref_res=32))
    computed = Counted(monkeypatch)
    first = build(cfg, tmp_path)
    build(cfg, tmp_path)
    assert computed.calls == 1
    exported = tmp_path / "stats" / "cifar10_train_png"

    def check_export(data: dict[str, np.ndarray]) -> None:
        files = fid_stats.list_images(exported)
        np.testing.assert_array_equal(np.stack([np.asarray(Image.open(f)) for f in files]),
                                      data["train"])

    data = make_cifar10(root, n_per_batch=2, seed=1)  # regenerated in place
    patch_cifar10_checksums(monkeypatch, root)
    capsys.readouterr()
    regenerated = build(cfg, tmp_path)
    assert computed.calls == 2 and regenerated.digest != first.digest
    err = capsys.readouterr().err
    assert "changed data_batch_1 (" in err and "content differs" in err, err
    check_export(data)
    np.testing.assert_allclose(regenerated.mu, expected_stats(exported)[0])

    other = tmp_path / "cifar_copy"
    data = make_cifar10(other, n_per_batch=3, seed=2)
    patch_cifar10_checksums(monkeypatch, other)
    copy = build(Config(model=cfg.model, data=DataConfig(root=str(other)), eval=cfg.eval),
                 tmp_path)
    assert computed.calls == 3 and copy.feats.shape == (15, 16)
    check_export(data)  # 15 images, none of the 10 before left over
    assert json.loads((exported / ".complete").read_text())["kind"] == "files"


class PaddedFeatures(fid_stats.ProjectionFeatures):
    """Inception-sized (2048) stand-in: the projection's 16 features, then zeros."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = super().forward(x)
        return torch.nn.functional.pad(feats, (0, fid_ref.INCEPTION_DIM - feats.shape[1]))


@pytest.mark.slow
def test_statistics_built_at_eval_ref_stats_follow_their_images(tmp_path: Path, monkeypatch,
                                                               capsys) -> None:
    """eval.ref_stats names a missing file and eval.ref_images the images: uvic builds the
    file there (with Inception) and rebuilds it when an image changes. A statistics file
    of the user's (no fingerprint) is never touched."""
    monkeypatch.setattr(fid_ref, "build_inception", lambda *a, **k: PaddedFeatures())
    folder = image_folder(tmp_path / "ref", 5)
    path = tmp_path / "user" / "ref_stats.npz"
    cfg = folder_config(folder, ref_stats=str(path),
                        inception_path=str(tmp_path / "no_inception.pt"))
    computed = Counted(monkeypatch)
    first = build(cfg, tmp_path, extractor=None)
    assert path.is_file() and build(cfg, tmp_path, extractor=None).digest == first.digest
    rewrite(folder / "000000.png", seed=9)
    changed = build(cfg, tmp_path, extractor=None)
    assert computed.calls == 2 and changed.digest != first.digest
    assert f"rebuilding the reference statistics {path}: source files changed" in \
        capsys.readouterr().err
    np.testing.assert_allclose(changed.mu, expected_stats(folder, PaddedFeatures())[0])

    mine = {"mu": np.zeros(fid_ref.INCEPTION_DIM), "sigma": np.eye(fid_ref.INCEPTION_DIM)}
    np.savez(path, **mine)
    rewrite(folder / "000001.png", seed=10)
    users = build(cfg, tmp_path, extractor=None)
    assert computed.calls == 2 and users.digest == fingerprint.file_digest(path)
    np.testing.assert_array_equal(users.mu, mine["mu"])


def test_the_result_records_the_reference_digest(tmp_path: Path) -> None:
    folder = image_folder(tmp_path / "ref", 6)
    cfg = folder_config(folder, n_samples=6)
    cfg.model = ModelConfig(img_size=8, patch_size=2, embed_dim=32, depth=2, num_heads=2,
                            attention="uvic", attention_backend="torch")
    cfg.sample = SampleConfig(steps=2, batch_size=6, cfg_scale=0.0)
    torch.manual_seed(0)
    save_safetensors(build_model(cfg.model), tmp_path / "ema.safetensors")
    cfg = apply_overrides(cfg, ["eval.n_samples=6"])
    kwargs = {"out_json": tmp_path / "fid.json", "feat_extractor": tiny_features(),
              "stats_dir": tmp_path / "stats", "num_workers": 0, "progress": False}
    result = fid.evaluate(cfg, tmp_path / "ema.safetensors", **kwargs)
    saved = json.loads((tmp_path / "fid.json").read_text())
    assert saved["reference_digest"] == result["reference_digest"] == build(cfg, tmp_path).digest
    rewrite(folder / "000002.png", seed=11)
    again = fid.evaluate(cfg, tmp_path / "ema.safetensors", **kwargs)
    assert again["reused"] == 6 and again["reference_digest"] != saved["reference_digest"]
    assert again["fid"] != pytest.approx(saved["fid"])


def test_a_single_files_content_counts(tmp_path: Path) -> None:
    """A large file (a CIFAR-10 batch) copied over with the same size and modification
    time but other bytes in its first or last MiB has another fingerprint."""
    path = tmp_path / "batch"
    path.write_bytes(bytes(3 << 20))
    before = fingerprint.files_source(tmp_path, [path], content=True)
    stat = path.stat()
    for offset in (10, (3 << 20) - 10):
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(b"x")
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        after = fingerprint.files_source(tmp_path, [path], content=True)
        assert after != before and after["files"][0][1:3] == before["files"][0][1:3]
        assert fingerprint.change({"source": before}, {"source": after}).endswith(
            "changed batch (content differs)")
        before = after


def test_fingerprint_change_lines() -> None:
    """One line per difference; a match is None."""
    old = {"version": 1, "features": {"name": "a"}, "mode": "clean", "res": 8,
           "source": {"kind": "files", "files": [["x.png", 10, 0]]}}
    assert fingerprint.change(old, json.loads(json.dumps(old))) is None
    assert fingerprint.change(old, {**old, "res": 16}) == "resolution 8 -> 16"
    assert fingerprint.change(old, {**old, "mode": "legacy_pytorch"}) == \
        "mode clean -> legacy_pytorch"
    line = fingerprint.change(old, {**old, "source": {"kind": "files",
                                                      "files": [["x.png", 12, 0]]}})
    assert line == "source files changed since they were built (1 -> 1 files): changed " \
        "x.png (size 10 -> 12 bytes)"
