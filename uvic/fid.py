"""FID / KID evaluation with clean-fid: generate N samples, extract Inception features, compare.

Protocol (REFERENCE.md section 3): CIFAR-10, 50,000 unconditional samples against the
CIFAR-10 train set (clean-fid's named statistics `cifar10`/train/32, or statistics built
from a local CIFAR-10 copy); MS-COCO 256, 30,000 samples whose captions are drawn from the
val split, DPM-Solver 50 steps with guidance `eps = c + 1.0 (c - u)`, against val2014 at
256x256 (center crop, resize). `evaluate` does all of it and writes a result JSON;
`results_table` turns a folder of results into the paper's Table 3.

What we take from clean-fid and what we do ourselves:

* Features: clean-fid's resizing ("clean" PIL bicubic, or "legacy_pytorch") and its
  Inception networks, through `cleanfid.fid.get_folder_features` / `get_files_features`.
* Frechet distance: our own float64 implementation. clean-fid 0.1.35 computes it with
  `scipy.linalg.sqrtm(..., disp=False)`, and SciPy 1.18 removed `disp`, so
  `cleanfid.fid.compute_fid` / `frechet_distance` fail there. We never call them.
* Downloads: clean-fid silently downloads the Inception weights to
  /tmp/inception-2015-12-05.pt and statistics into its package folder, failing offline with
  a urllib traceback. We check every file first and raise `InceptionWeightsMissing` /
  `ReferenceStatsMissing` saying which file, where, and the URL clean-fid would use;
  downloading happens only with `allow_download=True` (`--download`).

Samples are PNG files `{index:06d}.png`. Sample i is seeded by (seed, i) (see
`uvic.seeding.SampleGenerator`), so a run can be interrupted and resumed (samples on disk are
kept) and split over any number of processes (Accelerate) with identical results.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import platform
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from scipy import linalg

from uvic.config import Config, to_dict
from uvic.diffusion import Diffusion
from uvic.files import atomic_write, write_json
from uvic.images import save_images
from uvic.sampling import (
    SamplingAssets,
    distributed_state,
    generate,
    guidance_scale,
    is_latent,
    load_model,
)

MODES = ("clean", "legacy_pytorch", "legacy_tensorflow")
INCEPTION_FILE = "inception-2015-12-05.pt"  # clean-fid's TorchScript Inception (clean mode)
STATS_URL = "https://www.cs.cmu.edu/~clean-fid/stats"  # clean-fid's get_reference_statistics
SAMPLE_NAME = re.compile(r"^(\d+)\.png$")
SAMPLES_META = "samples.json"
VAE_FACTOR = 8  # the Stable Diffusion KL-f8 autoencoder: 32x32 latents -> 256x256 pixels
# Protocol sample counts and the numbers of the paper's Table 3 (and the U-ViT release).
PROTOCOL_N = {"cifar10": 50_000, "mscoco": 30_000}
PAPER_FID = {("U-ViT", "cifar10"): 3.39, ("U-ViT", "mscoco"): 5.99,
             ("U-ViC", "cifar10"): 3.27, ("U-ViC", "mscoco"): 5.85}
RELEASE_FID = {("U-ViT", "cifar10"): 3.11, ("U-ViT", "mscoco"): 5.95}
DATASET_TITLES = {"cifar10": "CIFAR-10", "mscoco": "MS-COCO 256", "shapes": "Shapes"}


class InceptionWeightsMissing(FileNotFoundError):
    """The Inception network FID needs is not on disk; the message says how to get it."""


class ReferenceStatsMissing(FileNotFoundError):
    """Reference statistics are neither on disk nor buildable from local images."""


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


def feature_statistics(feats: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and covariance (float64) of features (N, F), as clean-fid computes them."""
    feats = np.asarray(feats, dtype=np.float64)
    if feats.ndim != 2 or len(feats) < 2:
        raise ValueError(f"need features of shape (N >= 2, F), got {feats.shape}")
    return feats.mean(axis=0), np.cov(feats, rowvar=False)


def kernel_distance(feats1: np.ndarray, feats2: np.ndarray, seed: int = 0) -> float:
    """KID with clean-fid's estimator (100 subsets of up to 1000), seeded: clean-fid draws
    the subsets from NumPy's global RNG, which we seed and then restore."""
    from cleanfid.fid import kernel_distance as cleanfid_kid

    state = np.random.get_state()
    try:
        np.random.seed(seed)
        return float(cleanfid_kid(np.asarray(feats1, np.float64), np.asarray(feats2, np.float64)))
    finally:
        np.random.set_state(state)


# --------------------------------------------------------------------------- Inception


def inception_weights_path(cfg: Config, mode: str | None = None) -> tuple[Path, str]:
    """Where the Inception weights for `mode` are expected, and clean-fid's URL for them.

    clean / legacy_tensorflow: clean-fid's TorchScript file (default /tmp, as clean-fid);
    legacy_pytorch: pytorch-fid's state dict in torch.hub's checkpoint folder.
    `cfg.eval.inception_path` overrides the location.
    """
    mode = _check_mode(mode or cfg.eval.mode)
    if mode == "legacy_pytorch":
        from cleanfid.inception_pytorch import FID_WEIGHTS_URL as url

        default = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(url)
    else:
        from cleanfid.downloads_helper import inception_url as url

        default = Path("." if platform.system() == "Windows" else "/tmp") / INCEPTION_FILE
    path = Path(cfg.eval.inception_path).expanduser() if cfg.eval.inception_path else default
    return path, url


def check_inception(cfg: Config, mode: str | None = None) -> Path:
    """The Inception weights file, or InceptionWeightsMissing saying how to get it."""
    path, url = inception_weights_path(cfg, mode)
    if not path.is_file():
        raise InceptionWeightsMissing(
            f"FID Inception weights not found at {path}: download {url} there "
            f"(curl -L -o {path} {url}) or set eval.inception_path to a local copy"
        )
    return path


def build_inception(
    cfg: Config, mode: str | None = None, device: torch.device | str = "cpu",
    allow_download: bool = False,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """clean-fid's Inception feature extractor for `mode`, from the local weights file
    (`check_inception`); images (B, 3, 299, 299) in [0, 255] -> features (B, 2048)."""
    from cleanfid.features import feature_extractor
    from cleanfid.inception_torchscript import InceptionV3W

    mode = _check_mode(mode or cfg.eval.mode)
    path, _ = inception_weights_path(cfg, mode)
    if not (allow_download and not cfg.eval.inception_path):
        path = check_inception(cfg, mode)
    device = torch.device(device)
    if mode == "legacy_pytorch":
        # clean-fid loads pytorch-fid's state dict through torch.hub's cache (named after its
        # URL): point a temporary hub folder at our file while it builds the network.
        from cleanfid.inception_pytorch import FID_WEIGHTS_URL

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


def _check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"eval.mode must be one of {MODES}, got {mode!r}")
    return mode


def extractor_tag(feat_extractor: Callable | None) -> str:
    """Name of a feature extractor for cache files and results ("inception" for ours)."""
    if feat_extractor is None:
        return "inception"
    return str(getattr(feat_extractor, "name", None) or getattr(
        feat_extractor, "__name__", type(feat_extractor).__name__))


# --------------------------------------------------------------------------- features


def center_crop_resize(image: np.ndarray, size: int) -> np.ndarray:
    """uint8 (H, W, 3) -> (size, size, 3): central square crop, then a Lanczos resize
    (the U-ViT release's MS-COCO preprocessing). Already size x size: unchanged."""
    h, w = image.shape[:2]
    if (h, w) == (size, size):
        return image
    s = min(h, w)
    top, left = (h - s) // 2, (w - s) // 2
    crop = Image.fromarray(np.ascontiguousarray(image[top : top + s, left : left + s]))
    return np.asarray(crop.resize((size, size), Image.Resampling.LANCZOS), dtype=np.uint8)


def files_features(
    files: Sequence[str | Path], feat_extractor: Callable, *, mode: str = "clean",
    device: torch.device | str = "cpu", batch_size: int = 64, num_workers: int = 0,
    image_transform: Callable[[np.ndarray], np.ndarray] | None = None,
    description: str = "features", progress: bool = True,
) -> np.ndarray:
    """Features (N, F) of image files with clean-fid's resizing for `mode` and a progress
    bar (`cleanfid.fid.get_files_features`)."""
    from cleanfid.fid import get_files_features

    feats = get_files_features(
        [str(f) for f in files], feat_extractor, num_workers=num_workers, batch_size=batch_size,
        device=torch.device(device), mode=mode, description=description, verbose=progress,
        custom_image_tranform=image_transform,  # (sic) clean-fid's spelling
    )
    return np.asarray(feats, dtype=np.float64)


def list_images(folder: str | Path) -> list[Path]:
    """Image files in `folder` (recursively, sorted), with clean-fid's extensions."""
    from cleanfid.utils import EXTENSIONS

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
    """Cache of reference statistics we build: $UVIC_FID_STATS or ~/.cache/uvic/fid_stats."""
    return Path(os.environ.get("UVIC_FID_STATS", "~/.cache/uvic/fid_stats")).expanduser()


def _cleanfid_stats_path(name: str, mode: str, split: str, res: int, kid: bool = False) -> Path:
    import cleanfid

    suffix = "_kid" if kid else ""
    file = f"{name}_{mode}_{split}_{res}{suffix}.npz".lower()
    return Path(os.path.dirname(cleanfid.__file__)) / "stats" / file


@dataclass
class ReferenceImages:
    """Local images to build reference statistics from: `key` names the set in cache files,
    `prepare()` returns the folder (rendering or exporting it first if needed)."""

    key: str
    description: str
    prepare: Callable[[], Path]


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
        from uvic.data import SHAPES_SEEDS, save_shapes_folder

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
    """The torchvision CIFAR-10 copy in `root`, exported as PNGs once (cached)."""
    from torchvision.datasets import CIFAR10

    folder = stats_dir / f"cifar10_{split}_png"

    def prepare() -> Path:
        if not (folder / ".complete").is_file():
            data = CIFAR10(str(root), train=split == "train", download=False)
            folder.mkdir(parents=True, exist_ok=True)
            for i, array in enumerate(data.data):
                Image.fromarray(array).save(folder / f"{i:06d}.png")
            (folder / ".complete").touch()
        return folder

    return ReferenceImages(f"cifar10_{split}", f"CIFAR-10 {split} from {root}", prepare)


def _stats_plan(
    cfg: Config, mode: str, feat_extractor: Callable | None, stats_dir: Path,
    allow_download: bool,
) -> tuple[str, Path, ReferenceImages | None]:
    """Decide where the reference statistics come from, without heavy work.

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
            return "build", path, images
        raise ReferenceStatsMissing(
            f"FID reference statistics not found at {path} (eval.ref_stats): set "
            "eval.ref_images to the reference images to build them there")
    if feat_extractor is None and not is_file and named.is_file():
        return "file", named, None
    if images is not None:
        path = stats_dir / f"{images.key}_{mode}_{tag}_{ev.ref_res}.npz"
        return ("file" if path.is_file() else "build"), path, images
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
    mode = _check_mode(mode or cfg.eval.mode)
    stats_dir = Path(stats_dir) if stats_dir is not None else default_stats_dir()
    kind, path, images = _stats_plan(cfg, mode, feat_extractor, stats_dir, allow_download)
    if kind == "download":
        from cleanfid.features import get_reference_statistics

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
        image_transform=functools.partial(center_crop_resize, size=cfg.eval.ref_res),
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


# --------------------------------------------------------------------------- samples on disk


def existing_samples(folder: str | Path) -> set[int]:
    """Indices of the samples already in `folder` (files named `{index:06d}.png`)."""
    folder = Path(folder)
    if not folder.is_dir():
        return set()
    return {int(m.group(1)) for p in folder.iterdir() if (m := SAMPLE_NAME.match(p.name))}


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file (identifies a checkpoint in results and sample folders)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _samples_meta(cfg: Config, ckpt_sha: str, seed: int, precision: str) -> dict[str, Any]:
    """What determines the images: a resumed run must match it exactly."""
    s = cfg.sample
    return {
        "checkpoint_sha256": ckpt_sha, "seed": seed, "precision": precision,
        "model": to_dict(cfg)["model"], "diffusion": to_dict(cfg)["diffusion"],
        "scheduler": s.scheduler, "steps": s.steps, "order": s.order,
        "cfg_scale": guidance_scale(cfg), "data": cfg.data.name,
        "captions": cfg.eval.captions if cfg.model.clip_dim > 0 else "",
    }


def _check_samples_meta(folder: Path, meta: dict[str, Any], write: bool) -> None:
    path = folder / SAMPLES_META
    if path.is_file():
        old = json.loads(path.read_text())
        for key, value in meta.items():
            if old.get(key) != value:
                raise ValueError(
                    f"{folder} holds samples made with other settings ({key}: "
                    f"{old.get(key)!r} != {value!r}); use another --samples-dir or empty it"
                )
    elif write:
        if existing_samples(folder):
            raise ValueError(f"{folder} holds samples but no {SAMPLES_META}; "
                             "use another --samples-dir or empty it")
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(meta, indent=2) + "\n")


# --------------------------------------------------------------------------- text contexts


def caption_context_fn(cfg: Config, seed: int) -> Callable[[list[int]], torch.Tensor]:
    """Contexts for text-to-image FID: sample i gets a caption of a random val image (image
    and caption drawn with a generator seeded by (seed, i), so it does not depend on
    batching). eval.captions is a split folder of the feature layout (`<root>/val`)."""
    from uvic.data import MSCOCOFeatures, build_dataset

    if cfg.eval.captions:
        folder = Path(cfg.eval.captions)
        dataset = MSCOCOFeatures(folder.parent, folder.name, scale_factor=cfg.data.scale_factor)
    else:
        dataset = build_dataset(cfg, "val")

    def context_fn(indices: list[int]) -> torch.Tensor:
        rows = []
        for i in indices:
            rng = np.random.default_rng([seed, int(i), 1])  # 1: the caption stream
            contexts = dataset.contexts(int(rng.integers(len(dataset))))
            rows.append(contexts[int(rng.integers(len(contexts)))])
        return torch.stack(rows)

    return context_fn


# --------------------------------------------------------------------------- evaluation


def checkpoint_step(ckpt: str | Path) -> int | None:
    """Training step of a checkpoint if known: `trainer_state.json` beside it, a `step_N`
    folder, or (for a run's top-level ema.safetensors) the step folder with the same file."""
    ckpt = Path(ckpt)
    state = ckpt.parent / "trainer_state.json"
    if state.is_file():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            return int(json.loads(state.read_text())["step"])
    match = re.search(r"step[_-]?(\d+)", ckpt.parent.name + "/" + ckpt.stem)
    if match:
        return int(match.group(1))
    siblings = sorted(ckpt.parent.glob(f"step_*/{ckpt.name}"), reverse=True)
    size = ckpt.stat().st_size
    for other in siblings:
        if other.stat().st_size == size and file_sha256(other) == file_sha256(ckpt):
            return checkpoint_step(other)
    return None


def model_label(cfg: Config) -> str:
    """Row label of a result: U-ViT / U-ViC for the presets, else the attention spec."""
    return {"uvit": "U-ViT", "uvic": "U-ViC"}.get(cfg.model.attention.strip().lower(),
                                                 cfg.model.attention)


def versions() -> dict[str, str]:
    """Versions of the libraries that determine a result."""
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for dist in ("torch", "diffusers", "clean-fid", "numpy", "scipy", "pillow", "accelerate",
                 "uvic"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[dist] = md.version(dist)
    return out


def evaluate(
    cfg: Config,
    ckpt_path: str | Path,
    n: int | None = None,
    out_json: str | Path | None = None,
    samples_dir: str | Path | None = None,
    feat_extractor: Callable | None = None,
    *,
    config_path: str | Path | None = None,
    seed: int = 0,
    precision: str = "fp32",
    stats_dir: str | Path | None = None,
    allow_download: bool = False,
    feature_batch_size: int = 64,
    num_workers: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Generate `n` samples of the checkpoint (resumable), compute FID and KID, write JSON.

    Sampler settings come from cfg.sample, the protocol from cfg.eval (mode, reference).
    Runs on every process of an `accelerate launch` (each samples its share); the main
    process then extracts features and returns the result (other processes return {}).
    `feat_extractor` replaces Inception (tests, quickstart without weights): a callable
    mapping (B, 3, 299, 299) images in [0, 255] to features (B, F).
    Raises InceptionWeightsMissing / ReferenceStatsMissing before sampling anything.
    """
    t_start = time.perf_counter()
    state = distributed_state()
    mode = _check_mode(cfg.eval.mode)
    n = int(n if n is not None else cfg.eval.n_samples)
    if n < 2:
        raise ValueError(f"FID needs at least 2 samples, got n={n}")
    ckpt_path = Path(ckpt_path)
    if not ckpt_path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {ckpt_path}")
    stem = f"{cfg.name}_{ckpt_path.parent.name}_{ckpt_path.stem}"
    out_json = Path(out_json) if out_json is not None else Path("runs/fid") / f"{stem}.json"
    samples_dir = (Path(samples_dir) if samples_dir is not None
                   else out_json.with_name(f"{out_json.stem}_samples"))
    stats_dir = Path(stats_dir) if stats_dir is not None else default_stats_dir()
    workers = num_workers if num_workers is not None else min(8, os.cpu_count() or 1)

    # Fail fast (before hours of sampling) on a wrong resolution, missing Inception
    # weights or missing statistics.
    res = cfg.model.img_size * (VAE_FACTOR if is_latent(cfg) else 1)
    if cfg.eval.ref_res != res:
        raise ValueError(f"eval.ref_res={cfg.eval.ref_res} but the samples are {res}x{res} "
                         "pixels; the reference must have the samples' resolution")
    if feat_extractor is None and not allow_download:
        check_inception(cfg, mode)
    _stats_plan(cfg, mode, feat_extractor, stats_dir, allow_download)

    ckpt_sha = file_sha256(ckpt_path)
    meta = _samples_meta(cfg, ckpt_sha, seed, precision)
    if state.is_main_process:
        _check_samples_meta(samples_dir, meta, write=True)
    state.wait_for_everyone()
    _check_samples_meta(samples_dir, meta, write=False)

    # Sampling: each process takes every num_processes-th missing index.
    done = existing_samples(samples_dir)
    todo = [i for i in range(n) if i not in done]
    mine = todo[state.process_index :: state.num_processes]
    t0 = time.perf_counter()
    if mine:
        device = state.device
        model = load_model(cfg, ckpt_path, device)
        diffusion = Diffusion(cfg.diffusion)
        assets = SamplingAssets.from_config(cfg, device)
        context_fn = caption_context_fn(cfg, seed) if cfg.model.clip_dim > 0 else None
        for indices, images in generate(
            model, diffusion, cfg, mine, seed=seed, context_fn=context_fn,
            uncond_context=assets.uncond, vae=assets.vae, device=device, precision=precision,
            progress=progress and state.is_main_process,
        ):
            save_images(images, samples_dir, indices)
        del model, assets
    t_sampling = time.perf_counter() - t0
    state.wait_for_everyone()
    if not state.is_main_process:
        return {}

    # Features and distances (main process).
    missing = [i for i in range(n) if i not in existing_samples(samples_dir)]
    if missing:
        raise RuntimeError(f"{samples_dir}: samples {missing[:5]} missing after generation")
    t0 = time.perf_counter()
    device = state.device
    extractor = feat_extractor or build_inception(cfg, mode, device, allow_download)
    ref = reference_statistics(
        cfg, feat_extractor, mode=mode, device=device, stats_dir=stats_dir,
        allow_download=allow_download, batch_size=feature_batch_size, num_workers=workers,
        progress=progress,
    )
    files = [samples_dir / f"{i:06d}.png" for i in range(n)]
    feats = files_features(files, extractor, mode=mode, device=device,
                           batch_size=feature_batch_size, num_workers=workers,
                           description=f"samples {samples_dir.name}", progress=progress)
    mu, sigma = feature_statistics(feats)
    fid = frechet_distance(mu, sigma, ref.mu, ref.sigma)
    kid = kernel_distance(ref.feats, feats, seed=seed) if ref.feats is not None else None
    t_features = time.perf_counter() - t0

    result = {
        "name": cfg.name,
        "model": model_label(cfg),
        "attention": cfg.model.attention,
        "dataset": cfg.data.name,
        "config_path": str(config_path) if config_path is not None else None,
        "checkpoint": str(ckpt_path),
        "checkpoint_sha256": ckpt_sha,
        "step": checkpoint_step(ckpt_path),
        "sampler": {"scheduler": cfg.sample.scheduler, "steps": cfg.sample.steps,
                    "order": cfg.sample.order, "precision": precision, "seed": seed},
        "guidance": guidance_scale(cfg),
        "n": n,
        "fid": fid,
        "kid": kid,
        "mode": mode,
        "feature_extractor": extractor_tag(feat_extractor),
        "reference": ref.source,
        "samples_dir": str(samples_dir),
        "result_json": str(out_json),
        "generated": len(todo),
        "reused": n - len(todo),
        "wall_time_s": {"total": time.perf_counter() - t_start, "sampling": t_sampling,
                        "features": t_features},
        "device": _device_name(device),
        "num_processes": state.num_processes,
        "versions": versions(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": to_dict(cfg),
    }
    write_json(out_json, result)
    return result


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return f"{device.type}: {platform.processor() or platform.machine()}"


# --------------------------------------------------------------------------- Table 3


def load_results(folder: str | Path) -> list[dict[str, Any]]:
    """Every result JSON (with an "fid" key) in `folder`, recursively."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"results folder not found: {folder}")
    results = []
    for path in sorted(folder.rglob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from err
        if isinstance(data, dict) and "fid" in data and "dataset" in data and "model" in data:
            data["_path"] = str(path)
            results.append(data)
    return results


def results_table(results: list[dict[str, Any]]) -> str:
    """Markdown Table 3: rows U-ViT / U-ViC (plus any other attention pattern), columns
    CIFAR-10 / MS-COCO (plus any other dataset), our FID beside the paper's. The best
    (lowest) FID per cell is shown; details of each shown result follow the table."""
    datasets = ["cifar10", "mscoco"]
    datasets += sorted({r["dataset"] for r in results} - set(datasets))
    models = ["U-ViT", "U-ViC"]
    models += sorted({r["model"] for r in results} - set(models))
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for r in results:
        key = (r["model"], r["dataset"])
        if key not in best or r["fid"] < best[key]["fid"]:
            best[key] = r

    has_paper = {d: any(key[1] == d for key in PAPER_FID) for d in datasets}
    header = ["Model"]
    for d in datasets:
        title = DATASET_TITLES.get(d, d)
        header += [f"{title} (ours)", f"{title} (paper)"] if has_paper[d] else [f"{title} (ours)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    notes: list[str] = []
    for m in models:
        row = [m]
        for d in datasets:
            r = best.get((m, d))
            if r is None:
                row.append("—")
            else:
                marks = ""
                protocol = PROTOCOL_N.get(d)
                if protocol and r["n"] < protocol:
                    marks += "*"
                if r.get("feature_extractor") != "inception" or r.get("mode") != "clean":
                    marks += "†"
                row.append(f"{r['fid']:.2f}{marks}")
                notes.append(_describe(r))
            if not has_paper[d]:
                continue
            paper = PAPER_FID.get((m, d))
            release = RELEASE_FID.get((m, d))
            cell = "—" if paper is None else f"{paper:.2f}"
            if release is not None:
                cell += f" (release {release:.2f})"
            row.append(cell)
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Lower is better. Paper: Cog-attention paper, Table 3 (U-ViT-S/2, 44M "
              "parameters); release: the U-ViT repository's reported FID.",
              "`*` fewer samples than the protocol (CIFAR-10 50,000; MS-COCO 30,000); "
              "`†` not clean-fid Inception features in clean mode: not comparable.", ""]
    if notes:
        lines += ["Results shown:", "", *notes]
    return "\n".join(lines) + "\n"


def _describe(r: dict[str, Any]) -> str:
    s = r.get("sampler", {})
    kid = r.get("kid")
    kid_text = f", KID {kid:.5f}" if isinstance(kid, int | float) and not math.isnan(kid) else ""
    step = f" step {r['step']}" if r.get("step") is not None else ""
    return (f"- {r['model']} / {DATASET_TITLES.get(r['dataset'], r['dataset'])}: FID "
            f"{r['fid']:.3f}{kid_text}; N={r['n']}, {s.get('scheduler', '?')} "
            f"{s.get('steps', '?')} steps, guidance {r.get('guidance', 0)}, mode {r.get('mode')}, "
            f"features {r.get('feature_extractor', 'inception')}; {r['checkpoint']}{step} "
            f"({Path(r['_path']).name})")
