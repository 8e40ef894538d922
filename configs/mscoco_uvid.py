"""MS-COCO text-to-image U-ViD: mscoco_uvit.py with differential attention in blocks 2..12
(as cifar10_uvid.py)."""

from pathlib import Path

from uvic.config import Config, load_config


def get_config() -> Config:
    """Same recipe as mscoco_uvit; only the attention pattern, name and output differ."""
    return load_config(
        Path(__file__).with_name("mscoco_uvit.py"),
        ["model.attention=uvid", "name=mscoco_uvid", "train.output_dir=runs/mscoco_uvid"],
    )
