"""Typed run configuration: one `Config` fully describes a training, sampling or evaluation run.

Config files are Python modules (`configs/*.py`, defining `get_config() -> Config`; one
derived from another loads it, `uvic.presets.derive`, and sets fields) or a run's
saved `config.json`. The sections have slots, so a misspelt field is an error, and a loaded
value of the wrong type is a `ConfigError` naming the file and key. `--set
section.field=value` strings are the command line's: `apply_overrides` parses them with the
field's type. This package is the bottom layer (docs/architecture.md): none of its modules
imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
import traceback
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from uvic.config.schema import (  # the schema, re-exported: uvic.config.Config
    Config,
    DataConfig,
    DiffusionConfig,
    EvalConfig,
    ModelConfig,
    OptimConfig,
    SampleConfig,
    TrainConfig,
)

__all__ = [
    "RESUMES_KEY", "Config", "ConfigError", "DataConfig", "DiffusionConfig", "EvalConfig",
    "ModelConfig", "OptimConfig", "SampleConfig", "TrainConfig", "apply_overrides",
    "from_dict", "load_config", "parse_value", "require", "to_dict",
]


class ConfigError(ValueError):
    """A config file, key or value is wrong; the message names it."""


def require(checks: Iterable[tuple[bool, str]]) -> None:
    """Raise a ConfigError with the message of the first check that fails (the rules on
    values use it: `uvic.config.validation`)."""
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


# A run's config.json: the current config plus, under this key, the changes each resume
# made (uvic.run.prepare); loading the file as a config skips it.
RESUMES_KEY = "resumes"
# JSON has no infinity (Python writes `Infinity`, which strict readers refuse). The values
# of these keys may hold inf, the guidance interval's upper bound: `to_dict` writes it as
# null (no upper limit) and `from_dict` reads null back as inf (`inf_to_null`).
JSON_INF_AS_NULL = ("sample.guidance_interval",)


# --------------------------------------------------------------------------- loading


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a `configs/*.py` module (calls its `get_config()`; its values are type-checked
    as a saved config's are) or a saved `config.json`, then apply `section.field=value`
    overrides."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}:{err.lineno}: not valid JSON ({err})") from err
        if isinstance(data, dict):  # a run's config.json: its resume history is no setting
            data = {k: v for k, v in data.items() if k != RESUMES_KEY}
        cfg = from_dict(data, source=str(path))
    elif path.suffix == ".py":
        cfg = _run_config_module(path)
        if not isinstance(cfg, Config):
            raise ConfigError(f"{path}: get_config() must return uvic.config.Config")
        # every value of the declared type (`lr = "1e-4"` names the file and key), as JSON
        # would give it back: tuples as tuples, whole floats as floats
        cfg = from_dict(dataclasses.asdict(cfg), source=str(path))
    else:
        raise ConfigError(f"{path}: config must be a .py module or a saved .json")
    return apply_overrides(cfg, overrides)


def _run_config_module(path: Path) -> Any:
    """What a `configs/*.py` file's `get_config()` returns. A file that does not run (a
    syntax error, a name it lacks, an error of its own) is a ConfigError of one line,
    `file:line: what`, at the line of that file where it failed."""
    spec = importlib.util.spec_from_file_location(f"uvic_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    try:
        spec.loader.exec_module(module)
        if not hasattr(module, "get_config"):
            raise ConfigError(f"{path}: defines no get_config()")
        return module.get_config()
    except ConfigError:
        raise
    except SyntaxError as err:  # in this file, or in a module it imports
        elsewhere = err.filename and Path(err.filename).resolve() != path.resolve()
        where = err.filename if elsewhere else path
        raise ConfigError(f"{where}:{err.lineno}: {type(err).__name__}: {err.msg}") from None
    except Exception as err:
        lines = [f.lineno for f in traceback.extract_tb(err.__traceback__)
                 if Path(f.filename).resolve() == path.resolve()]
        where = f"{path}:{lines[-1]}" if lines else str(path)
        what = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ConfigError(f"{where}: {type(err).__name__}" + (f": {what}" if what else "")
                          ) from err


def apply_overrides(cfg: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    """Apply `section.field=value` strings in order; returns a new Config."""
    cfg = dataclasses.replace(cfg)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        section_name, _, field_name = key.partition(".")
        if not field_name:  # top-level scalar like name=...
            section_name, field_name, target = "", section_name, cfg
        else:
            if section_name not in _field_types(Config):
                raise ConfigError(f"unknown config key {key!r} (no section {section_name!r})")
            target = dataclasses.replace(getattr(cfg, section_name))
            setattr(cfg, section_name, target)
        types_ = _field_types(type(target))
        if field_name not in types_:
            known = ", ".join(sorted(types_))
            where = section_name or "top level"
            raise ConfigError(f"unknown config key {key!r}; {where} has: {known}")
        if dataclasses.is_dataclass(types_[field_name]):
            raise ConfigError(f"config key {key!r} is a section; set one of its fields")
        setattr(target, field_name, parse_value(raw, types_[field_name], key))
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain dict of a Config that strict JSON holds (`JSON_INF_AS_NULL`)."""
    data = dataclasses.asdict(cfg)
    for key in JSON_INF_AS_NULL:
        section, name = key.split(".")
        data[section][name] = inf_to_null(data[section][name])
    return data


def inf_to_null(values: Iterable[float]) -> list[float | None]:
    """Numbers for strict JSON: inf (no upper limit) as None, JSON's null."""
    return [None if v == math.inf else v for v in values]


def null_to_inf(values: Iterable[float | None]) -> list[float]:
    """`inf_to_null` undone: None (JSON's null) as inf."""
    return [math.inf if v is None else v for v in values]


def from_dict(data: dict[str, Any], source: str = "config") -> Config:
    """Build a Config from a dict (e.g. a saved config.json); unknown keys are errors."""
    return _build(Config, data, prefix="", source=source)


# --------------------------------------------------------------------------- helpers


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _build(cls: type, data: dict[str, Any], prefix: str, source: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'config'} must be a mapping")
    types_ = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in types_:
            raise ConfigError(f"{source}: unknown config key {full!r}")
        tp = types_[key]
        if full in JSON_INF_AS_NULL and isinstance(value, list):
            value = null_to_inf(value)
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, prefix=f"{full}.", source=source)
        else:
            kwargs[key] = _check_type(value, tp, full, source)
    return cls(**kwargs)


def _check_type(value: Any, tp: Any, key: str, source: str = "config") -> Any:
    """Validate a JSON value against a field type (tuples arrive as lists)."""
    origin = typing.get_origin(tp)
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: any length
            if not isinstance(value, list | tuple):
                raise ConfigError(f"{source}: {key} must be a list, got {value!r}")
            return tuple(_check_type(v, args[0], key, source) for v in value)
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ConfigError(f"{source}: {key} must be a list of {len(args)} values")
        return tuple(_check_type(v, a, key, source) for v, a in zip(value, args))
    if float in (tp, *typing.get_args(tp)) and type(value) is int:  # float or float | None
        return float(value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key} must be a mapping, got {value!r}")
        return dict(value)
    if (tp in (int, float) and isinstance(value, bool)) or not isinstance(value, tp):
        raise ConfigError(
            f"{source}: {key} must be {_type_name(tp)}, got {type(value).__name__} {value!r}"
        )
    return value


def _type_name(tp: Any) -> str:
    """`int`, or `bool | str` for a union."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (types.UnionType, typing.Union) else ()
    return " | ".join(map(_type_name, args)) if args else getattr(tp, "__name__", str(tp))


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_value(raw: str, tp: Any, key: str) -> Any:
    """Parse a command-line string into the field type `tp`; errors name the key."""
    raw = raw.strip()
    origin = typing.get_origin(tp)
    try:
        if tp is bool:
            if raw.lower() in _TRUE:
                return True
            if raw.lower() in _FALSE:
                return False
            raise ValueError
        if tp is int:
            return int(raw.replace("_", ""))
        if tp is float:
            return float(raw)
        if tp is str:
            return raw
        if origin is dict:  # a JSON object
            value = json.loads(raw)
            if not isinstance(value, dict):
                raise ValueError
            return value
        if origin is tuple:
            parts = [p for p in raw.strip("()[]").split(",") if p.strip()]
            args = typing.get_args(tp)
            if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: any length
                return tuple(parse_value(p, args[0], key) for p in parts)
            if len(parts) != len(args):
                raise ValueError
            return tuple(parse_value(p, a, key) for p, a in zip(parts, args))
        if origin in (types.UnionType, typing.Union):  # the first member type that parses
            for member in typing.get_args(tp):
                with contextlib.suppress(ConfigError):
                    return parse_value(raw, member, key)
            raise ValueError
    except ValueError:
        raise ConfigError(f"config key {key!r} expects {_type_name(tp)}, got {raw!r}") from None
    raise ConfigError(f"config key {key!r} has a type overrides cannot set ({tp})")
