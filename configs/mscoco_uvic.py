"""MS-COCO text-to-image U-ViC: mscoco_uvit.py with Cog attention in blocks 2..12."""

import dataclasses
from pathlib import Path

from uvic.config import Config, load_config


def get_config() -> Config:
    """Same recipe as mscoco_uvit; only the attention pattern, name and output differ."""
    base = load_config(Path(__file__).with_name("mscoco_uvit.py"))
    return dataclasses.replace(
        base,
        name="mscoco_uvic",
        model=dataclasses.replace(base.model, attention="uvic"),
        train=dataclasses.replace(base.train, output_dir="runs/mscoco_uvic"),
    )
