"""CIFAR-10 unconditional U-ViC: cifar10_uvit.py with Cog attention in blocks 2..12."""

import dataclasses
from pathlib import Path

from uvic.config import Config, load_config


def get_config() -> Config:
    """Same recipe as cifar10_uvit; only the attention pattern, name and output differ."""
    base = load_config(Path(__file__).with_name("cifar10_uvit.py"))
    return dataclasses.replace(
        base,
        name="cifar10_uvic",
        model=dataclasses.replace(base.model, attention="uvic"),
        train=dataclasses.replace(base.train, output_dir="runs/cifar10_uvic"),
    )
