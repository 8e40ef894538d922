"""The cells of the result tables (Table 3, the release table): each training seed's
best FID, the mean and 95% interval of several seeds, and the metrics `uvic-fid` records
beside FID (`eval.metrics`, `uvic.evaluation.metrics`) in columns of their own."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from uvic.evaluation.paired import format_interval, paired_difference, t_interval, verdict

TWINS = ("U-ViT", "U-ViC")  # the pair every table compares, baseline first

# result keys beside FID -> column title (and which way is better, for the note)
METRIC_COLUMNS = {"fd_dinov2": "FD-DINOv2", "precision": "precision", "recall": "recall"}
METRIC_DIGITS = {"fd_dinov2": 2, "precision": 3, "recall": 3}


def seed_of(result: dict[str, Any]) -> int | None:
    """The training seed of the run a result scores (its config's train.seed), if named."""
    return ((result.get("config") or {}).get("train") or {}).get("seed")


def best_per_seed(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each training seed's lowest-FID result, by seed (results naming none: one seed)."""
    best: dict[Any, dict[str, Any]] = {}
    for r in results:
        k = seed_of(r)
        if k not in best or r["fid"] < best[k]["fid"]:
            best[k] = r
    return [best[k] for k in sorted(best, key=str)]


def fid_cell(results: list[dict[str, Any]]) -> str:
    """A table cell: one seed's best FID (`3.27`); several seeds: the mean of each seed's
    best FID ± the half-width of its 95% Student-t interval (`3.271 ± 0.046 (3 seeds)`,
    `uvic.evaluation.paired`)."""
    chosen = best_per_seed(results)
    if len(chosen) == 1:
        return f"{chosen[0]['fid']:.2f}"
    iv = t_interval([r["fid"] for r in chosen], what="FID")
    return f"{format_interval(iv)} ({iv.n} seeds)"


def seeds_note(cells: Any) -> list[str]:
    """The note under a table where a cell averages several seeds."""
    if not any(len(best_per_seed(c)) > 1 for c in cells):
        return []
    return ["", "A cell of several seeds (`--seeds`) is the mean of each seed's best FID ± "
            "the half-width of its 95% Student-t interval over the seeds."]


def metric_keys(results: Iterable[dict[str, Any]]) -> list[str]:
    """The metrics beside FID that any of `results` records, in `METRIC_COLUMNS` order
    (none for results without them: a table of those is as before)."""
    results = list(results)
    return [k for k in METRIC_COLUMNS if any(k in r for r in results)]


def metric_cell(results: list[dict[str, Any]], key: str) -> str:
    """The cell of metric `key` beside `fid_cell`, of the same results (each seed's
    lowest-FID one): one value, or several seeds' mean ± 95% half-width; blank where
    none of them records it."""
    values = [r[key] for r in best_per_seed(results) if isinstance(r.get(key), int | float)]
    if not values:
        return ""
    if len(values) == 1:
        return f"{values[0]:.{METRIC_DIGITS[key]}f}"
    iv = t_interval(values, what=METRIC_COLUMNS[key])
    return f"{format_interval(iv)} ({iv.n} seeds)"


def metric_note(keys: Iterable[str]) -> list[str]:
    """The note under a table with metric columns: what they are, which way is better."""
    keys = set(keys)
    if not keys:
        return []
    what = {"fd_dinov2": "FD-DINOv2 (Frechet distance of DINOv2 features, lower is better)",
            "precision": "precision", "recall": "recall"}
    shown = [what[k] for k in METRIC_COLUMNS if k in keys]
    pr = ("; precision and recall (Kynkaanniemi et al. 2019) are higher is better"
          if keys & {"precision", "recall"} else "")
    return ["", f"Beside FID: {', '.join(shown)}, of the same result as the FID cell (each "
            f"seed's lowest FID){pr}; blank where a result does not record it."]


def paired_note(lines: list[tuple[str, dict[str, list[dict[str, Any]]]]]) -> list[str]:
    """Under a table whose lines (or columns) hold both twins over 2 or more shared training
    seeds: U-ViC − U-ViT FID paired by seed, its verdict and what it could detect."""
    out = []
    for title, cell in lines:
        fids = [{seed_of(r): r["fid"] for r in best_per_seed(cell.get(m, []))
                 if seed_of(r) is not None} for m in TWINS]
        if len(set(fids[0]) & set(fids[1])) >= 2:
            d = paired_difference(fids[0], fids[1], TWINS)
            out.append(f"- {title}: {d.mean:+.3f} ± {d.t_half_width:.3f} over {d.n} seeds "
                       f"(paired t p {d.t_p:.2g}): {verdict(d)}")
    if not out:
        return []
    return ["", "U-ViC − U-ViT FID, each seed's best paired by training seed (B − A: mean ± "
                "95% t half-width; MDE: the difference found with 80% power):", "", *out]

