"""constraints.txt is the full lock of `make install`: every package the install brings is
pinned, each pin within pyproject.toml's range (whose lower ends are not above the pins),
the pins are what this environment runs, and `make lock` writes them in that form."""

from __future__ import annotations

import importlib.metadata as metadata
import json
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def pins() -> dict[str, Requirement]:
    """constraints.txt's pins by canonical name."""
    lines = [line.split("#")[0].strip() for line in
             (ROOT / "constraints.txt").read_text().splitlines()]
    found = [Requirement(line) for line in lines if line]
    return {canonicalize_name(r.name): r for r in found}


def pinned_version(req: Requirement) -> Version:
    """The version of an `==` pin."""
    (spec,) = req.specifier
    assert spec.operator == "==", f"{req}: not an == pin"
    return Version(spec.version)


def test_every_dependency_is_pinned_within_its_range() -> None:
    """Each dependency of pyproject.toml (and its test extra) has a pin that its range
    allows, and no range starts above its pin (the ranges' lower ends stay installable)."""
    locked = pins()
    wanted = [*PROJECT["dependencies"], *PROJECT["optional-dependencies"]["test"]]
    for text in wanted:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name in locked, f"{req.name} is not pinned in constraints.txt"
        version = pinned_version(locked[name])
        assert req.specifier.contains(version, prereleases=True), f"{version} outside {text}"
        for spec in req.specifier:
            if spec.operator in (">=", ">", "~="):
                assert Version(spec.version) <= version, f"{text}: lower end above {version}"


def requirements_of(name: str, extras: set[str]) -> list[Requirement]:
    """The installed distribution `name`'s requirements that apply here with `extras`."""
    out = []
    for text in metadata.requires(name) or []:
        req = Requirement(text)
        if req.marker is None or any(req.marker.evaluate({"extra": e})
                                     for e in (extras or {""})):
            out.append(req)
    return out


def test_lock_holds_every_package_the_install_brings() -> None:
    """Every distribution that `uvic[test]` pulls in here (its requirements, followed
    through the installed metadata) is pinned at the version this environment runs."""
    locked = pins()
    visited: set[tuple[str, frozenset[str]]] = set()
    todo = [("uvic", frozenset({"test"}))]
    while todo:
        name, extras = todo.pop()
        for req in requirements_of(name, set(extras)):
            node = (canonicalize_name(req.name), frozenset(req.extras))
            if node not in visited:
                visited.add(node)
                todo.append((req.name, node[1]))
    seen = {name for name, _ in visited}
    missing = sorted(seen - set(locked))
    assert not missing, f"constraints.txt does not pin {missing} (make lock)"
    wrong = {n: (str(pinned_version(locked[n])), metadata.version(n)) for n in sorted(seen)
             if pinned_version(locked[n]) != Version(metadata.version(n))}
    assert not wrong, f"pinned vs installed: {wrong} (make install, or make lock)"


def test_torch_stays_at_its_pins() -> None:
    """The lock keeps the torch build the project is tested with."""
    locked = pins()
    assert str(locked["torch"].specifier) == "==2.14.1"
    assert str(locked["torchvision"].specifier) == "==0.29.2"


def test_make_lock_writes_sorted_pins_with_torchs_marker(tmp_path: Path) -> None:
    """The step of `make lock` that turns pip's install report into pins: one `name==version`
    line per package but the checkout itself, sorted by name, the CUDA packages and triton
    for Linux only."""
    recipe = subprocess.run(["make", "-n", "-s", "-C", str(ROOT), "lock"], capture_output=True,
                            text=True, timeout=60, check=True).stdout.splitlines()
    (line,) = [r for r in recipe if "report.json >>" in r]
    words = shlex.split(line)
    code = words[words.index("-c") + 1]
    report = {"install": [
        {"metadata": {"name": n, "version": v}, **({"is_direct": True} if n == "uvic" else {})}
        for n, v in [("uvic", "0.1.0"), ("triton", "3.8.0"), ("Jinja2", "3.1.6"),
                     ("nvidia-cublas", "13.1.1.3"), ("accelerate", "1.15.0"),
                     ("cuda-bindings", "13.5.0")]]}
    (tmp_path / "report.json").write_text(json.dumps(report))
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "report.json")],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    linux = '; platform_system == "Linux"'
    assert out.splitlines() == [
        "accelerate==1.15.0", f"cuda-bindings==13.5.0{linux}", "Jinja2==3.1.6",
        f"nvidia-cublas==13.1.1.3{linux}", f"triton==3.8.0{linux}"]
    for text in out.splitlines():
        Requirement(text)  # each line is a valid requirement, its marker too
