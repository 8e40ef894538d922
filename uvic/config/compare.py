"""Comparing configs: what differs between two runs' configs (a resume's changes, a
U-ViC config against its U-ViT twin) and a flat view for trackers' hyper-parameter tables."""

from __future__ import annotations

from typing import Any

from uvic.config import Config, to_dict


def flat_dict(cfg: Config) -> dict[str, Any]:
    """"section/field" -> value with scalars only (for trackers' hyper-parameter tables)."""
    flat = {}
    for section, values in to_dict(cfg).items():
        if isinstance(values, dict):
            for key, value in values.items():
                ok = isinstance(value, int | float | str | bool)
                flat[f"{section}/{key}"] = value if ok else str(value)
        else:
            flat[section] = values
    return flat


def config_changes(saved: Config, current: Config, section: str) -> list[str]:
    """The fields of `section` that differ between two configs, one line each."""
    old, new = to_dict(saved)[section], to_dict(current)[section]
    return [f"{section}.{k}: {old.get(k)!r} in the checkpoint vs {new.get(k)!r} now"
            for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def config_diff(old: Config, new: Config) -> dict[str, tuple[Any, Any]]:
    """Every field that differs between two configs: "section.field" (or a top-level
    name) -> (old value, new value), in the order of the config's fields."""
    before, after = to_dict(old), to_dict(new)
    diff = {}
    for section, values in before.items():
        if isinstance(values, dict):
            diff.update({f"{section}.{k}": (v, after[section][k]) for k, v in values.items()
                         if v != after[section][k]})
        elif values != after[section]:
            diff[section] = (values, after[section])
    return diff
