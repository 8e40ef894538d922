"""U-ViC twin of imagenet256_uvit_large.py: Cog attention but in the first and last block."""

from uvic.config import Config
from uvic.presets import derive


def get_config() -> Config:
    """imagenet256_uvit_large with another attention pattern; nothing else differs."""
    cfg = derive("imagenet256_uvit_large", __file__)
    cfg.model.attention = "uvic"
    return cfg
