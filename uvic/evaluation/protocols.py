"""FID protocols: what a number was measured under, named in every result and table column.

An FID is only comparable with another measured under the same protocol: the sampler and
its steps, the number of samples, clean-fid's mode, the reference statistics and the
feature extractor. `protocol_of(cfg)` reads it from a config; `RELEASE` holds the U-ViT
release's protocols, which the paper's Table 3 follows (the paper defers to U-ViT's
setup); `protocol_table` renders Table 3 with one column per (dataset, protocol), so two
protocols never share a column. A protocol whose features are not Inception (the
download-free eval.features=projection, test extractors) is a stand-in: its label, its
column and its result say it is not comparable with Inception FID. A result recorded under
a retired sampler name (`OLD_SAMPLERS`) is read back under a name saying so, so it never
shares a column, nor a label, with results of the protocol that replaced it.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

from uvic.config import Config
from uvic.sampling.checks import can_guide, fid_label_draw

# The paper's Table 3 and the U-ViT release's reported FIDs.
PAPER_FID = {("U-ViT", "cifar10"): 3.39, ("U-ViT", "mscoco"): 5.99,
             ("U-ViC", "cifar10"): 3.27, ("U-ViC", "mscoco"): 5.85}
RELEASE_FID = {("U-ViT", "cifar10"): 3.11, ("U-ViT", "mscoco"): 5.95}
DATASET_TITLES = {"cifar10": "CIFAR-10", "mscoco": "MS-COCO 256", "shapes": "Shapes"}
NOT_FID = "NOT comparable with Inception FID"  # what every stand-in result says
SAMPLES_META = "samples.json"  # `uvic.evaluation.fid`'s record of a samples folder: not a result


@dataclass(frozen=True)
class Protocol:
    """Everything besides the model that determines an FID."""

    sampler: str  # sample.scheduler (with its kwargs, if any)
    steps: int  # model calls per sample (guided calls count once)
    guidance: float  # s in eps = c + s (c - u); 0 for unconditional models
    n_samples: int
    fid_mode: str  # clean-fid mode
    reference: str  # reference statistics: name or file, split, resolution
    features: str = "inception"  # the feature extractor
    labels: str = ""  # class-conditional: how each sample's class is drawn (fid_label_draw)

    @property
    def inception(self) -> bool:
        """Inception features: an FID proper; else a stand-in, not comparable with FID."""
        return self.features == "inception"

    def label(self) -> str:
        """One line, e.g. `euler_maruyama 1000 steps, 50000 samples, legacy_pytorch,
        ref cifar10/train/32`; a stand-in adds `, features projection (stand-in: NOT
        comparable with Inception FID)`."""
        guided = f", guidance {self.guidance:g}" if self.guidance else ""
        features = "" if self.inception else f", features {self.features} (stand-in: {NOT_FID})"
        labels = f", labels {self.labels}" if self.labels else ""
        return (f"{self.sampler} {self.steps} steps{guided}{labels}, {self.n_samples} samples, "
                f"{self.fid_mode}, ref {self.reference}{features}")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "label": self.label(),
                "comparable_with_inception_fid": self.inception}


def sampler_name(cfg: Config) -> str:
    """sample.scheduler, with the order for DPM-Solver multistep and any scheduler kwargs."""
    s = cfg.sample
    name = s.scheduler
    if name in ("dpm_solver++", "dpm_solver"):
        name += f" order {s.order}"
    if s.scheduler_kwargs:
        items = ", ".join(f"{k}={v}" for k, v in sorted(s.scheduler_kwargs.items()))
        name += f" ({items})"
    return name


def reference_name(cfg: Config) -> str:
    """The reference statistics as `name/split/resolution` (a file: its stem)."""
    ev = cfg.eval
    stats = ev.ref_stats
    if stats.endswith(".npz") or "/" in stats:
        stats = Path(stats).stem
    return f"{stats}/{ev.ref_split}/{ev.ref_res}"


def protocol_of(
    cfg: Config, n: int | None = None, features: str | None = None
) -> Protocol:
    """The protocol a run of `eval/fid.py` with this config (and `n` samples) follows;
    `features` names a feature extractor other than eval.features' (tests)."""
    return Protocol(
        sampler=sampler_name(cfg), steps=cfg.sample.steps,
        guidance=cfg.sample.cfg_scale if can_guide(cfg) else 0.0,
        n_samples=int(n if n is not None else cfg.eval.n_samples), fid_mode=cfg.eval.mode,
        reference=reference_name(cfg),
        features=features if features is not None else cfg.eval.features,
        labels=fid_label_draw(cfg),
    )


# The release's protocols (configs/cifar10_*.py and configs/mscoco_*.py by default).
RELEASE = {
    "cifar10": Protocol("euler_maruyama", 1000, 0.0, 50_000, "legacy_pytorch",
                        "cifar10/train/32"),
    "mscoco": Protocol("dpm_solver++_fast_time_uniform", 50, 1.0, 30_000, "legacy_pytorch",
                       "mscoco_val2014_256/val/256"),
}
# Sampler names results were once recorded under, and the name they are read back as:
# `dpm_solver_fast` was uvic's MS-COCO sampler until issue 25, believed to be the
# release's protocol but not it (other network times; samples 4.5e-2 apart, relative L2).
OLD_SAMPLERS = {
    "dpm_solver_fast": "old dpm_solver_fast (uvic's MS-COCO sampler before issue 25, not "
                       "the release's protocol)",
}


def protocol_from_result(result: dict[str, Any]) -> Protocol:
    """The protocol recorded in a result JSON of `eval/fid.py` (a retired sampler under its
    `OLD_SAMPLERS` name)."""
    p = result.get("protocol")
    names = [f.name for f in fields(Protocol)]
    required = [f.name for f in fields(Protocol) if f.default is MISSING]
    if not isinstance(p, dict) or not all(k in p for k in required):
        raise ValueError(f"{result.get('_path', 'result')}: names no protocol (made before "
                         "protocols were recorded; evaluate it again)")
    values = {k: p[k] for k in names if k in p}  # not the derived label etc.
    values["sampler"] = OLD_SAMPLERS.get(values["sampler"], values["sampler"])
    return Protocol(**values)


# --------------------------------------------------------------------------- Table 3


def protocol_table(results: list[dict[str, Any]]) -> str:
    """Markdown Table 3: rows U-ViT / U-ViC (and other attention patterns), one column per
    (dataset, protocol) holding our best FID under that protocol, and the paper's column
    per dataset. Protocols are listed under the table; the release's is marked."""
    cells: dict[tuple[str, str, Protocol], dict[str, Any]] = {}
    for r in results:
        key = (r["model"], r["dataset"], protocol_from_result(r))
        if key not in cells or r["fid"] < cells[key]["fid"]:
            cells[key] = r
    datasets = ["cifar10", "mscoco"]
    datasets += sorted({d for _, d, _ in cells} - set(datasets))
    models = ["U-ViT", "U-ViC"]
    models += sorted({m for m, _, _ in cells} - set(models))

    columns: list[tuple[str, Protocol | None]] = []  # (dataset, protocol or None: paper)
    for d in datasets:
        protocols = sorted({p for _, dd, p in cells if dd == d},
                           key=lambda p: (p != RELEASE.get(d), p.label()))
        columns += [(d, p) for p in protocols]
        if any(key[1] == d for key in PAPER_FID):
            columns.append((d, None))
    names = {p: f"P{i + 1}" for i, p in enumerate(dict.fromkeys(p for _, p in columns if p))}

    header = ["Model"]
    for d, p in columns:
        title = DATASET_TITLES.get(d, d)
        mark = "" if p is None or p.inception else ", stand-in: not FID"
        header.append(f"{title} (paper)" if p is None else f"{title} ({names[p]}{mark})")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for m in models:
        row = [m]
        for d, p in columns:
            if p is None:
                paper, release = PAPER_FID.get((m, d)), RELEASE_FID.get((m, d))
                cell = "—" if paper is None else f"{paper:.2f}"
                row.append(cell + (f" (release {release:.2f})" if release is not None else ""))
            else:
                r = cells.get((m, d, p))
                row.append("—" if r is None else f"{r['fid']:.2f}")
        lines.append("| " + " | ".join(row) + " |")

    lines += ["", "Lower is better. Paper: the Cog-attention paper's Table 3 (U-ViT-S/2, 44M "
              "parameters), under the U-ViT release's protocol; release: the U-ViT "
              "repository's reported FID. Our numbers are comparable with them only in a "
              "column whose protocol is marked *release protocol*."]
    if any(not p.inception for p in names):
        lines += ["", "Columns marked *stand-in: not FID* use features other than Inception "
                  "(eval.features=projection: a fixed random projection, no downloads): they "
                  f"check the pipeline; their numbers are {NOT_FID}."]
    lines += ["", "Protocols:", ""]
    for p, name in names.items():
        d = next(dd for dd, pp in columns if pp == p)
        mark = " — *release protocol*" if RELEASE.get(d) == p else ""
        lines.append(f"- {name}: {p.label()}{mark}")
    details = [_describe(r, p, names[p]) for (_, _, p), r in sorted(
        cells.items(), key=lambda kv: (kv[0][1], kv[0][0], names[kv[0][2]]))]
    if details:
        lines += ["", "Results shown:", "", *details]
    return "\n".join(lines) + "\n"


def _describe(r: dict[str, Any], protocol: Protocol, name: str) -> str:
    kid = r.get("kid")
    kid_text = f", KID {kid:.5f}" if isinstance(kid, int | float) and not math.isnan(kid) else ""
    step = f" step {r['step']}" if r.get("step") is not None else ""
    what = "FID" if protocol.inception else f"stand-in FID ({protocol.features} features)"
    return (f"- {r['model']} / {DATASET_TITLES.get(r['dataset'], r['dataset'])} ({name}): "
            f"{what} {r['fid']:.3f}{kid_text}; {r['checkpoint']}{step}")


def load_results(folder: str | Path) -> list[dict[str, Any]]:
    """Every result JSON of `eval/fid.py` in `folder`, recursively (the samples folders'
    `samples.json` records aside). A folder with none, or any other JSON, is refused: a
    table built from nothing (the paper's numbers alone) would read like a result."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"results folder not found: {folder}")
    results = []
    for path in sorted(folder.rglob("*.json")):
        if path.name == SAMPLES_META:
            continue
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from err
        if not (isinstance(data, dict) and {"fid", "dataset", "model"} <= data.keys()):
            raise ValueError(f"{path}: not an FID result (a result JSON of eval/fid.py has "
                             "fid, model, dataset and protocol); give the folder of those")
        data["_path"] = str(path)
        results.append(data)
    if not results:
        raise ValueError(f"{folder}: holds no FID result JSONs (eval/fid.py --out writes "
                         "them); no table")
    return results
