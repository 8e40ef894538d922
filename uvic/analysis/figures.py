"""PNG figures of an analysis result (the dict of `uvic.analysis.analyze` or its JSON):
``heatmap_<metric>.png`` (block x noise level per model, one colour scale),
``maps_<label>_t<timestep>.png`` (each query patch's attention over image 0: blue positive,
red negative), ``overview.png`` and ``massive_activations.png`` (sink heads and the
massive-activation ratio per block).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.figure import Figure  # drawn without pyplot: no global backend, no GUI
from matplotlib.patches import Rectangle

from uvic.analysis.massive import pooled

# Metrics drawn as heatmaps: name -> title. "sink_share" and "collapse" are per block.
HEATMAPS = {
    "negative_mass": "share of |A| on negative weights",
    "negative_fraction": "share of negative weights",
    "entropy": "entropy of |A| rows (nats)",
    "effective_tokens": "effective attended tokens exp(entropy)",
    "first_token_weight": "weight on the first token",
    "time_weight": "weight on the time token",
    "text_weight": "weight on the text tokens",
    "row_sum": "sum of |A| per row (1 if normalised)",
    "sink_share": "share of sink heads",
    "collapse": "mean pairwise cosine of patch tokens",
    "massive_ratio": "largest token's hidden-state norm / mean of the others",
}
PER_BLOCK = ("sink_share", "collapse", "massive_ratio")  # keys of a block, not of its "mean"
OVERVIEW = ("negative_mass", "entropy", "time_weight", "collapse")


def _grid(result: dict, label: str, metric: str) -> np.ndarray:
    """(blocks, levels) array of `metric` for model `label`."""
    blocks = result["models"][label]["blocks"]
    if metric in PER_BLOCK:
        return np.array([blk[metric] for blk in blocks], dtype=float)
    return np.array([blk["mean"][metric] for blk in blocks], dtype=float)


def _draw_heatmap(ax: Axes, values: np.ndarray, result: dict, label: str,
                  vmin: float, vmax: float) -> ScalarMappable:
    entry = result["models"][label]
    image = ax.imshow(values, vmin=vmin, vmax=vmax, cmap="viridis", aspect="auto")
    ax.set_xticks(range(values.shape[1]),
                  [str(level["timestep"]) for level in result["noise_levels"]], fontsize=7)
    ax.set_yticks(range(values.shape[0]),
                  [f"{blk['name']} ({blk['mode'][0].upper()})" for blk in entry["blocks"]],
                  fontsize=7)
    ax.set_xlabel("timestep (noise level)", fontsize=7)
    ax.set_title(label, fontsize=9)
    for (r, c), value in np.ndenumerate(values):  # dark text on the bright end of viridis
        bright = (value - vmin) / (vmax - vmin) > 0.6
        ax.text(c, r, f"{value:.2g}", ha="center", va="center", fontsize=6,
                color="k" if bright else "w")
    return image


def _limits(arrays: list[np.ndarray]) -> tuple[float, float]:
    low = min(float(a.min()) for a in arrays)
    high = max(float(a.max()) for a in arrays)
    return low, high if high > low else low + 1e-6


def heatmap_figure(result: dict, metric: str, path: Path) -> Path:
    """Models side by side: block x noise level heatmap of one metric."""
    labels = list(result["models"])
    grids = [_grid(result, label, metric) for label in labels]
    vmin, vmax = _limits(grids)
    rows = grids[0].shape[0]
    fig = Figure(figsize=(2.2 + 2.6 * len(labels), 1.4 + 0.3 * rows), layout="constrained")
    axes = fig.subplots(1, len(labels), squeeze=False)
    for ax, label, values in zip(axes[0], labels, grids):
        image = _draw_heatmap(ax, values, result, label, vmin, vmax)
        if ax is not axes[0][0]:  # block names once, on the left; each panel its modes
            ax.set_yticklabels([f"({blk['mode'][0].upper()})"
                                for blk in result["models"][label]["blocks"]])
    fig.colorbar(image, ax=list(axes[0]), shrink=0.8)
    fig.suptitle(HEATMAPS[metric], fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def _signed_overlay(attn: np.ndarray) -> np.ndarray:
    """(rows, cols) weights -> RGBA: blue where > 0, red where < 0, opacity ~ |weight|
    relative to the map's largest |weight|, so the image shows through weak weights."""
    rgba = np.zeros((*attn.shape, 4))
    rgba[..., 2] = attn > 0  # blue
    rgba[..., 0] = attn < 0  # red
    rgba[..., 3] = 0.75 * np.abs(attn) / max(float(np.abs(attn).max()), 1e-12)
    return rgba


def maps_figure(result: dict, label: str, level: int, path: Path) -> Path:
    """Per block and query patch, the (head-mean) attention over the patches of image 0."""
    background = np.array(result["background"], dtype=float)  # (H, W, 3)
    rows, cols = result["layout"]["grid"]
    blocks = result["models"][label]["blocks"]
    queries = result["queries"]
    height, width = background.shape[:2]
    fig = Figure(figsize=(1.6 * len(queries) + 1, 1.6 * len(blocks)), layout="constrained")
    axes = fig.subplots(len(blocks), len(queries), squeeze=False)
    for b, blk in enumerate(blocks):
        for q, (qr, qc) in enumerate(queries):
            ax = axes[b][q]
            attn = np.array(blk["maps"][level][q], dtype=float).reshape(rows, cols)
            ax.imshow(background.mean(axis=-1), cmap="gray", vmin=0, vmax=1,
                      extent=(0, width, height, 0))
            ax.imshow(_signed_overlay(attn), extent=(0, width, height, 0),
                      interpolation="nearest")
            ph, pw = height / rows, width / cols
            ax.add_patch(Rectangle((qc * pw, qr * ph), pw, ph, fill=False, lw=1.2, ec="k"))
            ax.set_xticks([])
            ax.set_yticks([])
            if q == 0:
                ax.set_ylabel(f"{blk['name']}\n{blk['mode']}", fontsize=7)
            if b == 0:
                ax.set_title(f"query ({qr}, {qc})", fontsize=7)
    timestep = result["noise_levels"][level]["timestep"]
    fig.suptitle(f"{label}, timestep {timestep}: blue > 0, red < 0, "
                 "opacity ~ |A| / max |A| of the map",
                 fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def overview_figure(result: dict, path: Path) -> Path:
    """Key metrics (columns) for every model (rows), each column on one colour scale."""
    labels = list(result["models"])
    rows = len(result["models"][labels[0]]["blocks"]) + 2
    fig = Figure(figsize=(3.4 * len(OVERVIEW), 0.6 + 0.3 * rows * len(labels)),
                 layout="constrained")
    axes = fig.subplots(len(labels), len(OVERVIEW), squeeze=False)
    for c, metric in enumerate(OVERVIEW):
        grids = [_grid(result, label, metric) for label in labels]
        vmin, vmax = _limits(grids)
        for r, (label, values) in enumerate(zip(labels, grids)):
            image = _draw_heatmap(axes[r][c], values, result, label, vmin, vmax)
            axes[r][c].set_title(f"{label}: {metric}", fontsize=8)
        fig.colorbar(image, ax=[axes[r][c] for r in range(len(labels))], shrink=0.8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def massive_figure(result: dict, path: Path) -> Path:
    """Per block (x), one line per model: the sink share (left) and the massive-activation
    ratio with a band of +- one standard deviation over images and levels (right)."""
    fig = Figure(figsize=(9, 3.4), layout="constrained")
    sink_ax, ratio_ax = fig.subplots(1, 2)
    names = []
    for label, entry in result["models"].items():
        blocks = entry["blocks"]
        names = [blk["name"] for blk in blocks]
        x = np.arange(len(blocks))
        sink_ax.plot(x, [np.mean(blk["sink_share"]) for blk in blocks], marker="o", label=label)
        stats = np.array([pooled(blk) for blk in blocks])  # (blocks, 2): mean, std
        line, = ratio_ax.plot(x, stats[:, 0], marker="o", label=label)
        ratio_ax.fill_between(x, stats[:, 0] - stats[:, 1], stats[:, 0] + stats[:, 1],
                              color=line.get_color(), alpha=0.2)
    for ax, title in ((sink_ax, f"share of sink heads (> {result['sink_threshold']:g})"),
                      (ratio_ax, HEATMAPS["massive_ratio"])):
        ax.set_xticks(range(len(names)), names, rotation=60, fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    sink_ax.set_ylim(-0.03, 1.03)
    ratio_ax.axhline(1.0, color="k", lw=0.8, ls=":")  # no token stands out
    ratio_ax.legend(fontsize=7)
    fig.suptitle("mean over noise levels; band: +- one std over images and levels",
                 fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def save_figures(result: dict, out_dir: str | Path,
                 map_levels: list[int] | None = None) -> dict[str, Path]:
    """Write the figures of `result` into `out_dir`; returns {figure name: path}.

    Map grids are drawn for the noise levels (indices into result["noise_levels"]) in
    `map_levels`, by default all of them.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics = [m for m in HEATMAPS if m != "text_weight" or result["layout"]["text"]]
    paths = {f"heatmap_{m}": heatmap_figure(result, m, out / f"heatmap_{m}.png")
             for m in metrics}
    for label in result["models"]:
        for level, record in enumerate(result["noise_levels"]):
            if map_levels is not None and level not in map_levels:
                continue
            name = f"maps_{_safe(label)}_t{record['timestep']}"
            paths[name] = maps_figure(result, label, level, out / f"{name}.png")
    paths["overview"] = overview_figure(result, out / "overview.png")
    paths["massive_activations"] = massive_figure(result, out / "massive_activations.png")
    return paths
