"""CIFAR-10 unconditional U-ViD: cifar10_uvit.py with differential attention in blocks 2..12.

The blocks where U-ViC has Cog attention run differential attention (Ye et al., ICLR
2025): 4 heads of value width 128 on the same qkv and proj weights; lambda_init follows
the block's depth. `--set model.output_gate=headwise` (or elementwise) adds the output
gate to every block, on any preset.
"""

from pathlib import Path

from uvic.config import Config, load_config


def get_config() -> Config:
    """Same recipe as cifar10_uvit; only the attention pattern, name and output differ."""
    return load_config(
        Path(__file__).with_name("cifar10_uvit.py"),
        ["model.attention=uvid", "name=cifar10_uvid", "train.output_dir=runs/cifar10_uvid"],
    )
