"""The package list for setuptools; every other setting is in pyproject.toml.

pyproject.toml alone cannot both find packages and install a folder under another name,
so this file does: every package under `uvic/` is found automatically, and two folders
install under other names:

* `kernels/` as `uvic_kernels` (a bare `kernels` would collide with the `kernels`
  distribution that diffusers and transformers look for in site-packages);
* `configs/` as `uvic/configs/`, the preset configs an installed copy finds by name
  (`--config cifar10_uvic`, see `uvic.presets`).
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["uvic", "uvic.*"]), "uvic_kernels", "uvic.configs"],
    package_dir={"uvic_kernels": "kernels", "uvic.configs": "configs"},
    package_data={"uvic_kernels": ["*.md"]},
)
