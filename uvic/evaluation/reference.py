"""Reference statistics for FID, with clean-fid. In order (`stats_plan`): eval.ref_stats as a
local .npz, clean-fid's named statistics (`cifar10`), statistics built once from local
images and cached with the fingerprint of their source (rebuilt, saying why, when it no
longer matches), or clean-fid's download with `allow_download=True`. Missing or invalid
statistics (`ReferenceStatsMissing`, `ReferenceStatsInvalid`) stop before any sampling.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import cleanfid
import numpy as np
import torch
import torchvision
from cleanfid.features import get_reference_statistics
from cleanfid.fid import get_batch_features
from cleanfid.resize import build_resizer
from PIL import Image
from tqdm import tqdm

from uvic.config import Config, EvalConfig
from uvic.config.evaluation import check_mode
from uvic.data.datasets import SHAPES_SEEDS, CIFAR10Images, save_shapes_folder
from uvic.evaluation import fingerprint as fp
from uvic.evaluation.statistics import (
    build_inception,
    cache_dir,
    check_inception,
    crop_resize_array,
    extractor_tag,
    feature_statistics,
    files_features,
    inception_weights_path,
    list_images,
)
from uvic.files import atomic_write, write_json

STATS_URL = "https://www.cs.cmu.edu/~clean-fid/stats"  # clean-fid's get_reference_statistics


INCEPTION_DIM = 2048  # clean-fid's Inception pool_3 features: mu (2048,), sigma (2048, 2048)


class ReferenceStatsMissing(FileNotFoundError):
    """Reference statistics are neither on disk nor buildable from local images."""


class ReferenceStatsInvalid(ValueError):
    """A reference statistics file lacks a key or holds an array of the wrong shape."""


@dataclass
class ReferenceStats:
    """Reference mean/covariance, features for KID when available, where they came from,
    and a digest identifying them (`uvic.evaluation.fingerprint.digest`)."""

    mu: np.ndarray
    sigma: np.ndarray
    feats: np.ndarray | None
    source: str
    digest: str = ""


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
    raises before any sampling if `prepare()` could not work, `source()` is the cheap
    fingerprint of what the images come from (`uvic.evaluation.fingerprint`)."""

    key: str
    description: str
    prepare: Callable[[], Path]
    source: Callable[[], dict[str, Any]]
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
        return ReferenceImages(f"{src.name}-{digest}", str(src), lambda: src,
                               lambda: fp.files_source(src, list_images(src)))
    if cfg.data.name == "shapes":
        n, seed, size = cfg.eval.n_samples, SHAPES_SEEDS["val"], cfg.model.img_size
        key = f"shapes_seed{seed}_n{n}_{size}px"
        folder = stats_dir / key

        def prepare() -> Path:
            if not (folder / ".complete").is_file():
                save_shapes_folder(folder, n, seed=seed, size=size)
                (folder / ".complete").touch()
            return folder

        source = {"kind": "shapes", "seed": seed, "n": n, "size": size}
        return ReferenceImages(key, f"Shapes held-out set (seed {seed})", prepare,
                               lambda: source)
    if cfg.data.name == "cifar10" and (Path(cfg.data.root) / "cifar-10-batches-py").is_dir():
        return _cifar10_images(Path(cfg.data.root), ev.ref_split, stats_dir)
    return None


def _cifar10_images(root: Path, split: str, stats_dir: Path) -> ReferenceImages:
    """The torchvision CIFAR-10 copy in `root`, exported as PNGs (cached, with the batch
    files' fingerprint in its `.complete`: another or a changed copy is exported again). It
    is read with uvic.data's loader (torchvision's MD5 check): a missing or corrupt copy is
    one `DatasetError` line, raised by `check()` before an evaluation samples anything."""
    folder, subset = stats_dir / f"cifar10_{split}_png", "train" if split == "train" else "test"
    batches = root / "cifar-10-batches-py"
    names = [f"data_batch_{i}" for i in range(1, 6)] if subset == "train" else ["test_batch"]
    loaded: list[np.ndarray] = []  # the arrays, once read

    def source() -> dict[str, Any]:
        return fp.files_source(batches, [batches / name for name in names], content=True)

    def exported() -> bool:
        try:
            return json.loads((folder / ".complete").read_text()) == source()
        except (OSError, ValueError):  # none yet, or an empty marker of an older uvic
            return False

    def check() -> None:
        if not loaded and not exported():
            loaded.append(CIFAR10Images(root, subset).data.data)

    def prepare() -> Path:
        if not exported():
            marked = source()
            check()
            folder.mkdir(parents=True, exist_ok=True)
            (folder / ".complete").unlink(missing_ok=True)
            for old in folder.glob("*.png"):
                old.unlink()
            for i, array in enumerate(loaded[0]):
                Image.fromarray(array).save(folder / f"{i:06d}.png")
            write_json(folder / ".complete", marked)
        return folder

    return ReferenceImages(f"cifar10_{split}", f"CIFAR-10 {split} from {root}", prepare,
                           source, check)


class StatsPlan(NamedTuple):
    """Where the reference statistics come from (`stats_plan`): kind, path, images, why a
    cache is rebuilt ("" if not) and the fingerprint of what they are built from."""

    kind: str
    path: Path
    images: ReferenceImages | None
    reason: str = ""
    fingerprint: dict[str, Any] | None = None


def _fingerprint(ev: EvalConfig, images: ReferenceImages, feat_extractor: Callable | None,
                 mode: str) -> dict[str, Any]:
    """What statistics built from `images` depend on: their source, the feature extractor
    (Inception: its weights file), the mode and the resolution."""
    weights = inception_weights_path(ev, mode)[0] if feat_extractor is None else None
    return {"version": fp.VERSION, "source": images.source(), "mode": mode,
            "features": fp.extractor_identity(feat_extractor, extractor_tag(feat_extractor),
                                              weights),
            "res": ev.ref_res}


def _cached(path: Path, images: ReferenceImages, fingerprint: dict[str, Any]) -> StatsPlan:
    """Load the statistics at `path` if they were built from `fingerprint`'s data, else
    plan their (re)build, saying why."""
    reason = fp.stale(path, fingerprint) if path.is_file() else ""
    if path.is_file() and not reason:
        return StatsPlan("file", path, images, fingerprint=fingerprint)
    images.check()
    return StatsPlan("build", path, images, reason, fingerprint)


def stats_plan(
    cfg: Config, mode: str, feat_extractor: Callable | None, stats_dir: Path,
    allow_download: bool,
) -> StatsPlan:
    """Decide where the reference statistics come from, without heavy work (a CIFAR-10 copy
    still to be exported is read once, to check it before any sampling).

    Returns (kind, path, images, reason, fingerprint): "file" (load `path`), "build"
    (features of `images`, saved to `path`; `reason` says why an existing file is rebuilt)
    or "download" (clean-fid fetches its named statistics). In order: eval.ref_stats as a
    local .npz (built there from the images if missing, and rebuilt if uvic built it from
    files that have changed since); clean-fid's named statistics in its package folder;
    our cache of statistics built from local images (stats_dir, one file per image set,
    mode and extractor, used only while its fingerprint matches); clean-fid's download.
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
            if check_stats_file(path) == "images":
                check_inception(cfg.eval, mode)  # the file's images are scored with Inception
            if images is None or fp.stored(path) is None:  # the user's file: used as is
                return StatsPlan("file", path, None)
            return _cached(path, images, _fingerprint(cfg.eval, images, feat_extractor, mode))
        if images is not None:
            images.check()
            return StatsPlan("build", path, images,
                             fingerprint=_fingerprint(cfg.eval, images, feat_extractor, mode))
        raise ReferenceStatsMissing(
            f"FID reference statistics not found at {path} (eval.ref_stats, e.g. --set "
            f"eval.ref_stats=PATH): put the statistics file there (the U-ViT release's "
            f"assets/fid_stats/{path.name} or ADM's reference batch) or set eval.ref_images "
            "to the reference images to build it there")
    if feat_extractor is None and not is_file and named.is_file():
        return StatsPlan("file", named, None)
    if images is not None:
        path = stats_dir / f"{images.key}_{mode}_{tag}_{ev.ref_res}.npz"
        return _cached(path, images, _fingerprint(cfg.eval, images, feat_extractor, mode))
    if feat_extractor is None and allow_download:
        return StatsPlan("download", named, None)
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
    plan = stats_plan(cfg, mode, feat_extractor, stats_dir, allow_download)
    kind, path, images = plan[:3]
    if kind == "download":
        ev = cfg.eval
        name, res, split = ev.ref_stats or cfg.data.name, ev.ref_res, ev.ref_split
        mu, sigma = get_reference_statistics(name, res, mode=mode, split=split)
        feats = get_reference_statistics(name, res, mode=mode, split=split, metric="KID")
        return ReferenceStats(mu, sigma, feats, f"clean-fid {path.name} (downloaded)",
                              fp.file_digest(path))
    if kind == "file":
        if check_stats_file(path, INCEPTION_DIM if feat_extractor is None else None) == "images":
            extractor = feat_extractor or build_inception(cfg.eval, mode, device)
            return _images_stats(path, extractor, mode, device, batch_size, progress)
        return _load_stats(path)
    if plan.reason:
        print(f"rebuilding the reference statistics {path}: {plan.reason}", file=sys.stderr)
    folder = images.prepare()
    files = list_images(folder)
    if len(files) < 2:
        raise ReferenceStatsMissing(f"reference images {folder}: found {len(files)} images")
    extractor = feat_extractor or build_inception(cfg.eval, mode, device)
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
                            source=np.array(source), fingerprint=fp.encode(plan.fingerprint))
    return ReferenceStats(mu, sigma, feats, f"{source} ({path})", fp.digest(plan.fingerprint))


def check_stats_file(path: Path, dim: int | None = INCEPTION_DIM) -> str:
    """What a statistics .npz holds, checked before any sampling: "stats" (mu and sigma:
    clean-fid's and uvic's files, the U-ViT release's fid_stats, ADM's reference batches)
    or "images" (only ADM's `arr_0` images, to be scored). Raises ReferenceStatsInvalid,
    one line naming the file and the key, on a missing key or a wrong shape (mu (dim,),
    sigma (dim, dim); dim None: any, as for a stand-in extractor's cached statistics)."""
    try:
        data = np.load(path)
        keys = set(data.files)
    except (OSError, ValueError, AttributeError) as err:  # AttributeError: an .npy, not .npz
        raise ReferenceStatsInvalid(f"{path}: not an .npz statistics file ({err})") from err
    if not {"mu", "sigma"} <= keys:
        if "arr_0" in keys:
            return _check_images(path, data["arr_0"])
        missing = "mu" if "mu" not in keys else "sigma"
        raise ReferenceStatsInvalid(
            f"{path}: no key {missing!r} (keys: {', '.join(sorted(keys)) or 'none'}); a "
            "statistics file holds mu and sigma, an ADM reference batch arr_0")
    mu, sigma = data["mu"], data["sigma"]
    d = dim if dim is not None else (mu.shape[0] if mu.ndim == 1 else -1)
    for key, array, shape in (("mu", mu, (d,)), ("sigma", sigma, (d, d))):
        if array.shape != shape or not np.issubdtype(array.dtype, np.floating):
            want = " x ".join(str(n) if n >= 0 else "F" for n in shape)
            raise ReferenceStatsInvalid(
                f"{path}: key {key!r} has shape {array.shape} ({array.dtype}), expected a "
                f"float array of {want}" + (" (Inception pool features)" if dim else ""))
    return "stats"


def _check_images(path: Path, images: np.ndarray) -> str:
    """An `arr_0` of uint8 images (N >= 2, H, W, 3), as ADM's reference batches hold."""
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3 \
            or len(images) < 2:
        raise ReferenceStatsInvalid(
            f"{path}: key 'arr_0' has shape {images.shape} ({images.dtype}), expected uint8 "
            "images N x H x W x 3 (N >= 2), or keys mu and sigma")
    return "images"


def _load_stats(path: Path) -> ReferenceStats:
    """mu/sigma of a statistics .npz checked by `check_stats_file`; KID features from its
    `feats` or `<stem>_kid.npz`. ADM's reference batches hold Inception pool statistics as
    mu/sigma (used here) and spatial ones as mu_s/sigma_s (not FID's; ignored)."""
    data = np.load(path)
    mu, sigma = data["mu"], data["sigma"]
    feats = data.get("feats")
    kid_path = path.with_name(f"{path.stem}_kid.npz")
    if feats is None and kid_path.is_file():
        feats = np.load(kid_path)["feats"]
    source = str(data["source"]) if "source" in data else str(path)
    if "arr_0" in data.files and source == str(path):
        source = f"{path} (ADM reference batch: mu/sigma of pool features, mu_s/sigma_s unused)"
    built = fp.stored(path)  # uvic's statistics: what they were built from, else the file
    return ReferenceStats(mu, sigma, feats, source if source.startswith(str(path))
                          else f"{source} ({path})",
                          fp.digest(built) if built is not None else fp.file_digest(path))


def _images_stats(path: Path, extractor: Callable, mode: str, device: torch.device | str,
                  batch_size: int, progress: bool) -> ReferenceStats:
    """Statistics of the `arr_0` images of an ADM reference batch without mu/sigma, with
    clean-fid's resizing for `mode` and `extractor` (Inception, from its local weights)."""
    images = np.load(path)["arr_0"]
    resize = build_resizer(mode)
    to_tensor = torchvision.transforms.ToTensor()
    batches = range(0, len(images), batch_size)
    feats = []
    for start in tqdm(batches, desc=f"reference {path.name}", disable=not progress):
        resized = [resize(image) for image in images[start:start + batch_size]]
        batch = torch.stack([to_tensor(r) * 255 if r.dtype == np.uint8 else to_tensor(r)
                             for r in resized])  # as clean-fid's ResizeDataset
        feats.append(get_batch_features(batch, extractor, torch.device(device)))
    feats = np.concatenate(feats).astype(np.float64)
    mu, sigma = feature_statistics(feats)
    scored = {"file": fp.file_digest(path), "features": extractor_tag(extractor), "mode": mode}
    return ReferenceStats(mu, sigma, feats, f"{path} ({len(images)} arr_0 images, {mode})",
                          fp.digest(scored))
