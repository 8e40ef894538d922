"""PNG figures of gated attention blocks and of the skip-trigram capacity table.

* :func:`gate_figure`: the mean gate pattern of every head (query rows, key columns),
  one panel per head, and the mean number of open heads per (query, key) pair.
* :func:`capacity_figure`: capacity (mean and spread over seeds) per mode and head count.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure  # drawn without pyplot: no global backend, no GUI


def gate_figure(report: dict, path: str | Path, title: str = "") -> Path:
    """Draw ``report["gate_mean"]`` (h, N, N) and ``report["open_heads"]`` (N, N)."""
    gates = np.asarray(report["gate_mean"], dtype=float)
    heads = gates.shape[0]
    cols = min(heads + 1, 5)
    rows = -(-(heads + 1) // cols)
    fig = Figure(figsize=(2.2 * cols, 2.2 * rows + 0.4), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for h in range(heads):
        axes[h].imshow(gates[h], vmin=0, vmax=1, cmap="viridis")
        axes[h].set_title(f"head {h} gate", fontsize=8)
    opened = np.asarray(report["open_heads"], dtype=float)
    image = axes[heads].imshow(opened, vmin=0, vmax=max(1.0, opened.max()), cmap="magma")
    axes[heads].set_title(f"open heads (> {report['threshold']:g})", fontsize=8)
    # beside the whole grid: one beside the panel would widen that panel's grid column
    fig.colorbar(image, ax=list(axes), shrink=0.8, label="open heads")
    for ax in axes:
        ax.set_xticks([])
        ax.set_yticks([])
    for ax in axes[heads + 1:]:
        ax.set_visible(False)
    fig.suptitle(title or f"gate patterns (L0.6 {report['l0_6']:.3g}, relative error "
                          f"{report['relative_error']:.3g})", fontsize=9)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def capacity_figure(table: dict, path: str | Path) -> Path:
    """Bars: per mode, capacity for each head count (mean over seeds, min-max whiskers,
    every seed a dot); a second panel gives, for each cell's distilled (largest learnt)
    model, the share of its trigrams that no head holds alone (superposition)."""
    cells = table["cells"]
    modes = list(dict.fromkeys(c["mode"] for c in cells))
    head_counts = sorted({c["heads"] for c in cells})
    width = 0.8 / len(head_counts)
    fig = Figure(figsize=(8, 3.4), layout="constrained")
    ax, ax2 = fig.subplots(1, 2)
    for j, heads in enumerate(head_counts):
        xs, means, lo, hi, gated = [], [], [], [], []
        for i, mode in enumerate(modes):
            cell = next((c for c in cells if c["mode"] == mode and c["heads"] == heads), None)
            if cell is None:
                continue
            x = i + (j - (len(head_counts) - 1) / 2) * width
            xs.append(x)
            means.append(cell["mean"])
            lo.append(cell["mean"] - cell["min"])
            hi.append(cell["max"] - cell["mean"])
            ax.scatter([x] * len(cell["capacity"]), cell["capacity"], s=8, color="k", zorder=3)
            dist = cell.get("distilled")
            gated.append(len(dist["original_shared"]) / dist["trigrams"] if dist else np.nan)
        ax.bar(xs, means, width, yerr=[lo, hi], capsize=2, label=f"{heads} head(s)")
        ax2.bar(xs, gated, width, label=f"{heads} head(s)")
    for a, label in ((ax, "trigrams learnt to >= 99%"),
                     (ax2, "share of trigrams shared by heads")):
        a.set_xticks(range(len(modes)), modes)
        a.set_ylabel(label, fontsize=8)
        a.legend(fontsize=7)
    ax.set_title("capacity of one attention layer (mean, min-max, seeds)", fontsize=9)
    ax2.set_title("superposition in the largest learnt model", fontsize=9)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
