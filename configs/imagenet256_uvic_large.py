"""U-ViC twin of imagenet256_uvit_large.py: Cog attention but in the first and last block."""

from pathlib import Path

from uvic.config import Config, load_config


def get_config() -> Config:
    """Same recipe as imagenet256_uvit_large; only the attention pattern, name and output differ."""
    return load_config(Path(__file__).with_name("imagenet256_uvit_large.py"), [
        "model.attention=uvic",
        "name=imagenet256_uvic_large", "train.output_dir=runs/imagenet256_uvic_large",
    ])
