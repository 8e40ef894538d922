"""One budgeted GPU check: the measurements that matter most, in order of value, inside a
wall-time budget, with every finished row on disk at once.

    uvic-gpu-check [--budget-s 420] [--out FILE] [--smoke]   # or: make gpu-check

A row (`uvic.cli.gpu_check_plan`) whose estimated cost does not fit what is left is skipped,
a failing row is recorded with its reason, a row still running when the budget runs out is
stopped and the rest skipped; the record file is rewritten atomically after every row
(kernels/BENCHMARKS.md, "The budgeted GPU check"; the schema: kernels/results/README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from uvic.cli import summary
from uvic.experiments.records import default_out, environment, error_line
from uvic.files import write_json

if TYPE_CHECKING:
    from uvic.cli.gpu_check_plan import CostModel, Row

DEFAULT_BUDGET_S = 420.0  # 7 minutes: a minute under the check's 8-minute limit
SUMMARY_RESERVE_S = 5.0  # kept back from the rows for the targets, summary and last write
STACK_KEYS = ("python", "torch", "triton", "cuda", "device")
NOT_RUN = ("skipped", "timeout")


class BudgetSpent(BaseException):
    """Raised in a row when the budget runs out (a BaseException: the benchmarks' own
    `except Exception` must not swallow it)."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise BudgetSpent in this thread after `seconds` (SIGALRM; where there is none, or
    off the main thread, nothing is enforced and only the estimates keep the budget)."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise BudgetSpent

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Check:
    """The run: its rows' records, the budget's clock, and the record file."""

    def __init__(self, out: Path, budget_s: float, costs: CostModel, env: dict[str, Any],
                 facts: dict[str, Any], start: float | None = None) -> None:
        self.out, self.budget_s, self.costs = out, budget_s, costs
        self.start = time.monotonic() if start is None else start
        self.stack = {k: env.get(k) for k in STACK_KEYS}
        self.payload: dict[str, Any] = {"kind": "gpu-check", **env, **facts,
                                        "budget_s": budget_s, "finished": False,
                                        "wall_s": 0.0, "records": []}
        self.compiled: set[str] = set()  # our kernels' families compiled so far
        self.done: dict[str, dict[str, Any]] = {}  # --resume: finished rows, by id
        self.order: dict[str, int] = {}  # row id -> its place in the plan

    def resume(self, path: Path) -> None:
        """Keep the rows `path` holds that finished (any status but skipped or timeout) on
        this same stack: they are not run again."""
        import json

        try:
            old = json.loads(path.read_text())["records"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise SystemExit(
                f"--resume {path}: not a uvic-gpu-check record file ({err})") from None
        self.done = {r["id"]: r for r in old
                     if r.get("status") not in NOT_RUN and r.get("stack") == self.stack}

    def left_s(self) -> float:
        return self.budget_s - SUMMARY_RESERVE_S - (time.monotonic() - self.start)

    def estimate(self, row: Row) -> float:
        """The row's estimate plus compiling each of its kernel families not yet compiled."""
        new = [n for family, n in row.families.items() if family not in self.compiled]
        return row.estimate_s + sum(new) * self.costs.triton_config_s

    def save(self) -> None:
        self.payload["wall_s"] = time.monotonic() - self.start
        write_json(self.out, self.payload)

    def record(self, row: Row, status: str, reason: str, estimate: float, wall: float,
               result: dict[str, Any] | None = None) -> dict[str, Any]:
        record = {"id": row.id, "group": row.group, **(result or {}), "kind": row.kind,
                  "status": status, "reason": reason, "estimate_s": round(estimate, 1),
                  "wall_s": round(wall, 2), "stack": self.stack}
        if status == "ok" and (result or {}).get("status") not in (None, "ok"):
            record["status"] = result["status"]  # the benchmark's own: OOM, n/a, error
            record["reason"] = result.get("error") or ""
        self.payload["records"].append(record)
        self.payload["records"].sort(key=lambda r: self.order.get(r["id"], len(self.order)))
        self.save()
        print(f"[{time.monotonic() - self.start:5.0f} s] {row.id}: {record['status']}"
              + (f" ({record['reason']})" if record["reason"] else ""), flush=True)
        return record

    def run_row(self, row: Row, cuda: bool) -> bool:
        """Run or skip one row and record it; False once the budget is spent."""
        if row.id in self.done:  # --resume: measured earlier, recorded from the start
            self.compiled.update(row.families)
            return True
        estimate = self.estimate(row)
        if row.needs_cuda and not cuda:
            self.record(row, "skipped", "needs CUDA: not on the CPU smoke", estimate, 0.0)
            return True
        left = self.left_s()
        if estimate > left:
            self.record(row, "skipped", f"budget: estimated {estimate:.0f} s, "
                        f"{max(left, 0):.0f} s left", estimate, 0.0)
            return True
        started = time.monotonic()
        try:
            with deadline(left):
                result = row.run()
        except BudgetSpent:  # the process may be half-way through an import or a compile:
            # no row runs after it
            self.record(row, "timeout", f"budget: the budget ran out after "
                        f"{time.monotonic() - started:.0f} s in this row (estimated "
                        f"{estimate:.0f} s)", estimate, time.monotonic() - started)
            return False
        except Exception as err:  # any failure: one line, and the next row runs
            self.record(row, "error", error_line(err), estimate, time.monotonic() - started)
        else:
            self.record(row, "ok", "", estimate, time.monotonic() - started, result)
        finally:
            _free_memory()
        self.compiled.update(row.families)
        return True

    def run(self, rows: list[Row], cuda: bool) -> dict[str, Any]:
        """Every row in order (after the budget is spent: recorded as skipped); the
        targets and summary at the end. Returns the final payload."""
        from uvic.cli.gpu_check_report import evaluate_targets, summary

        self.order = {row.id: i for i, row in enumerate(rows)}  # records in plan order
        # rows kept by --resume are on disk from the first write: a kill loses none
        self.payload["records"] = [{**self.done[r.id], "resumed": True} for r in rows
                                   if r.id in self.done]
        self.save()
        going = True
        for row in rows:
            if going:
                going = self.run_row(row, cuda)
            else:
                self.record(row, "skipped", "budget: spent before this row", 0.0, 0.0)
        self.payload["targets"] = evaluate_targets(self.payload["records"],
                                                   self.payload["smoke"])
        self.payload["finished"] = True
        self.save()
        self.payload["summary"] = summary(self.payload)
        self.save()
        return self.payload


def _free_memory() -> None:
    """Between rows on CUDA: the last row's garbage (cycles too) and the allocator's cached
    blocks, so that each row starts with the device's memory free. Nothing elsewhere."""
    import gc
    import sys

    torch = sys.modules.get("torch")  # rows that never imported it have nothing cached
    try:
        if torch is not None and torch.cuda.is_available():
            gc.collect()
            torch.cuda.empty_cache()
    except Exception:  # a broken CUDA context: the next row says so
        pass


def dry_run(rows: list[Row], budget_s: float, costs: CostModel) -> list[str]:
    """What the cost model expects of a run: each row's estimate, whether it fits, and the
    expected wall time (start-up included), as printed lines; nothing runs."""
    compiled: set[str] = set()
    spent = costs.startup_s
    lines = [f"budget {budget_s:g} s; start-up {costs.startup_s:g} s (cost model: "
             f"{dataclasses.asdict(costs)})", "| row | estimate s | runs | expected end s |",
             "|---|---|---|---|"]
    for row in rows:
        estimate = row.estimate_s + sum(n for f, n in row.families.items()
                                        if f not in compiled) * costs.triton_config_s
        fits = estimate <= budget_s - SUMMARY_RESERVE_S - spent
        if fits:
            spent += estimate
            compiled.update(row.families)
        lines.append(f"| {row.id} | {estimate:.0f} | {'yes' if fits else 'skipped'} | "
                     f"{spent:.0f} |")
    lines.append(f"expected wall time {spent + SUMMARY_RESERVE_S:.0f} s of {budget_s:g} s; "
                 f"all rows would take {sum(_all(rows, costs)):.0f} s")
    return lines


def _all(rows: list[Row], costs: CostModel) -> list[float]:
    """Every row's estimate if all ran, in order (each kernel family compiled once)."""
    compiled: set[str] = set()
    out = [costs.startup_s]
    for row in rows:
        out.append(row.estimate_s + sum(n for f, n in row.families.items()
                                        if f not in compiled) * costs.triton_config_s)
        compiled.update(row.families)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help="wall-time budget in seconds, from the command's start: rows that "
                   f"would not fit are skipped (default {DEFAULT_BUDGET_S:g})")
    p.add_argument("--out", default=None, help="JSON record file (default: kernels/results/"
                   "<date>_<device>_gpu-check.json on a GPU, runs/bench/gpu-check.json on "
                   "the CPU smoke)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on the CPU (also without CUDA): checks the command, "
                   "not a timing")
    p.add_argument("--resume", default=None, metavar="FILE",
                   help="a record file of an earlier check on the same stack: its finished "
                   "rows are kept, not run again, and the others get this run's budget "
                   "(default --out: that file)")
    p.add_argument("--dry-run", action="store_true",
                   help="run nothing: print the GPU plan (as on an H100 where there is no "
                   "CUDA), each row's estimated seconds and which fit the budget")
    args = p.parse_args(argv)
    if args.budget_s <= 0:
        p.error("--budget-s must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns the exit status (0: the check ran, whatever its rows did)."""
    start = time.monotonic()
    args = parse_args(argv)
    import torch

    from uvic.cli.gpu_check_plan import cost_model, plan
    from uvic.experiments.speed import peak_tflops

    cuda = torch.cuda.is_available() and not args.smoke
    if args.dry_run:  # the GPU plan, whatever this machine has
        peak = peak_tflops(torch.cuda.get_device_name()) if cuda else None
        costs = cost_model(peak, smoke=args.smoke)
        device = torch.device("cuda" if not args.smoke else "cpu")
        print("\n".join(dry_run(plan(device, peak, costs), args.budget_s, costs)))
        return 0
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        print("No CUDA device (or --smoke): tiny smoke configuration on the CPU; not a timing.")
    peak = peak_tflops(torch.cuda.get_device_name(device)) if cuda else None
    env = environment(device)
    out = Path(args.out or args.resume or default_out("gpu-check", env))
    costs = cost_model(peak, smoke=not cuda)
    check = Check(out, args.budget_s, costs, env,
                  {"smoke": not cuda, "peak_bf16_tflops": peak,
                   "cost_model": dataclasses.asdict(costs)}, start)
    if args.resume:
        check.resume(Path(args.resume))
    print(f"uvic-gpu-check: budget {args.budget_s:g} s, writing {out}"
          + (f", {len(check.done)} rows of {args.resume} kept" if args.resume else ""),
          flush=True)
    payload = check.run(plan(device, peak, costs), cuda)
    print("\n" + payload["summary"])
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
