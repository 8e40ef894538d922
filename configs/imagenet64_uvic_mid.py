"""U-ViC twin of imagenet64_uvit_mid.py: Cog attention but in the first and last block."""

from pathlib import Path

from uvic.config import Config, load_config


def get_config() -> Config:
    """Same recipe as imagenet64_uvit_mid; only the attention pattern, name and output differ."""
    return load_config(Path(__file__).with_name("imagenet64_uvit_mid.py"), [
        "model.attention=uvic",
        "name=imagenet64_uvic_mid", "train.output_dir=runs/imagenet64_uvic_mid",
    ])
