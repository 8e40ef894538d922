"""CIFAR-10 unconditional U-ViS: cifar10_uvit.py with sigmoid attention in blocks 2..12.

The blocks where U-ViC has Cog attention run sigmoid attention without normalisation
(Gu et al. 2024, Table 15): sigmoid(q.k / sqrt(d) + b), b = -log N (N = 257 tokens) by
default; `--set model.sigmoid_bias_learnable=true` learns one b per head.
"""

from pathlib import Path

from uvic.config import Config, load_config


def get_config() -> Config:
    """Same recipe as cifar10_uvit; only the attention pattern, name and output differ."""
    return load_config(
        Path(__file__).with_name("cifar10_uvit.py"),
        ["model.attention=uvis", "name=cifar10_uvis", "train.output_dir=runs/cifar10_uvis"],
    )
