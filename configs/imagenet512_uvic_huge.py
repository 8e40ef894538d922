"""U-ViC twin of imagenet512_uvit_huge.py: Cog attention but in the first and last block."""

from uvic.config import Config
from uvic.presets import derive


def get_config() -> Config:
    """imagenet512_uvit_huge with another attention pattern; nothing else differs."""
    cfg = derive("imagenet512_uvit_huge", __file__)
    cfg.model.attention = "uvic"
    return cfg
