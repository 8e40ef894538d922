"""U-ViC twin of imagenet256_uvit_large_flow.py: Cog attention but in the first and last
block, under the same modern recipe (flow matching, REPA, guidance interval; the recipe,
its sources and its data are that file's)."""

from pathlib import Path

from uvic.config import Config, load_config


def get_config() -> Config:
    """Same recipe as imagenet256_uvit_large_flow; only the attention pattern, name and
    output differ."""
    return load_config(Path(__file__).with_name("imagenet256_uvit_large_flow.py"), [
        "model.attention=uvic",
        "name=imagenet256_uvic_large_flow", "train.output_dir=runs/imagenet256_uvic_large_flow",
    ])
