"""Explicit attention matrices of a U-ViT / U-ViC forward pass, captured with hooks.

The fused kernel never forms the N x N matrix; for the paper's small N (257, 334) a
pre-hook on each block's `attn` recomputes it from the block's own `qkv` with the kernels'
reference formula of its mode, and a hook on each block records its output tokens (for the
collapse measure and the massive activations). Nothing in the model or the kernels is
modified, and the hooks are removed on exit (`BlockRecorder`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from uvic.analysis import metrics
from uvic.analysis.massive import massive_activation, summarize
from uvic_kernels.modes import DESIGNS

# Modes whose rows are not normalised (sum |A| is not 1): their weights on the first,
# time and text tokens are the weights themselves (what those tokens' values are
# multiplied by, Gu et al.'s (2024) measure for sigmoid attention), not shares of the row.
UNNORMALISED_MODES = frozenset(d.name for d in DESIGNS if not d.normalised)

# Per-head metrics, each averaged over images and patch queries (see `metrics`).
HEAD_METRICS = ("negative_mass", "negative_fraction", "entropy", "effective_tokens",
                "first_token_weight", "time_weight", "text_weight", "row_sum")


@dataclass(frozen=True)
class TokenLayout:
    """Where each kind of token sits in the sequence of N = extras + patches tokens."""

    num_tokens: int
    num_extras: int  # time (+ label) (+ text) tokens before the patches
    time_index: int
    text: tuple[int, int] | None  # [start, stop) of the text tokens, if any
    grid: tuple[int, int]  # patch rows, patch columns

    def to_dict(self) -> dict:
        return {"num_tokens": self.num_tokens, "num_extras": self.num_extras,
                "time_index": self.time_index,
                "text": list(self.text) if self.text else None, "grid": list(self.grid)}


def token_layout(model: nn.Module) -> TokenLayout:
    """Token layout of a `uvic.models.uvit.UViT`: [label,] time[, text...], patches."""
    side = model.img_size // model.patch_size
    time_index = 1 if model.num_classes > 0 else 0
    text = (time_index + 1, time_index + 1 + model.num_clip_token) if model.clip_dim > 0 else None
    return TokenLayout(num_tokens=model.extras + side * side, num_extras=model.extras,
                       time_index=time_index, text=text, grid=(side, side))


@torch.no_grad()
def attention_weights(attn: nn.Module, x: Tensor) -> Tensor:
    """Attention weights A (B, heads, N, N) of a U-ViT attention module on its input x
    (B, N, D): its design's reference formula in float32, without gradients."""
    return attn.weights(x)


def row_metrics(a: Tensor, layout: TokenLayout, normalised: bool = True) -> dict[str, Tensor]:
    """All HEAD_METRICS per row of A (B, h, Nq, N) -> name: (B, h, Nq).

    `normalised=False` (a mode in UNNORMALISED_MODES): the key weights are |A| itself
    (`metrics.key_weight`), not shares of the row; "row_sum" says how far rows are from 1.
    """
    zeros = torch.zeros(a.shape[:-1], dtype=a.dtype, device=a.device)
    on = metrics.key_share if normalised else metrics.key_weight
    return {
        "negative_mass": metrics.negative_mass(a),
        "negative_fraction": metrics.negative_fraction(a),
        "entropy": metrics.entropy(a),
        "effective_tokens": metrics.effective_tokens(a),
        "first_token_weight": on(a, 0),
        "time_weight": on(a, layout.time_index),
        "text_weight": on(a, slice(*layout.text)) if layout.text else zeros,
        "row_sum": metrics.row_sum(a),
    }


class BlockRecorder:
    """Hooks on every block of a model that accumulate metrics over batches.

    Per block: sums of the per-head metrics over (images, patch queries), the summed
    mean pairwise cosine of the output patch tokens, each image's massive-activation
    ratio and largest token (`massive`), and, for image 0 (in the batch the
    caller marks with `batch_start = 0`), the attention rows of the chosen query patches
    (mean over heads, patch keys only).
    Use as a context manager; call `reset()` between noise levels and `means()` after.
    """

    def __init__(self, model: nn.Module, layout: TokenLayout,
                 queries: list[tuple[int, int]]) -> None:
        self.model, self.layout = model, layout
        self.query_tokens = [layout.num_extras + r * layout.grid[1] + c for r, c in queries]
        self.handles: list = []
        self.batch_start = 0  # index of the current batch's first image (set by the caller)
        self.reset()

    def reset(self) -> None:
        blocks = len(self.model.blocks())
        self.sums: list[dict[str, Tensor]] = [{} for _ in range(blocks)]
        self.cosine = [0.0] * blocks
        self.count = [0] * blocks  # images seen per block
        self.massive: list[list[tuple[Tensor, Tensor]]] = [[] for _ in range(blocks)]
        self.maps: list[Tensor | None] = [None] * blocks  # (queries, L) of image 0

    def __enter__(self) -> BlockRecorder:
        for i, blk in enumerate(self.model.blocks()):
            self.handles.append(blk.attn.register_forward_pre_hook(self._attn_hook(i)))
            self.handles.append(blk.register_forward_hook(self._block_hook(i)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _attn_hook(self, i: int) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            a = attention_weights(module, args[0])  # (B, h, N, N)
            patch_rows = a[:, :, self.layout.num_extras:]  # queries: patch tokens only
            normalised = module.mode not in UNNORMALISED_MODES
            for name, values in row_metrics(patch_rows, self.layout, normalised).items():
                summed = values.sum(dim=(0, 2)).double()  # (h,)
                self.sums[i][name] = self.sums[i].get(name, 0) + summed
            if self.batch_start == 0:
                first = a[0]  # image 0: (h, N, N)
                rows = first[:, self.query_tokens, self.layout.num_extras:]  # (h, Q, L)
                self.maps[i] = rows.mean(dim=0).double().cpu()
        return hook

    def _block_hook(self, i: int) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
            patches = output[:, self.layout.num_extras:].float()  # (B, L, D)
            self.cosine[i] += float(metrics.mean_pairwise_cosine(patches).sum())
            self.massive[i].append(tuple(t.cpu() for t in massive_activation(output)))
            self.count[i] += output.shape[0]
        return hook

    def means(self) -> list[dict]:
        """Per block: {"heads": {metric: (h,) list}, "collapse": float, "map": (Q, L),
        "massive": `massive.summarize`'s dict}."""
        queries_per_image = self.layout.num_tokens - self.layout.num_extras
        out = []
        for i, sums in enumerate(self.sums):
            if not self.count[i]:
                raise RuntimeError(f"block {i} saw no forward pass")
            denom = self.count[i] * queries_per_image
            out.append({
                "heads": {name: (sums[name] / denom).tolist() for name in HEAD_METRICS},
                "collapse": self.cosine[i] / self.count[i],
                "map": self.maps[i],
                "massive": summarize(torch.cat([r for r, _ in self.massive[i]]),
                                     torch.cat([k for _, k in self.massive[i]]),
                                     self.layout.to_dict()),
            })
        return out
