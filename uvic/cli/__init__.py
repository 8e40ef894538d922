"""The command-line programs, one module each, installed as commands (pyproject.toml's
[project.scripts]); the files in `scripts/` and `eval/` run the same `main`.

A program parses its arguments before it imports torch or the library, so that `--help` and
a usage error answer at once: this package and each program's module import only the
standard library and light modules of uvic at module level.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path


def summary(doc: str | None) -> str:
    """A module docstring's first paragraph in one line: a program's `--help` description,
    whole sentences (its first line alone may stop mid-sentence)."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def unit_float(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def class_list(text: str) -> list[int | str]:
    """argparse type: comma-separated class ids, numbers or WordNet ids (`207,n01440764`)."""
    words = [w.strip() for w in text.split(",")]
    bad = [w for w in words if not re.fullmatch(r"-?\d+|n\d{8}", w)]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]!r} is neither a class number nor a WordNet "
                                         "id (give ids like 207,360 or n01440764)")
    return [w if w.startswith("n") else int(w) for w in words]


def input_error(path: str | Path, option: str) -> str | None:
    """Why the input file `path` given to `option` cannot be read, in one line (None: it
    can), so that a mistyped path answers before the heavy imports."""
    p = Path(path)
    if not p.exists():
        return f"{option} {path}: no such file"
    if p.is_dir():
        return f"{option} {path}: a folder, not a file"
    if not os.access(p, os.R_OK):
        return f"{option} {path}: not readable (permissions)"
    return None
