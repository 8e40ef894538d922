"""MS-COCO 2014 features for text-to-image U-ViT / U-ViC, the release's way
(``uvic-extract-mscoco``): per image, sorted by COCO id, the Stable Diffusion VAE moments of
its 256 px center crop; per caption, the 77 CLIP ViT-L/14 token states
(`uvic.models.text_encoder`); and the empty-prompt and sample-grid contexts (layout:
`uvic.data.datasets`). Expects ``<coco>/{train,val}2014/*.jpg`` and
``<coco>/annotations/captions_{train,val}2014.json``; work is done in resumable chunks.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import open_clip
import PIL
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from uvic.data import datasets as layout
from uvic.data.chunks import as_list, check_same, write_npy
from uvic.data.datasets import DatasetError, center_crop_resize
from uvic.files import write_json
from uvic.models.autoencoder import DEFAULT_VAE, SCALE_FACTOR, encode_moments
from uvic.models.repa_encoder import RepaEncoder, encoder_id
from uvic.models.text_encoder import DEFAULT_MODEL, DEFAULT_PRETRAINED, ClipTextEncoder

# Prompts for the periodic sample grids during training (COCO-style captions).
SAMPLE_PROMPTS = [
    "A red double decker bus driving down a city street.",
    "A plate of food with broccoli, rice and grilled chicken.",
    "A giraffe standing next to a tree in a grassy field.",
    "A man riding a wave on top of a surfboard.",
    "A cat sleeping on a laptop keyboard on a wooden desk.",
    "A bathroom with a white sink and a large mirror.",
    "A train traveling over a bridge near a mountain.",
    "Two teddy bears sitting on a bench in the snow.",
]
PADDING = "release: positions after end-of-text filled with 49407 (HF CLIPTokenizer max_length)"
CROP = "center square crop ((h - s) // 2, (w - s) // 2), then PIL LANCZOS resize (U-ViT release)"


class CorruptImageError(RuntimeError):
    """An image file cannot be decoded; the message names it."""


# --------------------------------------------------------------------------- COCO input


@dataclass
class CocoSplit:
    """Images of one split in COCO-id order and their captions in annotation-file order."""

    image_ids: list[int]
    files: list[Path]
    captions: list[list[str]]


def read_coco_split(coco_root: str | Path, split: str, limit: int | None = None) -> CocoSplit:
    """Read ``annotations/captions_<split>2014.json``; images without captions are left out."""
    coco_root = Path(coco_root)
    ann_path = coco_root / "annotations" / f"captions_{split}2014.json"
    if not ann_path.is_file():
        raise DatasetError(f"COCO captions file not found: {ann_path} (unzip "
                           "annotations_trainval2014.zip into <coco>/annotations)")
    try:
        ann = json.loads(ann_path.read_text())
        images = {int(img["id"]): img["file_name"] for img in ann["images"]}
        by_image: dict[int, list[str]] = {i: [] for i in images}
        for a in ann["annotations"]:
            by_image[int(a["image_id"])].append(str(a["caption"]))
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise DatasetError(
            f"{ann_path}: not a COCO captions file ({type(err).__name__}: {err})"
        ) from err
    ids = sorted(i for i in images if by_image[i])
    if limit is not None:
        ids = ids[:limit]
    folder = coco_root / f"{split}2014"
    return CocoSplit(ids, [folder / images[i] for i in ids], [by_image[i] for i in ids])


def check_inputs(coco_root: str | Path, splits: Sequence[str], limit: int | None = None,
                 skip_corrupt: bool = False) -> None:
    """Before the first image is encoded (a missing val file must not wait for the whole
    train split): every split's captions file parses, its image folder exists and (unless
    `skip_corrupt`, which skips bad images later) holds every image it names. Raises
    DatasetError naming the first missing or unreadable path."""
    for split in splits:
        coco = read_coco_split(coco_root, split, limit)
        folder = Path(coco_root) / f"{split}2014"
        if not folder.is_dir():
            raise DatasetError(f"COCO image folder not found: {folder} (unzip {split}2014.zip "
                               "into <coco>)")
        missing = [] if skip_corrupt else [f for f in coco.files if not f.is_file()]
        if missing:
            raise DatasetError(f"COCO image not found: {missing[0]} ({len(missing)} of "
                               f"{len(coco.files)} {split} images missing)")


def load_image(path: Path, resolution: int) -> torch.Tensor:
    """RGB image file -> (3, resolution, resolution) float32 in [-1, 1]."""
    with Image.open(path) as image:
        pixels = np.asarray(center_crop_resize(image.convert("RGB"), resolution))
    return layout.to_signed(pixels)


class _ImageFiles(Dataset):
    """Decodes images in DataLoader workers; an unreadable file becomes an error string."""

    def __init__(self, files: Sequence[Path], resolution: int) -> None:
        self.files, self.resolution = files, resolution

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor | None, str]:
        try:
            return index, load_image(self.files[index], self.resolution), ""
        except (OSError, ValueError, SyntaxError) as err:  # PIL's decode errors
            return index, None, f"{type(err).__name__}: {err}"


# --------------------------------------------------------------------------- output helpers


def _write_json(path: Path, obj: Any) -> None:
    write_json(path, obj, indent=1)


def write_root_files(out: Path, text_encoder: ClipTextEncoder, settings: dict[str, Any]) -> None:
    """meta.json, the empty-prompt context and the sample prompts (cheap, rewritten each run)."""
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / layout.META_FILE
    if meta_path.is_file():
        check_same(meta_path, json.loads(meta_path.read_text())["settings"], settings)
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "diffusers": diffusers.__version__, "open_clip": open_clip.__version__,
                "numpy": np.__version__, "pillow": PIL.__version__}
    write_npy(out / layout.EMPTY_CONTEXT_FILE, text_encoder.encode([""])[0].cpu().numpy())
    _write_json(out / layout.SAMPLE_PROMPTS_FILE, SAMPLE_PROMPTS)
    write_npy(out / layout.SAMPLE_CONTEXTS_FILE, text_encoder.encode(SAMPLE_PROMPTS).cpu().numpy())
    _write_json(meta_path, {"settings": settings, "versions": versions})


# --------------------------------------------------------------------------- one split


@dataclass
class _SplitOutput:
    """One split's folder while it is written: the progress record (what is committed)
    and the preallocated memory-mapped arrays."""

    progress_path: Path
    state: dict[str, Any]
    moments: np.ndarray
    contexts: np.ndarray
    repa: np.ndarray | None = None  # REPA encoder patch features (settings["repa"])


def _open_split(folder: Path, coco: CocoSplit, offsets: np.ndarray, fingerprint: dict[str, Any],
                text_encoder: ClipTextEncoder) -> _SplitOutput:
    """Resume a split folder written with the same `fingerprint` (else DatasetError), or
    start it: static files, preallocated arrays, then the (empty) progress record."""
    resolution = fingerprint["resolution"]
    n_images, n_captions = fingerprint["num_images"], fingerprint["num_captions"]
    latent = resolution // 8
    moments_shape = (n_images, 8, latent, latent)
    contexts_shape = (n_captions, text_encoder.context_length, text_encoder.width)

    progress_path = folder / layout.PROGRESS_FILE
    if progress_path.is_file():
        state = json.loads(progress_path.read_text())
        check_same(progress_path, state["fingerprint"], fingerprint)
        mode = "r+"
    else:  # fresh start: static files, preallocated arrays, then the (empty) progress record
        _write_json(folder / layout.CAPTIONS_FILE, [c for caps in coco.captions for c in caps])
        write_npy(folder / layout.IMAGE_IDS_FILE, np.array(coco.image_ids, dtype=np.int64))
        write_npy(folder / layout.OFFSETS_FILE, offsets)
        num_chunks = -(-n_images // fingerprint["chunk_size"])
        state = {"fingerprint": fingerprint, "num_chunks": num_chunks, "done_chunks": [],
                 "skipped": [], "complete": False}
        mode = "w+"
    moments = np.lib.format.open_memmap(folder / layout.MOMENTS_FILE, mode=mode,
                                        dtype=fingerprint["moments_dtype"], shape=moments_shape)
    contexts = np.lib.format.open_memmap(folder / layout.CONTEXTS_FILE, mode=mode,
                                         dtype=fingerprint["context_dtype"], shape=contexts_shape)
    repa, features = fingerprint.get("repa"), None
    if repa:
        features = np.lib.format.open_memmap(folder / layout.REPA_FILE, mode=mode,
                                             dtype="float16",
                                             shape=(n_images, repa["grid"] ** 2, repa["dim"]))
    if mode == "w+":
        _write_json(progress_path, state)
    return _SplitOutput(progress_path, state, moments, contexts, features)


def _pending_batches(done: Sequence[int], num_chunks: int, chunk_size: int, n_images: int,
                     batch_size: int, max_chunks: int | None) -> tuple[list[list[int]], list[int]]:
    """The image rows of every batch still to encode and the chunk of each batch. Batches
    never straddle chunks, so a resumed chunk is computed exactly as before."""
    done = set(done)
    pending = [c for c in range(num_chunks) if c not in done][:max_chunks]
    batches, batch_chunk = [], []
    for c in pending:
        rows = list(range(c * chunk_size, min((c + 1) * chunk_size, n_images)))
        for start in range(0, len(rows), batch_size):
            batches.append(rows[start : start + batch_size])
            batch_chunk.append(c)
    return batches, batch_chunk


def _encode_images(items: list[tuple[int, torch.Tensor | None, str]], coco: CocoSplit,
                   vae: torch.nn.Module, out: _SplitOutput, skip_corrupt: bool,
                   features: RepaEncoder | None = None) -> list[dict[str, Any]]:
    """VAE moments of a batch of decoded images into `out.moments` (and the REPA
    encoder's features into `out.repa`); an unreadable image raises CorruptImageError, or
    with `skip_corrupt` gets zeros and a record (returned)."""
    moments = out.moments
    skipped = []
    good = [(i, x) for i, x, err in items if x is not None]
    for i, _, err in items:
        if err:
            if not skip_corrupt:
                raise CorruptImageError(f"cannot read image {coco.files[i]} ({err}); "
                                        "replace it or pass --skip-corrupt")
            skipped.append({"index": i, "file": str(coco.files[i]), "error": err})
            moments[i] = 0
    if good:
        rows = [i for i, _ in good]
        encoded = encode_moments(vae, torch.stack([x for _, x in good])).float().cpu()
        moments[rows] = encoded.numpy().astype(moments.dtype)
        if features is not None and out.repa is not None:
            out.repa[rows] = features(torch.stack([x for _, x in good])).half().cpu().numpy()
    return skipped


def _commit_chunk(c: int, out: _SplitOutput, coco: CocoSplit, offsets: np.ndarray,
                  text_encoder: ClipTextEncoder, text_batch_size: int,
                  skipped: list[dict[str, Any]]) -> None:
    """Encode chunk `c`'s captions, flush both arrays, then record the chunk as done."""
    chunk_size, num_chunks = out.state["fingerprint"]["chunk_size"], out.state["num_chunks"]
    first, last = c * chunk_size, min((c + 1) * chunk_size, len(coco.image_ids))
    texts = [t for caps in coco.captions[first:last] for t in caps]
    row = int(offsets[first])
    for start in range(0, len(texts), text_batch_size):
        states = text_encoder.encode(texts[start : start + text_batch_size])
        stop = row + start + len(states)
        out.contexts[row + start : stop] = states.cpu().numpy().astype(out.contexts.dtype)
    for array in (out.moments, out.contexts, out.repa):
        if array is not None:
            array.flush()
    out.state["done_chunks"] = sorted({*out.state["done_chunks"], c})
    out.state["skipped"] = out.state["skipped"] + skipped
    out.state["complete"] = len(out.state["done_chunks"]) == num_chunks
    _write_json(out.progress_path, out.state)


def extract_split(
    coco_root: str | Path,
    out: str | Path,
    split: str,
    vae: torch.nn.Module,
    text_encoder: ClipTextEncoder,
    settings: dict[str, Any],
    *,
    batch_size: int = 64,
    text_batch_size: int = 256,
    chunk_size: int = 1000,
    num_workers: int = 0,
    skip_corrupt: bool = False,
    max_chunks: int | None = None,
    progress: bool = True,
    features: RepaEncoder | None = None,
) -> bool:
    """Extract (or resume) one split into ``<out>/<split>``; True once the split is complete.
    `features`: the REPA encoder of settings["repa"], run on every image.

    `settings` (resolution, dtypes, model names, limit...) must match a previous partial run.
    `max_chunks` stops after that many newly committed chunks (to bound a session).
    """
    coco = read_coco_split(coco_root, split, settings["limit"])
    folder = Path(out) / split
    folder.mkdir(parents=True, exist_ok=True)
    offsets = np.cumsum([0] + [len(c) for c in coco.captions], dtype=np.int64)
    n_images, n_captions = len(coco.image_ids), int(offsets[-1])
    if n_images == 0:
        raise DatasetError(f"no captioned images for split {split!r} under {coco_root}")
    num_chunks = -(-n_images // chunk_size)
    fingerprint = {**settings, "split": split, "num_images": n_images,
                   "num_captions": n_captions, "chunk_size": chunk_size}
    output = _open_split(folder, coco, offsets, fingerprint, text_encoder)

    batches, batch_chunk = _pending_batches(output.state["done_chunks"], num_chunks, chunk_size,
                                            n_images, batch_size, max_chunks)
    loader = DataLoader(_ImageFiles(coco.files, settings["resolution"]), batch_sampler=batches,
                        collate_fn=as_list, num_workers=num_workers)
    bar = tqdm(total=n_images, initial=n_images - sum(map(len, batches)), unit="img",
               desc=f"{split}", disable=not progress)
    chunk_skipped: list[dict[str, Any]] = []
    for b, items in enumerate(loader):
        chunk_skipped += _encode_images(items, coco, vae, output, skip_corrupt, features)
        bar.update(len(items))
        c = batch_chunk[b]
        if b + 1 == len(batches) or batch_chunk[b + 1] != c:  # last batch of chunk c
            _commit_chunk(c, output, coco, offsets, text_encoder, text_batch_size, chunk_skipped)
            chunk_skipped = []
    bar.close()
    output.state["complete"] = len(output.state["done_chunks"]) == num_chunks
    _write_json(output.progress_path, output.state)
    return bool(output.state["complete"])


def extract_features(
    coco_root: str | Path,
    out: str | Path,
    vae: torch.nn.Module,
    text_encoder: ClipTextEncoder,
    *,
    splits: Sequence[str] = ("train", "val"),
    vae_name: str = DEFAULT_VAE,
    clip_model: str = DEFAULT_MODEL,
    clip_pretrained: str = DEFAULT_PRETRAINED,
    resolution: int = 256,
    limit: int | None = None,
    moments_dtype: str = "float32",
    context_dtype: str = "float32",  # the release stores float32
    repa: RepaEncoder | None = None,
    repa_name: str = "",
    **split_kwargs: Any,
) -> bool:
    """Root files then every split (see `extract_split` for the keyword arguments); with
    `repa` (the encoder `repa_name`), also its patch features of every image.

    Returns True when every split is complete.
    """
    if resolution % 8:
        raise ValueError(f"--resolution must be a multiple of 8, got {resolution}")
    settings = {"vae": vae_name, "clip_model": clip_model, "clip_pretrained": clip_pretrained,
                "scale_factor": SCALE_FACTOR, "resolution": resolution,
                "latent_shape": [4, resolution // 8, resolution // 8],
                "context_shape": [text_encoder.context_length, text_encoder.width],
                "padding": PADDING, "crop": CROP, "limit": limit,
                "moments_dtype": moments_dtype, "context_dtype": context_dtype}
    if repa is not None:  # only then: folders extracted before keep their fingerprint
        settings["repa"] = {"encoder": encoder_id(repa_name), "grid": repa.grid, "dim": repa.dim,
                            "input_size": repa.size}
    check_inputs(coco_root, splits, limit, split_kwargs.get("skip_corrupt", False))
    out = Path(out)
    write_root_files(out, text_encoder, settings)
    complete = [extract_split(coco_root, out, split, vae, text_encoder, settings,
                              features=repa, **split_kwargs) for split in splits]
    return all(complete)
