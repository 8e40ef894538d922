"""U-ViC twin of imagenet256_uvit_large_flow.py: Cog attention but in the first and last
block, under the same modern recipe (flow matching, REPA, guidance interval; the recipe,
its sources and its data are that file's)."""

from uvic.config import Config
from uvic.presets import derive


def get_config() -> Config:
    """imagenet256_uvit_large_flow with another attention pattern; nothing else differs."""
    cfg = derive("imagenet256_uvit_large_flow", __file__)
    cfg.model.attention = "uvic"
    return cfg
