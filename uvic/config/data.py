"""The rules on `data.*` values: which datasets exist, a sane loader.

Read by `build_dataset` and by `uvic.config.validation` (no torch here, so the CLI can offer
the names without loading the data code).
"""

from __future__ import annotations

from uvic.config import DataConfig, require

DATASETS = ("cifar10", "mscoco", "shapes", "imagenet", "imagenet_features", "celeba")
# Data whose model space is VAE latents, not pixels (samples are decoded before viewing).
LATENT_DATASETS = ("mscoco", "imagenet_features")


def check_data(data: DataConfig) -> None:
    """The rules on `data.*` values."""
    require([
        (data.name in DATASETS, f"data.name={data.name!r} must be one of {DATASETS}"),
        (data.num_workers >= 0, f"data.num_workers={data.num_workers} must be >= 0"),
    ])
