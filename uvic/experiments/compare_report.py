"""`uvic-compare`'s report from the evaluation files: <out>/compare.md, compare.tex,
compare.json (every run's numbers, the statistics and the provenance) and compare.png (each
metric against the step, the variants' means with their 95% bands).

The statistics are `uvic.evaluation.paired`'s. "Best step" figures (`--best`) are selected
on the evaluation metric itself, so optimistic, and marked so in every table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from uvic.config import to_dict
from uvic.evaluation.paired import (
    POWER,
    Interval,
    PairedDifference,
    best_step,
    bootstrap_min_seeds,
    format_interval,
    pairs_of,
    t_interval,
    verdict,
)
from uvic.experiments.compare_plan import BETTER_TEXT, METRICS, Plan
from uvic.experiments.records import git_state
from uvic.files import write_json

Values = dict[str, dict[int, float]]  # variant -> seed -> value
BEST = "best step (selected on this metric itself)"


def load_evaluations(plan: Plan) -> tuple[dict[str, dict[int, dict[str, Any]]], list[str]]:
    """run name -> step -> evaluation record, and the evaluations still missing."""
    from uvic.experiments.compare_eval import eval_file  # torch: only where evaluations are read

    records: dict[str, dict[int, dict[str, Any]]] = {}
    missing = []
    for cfg in plan.configs.values():
        for step in plan.grid:
            path = eval_file(plan.out, cfg.name, step)
            if path.is_file():
                records.setdefault(cfg.name, {})[step] = json.loads(path.read_text())
            else:
                missing.append(f"{cfg.name} step {step}")
    return records, missing


def values_at(plan: Plan, records: dict, metric: str, step: int) -> Values:
    """variant -> seed -> the metric at `step` (runs that have it)."""
    out: Values = {}
    for (variant, seed), cfg in plan.configs.items():
        value = records.get(cfg.name, {}).get(step, {}).get("metrics", {}).get(metric)
        if value is not None:
            out.setdefault(variant, {})[seed] = float(value)
    return out


def best_values(plan: Plan, records: dict, metric: str) -> tuple[Values, dict[str, dict]]:
    """variant -> seed -> the run's best value over the grid, and the steps selected."""
    values: Values = {}
    steps: dict[str, dict[int, int]] = {}
    for (variant, seed), cfg in plan.configs.items():
        by_step = {s: r["metrics"][metric] for s, r in records.get(cfg.name, {}).items()
                   if metric in r.get("metrics", {})}
        if len(by_step) == len(plan.grid):
            step, value = best_step(by_step, METRICS[metric][1])
            values.setdefault(variant, {})[seed] = value
            steps.setdefault(variant, {})[seed] = step
    return values, steps


def _intervals(values: Values) -> dict[str, Interval | None]:
    return {v: t_interval(list(by_seed.values())) if len(by_seed) >= 2 else None
            for v, by_seed in values.items()}


def needs_seeds() -> str:
    """What a report shows in place of a bootstrap figure too few seeds cannot back."""
    return f"needs >= {bootstrap_min_seeds()} seeds"


def pair_record(p: PairedDifference) -> dict[str, Any]:
    """A pair as the report keeps it: its figures and verdict; the bootstrap's figures
    null, and a note saying why, where too few seeds make them unreadable."""
    out = {**p.as_dict(), "verdict": verdict(p)}
    if not p.bootstrap_valid:
        out.update(bootstrap_low=None, bootstrap_high=None, bootstrap_p=None,
                   bootstrap_note=needs_seeds())
    return out


def summarize(plan: Plan, records: dict) -> dict[str, Any]:
    """Per metric: per evaluated step, each variant's interval and every pair's paired
    difference; with --best, the best-step figures."""
    summary: dict[str, Any] = {}
    for metric in plan.metrics:
        margin = plan.margins.get(metric)
        per_step = {}
        for step in plan.grid:
            values = values_at(plan, records, metric, step)
            complete = {v: s for v, s in values.items() if len(s) >= 2}
            per_step[step] = {
                "variants": {v: iv.as_dict() for v, iv in _intervals(values).items() if iv},
                "pairs": [pair_record(p) for p in pairs_of(complete, margin=margin)]
                if len(complete) >= 2 else [],
            }
        summary[metric] = {"what": plan.what(metric), "better": METRICS[metric][1],
                           "margin": margin, "steps": per_step}
        if plan.best:
            values, steps = best_values(plan, records, metric)
            summary[metric]["best"] = {
                "selected_on": f"{metric} itself (optimistic)",
                "variants": {v: {**iv.as_dict(), "steps": steps[v]}
                             for v, iv in _intervals(values).items() if iv}}
    return summary


def _iv(d: dict[str, Any] | None, latex: bool = False) -> str:
    if not d:
        return "—"
    return format_interval(Interval(d["mean"], d["half_width"], d["n"], d["sd"]), latex=latex)


def _diff(p: dict[str, Any], latex: bool = False) -> str:
    """A signed mean difference ± its t half-width."""
    text = format_interval(Interval(p["mean"], p["t_half_width"], p["n"], 0.0), latex=latex)
    sign = "+" if p["mean"] >= 0 else ""  # a negative mean brings its own sign
    return text.replace("$", "$" + sign, 1) if latex else sign + text


def _boot(p: dict[str, Any]) -> list[str]:
    """The bootstrap interval and p-value cells, or "needs >= N seeds" in both."""
    if p.get("bootstrap_low") is None:
        return [p.get("bootstrap_note") or needs_seeds()] * 2
    kind = f"exact, {p['bootstrap_resamples']}" if p["bootstrap_exact"] else \
        f"{p['bootstrap_resamples']} draws"
    return [f"[{p['bootstrap_low']:.4g}, {p['bootstrap_high']:.4g}] ({kind})",
            f"{p['bootstrap_p']:.3g}"]


def markdown(plan: Plan, summary: dict[str, Any], missing: list[str]) -> str:
    """The report as markdown: per metric a table of variants (mean ± 95% t half-width at
    each table step) and a table of paired differences."""
    seeds = ", ".join(map(str, plan.seeds))
    lines = [f"# Comparison: {', '.join(plan.variants)}", "",
             f"{len(plan.seeds)} seeds ({seeds}) per variant, every run trained "
             f"{plan.base.train.max_steps} steps and evaluated at the same steps "
             f"({', '.join(map(str, plan.grid))}). Cells: mean ± half-width of the 95% "
             "Student-t interval over seeds. Pairs: B − A seed by seed (seed s of every "
             "variant starts from the same initial weights, data order and noise); t "
             "interval and paired t-test p-value; the MDE, the true difference the "
             f"paired t-test finds with {POWER:.0%} power at these seeds and this spread "
             "(a t interval that contains 0 is inconclusive: differences below about the "
             "MDE mostly go unseen); the verdict (\"equivalent\" only from a TOST within "
             "a `--margin`); then the percentile bootstrap interval and "
             "bootstrap p-value of the mean difference, which no fewer than "
             f"{bootstrap_min_seeds()} seeds can back (its interval lies within the "
             "differences' range, which misses the mean with probability 2/2^n).", ""]
    for key, (name, overrides) in enumerate(plan.variants.items()):
        lines.append(f"{'Variants: ' if key == 0 else ''}`{name}` = {'; '.join(overrides)}")
    for s in summary.values():
        lines += ["", f"## {s['what']} ({BETTER_TEXT[s['better']]})", ""]
        head = [f"step {t}" for t in plan.table_steps] + ([BEST] if "best" in s else [])
        lines += ["| Variant | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
        for v in plan.variants:
            cells = [_iv(s["steps"][t]["variants"].get(v)) for t in plan.table_steps]
            if "best" in s:
                b = s["best"]["variants"].get(v)
                cells.append(_iv(b) + (f" (steps {', '.join(map(str, b['steps'].values()))})"
                                       if b else ""))
            lines.append(f"| {v} | " + " | ".join(cells) + " |")
        margin = s.get("margin")
        tost = [f"TOST p (±{margin:.3g})"] if margin is not None else []
        head = ["Pair (B − A)", "step", "mean difference ± t half-width", "paired t p",
                f"MDE ({POWER:.0%} power)", "verdict", *tost, "bootstrap interval",
                "bootstrap p"]
        lines += ["", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
        for t in plan.table_steps:
            for p in s["steps"][t]["pairs"]:
                cells = [f"{p['b']} − {p['a']}", str(t), _diff(p), f"{p['t_p']:.3g}",
                         f"{p['mde']:.3g}", p["verdict"],
                         *([f"{p['tost_p']:.3g}"] if tost else []), *_boot(p)]
                lines.append("| " + " | ".join(cells) + " |")
    if missing:
        lines += ["", f"Missing evaluations ({len(missing)}): {', '.join(missing[:8])}"
                  f"{' ...' if len(missing) > 8 else ''}: run the command again."]
    return "\n".join(lines) + "\n"


def latex(plan: Plan, summary: dict[str, Any]) -> str:
    """One LaTeX tabular per metric: variants x table steps, mean $\\pm$ half-width."""
    out = []
    for s in summary.values():
        cols = [f"step {t}" for t in plan.table_steps] + (["best step$^\\dagger$"]
                                                         if "best" in s else [])
        out += [f"% {s['what']} ({BETTER_TEXT[s['better']]}); 95% Student-t intervals over "
                f"{len(plan.seeds)} seeds", "\\begin{tabular}{l" + "c" * len(cols) + "}",
                "Variant & " + " & ".join(cols) + " \\\\", "\\hline"]
        for v in plan.variants:
            cells = [_iv(s["steps"][t]["variants"].get(v), latex=True) for t in plan.table_steps]
            if "best" in s:
                cells.append(_iv(s["best"]["variants"].get(v), latex=True))
            out.append(f"{v} & " + " & ".join(cells) + " \\\\")
        out += ["\\end{tabular}"]
        if "best" in s:
            out.append("% $\\dagger$ each run's best step, selected on this metric itself")
        out.append("")
    return "\n".join(out).replace("—", "--")


def plot(plan: Plan, summary: dict[str, Any], path: Path) -> None:
    """Each metric against the step (a column each): the variants' means with their 95% t
    bands, and below, each variant's paired difference to the first with its t band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n, first = len(summary), next(iter(plan.variants))
    fig, axes = plt.subplots(2, n, figsize=(3.4 * n, 5.8), squeeze=False, sharex=True)
    for col, (metric, s) in enumerate(summary.items()):
        top, bottom = axes[0][col], axes[1][col]
        for i, v in enumerate(plan.variants):
            pts = [(t, s["steps"][t]["variants"][v]) for t in plan.grid
                   if v in s["steps"][t]["variants"]]
            _band(top, pts, "mean", "low", "high", f"C{i}", v)
            diffs = [(t, p) for t in plan.grid for p in s["steps"][t]["pairs"]
                     if (p["a"], p["b"]) == (first, v)]
            _band(bottom, diffs, "mean", "t_low", "t_high", f"C{i}", f"{v} − {first}")
        bottom.axhline(0.0, color="grey", lw=0.8)
        top.set_title(metric + (" (velocity)" if "velocity MSE" in s["what"] else ""))
        bottom.set_xlabel("training step")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean, 95% t interval")
    axes[1][0].set_ylabel(f"paired difference to {first}")
    axes[0][0].legend(fontsize=8)
    axes[1][0].legend(fontsize=8)
    fig.suptitle(f"{', '.join(plan.variants)}: {len(plan.seeds)} seeds, matched steps")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _band(ax: Any, pts: list[tuple[int, dict[str, Any]]], mid: str, low: str, high: str,
          colour: str, label: str) -> None:
    if len(pts) == 1:  # one evaluated step: a band would have no width, draw its bar
        (t, d), = pts
        ax.errorbar([t], [d[mid]], yerr=[[d[mid] - d[low]], [d[high] - d[mid]]], marker="o",
                    color=colour, capsize=4, label=label)
    elif pts:
        steps = [t for t, _ in pts]
        ax.plot(steps, [d[mid] for _, d in pts], marker="o", color=colour, label=label)
        ax.fill_between(steps, [d[low] for _, d in pts], [d[high] for _, d in pts],
                        color=colour, alpha=0.2)


def write_report(plan: Plan, pairing: dict[str, Any], argv: list[str]) -> list[str]:
    """Write compare.md, .tex, .json and .png; returns the lines to print."""
    from uvic.evaluation.fid import versions

    records, missing = load_evaluations(plan)
    summary = summarize(plan, records)
    out = plan.out
    text = markdown(plan, summary, missing)
    (out / "compare.md").write_text(text)
    (out / "compare.tex").write_text(latex(plan, summary))
    plot(plan, summary, out / "compare.png")
    first = [r for steps in records.values() for r in steps.values()]
    write_json(out / "compare.json", {
        "command": argv, **git_state(), "versions": versions(),
        "variants": {k: list(v) for k, v in plan.variants.items()}, "seeds": plan.seeds,
        "grid": plan.grid, "table_steps": plan.table_steps,
        "metrics": {m: {"what": plan.what(m), "better": METRICS[m][1]} for m in plan.metrics},
        "protocols": next((r["protocols"] for r in first if "protocols" in r), {}),
        "reference_digests": next((r["reference_digests"] for r in first
                                   if "reference_digests" in r), {}),
        "pairing": pairing, "summary": summary, "missing": missing,
        "configs": {cfg.name: to_dict(cfg) for cfg in plan.configs.values()},
        "runs": {cfg.name: {"variant": v, "seed": seed,
                            "evaluations": records.get(cfg.name, {})}
                 for (v, seed), cfg in plan.configs.items()},
    }, indent=1)
    return [text, f"report: {out / 'compare.md'}, {out / 'compare.tex'}, "
                  f"{out / 'compare.json'}, {out / 'compare.png'}"]
