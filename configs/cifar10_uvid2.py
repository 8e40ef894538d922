"""CIFAR-10 unconditional U-ViD2: cifar10_uvit.py with differential attention V2 in blocks 2..12.

The blocks where U-ViC has Cog attention run the second version of differential attention
(the authors' public code): each of the 8 heads has a second query of its own sharing the
head's key and value, and weighs the value by softmax(S1) - sigmoid(x . w) softmax(S2), a
weight per query token and head; the qkv and proj weights are U-ViT's.
"""

from pathlib import Path

from uvic.config import Config, load_config


def get_config() -> Config:
    """Same recipe as cifar10_uvit; only the attention pattern, name and output differ."""
    return load_config(
        Path(__file__).with_name("cifar10_uvit.py"),
        ["model.attention=uvid2", "name=cifar10_uvid2", "train.output_dir=runs/cifar10_uvid2"],
    )
