"""The package as a user installs it: a wheel built from the checkout, installed into a
fresh folder outside it, runs every command's `--help`, a tiny training run (a preset
config by name, on the built-in Shapes data) and a tiny sampling of it.

The installed copy must be the only uvic the commands can import: they run with `python -S`
(no site-packages processing, so no editable install of the checkout) and a PYTHONPATH of
the install folder and this environment's site-packages (torch and the other dependencies).
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
TINY_TRAIN = [
    "--set", "train.max_steps=2", "--set", "train.batch_size=4", "--set", "train.log_every=1",
    "--set", "train.ckpt_every=2", "--set", "train.sample_every=0", "--set", "train.keep_steps=[]",
    "--set", "sample.autoguidance_scale=0", "--set", "data.num_images=16",
    "--set", "data.num_workers=0", "--set", "model.embed_dim=32", "--set", "model.depth=2",
]


def checkout_files() -> list[str]:
    """The files a release of this checkout holds: tracked, and new ones not ignored."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    return [name for name in out.decode().split("\0") if name and (ROOT / name).is_file()]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel of a clean copy of the checkout (no build/ leftovers), installed into a
    fresh folder; returns that folder."""
    tmp = tmp_path_factory.mktemp("install")
    source, wheels, target = tmp / "source", tmp / "wheels", tmp / "target"
    for name in checkout_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes((ROOT / name).read_bytes())
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    build = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                            str(source)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = wheels.glob("uvic-*.whl")
    install = subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    return target


def run(target: Path, *words: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -S words...` seeing the installed copy and the dependencies only."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd),
           "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(target), *site.getsitepackages()])}
    return subprocess.run([sys.executable, "-S", *words], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_installed_copy_is_complete(installed: Path) -> None:
    """Every package under uvic/ (found, not listed: uvic.analysis was once left out), the
    kernels as uvic_kernels with their notes, the preset configs and every command."""
    from setuptools import find_packages

    assert {"uvic.analysis", "uvic.cli", "uvic.models"} <= set(
        find_packages(where=str(ROOT), include=["uvic", "uvic.*"]))
    for package in find_packages(where=str(ROOT), include=["uvic", "uvic.*"]):
        assert (installed / package.replace(".", "/") / "__init__.py").is_file(), package
    for path in (ROOT / "kernels").glob("*.py"):
        assert (installed / "uvic_kernels" / path.name).is_file(), path.name
    assert (installed / "uvic_kernels" / "BENCHMARKS.md").is_file()
    presets = {p.name for p in (ROOT / "configs").glob("*.py")}
    assert presets and presets == {p.name for p in (installed / "uvic" / "configs").glob("*.py")}
    assert set(SCRIPTS) <= {p.name for p in (installed / "bin").iterdir()}


@pytest.mark.slow
def test_installed_commands_answer_help(installed: Path, tmp_path: Path) -> None:
    """Outside the checkout, every command's --help, from the installed copy."""
    where = run(installed, "-c", "import uvic, uvic_kernels; print(uvic.__file__); "
                "print(uvic_kernels.__file__)", cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    assert all(Path(line).is_relative_to(installed) for line in where.stdout.split()), where.stdout
    for name in sorted(SCRIPTS):
        proc = run(installed, str(installed / "bin" / name), "--help", cwd=tmp_path)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-2000:]}"
        assert proc.stdout.startswith("usage: "), name


@pytest.mark.slow
def test_installed_copy_trains_and_samples(installed: Path, tmp_path: Path) -> None:
    """A tiny training run of the quickstart preset, by name, then samples of it."""
    train = run(installed, str(installed / "bin" / "uvic-train"), "--config", "quickstart",
                "--output-dir", "run", *TINY_TRAIN, cwd=tmp_path)
    assert train.returncode == 0, train.stderr[-3000:]
    assert (tmp_path / "run" / "ema.safetensors").is_file()
    sample = run(installed, str(installed / "bin" / "uvic-sample"), "--config", "run/config.json",
                 "--ckpt", "run/ema.safetensors", "--out", "samples", "--n", "2", "--steps", "2",
                 "--quiet", cwd=tmp_path)
    assert sample.returncode == 0, sample.stderr[-3000:]
    assert (tmp_path / "samples" / "grid.png").read_bytes()[:4] == b"\x89PNG"


def test_wheel_file_lists_the_commands(installed: Path) -> None:
    """The installed metadata declares every console script of pyproject.toml."""
    (dist,) = installed.glob("uvic-*.dist-info")
    entry_points = (dist / "entry_points.txt").read_text()
    for name, entry in SCRIPTS.items():
        assert f"{name} = {entry}" in entry_points

