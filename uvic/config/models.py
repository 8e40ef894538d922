"""The rules on `model.*` values: attention pattern and backend, and the architecture.

`UViT` checks its arguments with them, and `uvic.config.validation` checks a config's model
section before any work starts, so both refuse the same values with the same message
(a ConfigError, which is a ValueError). The attention modes, presets and letters come
from the designs' records (`uvic_kernels.modes`, which imports no torch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from uvic.config import ConfigError, ModelConfig
from uvic_kernels.modes import BACKEND_MODES, DESIGN, DESIGNS

ATTENTION_MODES = tuple(DESIGN)  # every design a block can run (kernel modes and modules)
OUTPUT_GATES = ("none", "elementwise", "headwise")

# presets: all softmax ("uvit"), or softmax in the first and the last block and one other
# design in all blocks between (U-ViC: Cog, U-ViE: expressive, U-ViS: sigmoid attention)
INNER_MODE = {d.preset: d.name for d in DESIGNS if d.name != "softmax"}
ATTENTION_PRESETS = ("uvit", *INNER_MODE)
MODE_LETTERS = {d.name: d.letter for d in DESIGNS}
AUTO_BACKEND = "auto"  # `model.attention_backend` that lets the kernel pick per device
POS_EMBED_INITS = ("normal", "sincos")


# Model sizes of the U-ViT paper (Table 1), as in the release configs:
# small  = configs/cifar10_uvit.py, configs/mscoco_uvit.py        (13 blocks)
# mid    = configs/imagenet64_uvit_mid.py                         (17 blocks)
# large  = configs/imagenet64_uvit_large.py, imagenet512_uvit_large.py (21 blocks)
# huge   = configs/imagenet256_uvit_huge.py, imagenet512_uvit_huge.py  (29 blocks)
# `depth` counts in- plus out-blocks; the network has depth + 1 blocks with the mid-block.
UVIT_SIZES: dict[str, dict[str, int]] = {
    "small": {"embed_dim": 512, "depth": 12, "num_heads": 8},
    "mid": {"embed_dim": 768, "depth": 16, "num_heads": 12},
    "large": {"embed_dim": 1024, "depth": 20, "num_heads": 16},
    "huge": {"embed_dim": 1152, "depth": 28, "num_heads": 16},
}
_SIZE_ALIASES = {"s": "small", "m": "mid", "l": "large", "h": "huge", "medium": "mid"}


def uvit_size(name: str) -> dict[str, int]:
    """(embed_dim, depth, num_heads) of U-ViT-S/M/L/H; accepts "small" or "S" etc. The
    configs build their models from it (`ModelConfig(**uvit_size("small"), ...)`)."""
    key = _SIZE_ALIASES.get(name.lower(), name.lower())
    if key not in UVIT_SIZES:
        raise ValueError(f"unknown U-ViT size {name!r}; choose one of {sorted(UVIT_SIZES)}")
    return dict(UVIT_SIZES[key])


def check_model(model: ModelConfig) -> None:
    """The rules on `model.*` values (those `UViT` applies to its arguments)."""
    check_arch(model)
    backend = kernel_backend(model.attention_backend)
    modes = resolve_attention(model.attention, model.depth)
    check_backend_fits(backend, modes)
    check_designs(model, modes)


def check_designs(model: ModelConfig, modes: Sequence[str]) -> None:
    """The settings of the output gate and of differential attention fit the pattern."""
    if model.output_gate not in OUTPUT_GATES:
        raise ConfigError(f"model.output_gate={model.output_gate!r}: choose one of "
                          f"{', '.join(OUTPUT_GATES)}")
    lam = model.diff_lambda_init
    if lam is not None:
        if isinstance(lam, bool) or not isinstance(lam, int | float) or not math.isfinite(lam):
            raise ConfigError(f"model.diff_lambda_init={lam!r}: must be a finite number, or "
                              "unset for 0.8 - 0.6 exp(-0.3 (l - 1)) in block l")
        if "differential" not in modes:
            raise ConfigError(f"model.diff_lambda_init={lam!r}: lambda is differential "
                              f"attention's, and no block of model.attention="
                              f"{model.attention!r} runs it")
    if "differential" in modes:
        head = model.embed_dim // model.num_heads
        if model.num_heads % 2 or 2 * head > 128:
            raise ConfigError(
                f"model.num_heads={model.num_heads}: differential attention pairs the heads "
                f"(an even count) into h/2 heads of value width 2 D/h <= 128; got D/h={head}")


def check_sigmoid_bias(bias: float | None) -> None:
    """Sigmoid attention's fixed bias: None (-log N, N the sequence length) or a finite
    number."""
    if bias is not None and (isinstance(bias, bool) or not isinstance(bias, int | float)
                             or not math.isfinite(bias)):
        raise ConfigError(f"model.sigmoid_bias={bias!r}: must be a finite number, or unset "
                          "for -log N (N tokens)")


def resolve_attention(spec: str | Sequence[str], depth: int) -> list[str]:
    """Per-block attention modes, in order in_blocks..., mid_block, out_blocks....

    `spec` is a preset (`ATTENTION_PRESETS`: "uvit" all softmax; "uvic" Cog, and likewise
    each design's, keeping softmax in the first in-block and the last out-block) or a
    comma-separated string / list of depth + 1 modes.
    """
    num_blocks = depth + 1
    if isinstance(spec, str):
        name = spec.strip().lower()
        if name == "uvit":
            return ["softmax"] * num_blocks
        if name in INNER_MODE:
            return ["softmax"] + [INNER_MODE[name]] * (num_blocks - 2) + ["softmax"]
        if "," not in name and name not in ATTENTION_MODES:
            raise ConfigError(
                f"model.attention={spec!r}: expected a preset {ATTENTION_PRESETS} or a "
                f"comma-separated list of {num_blocks} entries from {ATTENTION_MODES}"
            )
        modes = [m.strip().lower() for m in name.split(",")]
    else:
        modes = [str(m).strip().lower() for m in spec]
    bad = [m for m in modes if m not in ATTENTION_MODES]
    if bad:
        raise ConfigError(
            f"model.attention={spec!r}: unknown mode {bad[0]!r}; each entry must be one of "
            f"{ATTENTION_MODES}"
        )
    if len(modes) != num_blocks:
        raise ConfigError(
            f"model.attention={spec!r}: has {len(modes)} entries but depth {depth} gives "
            f"{num_blocks} blocks (in_blocks, mid_block, out_blocks)"
        )
    return modes


def kernel_backend(name: str, label: str = "model.attention_backend=") -> str | None:
    """The kernels' backend for an `attention_backend` name: None for "auto" (the kernel
    picks), else the name itself; an unknown name is refused, `label` starting the
    message."""
    if name == AUTO_BACKEND:
        return None
    if name not in BACKEND_MODES:
        raise ConfigError(f"{label}{name!r}: choose one of "
                          f"{sorted([AUTO_BACKEND, *BACKEND_MODES])}")
    return name


def check_backend_fits(backend: str | None, modes: Sequence[str]) -> None:
    """A kernel backend that cannot run some blocks' modes (``sdpa``: softmax only, the
    kernels' `BACKEND_MODES`) is refused, naming the blocks. None: the kernel picks."""
    if backend is None:
        return
    runs = BACKEND_MODES[backend]
    bad = [i for i, mode in enumerate(modes) if mode not in runs]
    if bad:
        able = [AUTO_BACKEND] + [b for b, ok in BACKEND_MODES.items() if set(modes) <= set(ok)]
        names = [repr(b) for b in able]
        raise ConfigError(
            f"model.attention_backend={backend!r} runs "
            f"{', '.join(runs[:-1]) + ' and ' * (len(runs) > 1) + runs[-1]} attention only, "
            f"but blocks {bad} use {modes[bad[0]]!r}; use "
            f"{', '.join(names[:-1])} or {names[-1]}")


def check_arch(m: ModelConfig) -> None:
    """Sizes that fit together: patches tile the image, heads split the width, an even
    depth (in-blocks, mid-block, out-blocks), one kind of condition; a finite sigmoid
    attention bias, if one is set."""
    check_sigmoid_bias(m.sigmoid_bias)
    if m.img_size % m.patch_size:
        raise ConfigError(f"model.img_size={m.img_size} is not divisible by "
                          f"model.patch_size={m.patch_size}")
    if m.embed_dim % m.num_heads:
        raise ConfigError(f"model.embed_dim={m.embed_dim} is not divisible by "
                          f"model.num_heads={m.num_heads}")
    if m.depth < 2 or m.depth % 2:
        raise ConfigError(f"model.depth={m.depth} must be even and >= 2 "
                          "(depth/2 in-blocks + mid-block + depth/2 out-blocks)")
    if m.num_classes > 0 and m.clip_dim > 0:
        raise ConfigError("model.num_classes and model.clip_dim are both set; U-ViT is either "
                          "class- or text-conditional")
    if m.clip_dim > 0 and m.num_clip_token < 1:
        raise ConfigError(f"model.num_clip_token={m.num_clip_token} must be >= 1")
    if m.pos_embed_init not in POS_EMBED_INITS:
        raise ConfigError(f"model.pos_embed_init={m.pos_embed_init!r}: choose one of "
                          f"{list(POS_EMBED_INITS)}")
    if m.pos_embed_init == "sincos" and m.embed_dim % 4:
        raise ConfigError(f"model.pos_embed_init='sincos' needs model.embed_dim divisible "
                          f"by 4, got {m.embed_dim}")
