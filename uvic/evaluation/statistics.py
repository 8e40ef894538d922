"""Features for FID with clean-fid (Inception, or the download-free `ProjectionFeatures`
stand-in), their statistics, and the distances between two sets of them (Frechet, KID).

Missing weights or statistics raise `InceptionWeightsMissing` / `ReferenceStatsMissing`
naming the file and URL; nothing is downloaded without `allow_download=True` (`--download`).
The Frechet distance is our own float64 one: clean-fid's calls an argument of
`scipy.linalg.sqrtm` that SciPy 1.18 removed.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from cleanfid.downloads_helper import inception_url
from cleanfid.features import feature_extractor
from cleanfid.fid import get_files_features
from cleanfid.fid import kernel_distance as cleanfid_kid
from cleanfid.inception_pytorch import FID_WEIGHTS_URL
from cleanfid.inception_torchscript import InceptionV3W
from cleanfid.utils import EXTENSIONS
from PIL import Image
from scipy import linalg

from uvic.config import EvalConfig
from uvic.config.evaluation import check_mode
from uvic.data.datasets import center_crop_resize

INCEPTION_FILE = "inception-2015-12-05.pt"  # clean-fid's TorchScript Inception (clean mode)


def feature_statistics(feats: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and covariance (float64) of features (N, F), as clean-fid computes them."""
    feats = np.asarray(feats, dtype=np.float64)
    if feats.ndim != 2 or len(feats) < 2:
        raise ValueError(f"need features of shape (N >= 2, F), got {feats.shape}")
    return feats.mean(axis=0), np.cov(feats, rowvar=False)


class ProjectionFeatures(torch.nn.Module):
    """Stand-in for Inception (eval.features=projection, smoke runs, tests): (B, 3, H, W)
    in [0, 255], 4x4 average-pooled, through a fixed random projection -> (B, 16).
    Deterministic, cheap and download-free; the distances it gives are not FIDs (colour
    layout only, no learned features), and `name` says so in every result."""

    def __init__(self, name: str = "projection") -> None:
        super().__init__()
        self.name = name
        g = torch.Generator().manual_seed(0)
        self.register_buffer("proj", torch.randn(48, 16, generator=g) / 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # on the images' device: clean-fid moves each batch to the evaluation device
        # (CUDA under `accelerate launch`), never the extractor
        pooled = torch.nn.functional.adaptive_avg_pool2d(x / 255.0, 4).flatten(1)
        return pooled @ self.proj.to(x.device, pooled.dtype)


def stand_in_features(ev: EvalConfig) -> ProjectionFeatures | None:
    """The feature extractor eval.features asks for when it is not Inception, else None
    (None means Inception throughout this module and `uvic.evaluation.fid`)."""
    return ProjectionFeatures("projection") if ev.features == "projection" else None


class InceptionWeightsMissing(FileNotFoundError):
    """The Inception network FID needs is not on disk; the message says how to get it."""


class InceptionWeightsCorrupt(ValueError):
    """The Inception weights file exists but does not load (truncated, not TorchScript)."""


# --------------------------------------------------------------------------- Inception


def cache_dir() -> Path:
    """uvic's persistent user cache: $XDG_CACHE_HOME/uvic, else ~/.cache/uvic."""
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "uvic"


def inception_weights_path(ev: EvalConfig, mode: str | None = None) -> tuple[Path, str]:
    """Where the Inception weights for `mode` are expected, and clean-fid's URL for them.

    clean / legacy_tensorflow: clean-fid's TorchScript file in `cache_dir()` (clean-fid's
    own default, /tmp, is emptied on reboot); legacy_pytorch: pytorch-fid's state dict in
    torch.hub's checkpoint folder (~/.cache/torch). `ev.inception_path` overrides.
    """
    mode = check_mode(mode or ev.mode)
    if mode == "legacy_pytorch":
        url = FID_WEIGHTS_URL
        default = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(url)
    else:
        url = inception_url
        default = cache_dir() / INCEPTION_FILE
    path = Path(ev.inception_path).expanduser() if ev.inception_path else default
    return path, url


def check_inception(ev: EvalConfig, mode: str | None = None) -> Path:
    """The Inception weights file, or InceptionWeightsMissing saying how to get it."""
    path, url = inception_weights_path(ev, mode)
    if not path.is_file():
        raise InceptionWeightsMissing(
            f"FID Inception weights not found at {path}: download {url} there "
            f"(curl -L --create-dirs -o {path} {url}) or set eval.inception_path to a local "
            "copy (or use eval.features=projection: download-free, not comparable with FID)"
        )
    return path


def build_inception(
    ev: EvalConfig, mode: str | None = None, device: torch.device | str = "cpu",
    allow_download: bool = False,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """clean-fid's Inception feature extractor for `mode`, from the local weights file
    (`check_inception`); images (B, 3, 299, 299) in [0, 255] -> features (B, 2048)."""
    mode = check_mode(mode or ev.mode)
    path, _ = inception_weights_path(ev, mode)
    if not (allow_download and not ev.inception_path):
        path = check_inception(ev, mode)
    try:
        return _build_inception(path, mode, torch.device(device), allow_download)
    except Exception as err:  # torch.jit / torch.load report a bad file with many types
        if not path.is_file():  # a failed download, not a bad local file
            raise
        raise InceptionWeightsCorrupt(_corrupt_message(path, mode, err)) from err


def _corrupt_message(path: Path, mode: str, err: BaseException) -> str:
    detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    _, url = inception_weights_path(EvalConfig(), mode)
    return (f"FID Inception weights at {path} cannot be loaded ({detail}); download them "
            f"again ({url}) or set eval.inception_path to a good copy")


def _build_inception(path: Path, mode: str, device: torch.device,
                     allow_download: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    if mode == "legacy_pytorch":
        # clean-fid loads pytorch-fid's state dict through torch.hub's cache (named after its
        # URL): point a temporary hub folder at our file while it builds the network.
        hub = torch.hub.get_dir()
        with tempfile.TemporaryDirectory(prefix="uvic_hub_") as tmp:
            if path.is_file():
                (Path(tmp) / "checkpoints").mkdir()
                link = Path(tmp) / "checkpoints" / os.path.basename(FID_WEIGHTS_URL)
                link.symlink_to(path.resolve())
                torch.hub.set_dir(tmp)
            try:
                return feature_extractor("pytorch_inception", device=device,
                                         use_dataparallel=False)
            finally:
                torch.hub.set_dir(hub)
    resize_inside = mode == "legacy_tensorflow"
    if allow_download and not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)  # clean-fid writes into the folder
        model = InceptionV3W(str(path.parent), download=True, resize_inside=resize_inside)
    else:  # InceptionV3W wants a folder holding a file of exactly this name
        with _linked_as(path, INCEPTION_FILE) as folder:
            model = InceptionV3W(str(folder), download=False, resize_inside=resize_inside)
    return model.to(device).eval()


@contextlib.contextmanager
def _linked_as(path: Path, name: str):
    """A temporary folder where `name` links to `path` (or `path`'s own folder)."""
    if path.name == name:
        yield path.parent
        return
    with tempfile.TemporaryDirectory(prefix="uvic_inception_") as tmp:
        (Path(tmp) / name).symlink_to(path.resolve())
        yield Path(tmp)


def extractor_tag(feat_extractor: Callable | None) -> str:
    """Name of a feature extractor for cache files and results ("inception" for ours)."""
    if feat_extractor is None:
        return "inception"
    return str(getattr(feat_extractor, "name", None) or getattr(
        feat_extractor, "__name__", type(feat_extractor).__name__))


# --------------------------------------------------------------------------- features


def crop_resize_array(image: np.ndarray, size: int) -> np.ndarray:
    """`uvic.data.datasets.center_crop_resize` on a uint8 (H, W, 3) array, as clean-fid's custom
    transform of the reference images: (size, size, 3); already size x size: unchanged."""
    if image.shape[:2] == (size, size):
        return image
    return np.asarray(center_crop_resize(Image.fromarray(image), size), dtype=np.uint8)


def files_features(
    files: Sequence[str | Path], feat_extractor: Callable, *, mode: str = "clean",
    device: torch.device | str = "cpu", batch_size: int = 64, num_workers: int = 0,
    image_transform: Callable[[np.ndarray], np.ndarray] | None = None,
    description: str = "features", progress: bool = True,
) -> np.ndarray:
    """Features (N, F) of image files with clean-fid's resizing for `mode` and a progress
    bar (`cleanfid.fid.get_files_features`)."""
    feats = get_files_features(
        [str(f) for f in files], feat_extractor, num_workers=num_workers, batch_size=batch_size,
        device=torch.device(device), mode=mode, description=description, verbose=progress,
        custom_image_tranform=image_transform,  # (sic) clean-fid's spelling
    )
    return np.asarray(feats, dtype=np.float64)


def list_images(folder: str | Path) -> list[Path]:
    """Image files in `folder` (recursively, sorted), with clean-fid's extensions."""
    folder = Path(folder)
    exts = {e.lower() for e in EXTENSIONS} - {"npy"}
    return sorted(p for p in folder.rglob("*") if p.suffix[1:].lower() in exts and p.is_file())


# --------------------------------------------------------------------------- distances


def frechet_distance(
    mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray
) -> float:
    """||mu1 - mu2||^2 + Tr(S1 + S2 - 2 (S1 S2)^(1/2)), in float64.

    Tr((S1 S2)^(1/2)) is the sum of the square roots of the eigenvalues of S1 S2, which
    are those of the symmetric PSD matrix S1^(1/2) S2 S1^(1/2): two `eigh` calls, no
    complex arithmetic, and no `scipy.linalg.sqrtm(disp=...)` (removed in SciPy 1.18).
    """
    mu1 = np.atleast_1d(np.asarray(mu1, dtype=np.float64))
    mu2 = np.atleast_1d(np.asarray(mu2, dtype=np.float64))
    s1 = np.atleast_2d(np.asarray(sigma1, dtype=np.float64))
    s2 = np.atleast_2d(np.asarray(sigma2, dtype=np.float64))
    if mu1.shape != mu2.shape or s1.shape != s2.shape or s1.shape != (mu1.size, mu1.size):
        raise ValueError(f"FID statistics do not match: mu {mu1.shape} vs {mu2.shape}, "
                         f"sigma {s1.shape} vs {s2.shape}")
    w, v = linalg.eigh((s1 + s1.T) / 2)
    s1_half = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    m = s1_half @ s2 @ s1_half
    tr_covmean = np.sqrt(np.clip(linalg.eigvalsh((m + m.T) / 2), 0, None)).sum()
    diff = mu1 - mu2
    return float(diff @ diff + np.trace(s1) + np.trace(s2) - 2.0 * tr_covmean)


def kernel_distance(feats1: np.ndarray, feats2: np.ndarray, seed: int = 0) -> float:
    """KID with clean-fid's estimator (100 subsets of up to 1000), seeded: clean-fid draws
    the subsets from NumPy's global RNG, which we seed and then restore."""
    state = np.random.get_state()
    try:
        np.random.seed(seed)
        return float(cleanfid_kid(np.asarray(feats1, np.float64), np.asarray(feats2, np.float64)))
    finally:
        np.random.set_state(state)
