"""CIFAR-10 unconditional U-ViC: cifar10_uvit.py with Cog attention in blocks 2..12."""

from uvic.config import Config
from uvic.presets import derive


def get_config() -> Config:
    """cifar10_uvit with another attention pattern; nothing else differs."""
    cfg = derive("cifar10_uvit", __file__)
    cfg.model.attention = "uvic"
    return cfg
