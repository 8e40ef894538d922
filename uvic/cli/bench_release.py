"""uvic's training step beside the U-ViT release's own code at the same size, on the CPU:
`uvic-bench-train --release DIR` (DIR: a checkout of the release, with its libs/uvit.py).

Each model runs the same step (forward, noise MSE, backward, AdamW) on the same batch, the
models taking turns round by round, so that load on a shared machine falls on all alike;
the table gives each one's median and its ratio to the release's.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# (arch, batch): the quickstart's model and U-ViT-S/2 at CIFAR-10 size
SIZES = {
    "quickstart": ({"img_size": 16, "patch_size": 2, "embed_dim": 64, "depth": 4,
                    "num_heads": 4, "mlp_ratio": 2.0}, 32),
    "small": ({"img_size": 32, "patch_size": 2, "embed_dim": 512, "depth": 12,
               "num_heads": 8, "mlp_ratio": 4.0}, 8),
}


def release_class(checkout: Path) -> type:
    """The release's `UViT` class from `checkout/libs/uvit.py` (imported as a package, as
    the release imports it); a missing file is a ValueError naming it."""
    path = checkout / "libs" / "uvit.py"
    if not path.is_file():
        raise ValueError(f"--release {checkout}: no libs/uvit.py there (a checkout of the "
                         "U-ViT release is needed)")
    spec = importlib.util.spec_from_file_location(
        "uvit_release_libs", checkout / "libs" / "__init__.py",
        submodule_search_locations=[str(checkout / "libs")])
    package = importlib.util.module_from_spec(spec)
    sys.modules["uvit_release_libs"] = package
    spec.loader.exec_module(package)
    module = importlib.import_module("uvit_release_libs.uvit")
    return module.UViT


def side_by_side(checkout: Path, size: str, designs: list[str], rounds: int,
                 warmup: int = 3) -> list[dict[str, Any]]:
    """Median ms per step of the release's model and of uvic's with each attention preset
    of `designs`, taking turns for `rounds` rounds after `warmup`; ratio to the release's."""
    import torch

    from uvic.models.uvit import UViT

    arch, batch = SIZES[size]
    release = release_class(checkout)
    builders = {"release": lambda: release(**arch, in_chans=3, qkv_bias=False,
                                           mlp_time_embed=False, num_classes=-1)}
    builders.update({d: (lambda d=d: UViT(**arch, in_chans=3, attention=d)) for d in designs})
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, arch["img_size"], arch["img_size"], generator=g)
    t, noise = torch.rand(batch, generator=g) * 999, torch.randn(x.shape, generator=g)
    steps = {}
    for name, build in builders.items():
        torch.manual_seed(0)
        model = build().train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model: torch.nn.Module = model, opt: torch.optim.Optimizer = opt,
                 plain: bool = name == "release") -> None:
            out = model(x, t) if plain else model(x, t, return_dict=False)[0]
            loss = (out - noise).square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        steps[name] = step
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(warmup + rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            if r >= warmup:
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["release"])
    return [{"model": name, "size": size, "batch": batch, "ms_per_step": 1e3 * statistics.median(v),
             "ms_min": 1e3 * min(v), "ratio_to_release": statistics.median(v) / base,
             "rounds": rounds} for name, v in times.items()]


def table(rows: list[dict[str, Any]], threads: int) -> str:
    """The rows as markdown."""
    lines = [f"Training step beside the U-ViT release's code (CPU, {threads} thread(s), "
             "median over rounds taken in turn):", "",
             "| size (batch) | model | ms/step | min | x release |", "|---|---|---|---|---|"]
    lines += [f"| {r['size']} ({r['batch']}) | {r['model']} | {r['ms_per_step']:.1f} | "
              f"{r['ms_min']:.1f} | {r['ratio_to_release']:.3f} |" for r in rows]
    return "\n".join(lines)
