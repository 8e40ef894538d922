"""uvic: U-ViT and U-ViC (Cog attention) diffusion transformers: train, sample, evaluate.

The public API, each name imported on first use so that `import uvic` stays light:
`load_config`, `Config`, `ConfigError` (configs and overrides); `preset_path`,
`resolve_config` (preset configs by name); `build_model` (a fresh network), `load_model`
(a checkpoint, in the architecture it was trained with); `train`; `sample_to_folder` and
`generate` (sampling); `evaluate` (FID and KID). The programs are `uvic.cli`'s, the fused
attention kernels the package `uvic_kernels`.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it
_API = {
    "Config": "uvic.config",
    "ConfigError": "uvic.config",
    "load_config": "uvic.config",
    "preset_path": "uvic.presets",
    "resolve_config": "uvic.presets",
    "build_model": "uvic.models.uvit",
    "load_model": "uvic.sampling.load",
    "train": "uvic.training.trainer",
    "sample_to_folder": "uvic.sampling.folder",
    "generate": "uvic.sampling.generate",
    "evaluate": "uvic.evaluation.fid",
}

__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    """Import a public name's module when the name is first used (PEP 562)."""
    if name not in _API:
        raise AttributeError(f"module 'uvic' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value  # later uses skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
