"""ImageNet 64x64 class-conditional U-ViT-L/4: imagenet64_uvit_mid.py with the L model.

The release's two ImageNet 64 configs (configs/imagenet64_uvit_{mid,large}.py of
baofff/U-ViT) differ only in the network's width, depth and heads.
"""

from pathlib import Path

from uvic.config import Config, load_config
from uvic.config.models import size_overrides


def get_config() -> Config:
    """U-ViT-L/4 on 64x64 ImageNet pixels, 300k steps of batch 1024."""
    return load_config(Path(__file__).with_name("imagenet64_uvit_mid.py"), [
        *size_overrides("large"),  # U-ViT-L: 286.8M
        "name=imagenet64_uvit_large", "train.output_dir=runs/imagenet64_uvit_large",
    ])
