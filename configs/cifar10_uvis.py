"""CIFAR-10 unconditional U-ViS: cifar10_uvit.py with sigmoid attention in blocks 2..12.

The blocks where U-ViC has Cog attention run sigmoid attention without normalisation
(Gu et al. 2024, Table 15): sigmoid(q.k / sqrt(d) + b), b = -log N (N = 257 tokens) by
default; `--set model.sigmoid_bias_learnable=true` learns one b per head.
"""

from uvic.config import Config
from uvic.presets import derive


def get_config() -> Config:
    """cifar10_uvit with another attention pattern; nothing else differs."""
    cfg = derive("cifar10_uvit", __file__)
    cfg.model.attention = "uvis"
    return cfg
