"""The preset configs (`configs/*.py`) by name, in a checkout and in an installed copy (a
wheel installs them as `uvic/configs/`). `--config` takes a path or a preset's name, and a
`configs/NAME.py` that does not exist where the program runs is that preset. Also the
quickstart's two models and its configs, and `derive`, with which a config file starts
from another.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from uvic.config import Config, ConfigError, load_config

_HERE = Path(__file__).resolve().parent
# An installed copy: uvic/configs/; a checkout (or an editable install): configs/ beside uvic/.
_FOLDERS = (_HERE / "configs", _HERE.parent / "configs")

# The quickstart (`uvic-quickstart`): its two models, display name -> attention preset, and
# its config per `--preset` (the larger run on a GPU).
QUICKSTART_MODELS = {"U-ViT": "uvit", "U-ViC": "uvic"}
QUICKSTART_PRESETS = {"cpu": "quickstart", "gpu": "quickstart_gpu"}


def presets_folder() -> Path:
    """The folder of the preset config files."""
    for folder in _FOLDERS:
        if folder.is_dir():
            return folder
    raise FileNotFoundError(f"no preset configs: neither {_FOLDERS[0]} nor {_FOLDERS[1]} "
                            "exists (a broken install?)")


def preset_names() -> list[str]:
    """The presets' names (file stems), sorted."""
    return sorted(p.stem for p in presets_folder().glob("*.py") if not p.stem.startswith("_"))


def preset_path(name: str) -> Path:
    """The file of the preset `name` (`cifar10_uvic` or `cifar10_uvic.py`)."""
    stem = name.removesuffix(".py")
    path = presets_folder() / f"{stem}.py"
    if "/" in stem or "\\" in stem or stem.startswith("_") or not path.is_file():
        raise FileNotFoundError(f"no preset config {name!r} (presets: "
                                f"{', '.join(preset_names())})")
    return path


def resolve_config(text: str | Path) -> Path:
    """What `--config text` names: an existing file; else a preset, by name
    (`cifar10_uvic`: an unknown name raises FileNotFoundError listing the presets) or as
    `configs/cifar10_uvic.py`; else `text` unchanged (the loader then says that no such
    file exists)."""
    path = Path(text)
    if path.is_file():
        return path
    if len(path.parts) == 1 and not path.suffix:
        return preset_path(path.name)
    if path.suffix == ".py" and path.parts[:-1] in ((), ("configs",)):
        with contextlib.suppress(FileNotFoundError):
            return preset_path(path.name)
    return path


def derive(base: str, config_file: str | Path) -> Config:
    """The config `base`.py beside `config_file`, else the preset `base` (so a file named as
    its base, `my/cifar10_uvit.py` deriving from `cifar10_uvit`, starts from the preset),
    named after `config_file` (its `name` and run folder `runs/<name>`): a config file
    derived from another loads it so, then sets what differs."""
    path = Path(config_file)
    sibling = path.with_name(f"{base}.py")
    try:
        source = (sibling if sibling.is_file() and sibling.resolve() != path.resolve()
                  else preset_path(base))
    except FileNotFoundError as err:
        raise ConfigError(f"{path}: derive({base!r}): no {sibling.name} beside it; {err}"
                          ) from None
    if source.resolve() == path.resolve():
        raise ConfigError(f"{path}: derive({base!r}) names this file itself")
    cfg = load_config(source)
    cfg.name = path.stem
    cfg.train.output_dir = f"runs/{path.stem}"
    return cfg
