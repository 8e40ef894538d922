"""ImageNet 64x64 class-conditional U-ViT-L/4: imagenet64_uvit_mid.py with the L model.

The release's two ImageNet 64 configs (configs/imagenet64_uvit_{mid,large}.py of
baofff/U-ViT) differ only in the network's width, depth and heads.
"""

from dataclasses import replace

from uvic.config import Config
from uvic.config.models import uvit_size
from uvic.presets import derive


def get_config() -> Config:
    """U-ViT-L/4 on 64x64 ImageNet pixels, 300k steps of batch 1024."""
    cfg = derive("imagenet64_uvit_mid", __file__)
    cfg.model = replace(cfg.model, **uvit_size("large"))  # U-ViT-L: 286.8M
    return cfg
