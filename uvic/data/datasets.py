"""Training data: CIFAR-10 pixels, the built-in Shapes quickstart set, MS-COCO latent
features; `build_dataset` dispatches to these and to ImageNet (`uvic.data.imagenet`) and
CelebA (`uvic.data.celeba`).

Every item is a dict ``{"x": (C, H, W)}`` in the model's input space (pixels in [-1, 1],
or scaled VAE latents), with ``"context"`` (a caption's CLIP token states) for MS-COCO
and the class under ``"y"`` for class-conditional data.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch.utils.data import Dataset
from torchvision import datasets, transforms

from uvic.config import Config, ConfigError, DataConfig
from uvic.config.data import check_data
from uvic.data.base import DatasetError, to_signed
from uvic.data.celeba import CelebAImages
from uvic.data.imagenet import build_imagenet
from uvic.models.autoencoder import sample_from_moments

SPLITS = ("train", "val", "test")

# MS-COCO feature folder layout (written by scripts/extract_mscoco_features.py): in <root>,
META_FILE = "meta.json"  # VAE, CLIP model, padding, resolution, versions
EMPTY_CONTEXT_FILE = "empty_context.npy"  # (77, D) float32, the empty prompt ""
SAMPLE_PROMPTS_FILE = "sample_prompts.json"  # prompts for sample grids
SAMPLE_CONTEXTS_FILE = "sample_contexts.npy"  # (P, 77, D) float32
# and in <root>/<split>/:
MOMENTS_FILE = "moments.npy"  # (N, 8, h, w) VAE posterior [mean, logvar]
CONTEXTS_FILE = "contexts.npy"  # (M, 77, D) caption token states
OFFSETS_FILE = "caption_offsets.npy"  # (N + 1,) int64: image i has rows offsets[i]:offsets[i+1]
CAPTIONS_FILE = "captions.json"  # the M caption texts
IMAGE_IDS_FILE = "image_ids.npy"  # (N,) int64 COCO image ids (sorted)
PROGRESS_FILE = "progress.json"  # extraction progress; "complete": true when done
REPA_FILE = "repa.npy"  # optional (N, L, D) float16 REPA encoder features (--repa-encoder)
EXTRACT_HINT = "run `python scripts/extract_mscoco_features.py --coco data/coco --out {root}`"

CIFAR10_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"


# --------------------------------------------------------------------------- CIFAR-10


class CIFAR10Images(Dataset):
    """CIFAR-10 through torchvision: pixels in [-1, 1], optional random horizontal flip.

    split "train" is the 50k training set; "val" and "test" are the 10k test set.
    """

    def __init__(self, root: str | Path, split: str = "train", flip: bool = False,
                 download: bool = False) -> None:
        root = Path(root)
        train = split == "train"
        try:
            self.data = datasets.CIFAR10(root=str(root), train=train, download=download)
        except (RuntimeError, OSError) as err:  # torchvision: not found/corrupted; no network
            raise DatasetError(_cifar10_problem(root, download, err)) from err
        except (pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError) as err:
            raise DatasetError(_cifar10_unreadable(root, err)) from err  # passed the MD5 check
        ops: list[Any] = [transforms.RandomHorizontalFlip()] if flip else []
        ops += [transforms.ToTensor(), transforms.Normalize((0.5,) * 3, (0.5,) * 3)]
        self.transform = transforms.Compose(ops)
        self.item_shape = (3, 32, 32)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        image, _label = self.data[index]  # PIL image, 32 x 32 RGB
        return {"x": self.transform(image)}


def _cifar10_problem(root: Path, download: bool, err: Exception) -> str:
    folder = root / "cifar-10-batches-py"
    missing = [name for name in CIFAR10_FILES if not (folder / name).is_file()]
    copy = f"copy the extracted cifar-10-batches-py folder there (from {CIFAR10_URL})"
    how = f"pass --set data.download=true or {copy}"
    if download:
        return f"CIFAR-10 download to {root} failed ({err}); without a network, {copy}"
    if missing:
        return (f"CIFAR-10 not found: {folder} lacks {', '.join(missing)} (expected "
                f"data_batch_1..5, test_batch, batches.meta); {how}")
    return (f"CIFAR-10 files in {folder} fail torchvision's MD5 check (corrupted or not the "
            f"official python version); {how}")


def _cifar10_unreadable(root: Path, err: Exception) -> str:
    """The CIFAR-10 file that does not unpickle to what torchvision reads from it (a batch:
    'data' and 'labels'; the metadata: 'label_names'), named with what is wrong."""
    folder = root / "cifar-10-batches-py"
    for name in CIFAR10_FILES:
        keys = ("label_names",) if name == "batches.meta" else ("data", "labels")
        try:
            with open(folder / name, "rb") as f:
                entry = pickle.load(f, encoding="latin1")
            lacking = [key for key in keys if key not in entry]
        except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError) as bad:
            return f"CIFAR-10 file {folder / name} is not a readable pickle ({bad})"
        if lacking:
            return (f"CIFAR-10 file {folder / name} lacks the key(s) {', '.join(lacking)} "
                    "(not the official python version of the data)")
    return f"CIFAR-10 files in {folder} cannot be read ({type(err).__name__}: {err})"


# --------------------------------------------------------------------------- Shapes

SHAPES_SEEDS = {"train": 0, "val": 1, "test": 1}  # val/test are held out from train
SHAPE_KINDS = ("circle", "square", "triangle")


def _contrasting_colours(rng: np.random.Generator, count: int) -> list[tuple[int, int, int]]:
    """A background colour and `count` shape colours, each far from the background in RGB."""
    background = rng.integers(0, 256, size=3)
    colours = [tuple(int(c) for c in background)]
    while len(colours) < count + 1:
        candidate = rng.integers(0, 256, size=3)
        if np.linalg.norm(candidate - background) > 160.0:
            colours.append(tuple(int(c) for c in candidate))
    return colours


def render_shapes_image(seed: int, index: int, size: int = 32, supersample: int = 4) -> np.ndarray:
    """Image `index` of the Shapes set with `seed`: (size, size, 3) uint8.

    One or two filled circles / squares / triangles of random size, position and colour on
    a plain background of a contrasting colour. Drawn at `supersample` x resolution and
    downsampled (anti-aliased edges). Depends only on (seed, index).
    """
    rng = np.random.default_rng([seed, index])
    n_shapes = int(rng.integers(1, 3))
    background, *colours = _contrasting_colours(rng, n_shapes)
    big = size * supersample
    canvas = Image.new("RGB", (big, big), background)
    draw = ImageDraw.Draw(canvas)
    for colour in colours:
        kind = SHAPE_KINDS[int(rng.integers(len(SHAPE_KINDS)))]
        radius = rng.uniform(0.12, 0.28) * big
        cx, cy = rng.uniform(radius, big - radius, size=2)
        box = (cx - radius, cy - radius, cx + radius, cy + radius)
        if kind == "circle":
            draw.ellipse(box, fill=colour)
        elif kind == "square":
            draw.rectangle(box, fill=colour)
        else:  # upright triangle inscribed in the box
            draw.polygon([(cx, cy - radius), (cx + radius, cy + radius),
                          (cx - radius, cy + radius)], fill=colour)
    return np.asarray(canvas.resize((size, size), Image.Resampling.LANCZOS), dtype=np.uint8)


class ShapesDataset(Dataset):
    """Built-in quickstart data: coloured shapes on plain backgrounds, no download needed.

    All `num_images` images are rendered once (uint8, in memory); image i depends only on
    (seed, i). Items are ``{"x": (3, size, size) in [-1, 1]}``, randomly h-flipped if `flip`.
    """

    def __init__(self, num_images: int, size: int = 32, seed: int = 0, flip: bool = False) -> None:
        if num_images < 1:
            raise ValueError(f"Shapes num_images must be >= 1, got {num_images}")
        self.seed, self.size, self.flip = seed, size, flip
        self.item_shape = (3, size, size)
        self.images = np.stack([render_shapes_image(seed, i, size) for i in range(num_images)])

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x = to_signed(self.images[index])
        if self.flip and torch.rand(()) < 0.5:
            x = x.flip(-1)
        return {"x": x}


def save_shapes_folder(path: str | Path, n: int, seed: int = SHAPES_SEEDS["train"],
                       size: int = 32) -> Path:
    """Write Shapes images 0..n-1 as PNGs (``000000.png``...), e.g. for FID reference stats."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.fromarray(render_shapes_image(seed, i, size)).save(path / f"{i:06d}.png")
    return path


# --------------------------------------------------------------------------- MS-COCO


def center_crop_resize(image: Image.Image, resolution: int) -> Image.Image:
    """The U-ViT release's COCO crop: the central min(h, w) square, then a LANCZOS resize.

    Used for feature extraction and for the FID reference images of MS-COCO 256.
    """
    w, h = image.size
    side = min(w, h)
    top, left = (h - side) // 2, (w - side) // 2
    square = image.crop((left, top, left + side, top + side))
    return square.resize((resolution, resolution), Image.Resampling.LANCZOS)


def _require(path: Path, root: Path) -> Path:
    if not path.exists():
        raise DatasetError(f"MS-COCO features missing: {path}; {EXTRACT_HINT.format(root=root)}")
    return path


class MSCOCOFeatures(Dataset):
    """MS-COCO latents + caption contexts from the extraction script's memory-mapped arrays.

    Item i: a fresh latent sample ``(mean + exp(logvar/2) * noise) * scale_factor`` of image
    i and the context of one of its captions, both drawn at random on every access. The
    arrays are opened lazily in each DataLoader worker. Randomness comes from the global
    torch RNG, in workers too (DataLoader seeds it per worker), so whoever seeds that RNG
    around an access (the training loop does, per item) makes the item reproducible.
    """

    def __init__(self, root: str | Path, split: str = "train",
                 scale_factor: float = 0.23010, repa: bool = False) -> None:
        self.root = Path(root)
        self.folder = _require(self.root / split, self.root)
        self.repa = repa  # items carry "repa": the stored encoder features of the image
        for name in (MOMENTS_FILE, CONTEXTS_FILE, OFFSETS_FILE, IMAGE_IDS_FILE, PROGRESS_FILE,
                     *((REPA_FILE,) if repa else ())):
            _require(self.folder / name, self.root)
        progress = json.loads((self.folder / PROGRESS_FILE).read_text())
        if not progress.get("complete", False):
            done, total = len(progress.get("done_chunks", [])), progress.get("num_chunks", "?")
            raise DatasetError(
                f"MS-COCO features in {self.folder} are incomplete ({done}/{total} chunks); "
                f"rerun the extraction script to resume: {EXTRACT_HINT.format(root=self.root)}"
            )
        self.scale_factor = scale_factor
        self.offsets = np.load(self.folder / OFFSETS_FILE)
        self.image_ids = np.load(self.folder / IMAGE_IDS_FILE)
        skipped = {int(s["index"]) for s in progress.get("skipped", [])}
        self.indices = np.array([i for i in range(len(self.image_ids)) if i not in skipped],
                                dtype=np.int64)
        moments = np.load(self.folder / MOMENTS_FILE, mmap_mode="r")
        contexts = np.load(self.folder / CONTEXTS_FILE, mmap_mode="r")
        self.item_shape = (moments.shape[1] // 2, *moments.shape[2:])  # latent (C, h, w)
        self.context_dim = int(contexts.shape[-1])
        self._moments: np.ndarray | None = None  # reopened lazily (per worker)
        self._contexts: np.ndarray | None = None
        self._captions: list[str] | None = None

    def __len__(self) -> int:
        return len(self.indices)

    def __getstate__(self) -> dict[str, Any]:  # workers reopen the memmaps themselves
        state = self.__dict__.copy()
        state.update(_moments=None, _contexts=None)
        return state

    def _open(self) -> tuple[np.ndarray, np.ndarray]:
        if self._moments is None or self._contexts is None:
            self._moments = np.load(self.folder / MOMENTS_FILE, mmap_mode="r")
            self._contexts = np.load(self.folder / CONTEXTS_FILE, mmap_mode="r")
        return self._moments, self._contexts

    def image_index(self, index: int) -> int:
        """Row of item `index` in the stored arrays (differs when images were skipped)."""
        return int(self.indices[index])

    def moments(self, index: int) -> torch.Tensor:
        """Stored VAE moments of item `index`, float32 (8, h, w)."""
        moments, _ = self._open()
        return torch.from_numpy(np.array(moments[self.image_index(index)], dtype=np.float32))

    def contexts(self, index: int) -> torch.Tensor:
        """All caption contexts of item `index`, float32 (k, 77, D)."""
        _, contexts = self._open()
        i = self.image_index(index)
        rows = contexts[self.offsets[i] : self.offsets[i + 1]]
        return torch.from_numpy(np.array(rows, dtype=np.float32))

    def captions(self, index: int) -> list[str]:
        """Caption texts of item `index`."""
        if self._captions is None:
            self._captions = json.loads((self.folder / CAPTIONS_FILE).read_text())
        i = self.image_index(index)
        return self._captions[self.offsets[i] : self.offsets[i + 1]]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        _, contexts = self._open()
        i = self.image_index(index)
        x = sample_from_moments(self.moments(index), self.scale_factor)
        row = int(torch.randint(int(self.offsets[i]), int(self.offsets[i + 1]), ()))
        context = torch.from_numpy(np.array(contexts[row], dtype=np.float32))
        if self.repa:  # opened per access: REPA runs read one row per item
            stored = np.load(self.folder / REPA_FILE, mmap_mode="r")[i]
            return {"x": x, "context": context, "repa": torch.from_numpy(stored.astype(np.float32))}
        return {"x": x, "context": context}


def load_empty_context(data: DataConfig) -> torch.Tensor:
    """Context of the empty prompt "" (77, D) float32: the classifier-free 'unconditional'."""
    root = Path(data.root)
    return torch.from_numpy(np.load(_require(root / EMPTY_CONTEXT_FILE, root)).astype(np.float32))


def load_sample_prompts(data: DataConfig) -> tuple[list[str], torch.Tensor]:
    """The fixed prompts for sample grids and their contexts (P, 77, D) float32."""
    root = Path(data.root)
    prompts = json.loads(_require(root / SAMPLE_PROMPTS_FILE, root).read_text())
    contexts = np.load(_require(root / SAMPLE_CONTEXTS_FILE, root)).astype(np.float32)
    if len(prompts) != len(contexts):
        raise DatasetError(f"{root}: {len(prompts)} sample prompts but {len(contexts)} contexts")
    return prompts, torch.from_numpy(contexts)


# --------------------------------------------------------------------------- dispatch


def build_dataset(cfg: Config, split: str = "train") -> Dataset:
    """The dataset named by ``cfg.data.name`` for `split` ("train", "val" or "test").

    Checks that its items fit the model (``model.in_chans``, ``model.img_size``,
    ``model.clip_dim``) so a wrong config fails here with the key named.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    data, model = cfg.data, cfg.model
    check_data(data)
    flip = data.random_flip and split == "train"
    if data.name == "cifar10":
        dataset: Dataset = CIFAR10Images(data.root, split, flip=flip, download=data.download)
    elif data.name == "shapes":
        dataset = ShapesDataset(data.num_images, size=model.img_size, seed=SHAPES_SEEDS[split],
                                flip=flip)
    elif data.name == "mscoco":
        repa = bool(cfg.train.repa_encoder) and split == "train"  # stored REPA features
        dataset = MSCOCOFeatures(data.root, "val" if split == "test" else split,
                                 data.scale_factor, repa)
    elif data.name == "celeba":
        dataset = CelebAImages(data.root, split, model.img_size, flip=flip)
    else:  # imagenet, imagenet_features
        dataset = build_imagenet(cfg, split, flip)
    _check_fits_model(dataset, cfg)
    return dataset


def _check_fits_model(dataset: Any, cfg: Config) -> None:
    expected = (cfg.model.in_chans, cfg.model.img_size, cfg.model.img_size)
    if tuple(dataset.item_shape) != expected:
        raise ConfigError(f"data.name={cfg.data.name!r} gives inputs of shape "
                          f"{tuple(dataset.item_shape)} but model.in_chans/img_size expect "
                          f"{expected}")
    m = cfg.model
    if isinstance(dataset, MSCOCOFeatures):
        if m.clip_dim != dataset.context_dim:
            raise ConfigError(f"model.clip_dim={m.clip_dim} but {dataset.folder} stores "
                              f"contexts of width {dataset.context_dim}")
        tokens = dataset.contexts(0).shape[-2]
        if m.clip_dim > 0 and m.num_clip_token != tokens:
            raise ConfigError(f"model.num_clip_token={m.num_clip_token} but {dataset.folder} "
                              f"stores contexts of {tokens} tokens")
    elif m.clip_dim > 0:
        raise ConfigError(f"model.clip_dim={m.clip_dim} (text-to-image) but data.name="
                          f"{cfg.data.name!r} has no captions")
    if m.num_classes > 0:  # the classes, or the classes and the classifier-free null class
        classes = getattr(dataset, "num_classes", None)
        if classes is None:
            raise ConfigError(f"model.num_classes={m.num_classes} (class-conditional) but "
                              f"data.name={cfg.data.name!r} gives no class labels")
        if m.num_classes not in (classes, classes + 1):
            raise ConfigError(f"model.num_classes={m.num_classes} but data.root={cfg.data.root} "
                              f"has {classes} classes: set {classes}, or {classes + 1} with "
                              "the classifier-free null class")
