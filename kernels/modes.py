"""The attention modes of the kernel family and the backends that run them.

The one list of modes: the kernels dispatch on it, and the model's config rules
(`uvic.config.models.ATTENTION_MODES`), its processors and the analysis read it from here.
A new mode is added here first (docs/architecture.md, "Adding an attention mode"). No
torch here, so the command line can offer the modes before torch loads.
"""

from __future__ import annotations

MODES = ("cog", "softmax", "expressive", "sigmoid")
# The modes each backend runs: SDPA is PyTorch's softmax attention, Cog, expressive and
# sigmoid attention have no SDPA form.
BACKEND_MODES = {"triton": MODES, "torch": MODES, "sdpa": ("softmax",)}
BACKENDS = tuple(BACKEND_MODES)
