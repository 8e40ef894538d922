"""Model weights on disk: load `.pth`/`.pt` (the released `nnet_ema.pth` too) and
`.safetensors`, save `.safetensors` atomically.

Loading is strict by default and names every mismatch (missing, unexpected and misshapen
keys: the first few in the error's line, all in the file it names); wrapper prefixes
(`_orig_mod.` of torch.compile, `module.` of DDP) are stripped on both sides.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from uvic.files import atomic_write

# Keys under which training scripts commonly nest a state dict.
WRAPPER_KEYS = ("state_dict", "model", "ema", "model_ema", "nnet_ema", "nnet", "module")


WRAPPER_PREFIXES = ("_orig_mod.", "module.")
_MAX_LISTED = 3  # names of each kind of mismatch in an error's line; all in its report


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable, or does not fit the model. A mismatch
    keeps `details` (every line of it; the message shows the first few) and the `report`
    file that holds them, if one was written."""

    def __init__(self, message: str, details: list[str] | None = None,
                 report: Path | None = None) -> None:
        super().__init__(message)
        self.details, self.report = list(details or []), report


def mismatch_report(lines: list[str], path: Path | None = None) -> Path:
    """Write the whole account of a mismatch to `path` (default: a file of the temporary
    folder named by its content, so that the same mismatch again reuses it) and return
    the path: an error names it and stays one line."""
    text = "\n".join(lines) + "\n"
    if path is None:
        digest = hashlib.sha256(text.encode()).hexdigest()[:12]
        path = Path(tempfile.gettempdir()) / f"uvic-mismatch-{digest}.txt"
    with atomic_write(path) as tmp:
        tmp.write_text(text)
    return path


@dataclass
class LoadResult:
    """Keys that did not match (empty lists after a strict load)."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module inside torch.compile / DistributedDataParallel wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
            model = model.module
        else:
            return model


def strip_prefixes(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Remove leading `_orig_mod.` / `module.` (in any combination) from every key."""
    out = {}
    for key, value in state_dict.items():
        name = key
        while name.startswith(WRAPPER_PREFIXES):
            name = name.split(".", 1)[1]
        if name in out:
            raise CheckpointError(f"key {key!r} collides with another key after stripping "
                                  f"wrapper prefixes {WRAPPER_PREFIXES}")
        out[name] = value
    return out


def read_state_dict(path: str | Path, key: str | None = None) -> dict[str, Tensor]:
    """Tensors stored in `path` (.pth/.pt via torch.load(weights_only=True), or .safetensors).

    A `.pth` holding a dict that nests the state dict under one of WRAPPER_KEYS is
    unwrapped when that is unambiguous; pass `key` to pick one explicitly.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        try:
            obj: object = load_file(str(path), device="cpu")
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from err
    elif suffix in (".pth", ".pt", ".bin", ".ckpt"):
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # pickle/zip errors have many types
            msg = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise CheckpointError(f"{path}: torch.load failed ({msg})") from err
    else:
        raise CheckpointError(f"{path}: unknown checkpoint format {suffix!r} "
                              "(expected .pth, .pt or .safetensors)")
    state_dict = strip_prefixes(_select_state_dict(obj, path, key))
    bad = nonfinite_entry(state_dict)
    if bad is not None:
        raise CheckpointError(f"{path}: {nonfinite_message(bad)}")
    return state_dict


def nonfinite_entry(obj: object, name: str = "") -> str | None:
    """The name of the first floating-point tensor in `obj` (a tensor, or mappings and
    sequences of them, as state dicts and optimizer states are) that holds NaN or inf;
    None when every value is finite. Weights are checked where they are loaded: NaN bytes
    in a file read back without an error and would otherwise pass as good weights."""
    if isinstance(obj, Tensor):
        return name if obj.is_floating_point() and not torch.isfinite(obj).all() else None
    if isinstance(obj, Mapping):
        items = obj.items()
    elif isinstance(obj, list | tuple):
        items = enumerate(obj)
    else:
        return None
    for key, value in items:
        found = nonfinite_entry(value, f"{name}.{key}" if name else str(key))
        if found is not None:
            return found
    return None


def nonfinite_message(name: str) -> str:
    return (f"tensor {name!r} holds NaN or inf values (a corrupt file, or weights of a "
            "diverged run)")


def _select_state_dict(obj: object, path: Path, key: str | None) -> Mapping[str, Tensor]:
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{path}: holds a {type(obj).__name__}, not a state dict")
    if key is not None:
        if key not in obj:
            raise CheckpointError(f"{path}: no key {key!r}; top-level keys: {sorted(obj)[:20]}")
        obj = obj[key]
        if not isinstance(obj, Mapping):
            raise CheckpointError(f"{path}: {key!r} holds a {type(obj).__name__}, "
                                  "not a state dict")
    elif not all(isinstance(v, Tensor) for v in obj.values()):
        nested = [k for k in WRAPPER_KEYS if isinstance(obj.get(k), Mapping)]
        if len(nested) > 1:
            raise CheckpointError(f"{path}: holds several state dicts {nested}; "
                                  "choose one with key=...")
        if not nested:
            raise CheckpointError(f"{path}: not a plain state dict and none of "
                                  f"{list(WRAPPER_KEYS)} holds one; top-level keys: "
                                  f"{sorted(map(str, obj))[:20]}")
        obj = obj[nested[0]]
    bad = [k for k, v in obj.items() if not isinstance(v, Tensor)]
    if bad:
        raise CheckpointError(f"{path}: entry {bad[0]!r} is a {type(obj[bad[0]]).__name__}, "
                              "not a tensor")
    return obj


def load_weights(
    model: nn.Module, path: str | Path, strict: bool = True, key: str | None = None,
) -> LoadResult:
    """Load `path` into `model` (in place); strict: every key and shape must match.

    Raises CheckpointError naming missing/unexpected keys and shape mismatches. With
    strict=False, matching tensors are loaded and the unmatched keys are returned.
    """
    target = unwrap_model(model)
    loaded = read_state_dict(path, key)
    expected = target.state_dict()
    missing = [k for k in expected if k not in loaded]
    unexpected = [k for k in loaded if k not in expected]
    shapes = [
        f"{k}: file {tuple(loaded[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items() if k in loaded and loaded[k].shape != v.shape
    ]
    kinds = {"shape mismatch": shapes, "missing keys": missing if strict else [],
             "unexpected keys": unexpected if strict else []}
    problems = [f"{kind} {_listing(names)}" for kind, names in kinds.items() if names]
    if problems:
        details = [f"{kind}: {name}" for kind, names in kinds.items() for name in names]
        message = f"{path} does not fit {type(target).__name__}: " + "; ".join(problems)
        report = None
        if any(len(names) > _MAX_LISTED for names in kinds.values()):
            report = mismatch_report(details)
            message += f" (all of them: {report})"
        raise CheckpointError(message, details, report)
    target.load_state_dict({k: v for k, v in loaded.items() if k in expected}, strict=False)
    return LoadResult(missing=missing, unexpected=unexpected)


def save_safetensors(
    model_or_state_dict: nn.Module | Mapping[str, Tensor], path: str | Path,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write weights to `path` as safetensors, atomically (`uvic.files.atomic_write`).

    Keys are saved without wrapper prefixes so the file loads into the plain model.
    """
    path = Path(path)
    if isinstance(model_or_state_dict, nn.Module):
        state = unwrap_model(model_or_state_dict).state_dict()
    else:
        state = model_or_state_dict
    state = strip_prefixes(state)
    bad = [k for k, v in state.items() if not isinstance(v, Tensor)]
    if bad:
        raise CheckpointError(f"cannot save {path}: entry {bad[0]!r} is not a tensor")
    meta = None
    if metadata is not None:
        bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise CheckpointError(f"cannot save {path}: metadata {bad[0]!r} must map str to str")
        meta = dict(metadata)
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    with atomic_write(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
        if meta is not None and len(meta) > 1:
            _sort_metadata(Path(tmp))


def _sort_metadata(path: Path) -> None:
    """Rewrite the file's header with its metadata keys sorted. safetensors writes the
    metadata in hash order, which differs from process to process: without this, the same
    weights and metadata would give files of different bytes (and SHA-256). The header
    keeps its length (the same JSON, reordered), the tensors are not touched."""
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) > size:  # not the same JSON text: leave the file as written
            return
        f.seek(8)
        f.write(text.ljust(size, b" "))


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    more = f", ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    return f"({len(names)}): {shown}{more}"


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file (identifies a checkpoint in results and sample folders)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
