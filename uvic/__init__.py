"""uvic: U-ViT and U-ViC (Cog attention) diffusion transformers: train, sample, evaluate.

The public API, one name per job (each imported on first use, so `import uvic` stays
light: the command-line programs answer `--help` without loading torch):

- `load_config(path, overrides=())` -> `Config`: read a config file (`configs/*.py`, or a
  run's saved `config.json`) and apply `section.field=value` overrides; `Config` is the
  typed dataclass of every setting, `ConfigError` what a bad file or value raises.
- `preset_path(name)` -> Path: the file of a preset config by name (`"cifar10_uvic"`),
  in a checkout or an installed copy; `resolve_config(text)` is what `--config` names.
- `build_model(cfg)` -> `UViT`: the network a config's model section describes (fresh
  weights); `load_model(cfg, ckpt, device)`: a checkpoint's weights in the architecture
  it was trained with, ready to sample.
- `train(cfg, resume=None, overwrite=False)` -> Path: the training loop (Accelerate,
  EMA, checkpoints) into `cfg.train.output_dir`; returns the run folder.
- `sample_to_folder(cfg, ckpts, out, n=...)`: sample images of one or more checkpoints
  from the same noise into a folder (grid, PNGs, the settings used), as `uvic-sample`;
  `generate(model, diffusion, cfg, indices, seed=...)`: the one sampling loop under it,
  yielding batches of images.
- `evaluate(cfg, ckpt, n=...)` -> dict: FID and KID of a checkpoint under the config's
  protocol (clean-fid), as `uvic-fid`.

The programs (`uvic-train`, `uvic-sample`, `uvic-fid`, `uvic-quickstart`, ...) are in
`uvic.cli`; the fused attention kernels are the package `uvic_kernels`.
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
