"""MS-COCO text-to-image U-ViC: mscoco_uvit.py with Cog attention in blocks 2..12."""

from uvic.config import Config
from uvic.presets import derive


def get_config() -> Config:
    """mscoco_uvit with another attention pattern; nothing else differs."""
    cfg = derive("mscoco_uvit", __file__)
    cfg.model.attention = "uvic"
    return cfg
