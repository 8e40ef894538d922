"""How fast a training step and a sampler's network call run: the timed cells that
`uvic-bench-train`, `uvic-bench-sampling` and `uvic-gpu-check` share (random weights:
speed does not depend on them), and their tiny CPU smoke settings."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from uvic.config import Config, load_config
from uvic.experiments.profile import profile_step
from uvic.experiments.progress import make_batch, synthetic_loss
from uvic.experiments.records import error_line, peak_memory_mib, peak_mib, reset_peak_memory
from uvic.models.flops import num_tokens, training_flops
from uvic.presets import preset_path

if TYPE_CHECKING:
    import torch

# The CPU smoke runs: a tiny model of each preset (`smoke_model`) on inputs of these sizes,
# SMOKE_BATCH images a step or call.
TRAIN_SMOKE_SIZE, SAMPLING_SMOKE_SIZE = 8, 4
SMOKE_BATCH = 2
# Dense bf16 peak (TFLOP/s, no sparsity) by device name, first match: NVIDIA's data sheets.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("A100", 312.0))


def smoke_model(cfg: Config, img_size: int) -> Config:
    """`cfg` with the CPU smoke runs' network: width 32, 2 blocks, 2 heads, on inputs of
    `img_size`."""
    return replace(cfg, model=replace(cfg.model, embed_dim=32, depth=2, num_heads=2,
                                      img_size=img_size))


@dataclass
class Cell:
    """One row: what is timed."""

    dataset: str
    preset: str
    model: str  # uvit | uvic
    backend: str
    compile: str
    batch: int
    grad_checkpointing: bool = False


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of the device named `device_name`; None for one not in the table."""
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in device_name), None)


def mfu(flops_per_image: int, images_per_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak (None: no peak known)."""
    return None if peak is None else flops_per_image * images_per_s / (peak * 1e12)


def train_step(cfg: Config, cell: Cell, device: torch.device) -> Callable[[], None]:
    """The trainer's step for the cell: its model (compiled as `train.compile`), AdamW, EMA."""
    import torch

    from uvic.models.uvit import build_model
    from uvic.training.compile import dynamo_kwargs
    from uvic.training.ema import EMA
    from uvic.training.optim import make_optimizer

    torch.manual_seed(0)
    model = build_model(cfg.model).to(device).train()
    ema = EMA(model, cfg.train.ema_decay).to(device)
    optimizer, _ = make_optimizer(model, cfg.optim, cfg.train.max_steps)
    if cell.compile != "off":
        torch._dynamo.reset()  # each cell compiles afresh: no recompile limit across cells
        model = torch.compile(model, **dynamo_kwargs(cell.compile)["dynamo_plugin"].to_kwargs())
    loss_of = synthetic_loss(cfg, model, make_batch(cfg.model, cell.batch, device), device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_of()
        loss.backward()
        optimizer.step()
        ema.update(model)

    return step


def time_cell(step: Callable[[], None], device: torch.device, steps: int,
              warmup: int) -> tuple[float, float | None]:
    """Mean ms per call of `step` over `steps` calls after `warmup` (CUDA-synchronised),
    and the peak memory allocated while timing (CUDA only), in MiB."""
    for _ in range(warmup):  # compilation, autotuning, CUDA-graph recording, allocator
        step()
    reset_peak_memory(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    peak = peak_memory_mib(device)  # CUDA: once the steps are done
    return (time.perf_counter() - start) / steps * 1e3, peak


def run_cell(cell: Cell, steps: int, warmup: int, device: torch.device,
             peak: float | None, profile: bool = False) -> dict[str, Any]:
    """One row's record: the cell, its tokens and model FLOPs, and its timings (or the
    status "OOM", or "error" with the message); with `profile`, where the step's time goes
    (`uvic.experiments.profile`)."""
    import torch

    cuda = device.type == "cuda"
    cfg = load_config(preset_path(cell.preset))
    cfg.model.attention_backend = cell.backend
    cfg.model.grad_checkpointing = cell.grad_checkpointing
    cfg = cfg if cuda else smoke_model(cfg, TRAIN_SMOKE_SIZE)
    flops = training_flops(cfg.model)
    record: dict[str, Any] = {**asdict(cell), "tokens": num_tokens(cfg.model),
                              "train_flops_per_image": flops, "ms_per_step": None,
                              "images_per_s": None, "mfu": None, "peak_mib": None}
    try:
        step = train_step(cfg, cell, device)
        ms, peak_mib = time_cell(step, device, steps, warmup)
        images_per_s = cell.batch / ms * 1e3
        record.update(status="ok", ms_per_step=ms, images_per_s=images_per_s,
                      mfu=mfu(flops, images_per_s, peak), peak_mib=peak_mib)
        if profile:
            try:  # a profiler failure keeps the timing
                record["profile"] = profile_step(step, device)
            except Exception as err:
                record["profile_error"] = error_line(err)
    except torch.cuda.OutOfMemoryError:
        record["status"] = "OOM"
    except Exception as err:  # a compile or kernel failure: said, and the next cell runs
        record.update(status="error", error=error_line(err))
    finally:
        if cuda:
            torch.cuda.empty_cache()
    return record


def sd_vae(smoke: bool = False) -> torch.nn.Module:
    """Stable Diffusion's KL-f8 autoencoder architecture, random weights (timing only);
    `smoke`: the same layout with 32 channels a level."""
    from diffusers import AutoencoderKL

    widths = (32,) * 4 if smoke else (128, 256, 512, 512)
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, sample_size=256,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=widths, layers_per_block=1 if smoke else 2,
    )


def time_ms(fn: Callable[[], object], device: torch.device, iters: int, repeats: int) -> float:
    """Median over `repeats` of the mean wall time of `iters` calls of fn(), in ms
    (CUDA-synchronised)."""
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    means = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        means.append((time.perf_counter() - start) / iters * 1e3)
    return statistics.median(means)


def bench_network(cfg: Config, images: int, compile_mode: str, precision: str, iters: int,
                  repeats: int, device: torch.device) -> dict[str, Any]:
    """Time one network call of the solvers for `images` images (2x the rows when
    guided) with the network compiled as `compile_mode`, under `precision`'s autocast:
    the median over `repeats` of the mean of `iters` calls."""
    import torch

    from uvic.config.sampling import effective_cfg_scale, passes_per_eval
    from uvic.models.uvit import build_model
    from uvic.sampling.compiled import compile_network
    from uvic.sampling.generate import autocast, class_conditions, guided_eps

    torch.manual_seed(0)
    model = build_model(cfg.model).to(device).eval()
    torch._dynamo.reset()  # each cell compiles afresh: never dynamo's recompile limit
    net = compile_network(model, compile_mode)
    m, scale = cfg.model, effective_cfg_scale(cfg)
    x = torch.randn(images, m.in_chans, m.img_size, m.img_size, device=device)
    t = torch.full((images,), 500.0, device=device)
    cond: dict[str, Any] = {}
    if m.clip_dim > 0:
        cond = {"context": torch.randn(images, m.num_clip_token, m.clip_dim, device=device),
                "uncond_context": torch.randn(m.num_clip_token, m.clip_dim, device=device)}
    cond.update(class_conditions(cfg, range(images), device))  # {} without class labels

    def call() -> None:
        with torch.inference_mode(), autocast(device, precision):
            guided_eps(net, x, t, cfg_scale=scale, **cond)

    start = time.perf_counter()
    for _ in range(3):  # warm-up: compilation, CUDA-graph recording, autotuning, allocator
        call()
    warmup_s = time.perf_counter() - start
    ms = time_ms(call, device, iters, repeats)
    rows = images * passes_per_eval(scale != 0, autoguided=False)  # guided_eps: no guide
    return {"batch": rows, "images_per_batch": images, "guidance": scale, "ms_per_eval": ms,
            "images_per_s_per_eval": rows / ms * 1e3, "peak_mib": peak_mib(call, device),
            "warmup_s": warmup_s}


def bench_decode(batch: int, latent: int, precision: str, repeats: int,
                 device: torch.device, smoke: bool) -> float:
    """Images per second of VAE decoding (batches of `batch` latents 4 x latent x latent)."""
    import torch

    from uvic.sampling.generate import autocast

    vae = sd_vae(smoke).to(device).eval()
    z = torch.randn(batch, 4, latent, latent, device=device)

    def run() -> None:
        with torch.inference_mode(), autocast(device, precision):
            vae.decode(z)

    run()
    return batch / time_ms(run, device, 1, repeats) * 1e3
