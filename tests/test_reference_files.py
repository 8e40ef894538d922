"""Reference statistics from a local .npz: the U-ViT release's fid_stats (mu, sigma), ADM's
reference batches (arr_0 images with mu, sigma, mu_s, sigma_s; or arr_0 alone), and
one-line errors naming the file and key for a missing file, key or wrong shape."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from uvic.config import apply_overrides, load_config
from uvic.evaluation.reference import (
    INCEPTION_DIM,
    ReferenceStatsInvalid,
    ReferenceStatsMissing,
    _images_stats,
    check_stats_file,
    reference_statistics,
    stats_plan,
)
from uvic.evaluation.statistics import InceptionWeightsMissing, files_features

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def config(stats: Path, **extra: str):
    """The CelebA preset pointed at `stats` (eval.ref_stats), as a user would set it."""
    sets = [f"eval.ref_stats={stats}", *(f"{k}={v}" for k, v in extra.items())]
    return apply_overrides(load_config(CONFIGS / "celeba64_uvit_small.py"), sets)


def stats_arrays(dim: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(dim, 4)).astype(np.float64)
    return {"mu": rng.normal(size=dim), "sigma": a @ a.T}


def test_release_fid_stats_file_at_inception_size(tmp_path: Path) -> None:
    """The release's fid_stats files hold mu (2048,) and sigma (2048, 2048), nothing else."""
    path = tmp_path / "fid_stats_celeba64_train_50000_ddim.npz"
    arrays = stats_arrays(INCEPTION_DIM)
    np.savez(path, **arrays)
    cfg = config(path)
    assert stats_plan(cfg, "legacy_pytorch", None, tmp_path, False)[:2] == ("file", path)
    ref = reference_statistics(cfg, stats_dir=tmp_path)
    np.testing.assert_array_equal(ref.mu, arrays["mu"])
    np.testing.assert_array_equal(ref.sigma, arrays["sigma"])
    assert ref.feats is None and ref.source == str(path)


def test_adm_reference_batch_uses_the_pool_statistics(tmp_path: Path) -> None:
    path = tmp_path / "VIRTUAL_imagenet64_labeled.npz"
    pool, spatial = stats_arrays(INCEPTION_DIM), stats_arrays(7, seed=1)
    images = np.zeros((3, 8, 8, 3), np.uint8)
    np.savez(path, arr_0=images, mu=pool["mu"], sigma=pool["sigma"],
             mu_s=spatial["mu"], sigma_s=spatial["sigma"])
    ref = reference_statistics(config(path), stats_dir=tmp_path)
    np.testing.assert_array_equal(ref.mu, pool["mu"])
    np.testing.assert_array_equal(ref.sigma, pool["sigma"])
    assert "ADM reference batch: mu/sigma of pool features, mu_s/sigma_s unused" in ref.source


def test_images_only_batch_needs_local_inception_weights(tmp_path: Path) -> None:
    path = tmp_path / "VIRTUAL_imagenet64_images.npz"
    np.savez(path, arr_0=np.zeros((4, 8, 8, 3), np.uint8))
    assert check_stats_file(path) == "images"
    missing = tmp_path / "no_inception.pt"
    with pytest.raises(InceptionWeightsMissing, match=str(missing)):
        stats_plan(config(path, **{"eval.inception_path": str(missing)}), "legacy_pytorch",
                   None, tmp_path, False)


@pytest.mark.parametrize("mode", ["clean", "legacy_pytorch"])
def test_images_only_batch_is_scored_as_clean_fid_scores_files(tmp_path: Path,
                                                               mode: str) -> None:
    """arr_0's images get exactly the features clean-fid gives the same images as files."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(5, 16, 16, 3), dtype=np.uint8)
    path = tmp_path / "batch.npz"
    np.savez(path, arr_0=images)
    weights = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))

    def extractor(x: torch.Tensor) -> torch.Tensor:  # (B, 3, 299, 299) -> (B, 6)
        return x.mean(dim=(2, 3)) @ weights + x[:, :, ::37, ::41].flatten(1)[:, :6]

    ref = _images_stats(path, extractor, mode, "cpu", batch_size=2, progress=False)
    files = []
    for i, image in enumerate(images):
        files.append(tmp_path / f"{i}.png")
        Image.fromarray(image).save(files[-1])
    expected = files_features(files, extractor, mode=mode, batch_size=3, progress=False)
    np.testing.assert_allclose(ref.feats, expected, rtol=1e-6)
    assert ref.mu.shape == (6,) and ref.sigma.shape == (6, 6)


def test_missing_file_names_it_and_the_key(tmp_path: Path) -> None:
    path = tmp_path / "fid_stats" / "fid_stats_imagenet64_guided_diffusion.npz"
    with pytest.raises(ReferenceStatsMissing) as info:
        stats_plan(config(path), "legacy_pytorch", None, tmp_path, False)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"FID reference statistics not found at {path} "
                              "(eval.ref_stats, e.g. --set eval.ref_stats=PATH)")
    assert "assets/fid_stats/fid_stats_imagenet64_guided_diffusion.npz" in message


@pytest.mark.parametrize("arrays,needle", [
    ({"mean": np.zeros(4), "sigma": np.eye(4)}, "no key 'mu' (keys: mean, sigma)"),
    ({"mu": np.zeros(4)}, "no key 'sigma' (keys: mu)"),
    ({"mu": np.zeros(4), "sigma": np.eye(4)},
     "key 'mu' has shape (4,) (float64), expected a float array of 2048"),
    ({"mu": np.zeros(INCEPTION_DIM), "sigma": np.eye(4)},
     "key 'sigma' has shape (4, 4) (float64), expected a float array of 2048 x 2048"),
    ({"arr_0": np.zeros((4, 8, 8), np.uint8)}, "key 'arr_0' has shape (4, 8, 8) (uint8)"),
])
def test_wrong_keys_or_shapes_name_the_file_and_key(tmp_path: Path, arrays: dict,
                                                    needle: str) -> None:
    """Refused when the evaluation is planned, before any sampling, in one line."""
    path = tmp_path / "stats.npz"
    np.savez(path, **arrays)
    with pytest.raises(ReferenceStatsInvalid) as info:
        stats_plan(config(path), "legacy_pytorch", None, tmp_path, False)
    assert str(info.value).startswith(f"{path}: ") and needle in str(info.value)
    assert "\n" not in str(info.value)


def test_any_feature_size_for_a_stand_in_and_a_consistent_one(tmp_path: Path) -> None:
    path = tmp_path / "small.npz"
    np.savez(path, **stats_arrays(5))
    assert check_stats_file(path, dim=None) == "stats"
    np.savez(path, mu=np.zeros(5), sigma=np.eye(4))
    with pytest.raises(ReferenceStatsInvalid, match=r"key .sigma. has shape .4, 4.*5 x 5"):
        check_stats_file(path, dim=None)
    path.write_bytes(b"not a zip")
    with pytest.raises(ReferenceStatsInvalid, match=r"not an \.npz statistics file"):
        check_stats_file(path)
