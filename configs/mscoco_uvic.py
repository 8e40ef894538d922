"""MS-COCO text-to-image U-ViC: mscoco_uvit.py with Cog attention in blocks 2..12."""

from pathlib import Path

from uvic.config import Config, load_config


def get_config() -> Config:
    """Same recipe as mscoco_uvit; only the attention pattern, name and output differ."""
    return load_config(
        Path(__file__).with_name("mscoco_uvit.py"),
        ["model.attention=uvic", "name=mscoco_uvic", "train.output_dir=runs/mscoco_uvic"],
    )
