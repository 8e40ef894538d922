"""CIFAR-10 unconditional U-ViC: cifar10_uvit.py with Cog attention in blocks 2..12."""

from pathlib import Path

from uvic.config import Config, load_config


def get_config() -> Config:
    """Same recipe as cifar10_uvit; only the attention pattern, name and output differ."""
    return load_config(
        Path(__file__).with_name("cifar10_uvit.py"),
        ["model.attention=uvic", "name=cifar10_uvic", "train.output_dir=runs/cifar10_uvic"],
    )
