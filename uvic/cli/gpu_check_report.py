"""The end of `uvic-gpu-check`: the check's targets as met / missed / not measured
(`evaluate_targets`: our kernels against SDPA, U-ViC against U-ViT, step time and MFU,
graphed against eager sampling; bf16, one run, side by side), and the one-screen summary
(stack, rows, MFU, targets). A CPU smoke measures nothing.
"""

from __future__ import annotations

from typing import Any

MODES = ("off", "reduce-overhead")
DATASETS = {"cifar10": "CIFAR-10", "mscoco": "MS-COCO"}
NOT_RUN = ("skipped", "timeout")
MS_TARGET = {"cifar10": 30.0, "mscoco": 25.0}
MFU_TARGET = 0.35
UVIC_RATIO = 1.05
SAMPLING_SPEEDUP = 2.0

Best = tuple[float | None, str]  # (ms / step, why not measured: "" when measured)


def _train(records: list[dict[str, Any]], dataset: str, model: str, impl: str,
           mode: str | None = None) -> list[dict[str, Any]]:
    return [r for r in records if r.get("kind") == "train" and r.get("dataset") == dataset
            and r.get("model") == model and r.get("impl") == impl
            and not r.get("grad_checkpointing") and (mode is None or r.get("compile") == mode)]


def best(records: list[dict[str, Any]], dataset: str, model: str, impl: str,
         mode: str | None = None) -> tuple[dict[str, Any] | None, str]:
    """The fastest finished row of (dataset, model, impl) (in `mode` only, if given), or
    None and why not: while any of those rows was skipped or cut off by the budget, or none
    finished, the best is not measured."""
    rows = _train(records, dataset, model, impl, mode)
    label = f"{model} {impl}" + (f" {mode}" if mode else "")
    if not rows:
        return None, f"{label}: no row"
    not_run = [r for r in rows if r["status"] in NOT_RUN]
    if not_run:
        return None, f"{label} {not_run[0]['compile']}: {not_run[0]['status']}"
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return None, f"{label}: {rows[0]['status']} ({rows[0].get('error', '')})"
    return min(ok, key=lambda r: r["ms_per_step"]), ""


def _ms(r: dict[str, Any]) -> str:
    return f"{r['ms_per_step']:.1f} ms ({r['compile']})"


def _verdict(ok: bool) -> str:
    return "met" if ok else "missed"


def _compare(records: list[dict[str, Any]], dataset: str, mode: str | None) -> tuple[str, str]:
    ours, why = best(records, dataset, "uvit", "ours", mode)
    sdpa, why_sdpa = best(records, dataset, "uvit", "sdpa", mode)
    if ours is None or sdpa is None:
        return "not measured", why or why_sdpa
    ratio = ours["ms_per_step"] / sdpa["ms_per_step"]
    return _verdict(ratio <= 1.0), f"ours {_ms(ours)} vs SDPA {_ms(sdpa)}: {ratio:.2f}x"


def _uvic(records: list[dict[str, Any]], dataset: str) -> tuple[str, str]:
    uvic, why = best(records, dataset, "uvic", "ours")
    sdpa, why_sdpa = best(records, dataset, "uvit", "sdpa")
    if uvic is None or sdpa is None:
        return "not measured", why or why_sdpa
    ratio = uvic["ms_per_step"] / sdpa["ms_per_step"]
    return (_verdict(ratio <= UVIC_RATIO),
            f"U-ViC {_ms(uvic)} vs U-ViT-SDPA {_ms(sdpa)}: {ratio:.2f}x (<= {UVIC_RATIO})")


def _step(records: list[dict[str, Any]], dataset: str) -> tuple[str, str]:
    ours, why = best(records, dataset, "uvit", "ours")
    if ours is None:
        return "not measured", why
    mfu = ours.get("mfu")
    ok = ours["ms_per_step"] <= MS_TARGET[dataset]
    detail = f"U-ViT ours {_ms(ours)} (<= {MS_TARGET[dataset]:g})"
    if dataset == "cifar10":
        detail += f", MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} (>= 35%)"
        ok = ok and mfu is not None and mfu >= MFU_TARGET
    return _verdict(ok), detail


def _sampling(records: list[dict[str, Any]], dataset: str) -> tuple[str, str]:
    rows = [r for r in records if r.get("kind") == "sampling" and r.get("dataset") == dataset]
    pairs, missing = [], []
    for model in dict.fromkeys(r["model"] for r in rows):
        by_mode = {r["compile"]: r for r in rows if r["model"] == model}
        eager, graphed = by_mode.get("off"), by_mode.get("reduce-overhead")
        if eager and graphed and eager["status"] == graphed["status"] == "ok":
            pairs.append((model, graphed["images_per_s_per_eval"] / eager["images_per_s_per_eval"],
                          eager["images_per_s_per_eval"], graphed["images_per_s_per_eval"]))
        else:
            bad = next((r for r in (eager, graphed) if r and r["status"] != "ok"), None)
            missing.append(f"{model}: {bad['compile']} {bad['status']}" if bad else model)
    if not pairs:
        return "not measured", "; ".join(missing) or "no row"
    detail = "; ".join(f"{m} {e:.0f} -> {g:.0f} images/s/NFE = {x:.2f}x" for m, x, e, g in pairs)
    return _verdict(all(x >= SAMPLING_SPEEDUP for _, x, _, _ in pairs)), detail + (
        f" (not measured: {'; '.join(missing)})" if missing else "")


def evaluate_targets(records: list[dict[str, Any]], smoke: bool) -> list[dict[str, str]]:
    """Each target: {target, status (met | missed | not measured), detail}."""
    checks = []
    for d, name in DATASETS.items():
        checks += [(f"{name}: U-ViT ours <= SDPA, eager", _compare(records, d, "off")),
                   (f"{name}: U-ViT ours <= SDPA, best mode", _compare(records, d, None)),
                   (f"{name}: U-ViC best <= {UVIC_RATIO}x U-ViT-SDPA best", _uvic(records, d))]
    checks += [("CIFAR-10 b128 <= 30 ms/step, >= 35% MFU", _step(records, "cifar10")),
               ("MS-COCO b64 <= 25 ms/step", _step(records, "mscoco"))]
    checks += [(f"{name}: sampling graphed >= 2x eager images/s/NFE", _sampling(records, d))
               for d, name in DATASETS.items()]
    if smoke:
        return [{"target": t, "status": "not measured", "detail": "smoke on the CPU: no timing"}
                for t, _ in checks]
    return [{"target": t, "status": s, "detail": detail} for t, (s, detail) in checks]


def stack_line(stack: dict[str, Any]) -> str:
    return (f"Python {stack['python']}, torch {stack['torch']}, Triton {stack['triton']}, "
            f"CUDA {stack['cuda']}, {stack['device']}")


def result_text(r: dict[str, Any]) -> str:
    """A row's main figures in a few words (why not, for a row that did not finish)."""
    if r["status"] != "ok":
        return r.get("reason") or r.get("error") or ""
    try:
        if r["kind"] == "train":
            busy = (r.get("profile") or {}).get("gpu_busy")  # why a step is slow, in a number
            return (f"{r['ms_per_step']:.2f} ms/step, {r['images_per_s']:.0f} images/s"
                    + ("" if busy is None else f", GPU busy {100 * busy:.0f}%"))
        if r["kind"] == "sampling":
            return (f"{r['ms_per_eval']:.2f} ms/call, "
                    f"{r['images_per_s_per_eval']:.0f} images/s/NFE")
        graph = r.get("fwd_bwd_ms_cuda_graph")
        return (f"fwd {r['fwd_ms']:.3f} ms, fwd+bwd {r['fwd_bwd_ms']:.3f} ms"
                + ("" if graph is None else f" (graph {graph:.3f})"))
    except (KeyError, TypeError, ValueError):  # a record without its figures: see the JSON
        return "see the JSON"


def summary(payload: dict[str, Any]) -> str:
    """The one screen: stack, every row run (skipped ones counted per group), targets."""
    records, smoke = payload["records"], payload["smoke"]
    lines = [f"uvic-gpu-check{' --smoke (CPU: not a timing)' if smoke else ''}: "
             f"{stack_line(payload)}; {payload['wall_s']:.0f} s of a {payload['budget_s']:g} s "
             "budget", "", "| row | status | result | MFU | est s | wall s |",
             "|---|---|---|---|---|---|"]
    skipped: dict[int, list[str]] = {}
    for r in records:
        if r["status"] == "skipped":
            skipped.setdefault(r["group"], []).append(r["id"])
            continue
        mfu = r.get("mfu")
        lines.append(f"| {r['id']} | {r['status']} | {result_text(r)} | "
                     f"{'' if mfu is None else f'{100 * mfu:.1f}%'} | {r['estimate_s']:.0f} | "
                     f"{r['wall_s']:.1f} |")
    for group, ids in skipped.items():
        reasons = {r["reason"].split(":")[0] for r in records if r["id"] in ids}
        lines.append(f"| group {group}: {len(ids)} skipped | skipped | {', '.join(sorted(reasons))}"
                     " | | | |")
    lines += ["", "Targets:"]
    lines += [f"  {t['status']:>12}  {t['target']}: {t['detail']}" for t in payload["targets"]]
    return "\n".join(lines)
