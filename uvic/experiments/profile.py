"""Where a benchmarked step spends its time: a `torch.profiler` breakdown of a few calls
(`uvic-bench-train --profile`, kernels/BENCHMARKS.md).

A row's `profile` record holds the wall and device time of one step, ``gpu_busy`` (their
ratio: a step at 17% busy is bound by the host or by gaps between small kernels), and the
operators with the most host time (``host_top``) and device time (``kernels_top``). Imports
no torch at module level, so `--help` stays light.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

TOP = 8  # operators listed per table
PROFILED_STEPS = 3  # steps under the profiler (after the timed ones: warm)


def _per_step(total_us: float, steps: int) -> float:
    """A profiler total (microseconds over `steps` steps) in ms per step."""
    return total_us / steps / 1e3


def profile_step(step: Callable[[], None], device: torch.device,
                 steps: int = PROFILED_STEPS) -> dict[str, Any]:
    """Profile `steps` calls of a warm `step` on `device`: wall and device time per step,
    the GPU's busy fraction, and the top operators by own host time and by device time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - start) / steps * 1e3
    events = prof.key_averages()
    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP]
    record: dict[str, Any] = {
        "steps": steps, "wall_ms": wall_ms, "device_ms": None, "gpu_busy": None,
        "host_ms": _per_step(sum(e.self_cpu_time_total for e in events), steps),
        "host_top": [{"name": e.key, "self_host_ms": _per_step(e.self_cpu_time_total, steps),
                      "calls": e.count / steps} for e in host],
        "kernels_top": []}
    if cuda:  # the kernels themselves: events on the device, each once
        kernels: dict[str, list[float]] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels.setdefault(e.name, []).append(e.time_range.elapsed_us())
        busy_ms = _per_step(sum(sum(us) for us in kernels.values()), steps)
        top = sorted(kernels.items(), key=lambda item: sum(item[1]), reverse=True)[:TOP]
        record.update(device_ms=busy_ms, gpu_busy=busy_ms / wall_ms,
                      kernels_top=[{"name": name, "device_ms": _per_step(sum(us), steps),
                                    "calls": len(us) / steps} for name, us in top])
    return record


def profile_lines(title: str, record: dict[str, Any]) -> list[str]:
    """A row's profile as printed lines: the totals, then the top host operators."""
    busy = ("GPU busy n/a (no CUDA)" if record["gpu_busy"] is None else
            f"GPU busy {record['device_ms']:.2f} ms = {100 * record['gpu_busy']:.0f}%")
    lines = [f"{title}: {record['wall_ms']:.2f} ms/step under the profiler, {busy}, "
             f"host operators' own time {record['host_ms']:.2f} ms"]
    lines += [f"    host  {op['self_host_ms']:8.3f} ms  x{op['calls']:g}  {op['name']}"
              for op in record["host_top"]]
    lines += [f"    device {op['device_ms']:7.3f} ms  x{op['calls']:g}  {op['name']}"
              for op in record["kernels_top"]]
    return lines
