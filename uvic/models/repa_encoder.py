"""The frozen self-supervised image encoder of REPA (Yu et al. 2024): a timm ViT (the DINOv2
family) whose patch features the training loop aligns a U-ViT block with
(`uvic.training.repa`), or the feature extractors store once per image.

Images are resized so that the encoder's patch grid is the U-ViT's token grid (one feature
per token); only the last layer's patch tokens, after its norm, are kept. Where the weights
come from (`train.repa_encoder`, `train.repa_encoder_weights`): docs/training.md, "REPA".
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from uvic.config import ConfigError


class RepaEncoder(nn.Module):
    """A frozen timm ViT: pixels in [-1, 1] (B, 3, H, W) -> patch features (B, grid^2, D)
    in float32, computed without gradients in eval mode."""

    def __init__(self, model: nn.Module, grid: int) -> None:
        super().__init__()
        import timm.data

        self.model = model.eval().requires_grad_(False)
        self.grid = grid
        self.patch = int(model.patch_embed.patch_size[0])
        self.size = grid * self.patch
        self.dim = int(model.num_features)
        self.prefix = int(getattr(model, "num_prefix_tokens", 1))
        config = timm.data.resolve_model_data_config(model)
        self.register_buffer("mean", torch.tensor(config["mean"]).view(1, 3, 1, 1), False)
        self.register_buffer("std", torch.tensor(config["std"]).view(1, 3, 1, 1), False)

    def train(self, mode: bool = True) -> RepaEncoder:
        """Stays in eval mode whatever the caller asks (the encoder is frozen)."""
        return super().train(False)

    @torch.no_grad()
    def forward(self, images: Tensor) -> Tensor:
        if images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"the REPA encoder takes RGB images (B, 3, H, W), got "
                             f"{tuple(images.shape)}")
        x = (images.float() + 1) / 2  # [-1, 1] -> [0, 1]
        if x.shape[-2:] != (self.size, self.size):
            x = F.interpolate(x, size=(self.size, self.size), mode="bicubic",
                              align_corners=False, antialias=True)
        x = (x - self.mean) / self.std
        tokens = self.model.forward_features(x)  # (B, prefix + grid^2, D), final norm
        return tokens[:, self.prefix:].float()


def load_encoder(name: str, weights: str = "", grid: int = 16) -> RepaEncoder:
    """The frozen encoder `name` (timm name, "hf-hub:" repo or local folder; see the module
    docstring) with `weights` (a local file, optional), built for a `grid` x `grid` patch
    grid. A missing folder or file, or weights that cannot be loaded, is a ConfigError of
    one line naming it."""
    import timm

    kwargs: dict = {"pretrained": True, "num_classes": 0}
    path = Path(name).expanduser()
    if _is_path(name):
        if not (path / "config.json").is_file():
            raise ConfigError(f"train.repa_encoder={name}: no encoder folder {path} (expected "
                              "timm's hub layout: config.json and model.safetensors)")
        model_name = f"local-dir:{path.resolve()}"
    else:
        model_name = name
        if weights:
            file = Path(weights).expanduser()
            if not file.is_file():
                raise ConfigError(f"train.repa_encoder_weights: no such file: {file}")
            kwargs["pretrained_cfg_overlay"] = {"file": str(file.resolve())}
    if not model_name.startswith(("local-dir:", "hf-hub:")) and not timm.is_model(model_name):
        raise ConfigError(f"train.repa_encoder={name} is neither a timm model name (e.g. "
                          "vit_base_patch14_dinov2.lvd142m) nor an encoder folder")
    try:
        patch = _patch_size(model_name)
        model = timm.create_model(model_name, img_size=grid * patch, **kwargs)
    except (OSError, RuntimeError, ValueError, KeyError) as err:
        source = weights or name
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"train.repa_encoder: cannot load {source} ({first}; for a model "
                          "not in the Hugging Face cache, download it and pass its folder "
                          "or train.repa_encoder_weights)") from err
    return RepaEncoder(model, grid)


def encoder_id(name: str) -> str:
    """How feature folders record the encoder `name`: a folder by its absolute path (so
    that a run naming it relative to another directory still matches), a name as is."""
    return str(Path(name).expanduser().resolve()) if _is_path(name) else name


def _is_path(name: str) -> bool:
    """A local folder rather than a timm / hub name."""
    return name.startswith((".", "/", "~")) or Path(name).expanduser().exists() or (
        "/" in name and not name.startswith("hf-hub:"))


def _patch_size(model_name: str) -> int:
    """The patch size of `model_name` (built on the meta device: no weights, no memory)."""
    import timm

    with torch.device("meta"):
        if model_name.startswith("local-dir:"):
            from timm.models._hub import load_model_config_from_path

            _, arch, args = load_model_config_from_path(model_name.removeprefix("local-dir:"))
            model = timm.create_model(arch, pretrained=False, **(args or {}))
        else:
            model = timm.create_model(model_name, pretrained=False)
    return int(model.patch_embed.patch_size[0])
