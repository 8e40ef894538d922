"""ImageNet for the U-ViT release's class-conditional rows: 64x64 pixels read from the
ILSVRC-2012 class folders (`data.name="imagenet"`), or 256 and 512 px latents drawn from
the VAE moments that `uvic-extract-imagenet` stores (`data.name="imagenet_features"`).
A class index is its wnid's position in sorted order, as the release numbers them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from uvic.config import Config, ConfigError
from uvic.data.base import DatasetError, to_signed
from uvic.models.autoencoder import sample_from_moments

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".gif")  # what the release lists, in any case
VAE_FACTOR = 8  # KL-f8: a 256x256 image has 32x32 latents

# Feature folder layout (written by uvic.data.imagenet_extraction): <root>/meta.json (the
# extraction settings), and in <root>/<split>/: classes.json (wnids in class order),
# files.json (images in row order), labels.npy (N,), moments.npy and moments_flip.npy
# (N, 8, h, w: VAE [mean, logvar] of each crop and of its mirror image), the optional
# repa.npy ((N, L, D) float16 encoder features) and progress.json ("complete" when done).
META_FILE = "meta.json"
CLASSES_FILE = "classes.json"
FILES_FILE = "files.json"
LABELS_FILE = "labels.npy"
MOMENTS_FILE = "moments.npy"
FLIPPED_FILE = "moments_flip.npy"
REPA_FILE = "repa.npy"
PROGRESS_FILE = "progress.json"
EXTRACT_HINT = ("run `uvic-extract-imagenet --imagenet data/imagenet --out {root} "
                "--resolution {resolution}`")


# --------------------------------------------------------------------------- class folders


@dataclass(frozen=True)
class ClassFolders:
    """The images of one split folder in class-folder layout, in the release's order:
    classes by sorted wnid, images by sorted file name within each class."""

    folder: Path
    classes: tuple[str, ...]  # wnids; class index = position
    paths: np.ndarray  # (N,) bytes: "<wnid>/<file>" relative to `folder` (compact in workers)
    labels: np.ndarray  # (N,) int64

    def __len__(self) -> int:
        return len(self.labels)

    def file(self, index: int) -> Path:
        """Path of image `index`."""
        return self.folder / os.fsdecode(self.paths[index])

    def relative(self) -> list[str]:
        """Every image's path relative to the split folder, in order."""
        return [os.fsdecode(p) for p in self.paths]

    def class_counts(self) -> np.ndarray:
        """(classes,) int64 number of images per class."""
        return np.bincount(self.labels, minlength=len(self.classes))


def class_folder_names(folder: Path) -> list[str]:
    """The class folders of an ImageNet split folder, sorted: label i is the i-th (the one
    rule for the labels of the images and for a class named by its folder)."""
    with os.scandir(folder) as entries:
        return sorted(e.name for e in entries if e.is_dir() and not e.name.startswith("."))


def read_class_folders(folder: str | Path, per_class: int | None = None) -> ClassFolders:
    """List ``<folder>/<wnid>/*`` images (``.jpg``, ``.jpeg``, ``.png``, ``.gif``, any case).

    `per_class` keeps the first that many images of every class (a quick subset). Raises
    DatasetError naming the folder when it is missing, holds no class folders, or has a class
    folder without images (a half-copied dataset would otherwise shift every later label).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise DatasetError(f"ImageNet folder not found: {folder} (expected the ILSVRC-2012 "
                           "images in class folders, e.g. <root>/train/n01440764/*.JPEG)")
    classes = class_folder_names(folder)
    if not classes:
        raise DatasetError(f"ImageNet folder {folder} holds no class folders (expected one "
                           "folder of images per class, named by its wnid, e.g. n01440764/)")
    paths: list[bytes] = []
    labels: list[int] = []
    for label, wnid in enumerate(classes):
        with os.scandir(folder / wnid) as entries:
            names = sorted(e.name for e in entries
                           if e.name.lower().endswith(IMAGE_SUFFIXES) and e.is_file())
        if not names:
            raise DatasetError(f"ImageNet class folder {folder / wnid} holds no images "
                               f"({', '.join(IMAGE_SUFFIXES)}); every class needs at least one")
        names = names[:per_class]
        paths += [os.fsencode(f"{wnid}/{name}") for name in names]
        labels += [label] * len(names)
    return ClassFolders(folder, tuple(classes), np.array(paths, dtype=bytes),
                        np.array(labels, dtype=np.int64))


# --------------------------------------------------------------------------- the crop


def adm_center_crop(image: Image.Image, size: int) -> np.ndarray:
    """The release's ImageNet crop (guided-diffusion's ``center_crop_arr``): uint8
    (size, size, 3).

    While the short side is at least twice `size`, halve the image (BOX filter, sides
    floored); then a BICUBIC resize brings the short side to `size` (the long side rounded);
    then the central size x size square (offsets floored).
    """
    while min(image.size) >= 2 * size:
        image = image.resize(tuple(side // 2 for side in image.size),
                             resample=Image.Resampling.BOX)
    scale = size / min(image.size)
    image = image.resize(tuple(round(side * scale) for side in image.size),
                         resample=Image.Resampling.BICUBIC)
    pixels = np.asarray(image)
    top, left = (pixels.shape[0] - size) // 2, (pixels.shape[1] - size) // 2
    return pixels[top:top + size, left:left + size]


def load_crop(path: Path, size: int) -> np.ndarray:
    """An image file, as RGB, cropped by `adm_center_crop`: uint8 (size, size, 3)."""
    with Image.open(path) as image:
        image.load()
        return adm_center_crop(image.convert("RGB"), size)


# --------------------------------------------------------------------------- pixels


class ImageNetImages(Dataset):
    """ImageNet images of one class-folder split at `resolution` (ImageNet 64).

    Item i: image i cropped by `adm_center_crop`, mirrored with probability 1/2 if `flip`
    (the global torch RNG decides, which the training loop seeds per item), in [-1, 1], and
    its class index under "y" if `labels`. An unreadable image is named in a DatasetError.
    """

    def __init__(self, folder: str | Path, resolution: int, flip: bool = False,
                 labels: bool = True) -> None:
        self.listing = read_class_folders(folder)
        self.resolution, self.flip, self.labels = resolution, flip, labels
        self.item_shape = (3, resolution, resolution)
        self.num_classes = len(self.listing.classes)

    def __len__(self) -> int:
        return len(self.listing)

    def class_counts(self) -> np.ndarray:
        """(classes,) images per class (the release draws FID labels in these proportions)."""
        return self.listing.class_counts()

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        path = self.listing.file(index)
        try:
            pixels = load_crop(path, self.resolution)
        except (OSError, ValueError, SyntaxError) as err:  # PIL's decode errors
            raise DatasetError(f"cannot read image {path} ({type(err).__name__}: {err})") from err
        if self.flip and torch.rand(()) < 0.5:
            pixels = np.ascontiguousarray(pixels[:, ::-1])
        item = {"x": to_signed(pixels)}
        if self.labels:
            item["y"] = torch.tensor(int(self.listing.labels[index]), dtype=torch.int64)
        return item


# --------------------------------------------------------------------------- latents


def read_meta(root: Path) -> dict[str, Any]:
    """The extraction settings of a feature folder (``meta.json``'s "settings")."""
    path = root / META_FILE
    if not path.is_file():
        raise DatasetError(f"ImageNet features missing: {path}; "
                           + EXTRACT_HINT.format(root=root, resolution=256))
    return json.loads(path.read_text())["settings"]


class ImageNetFeatures(Dataset):
    """ImageNet VAE moments (and their mirror images') from the extractor's arrays.

    Item i < n (n = images, less those the extraction skipped as unreadable): a fresh latent
    ``(mean + exp(logvar / 2) * noise) * scale_factor`` of image i; item n + i: of its mirror
    image (only with `flip`), as the release stores both. The arrays are opened lazily in
    each DataLoader worker; latents draw from the global torch RNG.
    """

    def __init__(self, root: str | Path, split: str = "train", scale_factor: float = 0.18215,
                 flip: bool = True, labels: bool = True, repa: bool = False) -> None:
        self.root = Path(root)
        settings = read_meta(self.root)
        self.resolution = int(settings["resolution"])
        hint = EXTRACT_HINT.format(root=self.root, resolution=self.resolution)
        self.folder = self.root / split
        files = (CLASSES_FILE, LABELS_FILE, MOMENTS_FILE, FLIPPED_FILE, PROGRESS_FILE,
                 *((REPA_FILE,) if repa else ()))
        for name in files:
            if not (self.folder / name).is_file():
                raise DatasetError(f"ImageNet features missing: {self.folder / name}; {hint}")
        progress = json.loads((self.folder / PROGRESS_FILE).read_text())
        if not progress.get("complete", False):
            done, total = len(progress.get("done_chunks", [])), progress.get("num_chunks", "?")
            raise DatasetError(f"ImageNet features in {self.folder} are incomplete ({done}/"
                               f"{total} chunks); rerun the extraction to resume: {hint}")
        self.classes = json.loads((self.folder / CLASSES_FILE).read_text())
        self.num_classes = len(self.classes)
        all_labels = np.load(self.folder / LABELS_FILE)
        check_labels(all_labels, self.num_classes, self.folder / LABELS_FILE)
        skipped = {int(s["index"]) for s in progress.get("skipped", [])}
        self.indices = np.array([i for i in range(len(all_labels)) if i not in skipped],
                                dtype=np.int64)
        self.label_of = all_labels
        moments = np.load(self.folder / MOMENTS_FILE, mmap_mode="r")
        if len(moments) != len(all_labels):
            raise DatasetError(f"{self.folder / MOMENTS_FILE} has {len(moments)} rows but "
                               f"{LABELS_FILE} {len(all_labels)}; extract again into a new folder")
        self.item_shape = (moments.shape[1] // 2, *moments.shape[2:])  # latent (C, h, w)
        self.scale_factor, self.flip, self.labels = scale_factor, flip, labels
        if repa and "repa" not in settings:
            raise DatasetError(f"{self.root / META_FILE} records no REPA features; {hint} "
                               "--repa-encoder <the run's train.repa_encoder>")
        self.repa_grid = settings["repa"]["grid"] if repa else None
        self._arrays: tuple[np.ndarray, ...] | None = None  # reopened per worker

    def __len__(self) -> int:
        return len(self.indices) * (2 if self.flip else 1)

    def __getstate__(self) -> dict[str, Any]:  # workers reopen the memmaps themselves
        return {**self.__dict__, "_arrays": None}

    def class_counts(self) -> np.ndarray:
        """(classes,) images per class among the items."""
        return np.bincount(self.label_of[self.indices], minlength=self.num_classes)

    def row(self, index: int) -> tuple[int, bool]:
        """(row in the stored arrays, mirrored?) of item `index`."""
        n = len(self.indices)
        if not 0 <= index < len(self):
            raise IndexError(f"item {index} of {len(self)}")
        return int(self.indices[index % n]), index >= n

    def moments(self, index: int) -> torch.Tensor:
        """Stored VAE moments of item `index`, float32 (8, h, w)."""
        row, mirrored = self.row(index)
        return torch.from_numpy(np.array(self._open()[mirrored][row], dtype=np.float32))

    def _open(self) -> tuple[np.ndarray, ...]:
        if self._arrays is None:
            names = (MOMENTS_FILE, FLIPPED_FILE, *((REPA_FILE,) if self.repa_grid else ()))
            self._arrays = tuple(np.load(self.folder / n, mmap_mode="r") for n in names)
        return self._arrays

    def repa_features(self, index: int) -> torch.Tensor:
        """Stored REPA features of item `index`, float32 (L, D), mirrored on their grid
        for a mirrored item."""
        row, mirrored = self.row(index)
        features = torch.from_numpy(np.array(self._open()[2][row], dtype=np.float32))
        if mirrored:
            grid = self.repa_grid
            features = features.view(grid, grid, -1).flip(1).reshape(grid * grid, -1)
        return features

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = {"x": sample_from_moments(self.moments(index), self.scale_factor)}
        if self.labels:
            item["y"] = torch.tensor(int(self.label_of[self.row(index)[0]]), dtype=torch.int64)
        if self.repa_grid:
            item["repa"] = self.repa_features(index)
        return item


def check_labels(labels: np.ndarray, num_classes: int, path: Path) -> None:
    """Every label is a class index in [0, num_classes); else a DatasetError naming the
    file, the first bad row and its value."""
    bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if len(bad):
        row = int(bad[0])
        raise DatasetError(f"{path}: label {int(labels[row])} at row {row} is outside [0, "
                           f"{num_classes}) ({num_classes} classes; {len(bad)} bad rows)")


# --------------------------------------------------------------------------- dispatch


def build_imagenet(cfg: Config, split: str, flip: bool) -> Dataset:
    """The ImageNet dataset `cfg.data.name` names ("imagenet" or "imagenet_features") for
    `split`, checked against the model's input size (`uvic.data.datasets.build_dataset`
    checks the classes)."""
    data, model = cfg.data, cfg.model
    labels = model.num_classes > 0
    if data.name == "imagenet":
        return ImageNetImages(Path(data.root) / split, model.img_size, flip=flip, labels=labels)
    features = ImageNetFeatures(data.root, split, data.scale_factor, flip=flip, labels=labels,
                                repa=bool(cfg.train.repa_encoder) and split == "train")
    expected = (model.in_chans, model.img_size, model.img_size)
    if tuple(features.item_shape) != expected:
        shape = "x".join(map(str, features.item_shape))
        want = model.img_size * VAE_FACTOR
        raise ConfigError(
            f"data.root={data.root} holds latents {shape} of {features.resolution}x"
            f"{features.resolution} images, but model.in_chans/img_size expect "
            f"{'x'.join(map(str, expected))} ({want}x{want} images): point data.root at "
            f"features extracted with --resolution {want}")
    return features
