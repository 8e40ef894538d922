"""Massive activations per block: how far the largest token's hidden state stands out (Gu et
al. 2024, Figure 29; docs/analysis.md). For a block's output h (N tokens), per image and
noise level,

    ratio = max_j |h_j| / mean_{i != k} |h_i|,   k = argmax_j |h_j|

and k says which token it is (time, label, text or patch); 1 means no token stands out.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import Tensor

_TINY = 1e-30  # guards a division when every other token is 0


def massive_activation(hidden: Tensor) -> tuple[Tensor, Tensor]:
    """Hidden states (B, N, D) -> (ratio (B,) float64, index (B,) of the largest token).

    ratio = the largest token's L2 norm / the mean L2 norm of the N - 1 other tokens; ties
    go to the first token. Needs N >= 2.
    """
    if hidden.dim() != 3 or hidden.shape[1] < 2:
        raise ValueError(f"expected hidden states (B, N >= 2, D), got {tuple(hidden.shape)}")
    norms = torch.linalg.vector_norm(hidden.detach().to(torch.float64), dim=-1)  # (B, N)
    largest, index = norms.max(dim=-1)
    others = (norms.sum(dim=-1) - largest) / (norms.shape[1] - 1)
    return largest / others.clamp_min(_TINY), index


def token_kind(index: int, layout: dict) -> str:
    """What token `index` of the sequence is: "label", "time", "text" or "patch".

    `layout` is the result's "layout" (`TokenLayout.to_dict`): [label,] time[, text...],
    patches.
    """
    if index >= layout["num_extras"]:
        return "patch"
    if index == layout["time_index"]:
        return "time"
    text = layout["text"]
    if text and text[0] <= index < text[1]:
        return "text"
    return "label"


def token_name(index: int, layout: dict) -> str:
    """A readable name of token `index`: "time", "text 3", "patch (row, col)", "label"."""
    kind = token_kind(index, layout)
    if kind == "patch":
        row, col = divmod(index - layout["num_extras"], layout["grid"][1])
        return f"patch ({row}, {col})"
    if kind == "text":
        return f"text {index - layout['text'][0]}"
    return kind


def summarize(ratios: Tensor, indices: Tensor, layout: dict) -> dict:
    """Per-image ratios (B,) and largest-token indices (B,) of one block and noise level ->
    {"ratio": mean, "ratio_std": standard deviation over the images (0 for one image),
     "tokens": [{"index", "kind", "images"}] the largest tokens, most frequent first}."""
    ratios = ratios.to(torch.float64)
    counts = Counter(int(i) for i in indices.tolist())
    tokens = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return {"ratio": float(ratios.mean()),
            "ratio_std": float(ratios.std(correction=0)),
            "tokens": [{"index": i, "kind": token_kind(i, layout), "images": n}
                       for i, n in tokens]}


def pooled(block: dict) -> tuple[float, float]:
    """(mean, standard deviation) of a result block's ratio over all its images and noise
    levels, from the per-level means and spreads (every level has the same images)."""
    means = torch.tensor(block["massive_ratio"], dtype=torch.float64)
    stds = torch.tensor(block["massive_ratio_std"], dtype=torch.float64)
    mean = means.mean()
    variance = (stds**2 + means**2).mean() - mean**2
    return float(mean), float(variance.clamp_min(0).sqrt())


def top_token(block: dict) -> tuple[int, float]:
    """(index, share) of the token that is the largest most often over all the block's
    images and noise levels; share of those (image, level) pairs."""
    counts: Counter[int] = Counter()
    for level in block["massive_tokens"]:
        for token in level:
            counts[token["index"]] += token["images"]
    index, count = min(counts.items(), key=lambda item: (-item[1], item[0]))
    return index, count / sum(counts.values())


def massive_table(result: dict) -> str:
    """Plain-text table: per model and block, the mean sink share and the massive-activation
    ratio (mean +- standard deviation over images and levels) with its largest token."""
    levels = len(result["noise_levels"])
    width = max([5, *map(len, result["models"])]) + 1  # model labels stay in their column
    lines = [f"massive activations (largest token's L2 norm / mean norm of the others) "
             f"beside the sink share; {result['num_images']} image(s) x {levels} noise level(s)",
             f"{'model':<{width}} {'block':<13} {'mode':<10} {'sink share':>10} "
             f"{'ratio':>16}  largest token"]
    for label, entry in result["models"].items():
        for blk in entry["blocks"]:
            mean, std = pooled(blk)
            index, share = top_token(blk)
            sink = sum(blk["sink_share"]) / len(blk["sink_share"])
            lines.append(f"{label:<{width}} {blk['name']:<13} {blk['mode']:<10} {sink:>10.2f} "
                         f"{mean:>8.2f} +- {std:<5.2f}  "
                         f"{token_name(index, result['layout'])} ({share:.0%})")
    return "\n".join(lines)
