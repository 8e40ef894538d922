"""MS-COCO text-to-image U-ViD: mscoco_uvit.py with differential attention in blocks 2..12
(as cifar10_uvid.py)."""

from uvic.config import Config
from uvic.presets import derive


def get_config() -> Config:
    """mscoco_uvit with another attention pattern; nothing else differs."""
    cfg = derive("mscoco_uvit", __file__)
    cfg.model.attention = "uvid"
    return cfg
