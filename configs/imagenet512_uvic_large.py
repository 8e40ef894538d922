"""U-ViC twin of imagenet512_uvit_large.py: Cog attention but in the first and last block."""

from pathlib import Path

from uvic.config import Config, load_config


def get_config() -> Config:
    """Same recipe as imagenet512_uvit_large; only the attention pattern, name and output differ."""
    return load_config(Path(__file__).with_name("imagenet512_uvit_large.py"), [
        "model.attention=uvic",
        "name=imagenet512_uvic_large", "train.output_dir=runs/imagenet512_uvic_large",
    ])
