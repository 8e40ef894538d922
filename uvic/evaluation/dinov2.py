"""The DINOv2 image encoder of FD-DINOv2 (Stein et al. 2023; EDM2 reports it beside FID): its
weights (`eval.dinov2_path`, docs/evaluation.md), the network (timm's `VisionTransformer`)
and the features of image files.

Preprocessing is dgm-eval's, which EDM2 follows (`PROTOCOL`): uint8 RGB resized to 224x224
with PIL's bicubic filter, normalised with the ImageNet mean and standard deviation; the
feature is the CLS token after the final LayerNorm.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from uvic.evaluation.fingerprint import file_digest
from uvic.evaluation.statistics import crop_resize_array

DINOV2_FILE = "dinov2_vitl14_pretrain.pth"  # the original ViT-L/14 checkpoint (torch.hub)
DINOV2_URL = f"https://dl.fbaipublicfiles.com/dinov2/dinov2_vitl14/{DINOV2_FILE}"
HUB_NAME = "timm/vit_large_patch14_dinov2.lvd142m"  # timm's copy on the Hugging Face hub
INPUT_SIZE = 224
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# the preprocessing and feature, as recorded in protocols and cache fingerprints
PROTOCOL = "pil_bicubic_224_imagenet_norm_cls"
FAMILY = {384: "small", 768: "base", 1024: "large", 1536: "giant"}  # DINOv2 widths
DEPTH = {384: 12, 768: 12, 1024: 24, 1536: 40}  # ... and their depths
_HUB = re.compile(r"^(hf-hub:)?[\w.-]+/[\w.-]+$")


class DINOv2WeightsMissing(FileNotFoundError):
    """The DINOv2 weights are not on disk; the message names the path and how to get it."""


class DINOv2WeightsInvalid(ValueError):
    """The DINOv2 weights file does not load as a DINOv2 ViT; the message says why."""


def default_weights_path() -> Path:
    """Where torch.hub keeps the original ViT-L/14 checkpoint (dgm-eval's copy)."""
    return Path(torch.hub.get_dir()) / "checkpoints" / DINOV2_FILE


def is_hub_name(spec: str) -> bool:
    """`owner/name` or `hf-hub:owner/name` that is not a file here."""
    return bool(_HUB.match(spec)) and not Path(spec).expanduser().exists() \
        and not spec.endswith((".pth", ".pt", ".bin", ".safetensors"))


def resolve_weights(spec: str, allow_download: bool = False) -> Path:
    """The local weights file `eval.dinov2_path` names ("": torch.hub's original ViT-L/14,
    a local file of DINOv2's or timm's, or a hub name in the local cache), downloading it
    only with `allow_download`; else DINOv2WeightsMissing, one line naming the path."""
    hint = (f"set eval.dinov2_path (--dinov2-path) to a local copy (the original "
            f"{DINOV2_FILE} or timm's model.safetensors) or a hub name such as {HUB_NAME}")
    if spec and is_hub_name(spec):
        from huggingface_hub import hf_hub_download, try_to_load_from_cache

        repo = spec.removeprefix("hf-hub:")
        found = try_to_load_from_cache(repo, "model.safetensors")
        if isinstance(found, str):
            return Path(found)
        if allow_download:
            return Path(hf_hub_download(repo, "model.safetensors"))
        raise DINOv2WeightsMissing(
            f"DINOv2 weights {repo} not in the local Hugging Face cache: fetch them "
            f"(hf download {repo} model.safetensors), pass --download, or {hint}")
    path = Path(spec).expanduser() if spec else default_weights_path()
    if path.is_file():
        return path
    if allow_download and not spec:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.hub.download_url_to_file(DINOV2_URL, str(path))
        return path
    get = (f"download {DINOV2_URL} there (curl -L --create-dirs -o {path} {DINOV2_URL}) "
           "or pass --download, or " if not spec else "")
    raise DINOv2WeightsMissing(f"DINOv2 weights not found at {path}: {get}{hint}")


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a weights file (.safetensors or a torch state dict)."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
        for key in ("model", "state_dict", "teacher"):
            state = state.get(key, state) if isinstance(state, dict) else state
    except Exception as err:  # torch.load / safetensors report a bad file with many types
        detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DINOv2WeightsInvalid(f"DINOv2 weights at {path} cannot be read ({detail})") \
            from err
    if not isinstance(state, dict) or "cls_token" not in state or "pos_embed" not in state:
        raise DINOv2WeightsInvalid(f"DINOv2 weights at {path}: no cls_token / pos_embed, "
                                   "not a DINOv2 ViT state dict")
    return state


def architecture(state: dict[str, torch.Tensor], path: Path) -> tuple[str, dict[str, Any]]:
    """timm's model name and arguments for the ViT these weights belong to."""
    width = int(state["cls_token"].shape[-1])
    blocks = {int(m.group(1)) for k in state if (m := re.match(r"blocks\.(\d+)\.", k))}
    regs = state.get("register_tokens", state.get("reg_token"))
    if width % 64 or not blocks or "patch_embed.proj.weight" not in state:
        raise DINOv2WeightsInvalid(f"DINOv2 weights at {path}: width {width}, {len(blocks)} "
                                   "blocks: not a DINOv2 ViT (64-wide heads)")
    family = FAMILY.get(width, "small")
    name = f"vit_{family}_patch14_{'reg4_' if regs is not None else ''}dinov2"
    kwargs: dict[str, Any] = {
        "img_size": INPUT_SIZE, "num_classes": 0, "embed_dim": width,
        "depth": max(blocks) + 1, "num_heads": width // 64,
        "patch_size": int(state["patch_embed.proj.weight"].shape[-1])}
    if regs is not None:
        kwargs["reg_tokens"] = int(regs.shape[1])
    fc1 = state.get("blocks.0.mlp.fc1.weight")
    if family != "giant" and fc1 is not None:
        kwargs["mlp_ratio"] = fc1.shape[0] / width
    return name, kwargs


def resample_positions(state: dict[str, torch.Tensor], grid: int) -> dict[str, torch.Tensor]:
    """The position embeddings' patch grid resampled to `grid` x `grid` as DINOv2 does it
    (bicubic, scale factor (grid + 0.1) / old grid, no antialiasing, in float32); the
    class token's embedding, if any, is kept."""
    pos = state["pos_embed"]
    n, width = pos.shape[1], pos.shape[2]
    old = math.isqrt(n)
    prefix = n - old * old
    if old == grid:
        return state
    patches = pos[:, prefix:].float().reshape(1, old, old, width).permute(0, 3, 1, 2)
    scale = (grid + 0.1) / old
    patches = torch.nn.functional.interpolate(patches, scale_factor=(scale, scale),
                                              mode="bicubic", antialias=False)
    patches = patches.permute(0, 2, 3, 1).reshape(1, grid * grid, width).to(pos.dtype)
    return {**state, "pos_embed": torch.cat([pos[:, :prefix], patches], dim=1)}


class DINOv2Encoder(torch.nn.Module):
    """A DINOv2 ViT (timm) giving the CLS token after the final norm of images normalised
    as `PROTOCOL` says; `name` and `identity` name it in results and caches."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        import timm
        from timm.models.vision_transformer import checkpoint_filter_fn

        state = read_state_dict(path)
        arch, kwargs = architecture(state, path)
        self.model = timm.create_model(arch, pretrained=False, **kwargs)
        grid = self.model.patch_embed.grid_size[0]
        try:
            state = checkpoint_filter_fn(resample_positions(state, grid), self.model)
            self.model.load_state_dict(state)
        except (RuntimeError, KeyError, ValueError) as err:
            first = str(err).strip().splitlines()[0]
            raise DINOv2WeightsInvalid(f"DINOv2 weights at {path} do not fit timm's {arch} "
                                       f"({first})") from err
        self.model.eval().requires_grad_(False)
        self.dim = kwargs["embed_dim"]
        standard = DEPTH.get(self.dim) == kwargs["depth"]
        self.name = arch if standard else f"{arch} ({self.dim} wide, {kwargs['depth']} deep)"
        self.identity = {"name": f"dinov2 {self.name}", "weights": file_digest(path),
                         "file": str(path)}

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class _Images(Dataset):
    """Image files as the encoder's input (`PROTOCOL`); reference images first center-
    cropped and resized to `crop` as for Inception (`crop_resize_array`)."""

    def __init__(self, files: Sequence[str | Path], crop: int | None) -> None:
        self.files, self.crop = list(files), crop

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> torch.Tensor:
        image = np.asarray(Image.open(self.files[i]).convert("RGB"), dtype=np.uint8)
        if self.crop is not None:
            image = crop_resize_array(image, self.crop)
        image = Image.fromarray(image).resize((INPUT_SIZE, INPUT_SIZE),
                                              Image.Resampling.BICUBIC)
        x = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
        mean, std = torch.tensor(IMAGENET_MEAN), torch.tensor(IMAGENET_STD)
        return (x - mean[:, None, None]) / std[:, None, None]


def files_features(files: Sequence[str | Path], encoder: DINOv2Encoder, *,
                   crop: int | None = None, device: torch.device | str = "cpu",
                   batch_size: int = 64, num_workers: int = 0,
                   description: str = "DINOv2 features", progress: bool = True) -> np.ndarray:
    """DINOv2 features (N, dim) in float64 of image files (see `_Images`)."""
    loader = DataLoader(_Images(files, crop), batch_size=batch_size, num_workers=num_workers)
    encoder = encoder.to(device)
    out = [encoder(batch.to(device)).double().cpu().numpy()
           for batch in tqdm(loader, desc=description, disable=not progress)]
    return np.concatenate(out) if out else np.zeros((0, encoder.dim))
