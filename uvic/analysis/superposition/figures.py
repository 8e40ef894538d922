"""PNG figures of gated attention blocks and of the skip-trigram capacity table.

* :func:`gate_figure`: the mean gate pattern of every head (query rows, key columns),
  one panel per head, and the mean number of open heads per (query, key) pair.
* :func:`capacity_figure`: per head count, the share of seeds that learnt n trigrams.
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
    """One panel per head count: the share of seeds that learnt all n trigrams against n,
    per mode, with exact 95% intervals."""
    cells = table["cells"]
    head_counts = sorted({c["heads"] for c in cells})
    fig = Figure(figsize=(3.2 * len(head_counts), 3.0), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(head_counts), sharey=True))
    modes = list(dict.fromkeys(c["mode"] for c in cells))
    for ax, heads in zip(axes, head_counts):
        for cell in (c for c in cells if c["heads"] == heads):
            shift = 0.08 * (modes.index(cell["mode"]) - (len(modes) - 1) / 2)  # bars apart
            n = np.array([s["n"] for s in cell["success"]], dtype=float) + shift
            share = np.array([s["learnt"] / s["of"] for s in cell["success"]])
            low = np.array([s["interval_95"][0] for s in cell["success"]])
            high = np.array([s["interval_95"][1] for s in cell["success"]])
            ax.errorbar(n, share, yerr=[share - low, high - share], marker="o", ms=3,
                        capsize=2, label=cell["mode"], color=f"C{modes.index(cell['mode'])}")
        ax.set_title(f"{heads} head{'s' * (heads > 1)}", fontsize=9)
        ax.set_xlabel("trigrams n", fontsize=8)
        ax.set_ylim(-0.05, 1.05)
    axes[0].set_ylabel("seeds that learnt all n", fontsize=8)
    labelled = {label: handle for ax in axes
                for handle, label in zip(*ax.get_legend_handles_labels())}
    axes[-1].legend(labelled.values(), labelled.keys(), fontsize=7)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
