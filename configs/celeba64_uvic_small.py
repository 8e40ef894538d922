"""U-ViC twin of celeba64_uvit_small.py: Cog attention but in the first and last block."""

from pathlib import Path

from uvic.config import Config, load_config


def get_config() -> Config:
    """Same recipe as celeba64_uvit_small; only the attention pattern, name and output differ."""
    return load_config(Path(__file__).with_name("celeba64_uvit_small.py"), [
        "model.attention=uvic",
        "name=celeba64_uvic_small", "train.output_dir=runs/celeba64_uvic_small",
    ])
