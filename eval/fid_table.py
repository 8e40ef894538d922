"""Markdown version of the paper's Table 3 from a folder of `eval/fid.py` result JSONs.

    python eval/fid_table.py runs/fid --out runs/fid/table.md

Rows U-ViT / U-ViC, columns CIFAR-10 / MS-COCO (our best FID per cell beside the paper's
and the U-ViT release's numbers); missing cells show "—".
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from uvic.fid import PROTOCOL_N

# The paper's Table 3 (U-ViT-S/2) and the U-ViT release's reported FID.
PAPER_FID = {("U-ViT", "cifar10"): 3.39, ("U-ViT", "mscoco"): 5.99,
             ("U-ViC", "cifar10"): 3.27, ("U-ViC", "mscoco"): 5.85}
RELEASE_FID = {("U-ViT", "cifar10"): 3.11, ("U-ViT", "mscoco"): 5.95}
DATASET_TITLES = {"cifar10": "CIFAR-10", "mscoco": "MS-COCO 256", "shapes": "Shapes"}


def load_results(folder: str | Path) -> list[dict[str, Any]]:
    """Every result JSON (with an "fid" key) in `folder`, recursively."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"results folder not found: {folder}")
    results = []
    for path in sorted(folder.rglob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from err
        if isinstance(data, dict) and "fid" in data and "dataset" in data and "model" in data:
            data["_path"] = str(path)
            results.append(data)
    return results


def results_table(results: list[dict[str, Any]]) -> str:
    """Markdown Table 3: rows U-ViT / U-ViC (plus any other attention pattern), columns
    CIFAR-10 / MS-COCO (plus any other dataset), our FID beside the paper's. The best
    (lowest) FID per cell is shown; details of each shown result follow the table."""
    datasets = ["cifar10", "mscoco"]
    datasets += sorted({r["dataset"] for r in results} - set(datasets))
    models = ["U-ViT", "U-ViC"]
    models += sorted({r["model"] for r in results} - set(models))
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for r in results:
        key = (r["model"], r["dataset"])
        if key not in best or r["fid"] < best[key]["fid"]:
            best[key] = r

    has_paper = {d: any(key[1] == d for key in PAPER_FID) for d in datasets}
    header = ["Model"]
    for d in datasets:
        title = DATASET_TITLES.get(d, d)
        header += [f"{title} (ours)", f"{title} (paper)"] if has_paper[d] else [f"{title} (ours)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    notes: list[str] = []
    for m in models:
        row = [m]
        for d in datasets:
            r = best.get((m, d))
            if r is None:
                row.append("—")
            else:
                marks = ""
                protocol = PROTOCOL_N.get(d)
                if protocol and r["n"] < protocol:
                    marks += "*"
                if r.get("feature_extractor") != "inception" or r.get("mode") != "clean":
                    marks += "†"
                row.append(f"{r['fid']:.2f}{marks}")
                notes.append(_describe(r))
            if not has_paper[d]:
                continue
            paper = PAPER_FID.get((m, d))
            release = RELEASE_FID.get((m, d))
            cell = "—" if paper is None else f"{paper:.2f}"
            if release is not None:
                cell += f" (release {release:.2f})"
            row.append(cell)
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Lower is better. Paper: Cog-attention paper, Table 3 (U-ViT-S/2, 44M "
              "parameters); release: the U-ViT repository's reported FID.",
              "`*` fewer samples than the protocol (CIFAR-10 50,000; MS-COCO 30,000); "
              "`†` not clean-fid Inception features in clean mode: not comparable.", ""]
    if notes:
        lines += ["Results shown:", "", *notes]
    return "\n".join(lines) + "\n"


def _describe(r: dict[str, Any]) -> str:
    s = r.get("sampler", {})
    kid = r.get("kid")
    kid_text = f", KID {kid:.5f}" if isinstance(kid, int | float) and not math.isnan(kid) else ""
    step = f" step {r['step']}" if r.get("step") is not None else ""
    return (f"- {r['model']} / {DATASET_TITLES.get(r['dataset'], r['dataset'])}: FID "
            f"{r['fid']:.3f}{kid_text}; N={r['n']}, {s.get('scheduler', '?')} "
            f"{s.get('steps', '?')} steps, guidance {r.get('guidance', 0)}, mode {r.get('mode')}, "
            f"features {r.get('feature_extractor', 'inception')}; {r['checkpoint']}{step} "
            f"({Path(r['_path']).name})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results_dir", help="folder with result JSONs (searched recursively)")
    p.add_argument("--out", help="also write the table to this markdown file")
    args = p.parse_args(argv)
    try:
        table = results_table(load_results(args.results_dir))
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(table, end="")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
