"""CIFAR-10 unconditional U-ViD2: cifar10_uvit.py with differential attention V2 in blocks 2..12.

The blocks where U-ViC has Cog attention run the second version of differential attention
(the authors' public code): each of the 8 heads has a second query of its own sharing the
head's key and value, and weighs the value by softmax(S1) - sigmoid(x . w) softmax(S2), a
weight per query token and head; the qkv and proj weights are U-ViT's.
"""

from uvic.config import Config
from uvic.presets import derive


def get_config() -> Config:
    """cifar10_uvit with another attention pattern; nothing else differs."""
    cfg = derive("cifar10_uvit", __file__)
    cfg.model.attention = "uvid2"
    return cfg
