"""Fused softmax / Cog / expressive attention kernels for U-ViT and U-ViC.

Import name ``uvic_kernels``.

``attention(q, k, v, mode="cog")`` is the entry point; ``reference`` holds the plain
PyTorch formulas used as test oracles.  See ``triton_attention`` for the algorithm (the
JIT kernels), ``tiles`` for the tile tables and ``launch`` for the host side.
"""

from uvic_kernels.fused_attention import MODES, FusedAttention, attention
from uvic_kernels.reference import (
    cog_attention_eq3,
    cog_attention_reference,
    expressive_attention_reference,
    softmax_attention_reference,
)

__all__ = [
    "MODES",
    "FusedAttention",
    "attention",
    "cog_attention_eq3",
    "cog_attention_reference",
    "expressive_attention_reference",
    "softmax_attention_reference",
]
