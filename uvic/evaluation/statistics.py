"""Reference statistics and Inception features for FID, with clean-fid.

What we take from clean-fid and what we do ourselves:

* Features: clean-fid's resizing ("clean" PIL bicubic, or "legacy_pytorch") and its
  Inception networks, through `cleanfid.fid.get_files_features`.
* Reference statistics: clean-fid's named statistics (`cifar10`), a local .npz
  (eval.ref_stats), or statistics we build once from local images (eval.ref_images,
  center-cropped and resized to eval.ref_res; Shapes renders a held-out set) and cache.
* Downloads: clean-fid silently downloads the Inception weights to
  /tmp/inception-2015-12-05.pt (emptied on reboot) and statistics into its package folder,
  failing offline with a urllib traceback. We keep the weights in the user cache
  (`cache_dir()`, ~/.cache/uvic), check every file first and raise
  `InceptionWeightsMissing` / `ReferenceStatsMissing` saying which file, where, and the URL
  clean-fid would use; downloading happens only with `allow_download=True` (`--download`).
* Without downloads: eval.features=projection replaces Inception by `ProjectionFeatures`
  (a fixed random projection) and builds the reference statistics with it from local
  images, so the whole pipeline runs offline; its numbers are not comparable with FID.

The distances themselves (Frechet, KID) and the protocol are in `uvic.evaluation.fid`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import cleanfid
import numpy as np
import torch
from cleanfid.downloads_helper import inception_url
from cleanfid.features import feature_extractor, get_reference_statistics
from cleanfid.fid import get_files_features
from cleanfid.inception_pytorch import FID_WEIGHTS_URL
from cleanfid.inception_torchscript import InceptionV3W
from cleanfid.utils import EXTENSIONS
from PIL import Image

from uvic.config import Config
from uvic.data.datasets import SHAPES_SEEDS, CIFAR10Images, center_crop_resize, save_shapes_folder
from uvic.evaluation.checks import check_mode
from uvic.run.files import atomic_write

INCEPTION_FILE = "inception-2015-12-05.pt"  # clean-fid's TorchScript Inception (clean mode)
STATS_URL = "https://www.cs.cmu.edu/~clean-fid/stats"  # clean-fid's get_reference_statistics


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


def stand_in_features(cfg: Config) -> ProjectionFeatures | None:
    """The feature extractor eval.features asks for when it is not Inception, else None
    (None means Inception throughout this module and `uvic.evaluation.fid`)."""
    return ProjectionFeatures("projection") if cfg.eval.features == "projection" else None


class InceptionWeightsMissing(FileNotFoundError):
    """The Inception network FID needs is not on disk; the message says how to get it."""


class InceptionWeightsCorrupt(ValueError):
    """The Inception weights file exists but does not load (truncated, not TorchScript)."""


class ReferenceStatsMissing(FileNotFoundError):
    """Reference statistics are neither on disk nor buildable from local images."""


# --------------------------------------------------------------------------- Inception


def cache_dir() -> Path:
    """uvic's persistent user cache: $XDG_CACHE_HOME/uvic, else ~/.cache/uvic."""
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "uvic"


def inception_weights_path(cfg: Config, mode: str | None = None) -> tuple[Path, str]:
    """Where the Inception weights for `mode` are expected, and clean-fid's URL for them.

    clean / legacy_tensorflow: clean-fid's TorchScript file in `cache_dir()` (clean-fid's
    own default, /tmp, is emptied on reboot); legacy_pytorch: pytorch-fid's state dict in
    torch.hub's checkpoint folder (~/.cache/torch). `cfg.eval.inception_path` overrides.
    """
    mode = check_mode(mode or cfg.eval.mode)
    if mode == "legacy_pytorch":
        url = FID_WEIGHTS_URL
        default = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(url)
    else:
        url = inception_url
        default = cache_dir() / INCEPTION_FILE
    path = Path(cfg.eval.inception_path).expanduser() if cfg.eval.inception_path else default
    return path, url


def check_inception(cfg: Config, mode: str | None = None) -> Path:
    """The Inception weights file, or InceptionWeightsMissing saying how to get it."""
    path, url = inception_weights_path(cfg, mode)
    if not path.is_file():
        raise InceptionWeightsMissing(
            f"FID Inception weights not found at {path}: download {url} there "
            f"(curl -L --create-dirs -o {path} {url}) or set eval.inception_path to a local "
            "copy (or use eval.features=projection: download-free, not comparable with FID)"
        )
    return path


def build_inception(
    cfg: Config, mode: str | None = None, device: torch.device | str = "cpu",
    allow_download: bool = False,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """clean-fid's Inception feature extractor for `mode`, from the local weights file
    (`check_inception`); images (B, 3, 299, 299) in [0, 255] -> features (B, 2048)."""
    mode = check_mode(mode or cfg.eval.mode)
    path, _ = inception_weights_path(cfg, mode)
    if not (allow_download and not cfg.eval.inception_path):
        path = check_inception(cfg, mode)
    try:
        return _build_inception(path, mode, torch.device(device), allow_download)
    except Exception as err:  # torch.jit / torch.load report a bad file with many types
        if not path.is_file():  # a failed download, not a bad local file
            raise
        raise InceptionWeightsCorrupt(_corrupt_message(path, mode, err)) from err


def _corrupt_message(path: Path, mode: str, err: BaseException) -> str:
    detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    _, url = inception_weights_path(Config(), mode)
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


# --------------------------------------------------------------------------- reference statistics


@dataclass
class ReferenceStats:
    """Reference mean/covariance, features for KID when available, and where they came from."""

    mu: np.ndarray
    sigma: np.ndarray
    feats: np.ndarray | None
    source: str


def default_stats_dir() -> Path:
    """Cache of reference statistics we build: $UVIC_FID_STATS or `cache_dir()`/fid_stats."""
    stats = os.environ.get("UVIC_FID_STATS")
    return Path(stats).expanduser() if stats else cache_dir() / "fid_stats"


def _cleanfid_stats_path(name: str, mode: str, split: str, res: int, kid: bool = False) -> Path:
    suffix = "_kid" if kid else ""
    file = f"{name}_{mode}_{split}_{res}{suffix}.npz".lower()
    return Path(os.path.dirname(cleanfid.__file__)) / "stats" / file


@dataclass
class ReferenceImages:
    """Local images to build reference statistics from: `key` names the set in cache files,
    `prepare()` returns the folder (rendering or exporting it first if needed), `check()`
    raises before any sampling if `prepare()` could not work."""

    key: str
    description: str
    prepare: Callable[[], Path]
    check: Callable[[], None] = lambda: None


def reference_images(cfg: Config, stats_dir: Path) -> ReferenceImages | None:
    """Local images the reference statistics can be built from, or None.

    eval.ref_images: a folder of images, or a torchvision CIFAR-10 root (exported to PNGs
    once). Without it: Shapes renders a held-out set (the "val" seed, eval.n_samples
    images); CIFAR-10 uses data.root when it holds the torchvision copy.
    """
    ev = cfg.eval
    if ev.ref_images:
        src = Path(ev.ref_images).expanduser()
        if not src.exists():
            raise ReferenceStatsMissing(f"eval.ref_images={ev.ref_images!r}: {src} does not exist")
        if (src / "cifar-10-batches-py").is_dir():
            return _cifar10_images(src, ev.ref_split, stats_dir)
        digest = hashlib.sha256(str(src.resolve()).encode()).hexdigest()[:8]
        return ReferenceImages(f"{src.name}-{digest}", str(src), lambda: src)
    if cfg.data.name == "shapes":
        n, seed, size = cfg.eval.n_samples, SHAPES_SEEDS["val"], cfg.model.img_size
        key = f"shapes_seed{seed}_n{n}_{size}px"
        folder = stats_dir / key

        def prepare() -> Path:
            if not (folder / ".complete").is_file():
                save_shapes_folder(folder, n, seed=seed, size=size)
                (folder / ".complete").touch()
            return folder

        return ReferenceImages(key, f"Shapes held-out set (seed {seed})", prepare)
    if cfg.data.name == "cifar10" and (Path(cfg.data.root) / "cifar-10-batches-py").is_dir():
        return _cifar10_images(Path(cfg.data.root), ev.ref_split, stats_dir)
    return None


def _cifar10_images(root: Path, split: str, stats_dir: Path) -> ReferenceImages:
    """The torchvision CIFAR-10 copy in `root`, exported as PNGs once (cached). It is read
    with uvic.data's loader (torchvision's MD5 check): a missing or corrupt copy is one
    `DatasetError` line, raised by `check()` before an evaluation samples anything."""
    folder = stats_dir / f"cifar10_{split}_png"
    loaded: list[np.ndarray] = []  # the arrays, once read

    def check() -> None:
        if not loaded and not (folder / ".complete").is_file():
            loaded.append(CIFAR10Images(root, "train" if split == "train" else "test").data.data)

    def prepare() -> Path:
        if not (folder / ".complete").is_file():
            check()
            folder.mkdir(parents=True, exist_ok=True)
            for i, array in enumerate(loaded[0]):
                Image.fromarray(array).save(folder / f"{i:06d}.png")
            (folder / ".complete").touch()
        return folder

    return ReferenceImages(f"cifar10_{split}", f"CIFAR-10 {split} from {root}", prepare, check)


def stats_plan(
    cfg: Config, mode: str, feat_extractor: Callable | None, stats_dir: Path,
    allow_download: bool,
) -> tuple[str, Path, ReferenceImages | None]:
    """Decide where the reference statistics come from, without heavy work (a CIFAR-10 copy
    still to be exported is read once, to check it before any sampling).

    Returns (kind, path, images): "file" (load `path`), "build" (features of `images`,
    saved to `path`) or "download" (clean-fid fetches its named statistics). In order:
    eval.ref_stats as a local .npz (built there from the images if missing); clean-fid's
    named statistics in its package folder; our cache of statistics built from local
    images (stats_dir, one file per image set, mode and extractor); clean-fid's download.
    A stand-in extractor never uses Inception statistics. Raises ReferenceStatsMissing.
    """
    ev = cfg.eval
    tag = extractor_tag(feat_extractor)
    is_file = ev.ref_stats.endswith(".npz")
    named = _cleanfid_stats_path(ev.ref_stats or cfg.data.name, mode, ev.ref_split, ev.ref_res)
    images = reference_images(cfg, stats_dir)
    if feat_extractor is None and is_file:
        path = Path(ev.ref_stats).expanduser()
        if path.is_file():
            return "file", path, None
        if images is not None:
            images.check()
            return "build", path, images
        raise ReferenceStatsMissing(
            f"FID reference statistics not found at {path} (eval.ref_stats): set "
            "eval.ref_images to the reference images to build them there")
    if feat_extractor is None and not is_file and named.is_file():
        return "file", named, None
    if images is not None:
        path = stats_dir / f"{images.key}_{mode}_{tag}_{ev.ref_res}.npz"
        if path.is_file():
            return "file", path, images
        images.check()
        return "build", path, images
    if feat_extractor is None and allow_download:
        return "download", named, None
    hint = "set eval.ref_images to a folder of reference images to build them"
    if cfg.data.name == "cifar10":
        hint += " (or data.root to a torchvision CIFAR-10 copy)"
    if feat_extractor is not None:
        raise ReferenceStatsMissing(f"no reference images for the {tag} features: {hint}")
    raise ReferenceStatsMissing(
        f"FID reference statistics not found at {named}: download {STATS_URL}/{named.name} "
        f"there (and {named.stem}_kid.npz for KID), pass --download, or {hint}")


def reference_statistics(
    cfg: Config, feat_extractor: Callable | None = None, *, mode: str | None = None,
    device: torch.device | str = "cpu", stats_dir: str | Path | None = None,
    allow_download: bool = False, batch_size: int = 64, num_workers: int = 0,
    progress: bool = True,
) -> ReferenceStats:
    """Reference statistics for cfg.eval: clean-fid named statistics (`cifar10`), a local
    .npz (eval.ref_stats), or statistics built once from local images (eval.ref_images,
    center-cropped and resized to eval.ref_res; Shapes renders a held-out set) and cached.

    With a custom (stand-in) feature extractor the statistics are always built from the
    images and cached under the extractor's name.
    """
    mode = check_mode(mode or cfg.eval.mode)
    stats_dir = Path(stats_dir) if stats_dir is not None else default_stats_dir()
    kind, path, images = stats_plan(cfg, mode, feat_extractor, stats_dir, allow_download)
    if kind == "download":
        ev = cfg.eval
        name, res, split = ev.ref_stats or cfg.data.name, ev.ref_res, ev.ref_split
        mu, sigma = get_reference_statistics(name, res, mode=mode, split=split)
        feats = get_reference_statistics(name, res, mode=mode, split=split, metric="KID")
        return ReferenceStats(mu, sigma, feats, f"clean-fid {path.name} (downloaded)")
    if kind == "file":
        return _load_stats(path)
    folder = images.prepare()
    files = list_images(folder)
    if len(files) < 2:
        raise ReferenceStatsMissing(f"reference images {folder}: found {len(files)} images")
    extractor = feat_extractor or build_inception(cfg, mode, device)
    feats = files_features(
        files, extractor, mode=mode, device=device, batch_size=batch_size,
        num_workers=num_workers, description=f"reference {Path(folder).name}",
        image_transform=functools.partial(crop_resize_array, size=cfg.eval.ref_res),
        progress=progress,
    )
    mu, sigma = feature_statistics(feats)
    source = f"{images.description}, {len(files)} images"
    with atomic_write(path, suffix=".npz") as tmp:
        np.savez_compressed(tmp, mu=mu, sigma=sigma, feats=feats.astype(np.float32),
                            source=np.array(source))
    return ReferenceStats(mu, sigma, feats, f"{source} ({path})")


def _load_stats(path: Path) -> ReferenceStats:
    """mu/sigma from a clean-fid style .npz; KID features from its `feats` or `<stem>_kid.npz`."""
    try:
        data = np.load(path)
        mu, sigma = data["mu"], data["sigma"]
    except (KeyError, OSError, ValueError) as err:
        msg = f"{path}: not a statistics file with mu and sigma ({err})"
        raise ReferenceStatsMissing(msg) from err
    feats = data.get("feats")
    kid_path = path.with_name(f"{path.stem}_kid.npz")
    if feats is None and kid_path.is_file():
        feats = np.load(kid_path)["feats"]
    source = str(data["source"]) if "source" in data else str(path)
    return ReferenceStats(mu, sigma, feats, source if source == str(path) else f"{source} ({path})")


