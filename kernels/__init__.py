"""Fused softmax / Cog / expressive / sigmoid attention kernels for U-ViT and U-ViC (import
name ``uvic_kernels``).

``attention(q, k, v, mode="cog")`` is the entry point, ``reference`` holds the plain PyTorch
formulas the kernels are tested against; ``triton_attention`` has the algorithm. Names are
imported on first use, so importing the package loads neither torch nor triton.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it
_API = {
    "MODES": "uvic_kernels.fused_attention",
    "FusedAttention": "uvic_kernels.fused_attention",
    "attention": "uvic_kernels.fused_attention",
    "attention_weights": "uvic_kernels.reference",
    "cog_attention_eq3": "uvic_kernels.reference",
    "cog_attention_reference": "uvic_kernels.reference",
    "differential_attention_reference": "uvic_kernels.reference",
    "differential_v2_attention_reference": "uvic_kernels.reference",
    "expressive_attention_reference": "uvic_kernels.reference",
    "sigmoid_attention_reference": "uvic_kernels.reference",
    "sigmoid_bias_default": "uvic_kernels.reference",
    "softmax_attention_reference": "uvic_kernels.reference",
}

__all__ = [
    "MODES",
    "FusedAttention",
    "attention",
    "attention_weights",
    "cog_attention_eq3",
    "cog_attention_reference",
    "differential_attention_reference",
    "differential_v2_attention_reference",
    "expressive_attention_reference",
    "sigmoid_attention_reference",
    "sigmoid_bias_default",
    "softmax_attention_reference",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module when the name is first used."""
    if name not in _API:
        raise AttributeError(f"module 'uvic_kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value  # later uses skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
