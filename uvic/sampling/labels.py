"""Which class each sample of a class-conditional model shows: `shown_labels` for
`uvic-sample` (the `--class-labels` ids, a grid row each, else image i shows class i mod K),
and `FIDLabels` for FID, drawn as the U-ViT release draws them but from a generator per
sample seeded by (seed, i), so the labels are the same for any batch size, number of
processes or resumed run (docs/evaluation.md). A label function maps global sample indices
to class ids, like the text path's `context_fn`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from uvic.config import Config
from uvic.config.sampling import FREQUENCY_LABEL_DATA, conditioning, fid_label_draw, real_classes
from uvic.data.imagenet import class_folder_names, read_class_folders

LabelFn = Callable[[Sequence[int]], torch.Tensor]
LABEL_STREAM = 2  # FID's per-sample generators: [seed, i, 2] (captions use stream 1)


def check_class_labels(cfg: Config, labels: Sequence[int]) -> None:
    """Refuse (ValueError, one line) class labels for a model without class labels, or an
    id outside [0, K) (K = `real_classes`: the null class is no class to show)."""
    k = real_classes(cfg)
    if k == 0:
        raise ValueError(f"--class-labels given but {cfg.name} is {conditioning(cfg)}: it "
                         "takes no class labels"
                         + (" (give --prompts)" if cfg.model.clip_dim > 0 else ""))
    for label in labels:
        if not 0 <= label < k:
            null = (f"; {k} is its null class" if cfg.model.num_classes > k else "")
            raise ValueError(f"--class-labels {label} is outside [0, {k}) ({cfg.name} has "
                             f"{k} classes{null})")


def class_names(cfg: Config) -> list[str] | None:
    """The WordNet id of each class of an ImageNet model, in label order: the names of the
    class folders of `<data.root>/train` where they are (sorted, as `read_class_folders`
    labels them), else ILSVRC-2012's 1000 in the same order (timm's ImageNetInfo); None for
    other data, or when the count is not the model's."""
    if not cfg.data.name.startswith("imagenet"):
        return None
    folder = Path(cfg.data.root) / "train"
    names = (class_folder_names(folder) if folder.is_dir()
             else list(_imagenet_info().label_names()))
    return names if len(names) == real_classes(cfg) else None


@functools.cache
def _imagenet_info() -> Any:
    """timm's ILSVRC-2012 class table (WordNet ids and names), read once."""
    from timm.data import ImageNetInfo

    return ImageNetInfo()


def resolve_class_labels(cfg: Config, labels: Sequence[int | str]) -> list[int]:
    """`--class-labels` as class ids: numbers as given, WordNet ids (n01440764, the names
    of ImageNet's class folders) by `class_names`; checked (`check_class_labels`)."""
    names = class_names(cfg) if any(isinstance(label, str) for label in labels) else None
    ids = []
    for label in labels:
        if isinstance(label, int):
            ids.append(label)
        elif names is None:
            raise ValueError(f"--class-labels {label}: {cfg.name} has no WordNet class names "
                             f"(data.name={cfg.data.name!r}); give class numbers")
        elif label not in names:
            raise ValueError(f"--class-labels {label} is not one of the {len(names)} classes "
                             f"of {cfg.name} (data.root={cfg.data.root})")
        else:
            ids.append(names.index(label))
    check_class_labels(cfg, ids)
    return ids


def class_caption(label: int, names: Sequence[str] | None) -> str:
    """A grid row's caption: "class 0", or with ImageNet's names "class 0 n01440764 tench"."""
    if names is None:
        return f"class {label}"
    wnid = names[label]
    with contextlib.suppress(KeyError, ValueError):
        return f"class {label} {wnid} {_imagenet_info().label_name_to_description(wnid)}".split(
            ",")[0]
    return f"class {label} {wnid}"


def shown_labels(cfg: Config, n: int,
                 labels: Sequence[int | str] | None) -> tuple[list[int], int]:
    """The class of each of `uvic-sample`'s images, and images per label: each of `labels`
    (resolved and checked) gets max(1, n // #labels) images in a row; without labels,
    image i of n shows class i mod K, one image each."""
    if labels is None:
        k = real_classes(cfg)
        return [i % k for i in range(n)], 1
    ids = resolve_class_labels(cfg, labels)
    per_label = max(1, n // len(ids))
    return [label for label in ids for _ in range(per_label)], per_label


def label_fn(per_image: Sequence[int]) -> LabelFn:
    """A label function showing class `per_image[i]` in image i."""
    table = torch.tensor(list(per_image), dtype=torch.long)
    return lambda indices: table[torch.as_tensor(list(indices), dtype=torch.long)]


@dataclass(frozen=True)
class FIDLabels:
    """The release's FID labels: sample i of a run seeded `seed` shows a class drawn by
    `np.random.default_rng([seed, i, LABEL_STREAM])`, uniform over `classes`, or, with
    `counts` (training images per class), a uniformly drawn training image's class."""

    seed: int
    classes: int
    counts: np.ndarray | None = None

    def __call__(self, indices: Sequence[int]) -> torch.Tensor:
        cumulative = np.cumsum(self.counts) if self.counts is not None else None
        out = []
        for i in indices:
            rng = np.random.default_rng([self.seed, int(i), LABEL_STREAM])
            if cumulative is None:
                out.append(int(rng.integers(self.classes)))
            else:  # image u of the training set, classes in order: its class
                u = rng.integers(cumulative[-1])
                out.append(int(np.searchsorted(cumulative, u, side="right")))
        return torch.tensor(out, dtype=torch.long)

    def record(self, draw: str) -> dict[str, Any]:
        """What determines the labels, for a samples folder's record (`draw`: the
        protocol's words, `fid_label_draw`)."""
        out: dict[str, Any] = {"draw": draw, "classes": self.classes}
        if self.counts is not None:
            out["images"] = int(self.counts.sum())
            out["counts_sha256"] = hashlib.sha256(
                np.ascontiguousarray(self.counts, dtype=np.int64).tobytes()).hexdigest()
        return out


def fid_labels(cfg: Config, seed: int) -> FIDLabels | None:
    """The release's FID labels for `cfg`'s model (None without class labels). ImageNet 64
    pixels count the images of each class folder of `<data.root>/train` (a missing or
    empty folder is a one-line DatasetError naming it)."""
    k = real_classes(cfg)
    if k == 0:
        return None
    if cfg.data.name not in FREQUENCY_LABEL_DATA:
        return FIDLabels(seed, k)
    folder = Path(cfg.data.root) / "train"
    counts = read_class_folders(folder).class_counts()
    if len(counts) != k:
        raise ValueError(f"{folder} has {len(counts)} class folders but {cfg.name} has {k} "
                         f"classes ({fid_label_draw(cfg)}): point data.root at its training set")
    return FIDLabels(seed, k, counts)
