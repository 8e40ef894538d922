"""CIFAR-10 unconditional U-ViC trained by flow matching: cifar10_uvit_flow.py with Cog
attention in blocks 2..12 (the recipe and its reasons are that file's)."""

from pathlib import Path

from uvic.config import Config, load_config


def get_config() -> Config:
    """Same recipe as cifar10_uvit_flow; only the attention pattern, name and output differ."""
    return load_config(
        Path(__file__).with_name("cifar10_uvit_flow.py"),
        ["model.attention=uvic", "name=cifar10_uvic_flow",
         "train.output_dir=runs/cifar10_uvic_flow"],
    )
