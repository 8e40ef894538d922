"""CIFAR-10 unconditional U-ViC trained by flow matching: cifar10_uvit_flow.py with Cog
attention in blocks 2..12 (the recipe and its reasons are that file's)."""

from uvic.config import Config
from uvic.presets import derive


def get_config() -> Config:
    """cifar10_uvit_flow with another attention pattern; nothing else differs."""
    cfg = derive("cifar10_uvit_flow", __file__)
    cfg.model.attention = "uvic"
    return cfg
