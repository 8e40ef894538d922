"""Small, deterministic data and models in the real on-disk formats, for tests.

Import from any test file with ``from datagen import make_cifar10, ...`` (pytest puts
tests/ on sys.path). Nothing here downloads anything.

* `make_cifar10(root)` writes a ``cifar-10-batches-py`` folder (torchvision's format);
  torchvision verifies the official MD5s even with ``download=False``, so wrap dataset
  construction in `fake_cifar10_checksums(root)` (or `patch_cifar10_checksums`).
* `make_coco(root)` writes ``train2014/``, ``val2014/`` JPEGs of mixed sizes and the
  ``annotations/captions_*2014.json`` files in COCO's format.
* `tiny_vae()` / `tiny_clip()`: randomly initialised diffusers ``AutoencoderKL`` (f8, 4
  latent channels) and open_clip ``CLIP`` (text width 32, real 49408-token vocabulary);
  `*_folder` variants save them where `load_vae` / ``local-dir:`` open_clip loading find them.
* `make_mscoco_features(root)` runs the real extraction on a tiny COCO with the tiny models
  (64 px images -> 4 x 8 x 8 latents, contexts 77 x 32).
* `make_imagenet(root)` writes ILSVRC-2012's class-folder layout
  (``<root>/train/<wnid>/<wnid>_<n>.JPEG``, mixed sizes, a grayscale and a PNG image);
  `make_imagenet_features(root)` runs the real ImageNet extraction on it with the tiny VAE.
* `make_celeba(root)` writes CelebA's ``img_align_celeba/*.jpg`` (178 x 218) and
  ``list_eval_partition.txt``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import open_clip
import torch
import torchvision
from diffusers import AutoencoderKL
from PIL import Image

from uvic.experiments import smoke_data

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer",
                   "dog", "frog", "horse", "ship", "truck"]

# --------------------------------------------------------------------------- CIFAR-10


def make_cifar10(root: str | Path, n_per_batch: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
    """Write ``<root>/cifar-10-batches-py`` with 5 train batches and a test batch of
    `n_per_batch` random images each. Returns the images as uint8 (n, 32, 32, 3) HWC
    ("train", "test") and their labels ("train_labels", "test_labels").

    Each batch is a pickled dict like the official files as torchvision reads them
    (``pickle.load(f, encoding="latin1")``): "data" uint8 (n, 3072) with the red, green and
    blue planes row-major, "labels", "batch_label", "filenames"; batches.meta holds
    "label_names".
    """
    folder = Path(root) / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    out: dict[str, list[np.ndarray]] = {"train": [], "test": [], "train_labels": [],
                                         "test_labels": []}
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        images = rng.integers(0, 256, size=(n_per_batch, 32, 32, 3), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n_per_batch)
        entry = {
            "batch_label": f"fake {name}",
            "labels": [int(v) for v in labels],
            "data": images.transpose(0, 3, 1, 2).reshape(n_per_batch, 3072),
            "filenames": [f"{name}_{i}.png" for i in range(n_per_batch)],
        }
        (folder / name).write_bytes(pickle.dumps(entry, protocol=2))
        key = "test" if name == "test_batch" else "train"
        out[key].append(images)
        out[f"{key}_labels"].append(labels)
    meta = {"label_names": CIFAR10_CLASSES, "num_cases_per_batch": n_per_batch, "num_vis": 3072}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))
    return {key: np.concatenate(value) for key, value in out.items()}


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def fake_cifar10_checksums(root: str | Path) -> Iterator[None]:
    """Make torchvision's CIFAR10 accept the files under `root` (their MD5s replace the
    official ones on the class) for the duration of the block."""
    cls = torchvision.datasets.CIFAR10
    saved = (cls.train_list, cls.test_list, cls.meta)
    folder = Path(root) / cls.base_folder
    cls.train_list = [[name, _md5(folder / name)] for name, _ in saved[0]]
    cls.test_list = [[name, _md5(folder / name)] for name, _ in saved[1]]
    cls.meta = {**saved[2], "md5": _md5(folder / saved[2]["filename"])}
    try:
        yield
    finally:
        cls.train_list, cls.test_list, cls.meta = saved


def patch_cifar10_checksums(monkeypatch: Any, root: str | Path) -> None:
    """pytest `monkeypatch` version of `fake_cifar10_checksums` (undone after the test)."""
    cls = torchvision.datasets.CIFAR10
    folder = Path(root) / cls.base_folder
    monkeypatch.setattr(cls, "train_list", [[n, _md5(folder / n)] for n, _ in cls.train_list])
    monkeypatch.setattr(cls, "test_list", [[n, _md5(folder / n)] for n, _ in cls.test_list])
    monkeypatch.setattr(cls, "meta", {**cls.meta, "md5": _md5(folder / cls.meta["filename"])})


# --------------------------------------------------------------------------- COCO

COCO_SIZES = [(48, 40), (40, 56), (64, 64), (37, 29), (80, 50)]  # (width, height)
COCO_WORDS = ["red", "small", "green", "striped", "wooden", "blue", "old", "shiny"]
COCO_THINGS = ["bus", "dog", "plate of food", "surfboard", "giraffe", "kitchen", "train"]


def make_coco(root: str | Path, n_images: dict[str, int] | None = None,
              seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """Write a tiny COCO 2014 tree: ``<root>/{split}2014/COCO_{split}2014_<id:012d>.jpg`` and
    ``<root>/annotations/captions_{split}2014.json`` ("images", "annotations" with
    image_id / id / caption, in shuffled order like the real files).

    Images have mixed sizes and aspect ratios (one is grayscale) and 3 to 6 captions each.
    Returns per split the images sorted by id: {"id", "file", "captions"} (captions in
    annotation-file order).
    """
    n_images = n_images or {"train": 5, "val": 3}
    root = Path(root)
    rng = np.random.default_rng(seed)
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    result: dict[str, list[dict[str, Any]]] = {}
    next_ann = 1
    for split, count in n_images.items():
        folder = root / f"{split}2014"
        folder.mkdir(parents=True, exist_ok=True)
        ids = [int(v) for v in rng.choice(np.arange(1, 600_000), size=count, replace=False)]
        images, annotations, records = [], [], {}
        for k, image_id in enumerate(ids):
            width, height = COCO_SIZES[k % len(COCO_SIZES)]
            name = f"COCO_{split}2014_{image_id:012d}.jpg"
            yy, xx = np.mgrid[0:height, 0:width]
            base = rng.integers(0, 256, size=3)
            pixels = (base + 60 * np.sin(xx[..., None] / (3 + k) + yy[..., None] / 5 + k)
                      + rng.normal(0, 10, size=(height, width, 3)))
            image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
            if k == 1:
                image = image.convert("L")  # COCO has a few grayscale JPEGs
            image.save(folder / name, quality=90)
            images.append({"license": 1, "file_name": name, "coco_url": "", "height": height,
                           "width": width, "date_captured": "2013-11-14 16:28:13",
                           "flickr_url": "", "id": image_id})
            captions = []
            for j in range(int(rng.integers(3, 7))):
                text = (f"A {rng.choice(COCO_WORDS)} {rng.choice(COCO_THINGS)} number {j} "
                        f"in picture {image_id}.")
                captions.append(text)
                annotations.append({"image_id": image_id, "id": next_ann, "caption": text})
                next_ann += 1
            records[image_id] = {"id": image_id, "file": folder / name, "captions": captions}
        order = rng.permutation(len(annotations))
        ann_file = {"info": {"description": "tiny COCO for tests", "year": 2014},
                    "licenses": [{"id": 1, "name": "test"}], "images": images,
                    "annotations": [annotations[i] for i in order]}
        (root / "annotations" / f"captions_{split}2014.json").write_text(json.dumps(ann_file))
        # captions of one image keep their relative file order after the shuffle
        for record in records.values():
            record["captions"] = [annotations[i]["caption"] for i in order
                                  if annotations[i]["image_id"] == record["id"]]
        result[split] = [records[i] for i in sorted(records)]
    return result


# --------------------------------------------------------------------------- tiny models


def tiny_vae(seed: int = 0) -> AutoencoderKL:
    """A random diffusers AutoencoderKL with the SD layout: 4 blocks (downsampling by 8),
    4 latent channels, tiny widths. Encodes (B, 3, 64, 64) -> moments (B, 8, 8, 8). The
    one `uvic-release-table --smoke` writes."""
    return smoke_data.tiny_vae(seed)


def tiny_vae_folder(path: str | Path, seed: int = 0) -> Path:
    """Save `tiny_vae(seed)` with ``save_pretrained`` (config.json + safetensors)."""
    tiny_vae(seed).save_pretrained(path)
    return Path(path)


TINY_CLIP_CFG = {
    "embed_dim": 16,
    "quick_gelu": True,
    "vision_cfg": {"image_size": 16, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 4, "layers": 2},
}


def tiny_clip(seed: int = 0) -> open_clip.CLIP:
    """A random open_clip CLIP (the real class; text width 32, 2 layers, QuickGELU).

    Every parameter gets a little extra noise so no LayerNorm/bias sits at an identity value.
    """
    torch.manual_seed(seed)
    model = open_clip.CLIP(**json.loads(json.dumps(TINY_CLIP_CFG)))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def tiny_clip_folder(path: str | Path, seed: int = 0) -> str:
    """Save `tiny_clip(seed)` as an open_clip ``local-dir`` folder; returns the model name
    ``"local-dir:<path>"`` to pass as the open_clip model name."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {"model_cfg": TINY_CLIP_CFG, "preprocess_cfg": {}}
    (path / "open_clip_config.json").write_text(json.dumps(config))
    torch.save(tiny_clip(seed).state_dict(), path / "open_clip_pytorch_model.bin")
    return f"local-dir:{path}"


# --------------------------------------------------------------------------- MS-COCO features


def make_mscoco_features(root: str | Path, n_images: dict[str, int] | None = None,
                         resolution: int = 64, seed: int = 0, **kwargs: Any) -> Path:
    """Tiny COCO + tiny VAE/CLIP -> a complete feature folder at ``<root>/features``
    (latents 4 x res/8 x res/8, contexts 77 x 32). Extra kwargs go to `extract_features`."""
    from uvic.data.mscoco_extraction import extract_features
    from uvic.models.text_encoder import ClipTextEncoder

    root = Path(root)
    make_coco(root / "coco", n_images, seed=seed)
    encoder = ClipTextEncoder("ViT-L-14-quickgelu", model=tiny_clip(seed))
    kwargs = {"chunk_size": 2, "batch_size": 2, "progress": False, **kwargs}
    extract_features(root / "coco", root / "features", tiny_vae(seed), encoder,
                            splits=tuple(n_images or {"train": 5, "val": 3}),
                            vae_name="tiny-vae", clip_model="tiny-clip", clip_pretrained="",
                            resolution=resolution, **kwargs)
    return root / "features"


# --------------------------------------------------------------------------- ImageNet

# (width, height): wide and tall, below and above twice a 16 or 64 px crop (ADM's BOX
# halving), odd sides (its rounding and floored offsets)
IMAGENET_SIZES = [(80, 60), (45, 71), (133, 131), (64, 64), (300, 129), (17, 23)]
IMAGENET_WNIDS = ["n01440764", "n01443537", "n01484850", "n01491361", "n01494475"]


def _picture(rng: np.random.Generator, width: int, height: int, k: int) -> Image.Image:
    """A smooth random colour pattern with some noise (JPEG-friendly, not constant)."""
    yy, xx = np.mgrid[0:height, 0:width]
    base = rng.integers(0, 256, size=3)
    pixels = (base + 70 * np.sin(xx[..., None] / (2 + k % 5) + yy[..., None] / 4 + k)
              + rng.normal(0, 12, size=(height, width, 3)))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def make_imagenet(root: str | Path, per_class: tuple[int, ...] = (3, 2, 4), split: str = "train",
                  seed: int = 0) -> dict[str, Any]:
    """Write ``<root>/<split>/<wnid>/<wnid>_<n>.JPEG`` for ``len(per_class)`` classes (real
    wnids, in shuffled creation order) with `per_class[c]` images each; the second image of
    the first class is grayscale and one image of the last class is a ``.png``. A stray file
    at the split level (``LOC_synset_mapping.txt``) is not a class.

    Returns {"classes": wnids sorted, "files": paths in the release's order (class, then
    file name), "labels": class index of each}.
    """
    rng = np.random.default_rng(seed)
    folder = Path(root) / split
    wnids = IMAGENET_WNIDS[:len(per_class)]
    files: dict[str, list[Path]] = {}
    k = 0
    for c in rng.permutation(len(wnids)):
        wnid = wnids[c]
        (folder / wnid).mkdir(parents=True, exist_ok=True)
        numbers = sorted(int(v) for v in rng.choice(np.arange(1, 20000), size=per_class[c],
                                                           replace=False))
        for j, number in enumerate(numbers):
            width, height = IMAGENET_SIZES[k % len(IMAGENET_SIZES)]
            image = _picture(rng, width, height, k)
            suffix = ".png" if (c == len(wnids) - 1 and j == per_class[c] - 1) else ".JPEG"
            if c == 0 and j == 1:
                image = image.convert("L")
            path = folder / wnid / f"{wnid}_{number}{suffix}"
            image.save(path, **({"quality": 90} if suffix == ".JPEG" else {}))
            files.setdefault(wnid, []).append(path)
            k += 1
    (folder / "LOC_synset_mapping.txt").write_text("\n".join(wnids) + "\n")
    ordered = [(label, p) for label, wnid in enumerate(wnids)
               for p in sorted(files[wnid], key=lambda p: p.name)]
    return {"classes": wnids, "files": [p for _, p in ordered],
            "labels": [label for label, _ in ordered]}


def make_imagenet_features(root: str | Path, resolution: int = 64, seed: int = 0,
                           imagenet: str | Path | None = None, **kwargs: Any) -> Path:
    """The complete feature folder ``<root>/features`` of a tiny ImageNet (`imagenet`, else
    `make_imagenet(<root>/imagenet, seed=seed)`) from the real extraction with
    `tiny_vae(seed)`: latents 4 x res/8 x res/8. Extra kwargs go to `extract_features`."""
    from uvic.data.imagenet_extraction import extract_features, list_splits

    root = Path(root)
    if imagenet is None:
        imagenet = root / "imagenet"
        make_imagenet(imagenet, seed=seed)
    kwargs = {"chunk_size": 4, "batch_size": 2, "progress": False, **kwargs}
    assert extract_features(list_splits(imagenet, ["train"]), root / "features",
                            tiny_vae(seed), vae_name="tiny-vae", resolution=resolution,
                            **kwargs)
    return root / "features"


# --------------------------------------------------------------------------- CelebA


def make_celeba(root: str | Path, partitions: tuple[int, ...] = (0, 0, 1, 0, 2, 0),
                seed: int = 0) -> list[str]:
    """Write CelebA's ``<root>/img_align_celeba/<000001>.jpg`` (178 x 218, the aligned size)
    and ``<root>/list_eval_partition.txt`` ("000001.jpg 0" per line), image i in partition
    `partitions[i]` (0 train, 1 val, 2 test). Returns the file names."""
    rng = np.random.default_rng(seed)
    folder = Path(root) / "img_align_celeba"
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"{i + 1:06d}.jpg" for i in range(len(partitions))]
    for k, name in enumerate(names):
        _picture(rng, 178, 218, k).save(folder / name, quality=90)
    lines = [f"{name} {part}" for name, part in zip(names, partitions)]
    (Path(root) / "list_eval_partition.txt").write_text("\n".join(lines) + "\n")
    return names


# --------------------------------------------------------------------------- REPA encoder

# A DINOv2 ViT of timm's real class, shrunk (one block of width 32, patch 14): the smoke
# runs' encoder (`uvic.experiments.smoke_data`), saved in timm's hub layout.
TINY_REPA_ARGS = smoke_data.TINY_REPA_ARGS


def tiny_repa_encoder(folder: str | Path, seed: int = 0) -> Path:
    """A randomly initialised `vit_small_patch14_dinov2` shrunk by TINY_REPA_ARGS, in timm's
    hub layout (config.json + model.safetensors): the folder a `train.repa_encoder` names."""
    return smoke_data.tiny_repa_encoder(Path(folder), seed)
