"""U-ViC twin of imagenet64_uvit_mid.py: Cog attention but in the first and last block."""

from uvic.config import Config
from uvic.presets import derive


def get_config() -> Config:
    """imagenet64_uvit_mid with another attention pattern; nothing else differs."""
    cfg = derive("imagenet64_uvit_mid", __file__)
    cfg.model.attention = "uvic"
    return cfg
