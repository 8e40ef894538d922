"""ImageNet 256 / 512 latent features as the release extracts them (``uvic-extract-imagenet``):
for every image of a class-folder split, in the release's order, the Stable Diffusion VAE's
posterior moments of the release's crop and of its mirror image, encoded in one batch as
the release does (layout: `uvic.data.imagenet`).

Work is done in chunks (`uvic.data.chunks`): a rerun with the same settings skips committed
chunks, so a killed extraction resumes where it stopped. An unreadable image stops it naming
the file, or with `skip_corrupt` is recorded in ``progress.json`` and left out.
"""

from __future__ import annotations

import hashlib
import json
import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import PIL
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from uvic.data import imagenet as layout
from uvic.data.base import DatasetError, to_signed
from uvic.data.chunks import ChunkedArrays, as_list, check_same, write_npy
from uvic.data.imagenet import ClassFolders, load_crop, read_class_folders
from uvic.files import write_json
from uvic.models.autoencoder import encode_moments
from uvic.models.repa_encoder import RepaEncoder, encoder_id

CROP = ("guided-diffusion center_crop_arr: BOX halving while the short side >= 2 res, BICUBIC "
        "to short side res (long side rounded), central res x res (U-ViT release)")
FLIP = "moments_flip.npy: the crop mirrored left-right (the release's img.flip(-1))"
SCALE_FACTOR = 0.18215  # the release's ImageNet latent scale (its autoencoder's default)


class CorruptImageError(DatasetError):
    """An image file cannot be decoded; the message names it."""


class _Crops(Dataset):
    """Decodes and crops images in DataLoader workers; a bad file becomes an error string."""

    def __init__(self, listing: ClassFolders, resolution: int) -> None:
        self.listing, self.resolution = listing, resolution

    def __len__(self) -> int:
        return len(self.listing)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor | None, str]:
        try:
            return index, to_signed(load_crop(self.listing.file(index), self.resolution)), ""
        except (OSError, ValueError, SyntaxError) as err:  # PIL's decode errors
            return index, None, f"{type(err).__name__}: {err}"


def list_splits(imagenet: str | Path, splits: Sequence[str],
                per_class: int | None = None) -> dict[str, ClassFolders]:
    """Every split's class folders, read and checked before any image is encoded."""
    return {split: read_class_folders(Path(imagenet) / split, per_class) for split in splits}


def listing_digest(listing: ClassFolders) -> str:
    """SHA-256 of the image paths in order: a restart must see the same images."""
    return hashlib.sha256(b"\n".join(listing.paths.tolist())).hexdigest()


def write_meta(out: Path, settings: dict[str, Any]) -> None:
    """meta.json: the settings (a rerun must use the same) and the library versions."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / layout.META_FILE
    if path.is_file():
        check_same(path, json.loads(path.read_text())["settings"], settings)
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "diffusers": diffusers.__version__, "numpy": np.__version__,
                "pillow": PIL.__version__}
    write_json(path, {"settings": settings, "versions": versions}, indent=1)


def extract_split(
    listing: ClassFolders,
    folder: str | Path,
    encode: Callable[[torch.Tensor], torch.Tensor],
    settings: dict[str, Any],
    *,
    batch_size: int = 64,
    chunk_size: int = 1000,
    num_workers: int = 0,
    skip_corrupt: bool = False,
    max_chunks: int | None = None,
    progress: bool = True,
    features: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> bool:
    """Extract (or resume) one split into `folder`; True once it is complete.

    `encode` maps images (B, 3, res, res) in [-1, 1] to moments (B, 8, res/8, res/8);
    `features` (with settings["repa"]) to REPA encoder patch features (B, L, D), stored
    in float16 for the crops (a mirrored item mirrors them, `uvic.data.imagenet`).
    `max_chunks` stops after that many newly committed chunks (to bound a session).
    """
    folder = Path(folder)
    resolution, n = settings["resolution"], len(listing)
    latent = resolution // layout.VAE_FACTOR
    shape = (n, 8, latent, latent)
    fingerprint = {**settings, "num_images": n, "num_classes": len(listing.classes),
                   "files_sha256": listing_digest(listing), "chunk_size": chunk_size}

    def write_static() -> None:
        write_json(folder / layout.CLASSES_FILE, list(listing.classes))
        write_json(folder / layout.FILES_FILE, listing.relative(), indent=0)
        write_npy(folder / layout.LABELS_FILE, listing.labels)

    dtype, repa = settings["moments_dtype"], settings.get("repa")
    arrays = {layout.MOMENTS_FILE: (dtype, shape), layout.FLIPPED_FILE: (dtype, shape)}
    if repa:
        arrays[layout.REPA_FILE] = ("float16", (n, repa["grid"] ** 2, repa["dim"]))
    out = ChunkedArrays(folder, fingerprint, n, chunk_size, arrays, write_static)
    moments, flipped = out.arrays[layout.MOMENTS_FILE], out.arrays[layout.FLIPPED_FILE]
    # Batches never straddle chunks, so a resumed chunk is computed exactly as before.
    batches, batch_chunk = [], []
    for c in out.pending(max_chunks):
        rows = list(out.rows(c))
        for start in range(0, len(rows), batch_size):
            batches.append(rows[start:start + batch_size])
            batch_chunk.append(c)
    loader = DataLoader(_Crops(listing, resolution), batch_sampler=batches,
                        collate_fn=as_list, num_workers=num_workers)
    bar = tqdm(total=n, initial=n - sum(map(len, batches)), unit="img",
               desc=listing.folder.name, disable=not progress)
    chunk_skipped: list[dict[str, Any]] = []
    for b, items in enumerate(loader):
        good = [(i, x) for i, x, _ in items if x is not None]
        for i, _, err in items:
            if err:
                if not skip_corrupt:
                    raise CorruptImageError(f"cannot read image {listing.file(i)} ({err}); "
                                            "replace it or pass --skip-corrupt")
                chunk_skipped.append({"index": i, "file": str(listing.file(i)), "error": err})
                moments[i] = flipped[i] = 0
        if good:
            rows = [i for i, _ in good]
            images = torch.stack([x for _, x in good])
            both = encode(torch.cat([images, images.flip(-1)])).float().cpu().numpy()
            moments[rows] = both[:len(rows)].astype(dtype)
            flipped[rows] = both[len(rows):].astype(dtype)
            if features is not None:
                out.arrays[layout.REPA_FILE][rows] = features(images).half().cpu().numpy()
        bar.update(len(items))
        c = batch_chunk[b]
        if b + 1 == len(batches) or batch_chunk[b + 1] != c:  # the last batch of chunk c
            out.commit(c, chunk_skipped)
            chunk_skipped = []
    bar.close()
    return out.complete


def extract_features(
    listings: dict[str, ClassFolders],
    out: str | Path,
    vae: torch.nn.Module,
    *,
    vae_name: str,
    resolution: int = 256,
    per_class: int | None = None,
    moments_dtype: str = "float32",
    repa: RepaEncoder | None = None,
    repa_name: str = "",
    **split_kwargs: Any,
) -> bool:
    """meta.json, then every split of `listings` (from `list_splits`) into ``<out>/<split>``
    (see `extract_split` for the keyword arguments). True when every split is complete.
    With `repa` (the encoder `repa_name`), also its patch features of every crop."""
    if resolution % layout.VAE_FACTOR:
        raise ValueError(f"--resolution must be a multiple of 8, got {resolution}")
    latent = resolution // layout.VAE_FACTOR
    settings = {"vae": vae_name, "resolution": resolution, "latent_shape": [4, latent, latent],
                "scale_factor": SCALE_FACTOR, "crop": CROP, "flip": FLIP,
                "per_class": per_class, "moments_dtype": moments_dtype}
    if repa is not None:  # only then: folders extracted before keep their fingerprint
        settings["repa"] = {"encoder": encoder_id(repa_name), "grid": repa.grid, "dim": repa.dim,
                            "input_size": repa.size}
    out = Path(out)
    write_meta(out, settings)

    def encode(images: torch.Tensor) -> torch.Tensor:
        return encode_moments(vae, images)

    return all([extract_split(listing, out / split, encode, {**settings, "split": split},
                              features=repa, **split_kwargs)
                for split, listing in listings.items()])
