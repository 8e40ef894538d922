"""CelebA 64x64 (`data.name="celeba"`), read from its own layout (``img_align_celeba/`` and
``list_eval_partition.txt`` in `data.root` or in ``<data.root>/celeba/``) and cropped as the
U-ViT release crops it: the train partition's aligned images (162,770), the 128 x 128
square centred at (89, 121), resized to `model.img_size`, optionally mirrored. The
release's CelebA model is unconditional: items are ``{"x": (3, H, W)}`` in [-1, 1].
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision.transforms import functional as TF

from uvic.data.base import DatasetError, to_signed

IMAGES = "img_align_celeba"
PARTITION_FILE = "list_eval_partition.txt"
PARTITIONS = {"train": 0, "val": 1, "test": 2}  # list_eval_partition.txt's codes
# The release's crop: a 128 x 128 square centred at (x, y) = (89, 121) of the aligned image.
CROP_CENTRE = (89, 121)
CROP_SIZE = 128
CROP_TOP = CROP_CENTRE[1] - CROP_SIZE // 2  # 57
CROP_LEFT = CROP_CENTRE[0] - CROP_SIZE // 2  # 25


def celeba_folder(root: str | Path) -> Path:
    """The folder holding ``img_align_celeba/``: `root` itself or torchvision's
    ``<root>/celeba``."""
    root = Path(root)
    return root / "celeba" if (root / "celeba" / IMAGES).is_dir() else root


def read_partition(folder: Path, split: str) -> list[str]:
    """File names of `split` in ``list_eval_partition.txt`` order; a missing file or a
    malformed line is named in a DatasetError."""
    path = folder / PARTITION_FILE
    if not path.is_file():
        raise DatasetError(f"CelebA split file not found: {path} (CelebA's "
                           f"{PARTITION_FILE}, next to {IMAGES}/)")
    names = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        words = line.split()
        if not words:
            continue
        if len(words) != 2 or words[1] not in ("0", "1", "2"):
            raise DatasetError(f"{path}, line {number}: expected '<image>.jpg <0|1|2>', got "
                               f"{line.strip()!r}")
        if int(words[1]) == PARTITIONS[split]:
            names.append(words[0])
    return names


def release_crop(image: Image.Image, resolution: int, path: Path) -> Image.Image:
    """The release's CelebA crop and resize of one RGB image (`path` names it in errors):
    rows 57..184, columns 25..152, then torchvision's bilinear antialiased ``resize``."""
    width, height = image.size
    if width < CROP_LEFT + CROP_SIZE or height < CROP_TOP + CROP_SIZE:
        raise DatasetError(f"CelebA image {path} is {width}x{height}, too small for the "
                           f"release's {CROP_SIZE}x{CROP_SIZE} crop at ({CROP_LEFT}, {CROP_TOP})"
                           " (the aligned images are 178x218)")
    square = TF.crop(image, CROP_TOP, CROP_LEFT, CROP_SIZE, CROP_SIZE)
    return TF.resize(square, resolution)


class CelebAImages(Dataset):
    """CelebA aligned images of one split, cropped as the release does (`release_crop`).

    The global torch RNG decides the flips (the training loop seeds it per item).
    """

    def __init__(self, root: str | Path, split: str = "train", resolution: int = 64,
                 flip: bool = False) -> None:
        if split not in PARTITIONS:
            raise ValueError(f"CelebA split must be one of {tuple(PARTITIONS)}, got {split!r}")
        self.folder = celeba_folder(root)
        images = self.folder / IMAGES
        if not images.is_dir():
            raise DatasetError(f"CelebA images not found: {images} (unzip "
                               f"img_align_celeba.zip there; data.root may also be the folder "
                               "holding celeba/)")
        self.names = read_partition(self.folder, split)
        if not self.names:
            raise DatasetError(f"{self.folder / PARTITION_FILE} lists no {split} images "
                               f"(partition {PARTITIONS[split]})")
        present = {p.name for p in images.iterdir()}
        missing = [n for n in self.names if n not in present]
        if missing:
            raise DatasetError(f"CelebA image not found: {images / missing[0]} ({len(missing)} "
                               f"of the {len(self.names)} {split} images missing)")
        self.resolution, self.flip = resolution, flip
        self.item_shape = (3, resolution, resolution)

    def __len__(self) -> int:
        return len(self.names)

    def file(self, index: int) -> Path:
        """Path of image `index`."""
        return self.folder / IMAGES / self.names[index]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        path = self.file(index)
        try:
            with Image.open(path) as image:
                rgb = image.convert("RGB")
        except (OSError, ValueError, SyntaxError) as err:  # PIL's decode errors
            raise DatasetError(f"cannot read image {path} ({type(err).__name__}: {err})") from err
        pixels = np.asarray(release_crop(rgb, self.resolution, path))
        if self.flip and torch.rand(()) < 0.5:
            pixels = np.ascontiguousarray(pixels[:, ::-1])
        return {"x": to_signed(pixels)}
