"""FID protocols: what a number was measured under (sampler and steps, guidance, samples,
clean-fid mode, reference statistics, features), named in every result and table column.

`protocol_of(cfg)` reads it from a config; `RELEASE_ROWS` holds the U-ViT release's protocol
for every row of its table (`RELEASE`: those of Table 3, which the paper follows);
`protocol_table` renders Table 3 with a column per (dataset, protocol). A protocol whose
features are not Inception is a stand-in and says it is not comparable with FID.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

from uvic.config import Config, EvalConfig, inf_to_null, load_config, null_to_inf
from uvic.config.diffusion import objective_label
from uvic.config.sampling import (
    effective_cfg_scale,
    fid_label_draw,
    guidance_interval,
    interval_text,
)
from uvic.evaluation.cells import (
    METRIC_COLUMNS,
    best_per_seed,
    fid_cell,
    metric_cell,
    metric_keys,
    metric_note,
    paired_note,
    seeds_note,
)
from uvic.evaluation.reference_split import ReferenceSplit, digest_order
from uvic.presets import preset_path

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
    steps: int  # sample.steps: the sampler's steps (flow_heun makes 2 steps - 1 model calls)
    guidance: float  # s in eps = c + s (c - u); 0 for unconditional models
    n_samples: int
    fid_mode: str  # clean-fid mode
    reference: str  # reference statistics: name or file, split, resolution
    features: str = "inception"  # the feature extractor
    labels: str = ""  # class-conditional: how each sample's class is drawn (fid_label_draw)
    guidance_interval: tuple[float, ...] = ()  # guided noise levels (); older results: ()
    autoguidance: float = 0.0  # sample.autoguidance_scale; recorded only when set
    guide: str = ""  # its weaker model (sample.autoguidance_ckpt); recorded only with it

    @property
    def inception(self) -> bool:
        """Inception features: an FID proper; else a stand-in, not comparable with FID."""
        return self.features == "inception"

    def label(self) -> str:
        """One line, e.g. `euler_maruyama 1000 steps, 50000 samples, legacy_pytorch,
        ref cifar10/train/32`; a stand-in adds `, features projection (stand-in: NOT
        comparable with Inception FID)`."""
        guided = f", guidance {self.guidance:g}" if self.guidance else ""
        if self.autoguidance:
            guided += f", autoguidance {self.autoguidance:g} (guide {self.guide})"
        if self.guidance_interval:  # (autoguidance alone: `guidance on sigma in ...`)
            guided = f"{guided or ', guidance'} {interval_text(self.guidance_interval)}"
        features = "" if self.inception else f", features {self.features} (stand-in: {NOT_FID})"
        labels = f", labels {self.labels}" if self.labels else ""
        return (f"{self.sampler} {self.steps} steps{guided}{labels}, {self.n_samples} samples, "
                f"{self.fid_mode}, ref {self.reference}{features}")

    def sampling_record(self) -> dict[str, Any]:
        """What a samples record (`SAMPLES_META`) pins of the guidance: the interval, and
        autoguidance only where set (older records hold neither)."""
        auto = {"autoguidance": self.autoguidance, "guide": self.guide} if self.autoguidance else {}
        return {"guidance_interval": inf_to_null(self.guidance_interval), **auto}  # strict JSON

    def as_dict(self) -> dict[str, Any]:  # no autoguidance keys without it, as before
        record = {k: v for k, v in asdict(self).items() if k not in ("autoguidance", "guide")}
        return {**record, **self.sampling_record(), "label": self.label(),
                "comparable_with_inception_fid": self.inception}


def sampler_name(cfg: Config) -> str:
    """sample.scheduler, with the order for DPM-Solver multistep, any scheduler kwargs and a
    velocity model's objective and interpolant."""
    s = cfg.sample
    name = s.scheduler
    if name in ("dpm_solver++", "dpm_solver"):
        name += f" order {s.order}"
    if s.scheduler_kwargs:
        items = ", ".join(f"{k}={v}" for k, v in sorted(s.scheduler_kwargs.items()))
        name += f" ({items})"
    return name + objective_label(cfg.diffusion)


def reference_name(ev: EvalConfig) -> str:
    """The reference statistics as `name/split/resolution` (a file: its stem)."""
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
        guidance=effective_cfg_scale(cfg),
        n_samples=int(n if n is not None else cfg.eval.n_samples), fid_mode=cfg.eval.mode,
        reference=reference_name(cfg.eval),
        features=features if features is not None else cfg.eval.features,
        labels=fid_label_draw(cfg), guidance_interval=guidance_interval(cfg),
        autoguidance=cfg.sample.autoguidance_scale,
        guide=cfg.sample.autoguidance_ckpt if cfg.sample.autoguidance_scale else "",
    )


@functools.cache
def preset_protocol(preset: str) -> Protocol:
    """The protocol a shipped config (`uvic.presets`) evaluates under by default. The
    release's protocols are written once, in the presets' `sample` and `eval` sections:
    `RELEASE` and `RELEASE_ROWS` read them from there."""
    return protocol_of(load_config(preset_path(preset)))


@dataclass(frozen=True)
class ReleaseRow:
    """One row of the U-ViT release's table: the uvic preset of its U-ViT (`uvit`; the
    U-ViC twin is `uvic`), the release's config file, the protocol the release evaluates it
    under (its eval script run with that config's `sample` section), the release's
    reference statistics file (`fid_stat` of its datasets.py; for ImageNet, ADM's
    reference batches' mu and sigma), how it draws labels where the protocol does not say
    (`labels`: unconditional rows, captions; class draws are the protocol's), and the FID
    it reports."""

    key: str
    title: str
    uvit: str
    release_config: str
    release_stats: str
    labels: str
    release_fid: float

    @property
    def protocol(self) -> Protocol:
        """The release's protocol of this row, as its U-ViT preset's config states it."""
        return preset_protocol(self.uvit)

    @property
    def uvic(self) -> str:
        """The U-ViC twin's preset (Cog attention in every block but the first and last)."""
        return self.uvit.replace("_uvit", "_uvic", 1)

    @property
    def guidance_scale(self) -> float:
        """The same guidance in diffusers' convention `eps = u + g (c - u)`: g = s + 1
        (1: no guidance)."""
        return self.protocol.guidance + 1.0

    def label(self) -> str:
        """The protocol with both guidance conventions and the release's statistics file."""
        p = self.protocol
        guidance = (f"guidance s={p.guidance:g} (diffusers guidance_scale={self.guidance_scale:g})"
                    if p.guidance else "no guidance")
        return (f"{p.sampler}, {p.steps} steps, {guidance}, {p.n_samples} samples, "
                f"labels: {p.labels or self.labels}, the release's statistics: "
                f"{self.release_stats}")


_IN64, _IN256, _IN512 = (f"fid_stats_imagenet{r}_guided_diffusion.npz" for r in (64, 256, 512))
_CELEBA = "fid_stats_celeba64_train_50000_ddim.npz"
# The release's rows (baofff/U-ViT: configs/*.py, datasets.py `fid_stat`); the protocol of
# each (sampler, steps, guidance, samples, statistics, labels) is its preset's
# (`ReleaseRow.protocol`). CIFAR-10 and MS-COCO keep uvic's reference statistics
# (clean-fid's named `cifar10`; val2014 built locally).
RELEASE_ROWS = {row.key: row for row in [
    ReleaseRow("cifar10", "CIFAR-10, U-ViT-S/2", "cifar10_uvit", "configs/cifar10_uvit_small.py",
               "fid_stats_cifar10_train_pytorch.npz", "none", 3.11),
    ReleaseRow("celeba64_small", "CelebA 64, U-ViT-S/4", "celeba64_uvit_small",
               "configs/celeba64_uvit_small.py",
               _CELEBA, "none", 2.87),
    ReleaseRow("imagenet64_mid", "ImageNet 64, U-ViT-M/4", "imagenet64_uvit_mid",
               "configs/imagenet64_uvit_mid.py",
               _IN64, "", 5.85),
    ReleaseRow("imagenet64_large", "ImageNet 64, U-ViT-L/4", "imagenet64_uvit_large",
               "configs/imagenet64_uvit_large.py",
               _IN64, "", 4.26),
    ReleaseRow("imagenet256_large", "ImageNet 256, U-ViT-L/2", "imagenet256_uvit_large",
               "configs/imagenet256_uvit_large.py",
               _IN256, "", 3.40),
    ReleaseRow("imagenet256_huge", "ImageNet 256, U-ViT-H/2", "imagenet256_uvit_huge",
               "configs/imagenet256_uvit_huge.py",
               _IN256, "", 2.29),
    ReleaseRow("imagenet512_large", "ImageNet 512, U-ViT-L/4", "imagenet512_uvit_large",
               "configs/imagenet512_uvit_large.py",
               _IN512, "", 4.67),
    ReleaseRow("imagenet512_huge", "ImageNet 512, U-ViT-H/4", "imagenet512_uvit_huge",
               "configs/imagenet512_uvit_huge.py",
               _IN512, "", 4.05),
    ReleaseRow("mscoco", "MS-COCO 256 (text), U-ViT-S/2", "mscoco_uvit",
               "configs/mscoco_uvit_small.py", "fid_stats_mscoco256_val.npz",
               "the captions of random val images", 5.95),
]}
# The release's protocols of Table 3's datasets (the cifar10_* and mscoco_* presets' default)
RELEASE = {key: RELEASE_ROWS[key].protocol for key in ("cifar10", "mscoco")}

# Sampler names results were once recorded under, and the name they are read back as:
# `dpm_solver_fast` was uvic's former MS-COCO sampler, believed to be the
# release's protocol but not it (other network times; samples 4.5e-2 apart, relative L2).
OLD_SAMPLERS = {
    "dpm_solver_fast": "old dpm_solver_fast (uvic's former MS-COCO sampler, not "
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
    values["guidance_interval"] = tuple(map(float, null_to_inf(values.get("guidance_interval",
                                                                         ()))))
    return Protocol(**values)


# --------------------------------------------------------------------------- Table 3


def protocol_table(results: list[dict[str, Any]]) -> str:
    """Markdown Table 3: rows U-ViT / U-ViC (and other attention patterns), one column per
    (dataset, protocol, reference digest) holding our best FID under that protocol and
    reference (runs of several training seeds: the mean of each seed's best ± its 95%
    interval, `fid_cell`) (`uvic.evaluation.reference_split`: a protocol is split by reference, and
    marked, only where its results' references differ), and the paper's column per
    dataset. Protocols are listed under the table; the release's is marked."""
    split = ReferenceSplit()
    cells: dict[tuple[str, str, Protocol, str | None], list[dict[str, Any]]] = {}
    for r in results:
        p = protocol_from_result(r)
        key = (r["model"], r["dataset"], p, split.add(r["dataset"], p, r))
        cells.setdefault(key, []).append(r)
    datasets = ["cifar10", "mscoco"]
    datasets += sorted({key[1] for key in cells} - set(datasets))
    models = ["U-ViT", "U-ViC"]
    models += sorted({key[0] for key in cells} - set(models))

    # (dataset, protocol or None: the paper's, reference digest)
    columns: list[tuple[str, Protocol | None, str | None]] = []
    for d in datasets:
        keys = sorted({(p, g) for _, dd, p, g in cells if dd == d},
                      key=lambda k: (k[0] != RELEASE.get(d), k[0].label(), digest_order(k[1])))
        columns += [(d, p, g) for p, g in keys]
        if any(key[1] == d for key in PAPER_FID):
            columns.append((d, None, None))
    names = {p: f"P{i + 1}" for i, p in enumerate(dict.fromkeys(p for _, p, _ in columns if p))}
    tags = {(d, p, g): names[p] + split.tag(d, p, g) for d, p, g in columns if p}
    # each column's metrics beside FID (`uvic.evaluation.cells`): a column of their own each
    extra = {(d, p, g): metric_keys([r for (_, *k), rs in cells.items() if tuple(k) == (d, p, g)
                                     for r in rs]) for d, p, g in columns}

    header = ["Model"]
    for d, p, g in columns:
        title = DATASET_TITLES.get(d, d)
        mark = "" if p is None or p.inception else ", stand-in: not FID"
        header.append(f"{title} (paper)" if p is None else f"{title} ({tags[d, p, g]}{mark})")
        header += [f"{title} ({tags[d, p, g]}) {METRIC_COLUMNS[k]}" for k in extra[d, p, g]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for m in models:
        row = [m]
        for d, p, g in columns:
            if p is None:
                paper, release = PAPER_FID.get((m, d)), RELEASE_FID.get((m, d))
                cell = "—" if paper is None else f"{paper:.2f}"
                row.append(cell + (f" (release {release:.2f})" if release is not None else ""))
            else:
                found = cells.get((m, d, p, g))
                row.append("—" if found is None else fid_cell(found))
                row += [metric_cell(found or [], k) for k in extra[d, p, g]]
        lines.append("| " + " | ".join(row) + " |")

    lines += ["", "Lower is better. Paper: the Cog-attention paper's Table 3 (U-ViT-S/2, 44M "
              "parameters), under the U-ViT release's protocol; release: the U-ViT "
              "repository's reported FID. Our numbers are comparable with them only in a "
              "column whose protocol is marked *release protocol*."]
    def mark(p: Protocol) -> str:
        d = next(dd for dd, pp, _ in columns if pp == p)
        return " — *release protocol*" if RELEASE.get(d) == p else ""

    lines += metric_note({k for keys in extra.values() for k in keys})
    lines += protocol_notes(names, "Columns", mark) + seeds_note(cells.values())
    lines += paired_note([(f"{DATASET_TITLES.get(d, d)}, {tags[d, p, g]}",
                           {m: cells.get((m, d, p, g), []) for m in models})
                          for d, p, g in columns if p])
    lines += split.notes({(d, p): f"{DATASET_TITLES.get(d, d)}, {names[p]}"
                          for d, p, _ in columns if p}, "column")
    number = {p: i for i, p in enumerate(names)}  # P2 before P10
    details = [_describe(r, p, tags[d, p, g]) for (_, d, p, g), found in sorted(
        cells.items(), key=lambda kv: (kv[0][1], kv[0][0], number[kv[0][2]],
                                       digest_order(kv[0][3]))) for r in best_per_seed(found)]
    if details:
        lines += ["", "Results shown:", "", *details]
    return "\n".join(lines) + "\n"


def protocol_notes(names: dict[Protocol, str], marked: str,
                   mark: Callable[[Protocol], str]) -> list[str]:
    """The notes under a protocol table (Table 3, the release table): what the stand-in
    mark means where any protocol is a stand-in (`marked`: "Columns" or "Lines", what the
    table marks), then the protocols by their short names, each followed by `mark(p)`."""
    lines: list[str] = []
    if any(not p.inception for p in names):
        lines += ["", f"{marked} marked *stand-in: not FID* use features other than Inception "
                  "(eval.features=projection: a fixed random projection, no downloads): they "
                  f"check the pipeline; their numbers are {NOT_FID}."]
    return lines + ["", "Protocols:", ""] + [f"- {name}: {p.label()}{mark(p)}"
                                             for p, name in names.items()]


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
