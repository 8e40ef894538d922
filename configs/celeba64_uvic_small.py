"""U-ViC twin of celeba64_uvit_small.py: Cog attention but in the first and last block."""

from uvic.config import Config
from uvic.presets import derive


def get_config() -> Config:
    """celeba64_uvit_small with another attention pattern; nothing else differs."""
    cfg = derive("celeba64_uvit_small", __file__)
    cfg.model.attention = "uvic"
    return cfg
