"""CIFAR-10 unconditional U-ViD: cifar10_uvit.py with differential attention in blocks 2..12.

The blocks where U-ViC has Cog attention run differential attention (Ye et al., ICLR
2025): 4 heads of value width 128 on the same qkv and proj weights; lambda_init follows
the block's depth. `--set model.output_gate=headwise` (or elementwise) adds the output
gate to every block, on any preset.
"""

from uvic.config import Config
from uvic.presets import derive


def get_config() -> Config:
    """cifar10_uvit with another attention pattern; nothing else differs."""
    cfg = derive("cifar10_uvit", __file__)
    cfg.model.attention = "uvid"
    return cfg
