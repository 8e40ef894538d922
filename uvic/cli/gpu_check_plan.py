"""The rows of `uvic-gpu-check`, in the order of their value, and what each should cost.

Each row is one measurement of an existing benchmark: training steps of U-ViT / U-ViC
through our kernels and SDPA at CIFAR-10 and MS-COCO sizes, the attention alone, sampling,
then U-ViT-H/2 and longer sequences (kernels/BENCHMARKS.md, "The budgeted GPU check"). On
the CPU (`--smoke`) the same rows run at tiny sizes, and those that need CUDA are skipped.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from uvic.config import load_config
from uvic.models.flops import forward_flops, training_flops
from uvic.presets import preset_path

if TYPE_CHECKING:
    import torch

TRAIN_MODES = ("off", "reduce-overhead")
TRAIN = (("cifar10", 128), ("mscoco", 64))  # group 1, group 2: dataset, batch
HUGE = ("imagenet256", "imagenet256_uvit_huge", 128)
ATTENTION_METHODS = ("cog (ours)", "softmax (ours)", "sdpa cudnn", "sdpa flash")
ON_CPU = {"cog (ours)": "cog (ours, torch)", "softmax (ours)": "softmax (ours, torch)"}
U_VIT_SHAPES = ((128, 8, 257, 64), (256, 8, 334, 64))  # group 3
LONG_SHAPES = ((32, 8, 1024, 64), (4, 8, 4096, 64))  # group 5
SMOKE_N = {257: 33, 334: 42, 1024: 64, 4096: 128}  # smoke: (1, 2, N, 32)
SAMPLING = (("cifar10", 500), ("mscoco", 250))  # images a call: 500 rows (MS-COCO guided)
SAMPLING_MODELS = ("uvic", "uvit")


@dataclass(frozen=True)
class CostModel:
    """Seconds each part of a row is expected to take on an H100 from cold Triton and
    inductor caches, on the high side: a model's build, its steps at `mfu_guess` of the
    peak plus host time, an inductor compile, and each autotuning config of our kernels
    compiled once per pass, dtype and mode (`triton_config_s`) and timed per new key."""

    model_build_s: float = 4.0
    triton_config_s: float = 2.5
    autotune_config_s: float = 0.3
    inductor_train_s: float = 90.0
    inductor_sample_s: float = 50.0
    attention_row_s: float = 4.0
    host_ms_per_step: float = 30.0
    mfu_guess: float = 0.15
    peak_tflops: float = 989.4
    startup_s: float = 20.0  # torch, CUDA context: spent before the first row


SMOKE_COSTS = CostModel(model_build_s=0.3, triton_config_s=0.0, autotune_config_s=0.0,
                        inductor_train_s=0.0, inductor_sample_s=0.0, attention_row_s=0.2,
                        host_ms_per_step=50.0, mfu_guess=0.5, peak_tflops=0.05, startup_s=3.0)


@dataclass
class Row:
    """One row: `run()` returns its record's measurements; `estimate_s` its expected cost
    apart from compiling our kernels' `families` (each compiled once per process, costing
    `family_configs[family]` configs); `needs_cuda`: skipped on the CPU."""

    id: str
    group: int
    kind: str  # train | attention | sampling
    run: Callable[[], dict[str, Any]]
    estimate_s: float
    families: dict[str, int] = field(default_factory=dict)
    needs_cuda: bool = False


def _kernel_configs(training: bool) -> dict[str, int]:
    """Autotuning configs our kernels compile per pass, for one dtype and mode: the
    forward's, and for training the backward's dQ and dK/dV configs (uvic_kernels.tiles,
    16-bit tile lists)."""
    from uvic_kernels import tiles

    configs = {"fwd": len(tiles.GPU_FWD_TILES)}
    if training:
        configs["bwd"] = len(tiles.GPU_BWD_DQ_TILES) + len(tiles.GPU_BWD_DKDV_TILES)
    return configs


def _families(modes: tuple[str, ...], dtype: str, head_dim: int,
              training: bool) -> dict[str, int]:
    """Our kernels' (dtype, head dim, mode, pass) families a row compiles (each its own
    compiled kernels: the head dim sets BLOCK_D): configs of each."""
    return {f"{dtype} d{head_dim} {mode} {kind}": n for mode in modes
            for kind, n in _kernel_configs(training).items()}


def _head_dim(cfg: Any) -> int:
    return cfg.model.embed_dim // cfg.model.num_heads


def _modes(model: str, backend: str) -> tuple[str, ...]:
    """The attention modes a model runs through our kernels (none through another backend)."""
    if backend != "triton":
        return ()
    return ("softmax",) if model == "uvit" else ("softmax", "cog")


def _step_s(flops: float, costs: CostModel) -> float:
    """Guessed seconds of one step of `flops` model FLOPs."""
    return flops / (costs.mfu_guess * costs.peak_tflops * 1e12) + costs.host_ms_per_step / 1e3


def train_rows(env: argparse.Namespace, costs: CostModel) -> list[Row]:
    """Groups 1 and 2, then group 5's U-ViT-H/2 rows."""
    from uvic.experiments.speed import SMOKE_BATCH, TRAIN_SMOKE_SIZE, Cell, run_cell, smoke_model

    specs = [(g + 1, d, f"{d}_{m}", m, b, mode, batch, False)
             for g, (d, batch) in enumerate(TRAIN) for mode in TRAIN_MODES
             for m, b in (("uvit", "triton"), ("uvit", "sdpa"), ("uvic", "triton"))]
    dataset, preset, batch = HUGE
    specs += [(5, dataset, preset, "uvit", "triton", "off", batch, ckpt) for ckpt in (False, True)]
    rows = []
    for group, dataset, preset, model, backend, mode, batch, ckpt in specs:
        on_gpu_backend = backend if env.cuda else ("torch" if backend == "triton" else backend)
        cell = Cell(dataset, preset, model, on_gpu_backend, mode,
                    batch if env.cuda else SMOKE_BATCH, ckpt)
        cfg = load_config(preset_path(preset))
        cfg = cfg if env.cuda else smoke_model(cfg, TRAIN_SMOKE_SIZE)
        steps = env.steps + env.warmup + (3 if env.cuda else 0)  # + the profiled steps
        cost = (costs.model_build_s + steps * _step_s(training_flops(cfg.model) * cell.batch,
                                                        costs)
                + (costs.inductor_train_s if mode != "off" else 0.0))
        families = _families(_modes(model, on_gpu_backend), "bf16", _head_dim(cfg),
                             training=True)
        cost += sum(n * costs.autotune_config_s for n in families.values())
        name = "ours" if backend == "triton" else backend
        rid = f"train {dataset} {model} {name} {mode}" + (" ckpt" if ckpt else "")

        def run(cell: Cell = cell, name: str = name) -> dict[str, Any]:
            record = run_cell(cell, env.steps, env.warmup, env.device, env.peak,
                              profile=env.cuda)
            return {**record, "impl": name}

        rows.append(Row(rid, group, "train", run, cost, families, needs_cuda=mode != "off"))
    return rows


def attention_rows(env: argparse.Namespace, costs: CostModel, group: int,
                   shapes: tuple[tuple[int, int, int, int], ...]) -> list[Row]:
    """The attention alone (bf16 on a GPU): each shape x method, plain and graphed."""
    from uvic_kernels.bench_cells import bench_cell, methods

    rows = []
    for shape in shapes:
        run_shape = shape if env.cuda else (1, 2, SMOKE_N[shape[2]], 32)
        for method in ATTENTION_METHODS:
            name = method if env.cuda else ON_CPU.get(method, method)
            families = (_families((method.split()[0],), "bf16", shape[3], training=True)
                        if "ours" in method else {})
            cost = costs.attention_row_s + sum(n * costs.autotune_config_s
                                               for n in families.values())

            def run(name: str = name, shape: tuple[int, ...] = run_shape) -> dict[str, Any]:
                import torch

                fn = methods(env.device)[name]
                dtype = torch.bfloat16 if env.cuda else torch.float32
                return bench_cell(name, fn, shape, dtype, env.device, cuda_graphs=True)

            rows.append(Row(f"attention N={shape[2]} {method}", group, "attention", run, cost,
                            families, needs_cuda=method not in ON_CPU))
    return rows


def sampling_rows(env: argparse.Namespace, costs: CostModel) -> list[Row]:
    """Group 4: the solvers' network call, eager and graphed, images / s per evaluation."""
    from uvic.config.sampling import effective_cfg_scale, passes_per_eval
    from uvic.experiments.speed import SAMPLING_SMOKE_SIZE, SMOKE_BATCH, bench_network, smoke_model

    rows = []
    for dataset, images in SAMPLING:
        for model in SAMPLING_MODELS:
            backend = "triton" if env.cuda else "torch"
            cfg = load_config(preset_path(f"{dataset}_{model}"))
            cfg.model.attention_backend = backend
            cfg = cfg if env.cuda else smoke_model(cfg, SAMPLING_SMOKE_SIZE)
            n = images if env.cuda else SMOKE_BATCH
            nets = n * passes_per_eval(effective_cfg_scale(cfg) != 0, autoguided=False)
            for mode in TRAIN_MODES:
                calls = 3 + env.iters * env.repeats + 1  # warm-up, timed, peak memory
                cost = (costs.model_build_s + calls * _step_s(forward_flops(cfg.model) * nets,
                                                              costs)
                        + (costs.inductor_sample_s if mode != "off" else 0.0))
                families = _families(_modes(model, backend), "bf16", _head_dim(cfg),
                                     training=False)

                def run(cfg: Any = cfg, n: int = n, mode: str = mode,
                        dataset: str = dataset, model: str = model) -> dict[str, Any]:
                    return {"dataset": dataset, "model": model,
                            "backend": cfg.model.attention_backend, "compile": mode,
                            "precision": env.precision,
                            **bench_network(cfg, n, mode, env.precision, env.iters,
                                            env.repeats, env.device)}

                rid = f"sampling {dataset} {model} {'eager' if mode == 'off' else mode}"
                rows.append(Row(rid, 4, "sampling", run, cost, families,
                                needs_cuda=mode != "off"))
    return rows


def cost_model(peak: float | None, smoke: bool) -> CostModel:
    """The smoke's costs on the CPU; on a GPU the H100's, at the device's own peak."""
    return SMOKE_COSTS if smoke else CostModel(**({"peak_tflops": peak} if peak else {}))


def plan(device: torch.device, peak: float | None, costs: CostModel) -> list[Row]:
    """Every row, in the order of value (groups 1 to 5); on a CPU device, the smoke's."""
    cuda = device.type == "cuda"
    env = argparse.Namespace(device=device, peak=peak, cuda=cuda,
                             steps=10 if cuda else 1, warmup=3 if cuda else 1,
                             iters=10 if cuda else 1, repeats=3 if cuda else 1,
                             precision="bf16" if cuda else "fp32")
    train = train_rows(env, costs)
    rows = (train[:12] + attention_rows(env, costs, 3, U_VIT_SHAPES) + sampling_rows(env, costs)
            + train[12:] + attention_rows(env, costs, 5, LONG_SHAPES))
    return sorted(rows, key=lambda r: r.group)  # stable: the order within a group stays
