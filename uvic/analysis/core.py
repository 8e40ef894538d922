"""Attention analysis of one or more U-ViT / U-ViC models on the same noised inputs.

`analyze` noises a fixed set of images to a few levels of the training schedule, runs every
model on exactly those inputs with `BlockRecorder` hooks, and returns a JSON-ready dict
(`RESULT_SCHEMA` below, checked by `check_result`); `load_models` and `load_inputs` build
models and inputs from a config and checkpoint files, for the command line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from uvic.analysis.capture import HEAD_METRICS, BlockRecorder, TokenLayout, token_layout
from uvic.analysis.metrics import sink_share
from uvic.config import Config, DiffusionConfig
from uvic.diffusion.flow import NET_TIME_SCALE, Interpolant
from uvic.diffusion.schedule import Diffusion
from uvic.run.architecture import ModelChoice, resolve_model
from uvic.sampling.load import load_model

SCHEMA_VERSION = 2

# RESULT_SCHEMA (version 2); L levels, h heads, Q query patches, P = rows * cols patches:
#     schema_version: 2
#     config_name: str, num_images: int, seed: int, sink_threshold: float
#     noise_levels: [{"timestep": int, "net_time": float, "alpha_bar": float}] * L
#     layout: {"num_tokens", "num_extras", "time_index", "text": [start, stop] | null,
#              "grid": [rows, cols]}
#     queries: [[row, col]] * Q  (query patches of the maps)
#     background: [rows_px][cols_px][3] floats in [0, 1] (image 0, drawn under the maps)
#     metrics: the names in HEAD_METRICS
#     models: {label: {"attention_modes": [str], "num_heads": h,
#         "sink_share": [L] (over the heads of all blocks), "blocks": [{
#         "index": int, "name": "in_blocks.0" | "mid_block" | "out_blocks.0", "mode": str,
#         "heads": {metric: [L][h]}, "mean": {metric: [L]} (over heads),
#         "sink_share": [L], "collapse": [L], "maps": [L][Q][P],
#         "massive_ratio": [L], "massive_ratio_std": [L],
#         "massive_tokens": [L][{"index": int, "kind": str, "images": int}]}]}}
# Head metrics average over the images and the patch-token queries (the rows that make
# the predicted noise); "maps" are rows of image 0, averaged over heads, on patch keys.
# "massive_*" (`uvic.analysis.massive`): the largest token's hidden-state norm over the
# mean of the others after the block, mean and spread over the images, and which tokens
# are the largest (kind: label, time, text or patch), in how many images.


def spread_timesteps(num_levels: int, num_train_timesteps: int) -> list[int]:
    """`num_levels` discrete timesteps at the centres of equal parts of the schedule.

    5 levels of a 1000-step schedule: [99, 299, 499, 699, 899] (low to high noise).
    """
    if not 1 <= num_levels <= num_train_timesteps:
        raise ValueError(f"num_levels must be in [1, {num_train_timesteps}] (the schedule's "
                         f"timesteps), got {num_levels}")
    return [round((i + 0.5) * num_train_timesteps / num_levels) - 1 for i in range(num_levels)]


def default_queries(grid: tuple[int, int]) -> list[tuple[int, int]]:
    """Three query patches on the diagonal: a quarter, the centre, three quarters."""
    rows, cols = grid
    picks = [(rows // 4, cols // 4), (rows // 2, cols // 2), ((3 * rows) // 4, (3 * cols) // 4)]
    return list(dict.fromkeys(picks))


def block_names(model: nn.Module) -> list[str]:
    """Names of `model.blocks()` in order: in_blocks.i, mid_block, out_blocks.i."""
    half = len(model.in_blocks)
    return ([f"in_blocks.{i}" for i in range(half)] + ["mid_block"]
            + [f"out_blocks.{i}" for i in range(len(model.out_blocks))])


def background_image(x0: Tensor) -> list:
    """Image (C, H, W) -> (H, W, 3) floats in [0, 1]: RGB pixels from [-1, 1], or the
    channel mean of a latent, rescaled to [0, 1] (latents are not decoded)."""
    x = x0.detach().float().cpu()
    if x.shape[0] == 3:
        rgb = ((x + 1) / 2).clamp(0, 1)
    else:
        grey = x.mean(dim=0)
        grey = (grey - grey.min()) / (grey.max() - grey.min()).clamp_min(1e-8)
        rgb = grey.expand(3, -1, -1)
    return rgb.permute(1, 2, 0).tolist()


def noised_inputs(diffusion: DiffusionConfig, images: Tensor, timesteps: list[int],
                  seed: int) -> list[tuple[Tensor, Tensor, dict]]:
    """Per level: (x_t (B, C, H, W), network time (B,), level record), fixed noise.

    Timestep k is the schedule's grid point; a velocity model (`diffusion.objective`) is
    noised by its interpolant at t = (k + 1) / T, its "alpha_bar" the VP value of the same
    signal-to-noise ratio, alpha^2 / (alpha^2 + sigma^2)."""
    schedule = Diffusion(diffusion)
    alpha_bars = schedule.alphas_cumprod()
    velocity = diffusion.objective == "velocity"
    generator = torch.Generator().manual_seed(seed)
    levels = []
    for k in timesteps:
        if not 0 <= k < schedule.num_timesteps:
            raise ValueError(f"timestep {k} is outside [0, {schedule.num_timesteps})")
        noise = torch.randn(images.shape, generator=generator, dtype=torch.float32)
        if velocity:
            t = torch.tensor((k + 1) / schedule.num_timesteps, dtype=torch.float64)
            a, s = (float(c) for c in Interpolant(diffusion.interpolant).coefficients(t)[:2])
            ab = a * a / (a * a + s * s)
            net_t = torch.full((images.shape[0],), NET_TIME_SCALE * float(t))
        else:
            ab = float(alpha_bars[k])
            a, s = ab**0.5, (1 - ab) ** 0.5
            net_t = schedule.net_time(torch.full((images.shape[0],), k))
        x_t = a * images.float().cpu() + s * noise
        levels.append((x_t, net_t, {"timestep": k, "net_time": float(net_t[0]),
                                    "alpha_bar": ab}))
    return levels


@torch.no_grad()
def _record_levels(model: nn.Module, levels: list, layout: TokenLayout,
                   queries: list[tuple[int, int]], contexts: Tensor | None,
                   labels: Tensor | None, batch_size: int) -> list[list[dict]]:
    """Run `model` (in eval mode) on every level's inputs: [level][block] of recorder means."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    per_level = []
    try:
        with BlockRecorder(model, layout, queries) as recorder:
            for x_t, net_t, _ in levels:
                recorder.reset()
                for start in range(0, x_t.shape[0], batch_size):
                    part = slice(start, start + batch_size)
                    recorder.batch_start = start
                    model(x_t[part].to(device), net_t[part].to(device),
                          context=None if contexts is None else contexts[part].to(device),
                          y=None if labels is None else labels[part].to(device),
                          return_dict=False)
                per_level.append(recorder.means())
    finally:
        model.train(was_training)
    return per_level


def _analyze_model(model: nn.Module, levels: list, layout: TokenLayout,
                   queries: list[tuple[int, int]], contexts: Tensor | None,
                   labels: Tensor | None, batch_size: int, threshold: float) -> dict:
    """One model's entry of the result (RESULT_SCHEMA above)."""
    per_level = _record_levels(model, levels, layout, queries, contexts, labels, batch_size)
    blocks = []
    for i, (name, blk) in enumerate(zip(block_names(model), model.blocks())):
        levels_i = [level[i] for level in per_level]
        heads = {m: [lv["heads"][m] for lv in levels_i] for m in HEAD_METRICS}
        blocks.append({
            "index": i, "name": name, "mode": blk.attn.mode, "heads": heads,
            "mean": {m: [sum(v) / len(v) for v in values] for m, values in heads.items()},
            "sink_share": [sink_share(torch.tensor(v), threshold)
                           for v in heads["first_token_weight"]],
            "collapse": [lv["collapse"] for lv in levels_i],
            "maps": [lv["map"].tolist() for lv in levels_i],
            **{f"massive_{key}": [lv["massive"][key] for lv in levels_i]
               for key in ("ratio", "ratio_std", "tokens")},
        })
    all_heads = [[w for blk in blocks for w in blk["heads"]["first_token_weight"][level]]
                 for level in range(len(levels))]
    return {"attention_modes": [blk.attn.mode for blk in model.blocks()],
            "num_heads": model.blocks()[0].attn.num_heads,
            "sink_share": [sink_share(torch.tensor(w), threshold) for w in all_heads],
            "blocks": blocks}


def analyze(
    models: dict[str, nn.Module], cfg: Config, images: Tensor, contexts: Tensor | None = None,
    labels: Tensor | None = None, timesteps: list[int] | None = None, num_levels: int = 5,
    queries: list[tuple[int, int]] | None = None, batch_size: int = 16, seed: int = 0,
    sink_threshold: float = 0.3,
) -> dict:
    """Attention metrics of every model, block, head and noise level (RESULT_SCHEMA above).

    images (B, C, H, W): clean images in [-1, 1] or scaled latents; contexts
    (B, tokens, clip_dim) for text-conditional models; labels (B,) for class-conditional
    ones. All models must share the token layout of `cfg.model` (they may differ in
    their attention modes). Timesteps default to `spread_timesteps(num_levels, T)`.
    """
    if not models:
        raise ValueError("analyze needs at least one model")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    layouts = {label: token_layout(model) for label, model in models.items()}
    layout = next(iter(layouts.values()))
    for label, other in layouts.items():
        if other != layout:
            raise ValueError(f"model {label!r} has token layout {other} but another has {layout}")
    queries = [tuple(q) for q in (queries or default_queries(layout.grid))]
    for r, c in queries:
        if not (0 <= r < layout.grid[0] and 0 <= c < layout.grid[1]):
            raise ValueError(f"query patch ({r}, {c}) is outside the {layout.grid} patch grid")
    timesteps = timesteps or spread_timesteps(num_levels, cfg.diffusion.num_train_timesteps)
    levels = noised_inputs(cfg.diffusion, images, timesteps, seed)
    return {
        "schema_version": SCHEMA_VERSION, "config_name": cfg.name,
        "num_images": int(images.shape[0]), "seed": seed, "sink_threshold": sink_threshold,
        "noise_levels": [record for _, _, record in levels], "layout": layout.to_dict(),
        "queries": [list(q) for q in queries], "background": background_image(images[0]),
        "metrics": list(HEAD_METRICS),
        "models": {label: _analyze_model(model, levels, layout, queries, contexts, labels,
                                         batch_size, sink_threshold)
                   for label, model in models.items()},
    }


def check_result(result: dict) -> None:
    """Raise ValueError naming the first key of `result` that breaks RESULT_SCHEMA (above)."""
    try:
        _check_result(result)
    except (KeyError, IndexError, TypeError) as err:
        raise ValueError(f"analysis result is malformed: missing or bad entry {err}") from err


def _check_result(result: dict) -> None:
    top = ("schema_version", "config_name", "num_images", "seed", "sink_threshold",
           "noise_levels", "layout", "queries", "background", "metrics", "models")
    for key in top:
        if key not in result:
            raise ValueError(f"analysis result lacks key {key!r}")
    levels, queries = len(result["noise_levels"]), len(result["queries"])
    rows, cols = result["layout"]["grid"]
    for label, entry in result["models"].items():
        heads = entry["num_heads"]
        if len(entry["sink_share"]) != levels:
            raise ValueError(f"models.{label}.sink_share has not {levels} levels")
        if len(entry["blocks"]) != len(entry["attention_modes"]):
            raise ValueError(f"models.{label}: {len(entry['blocks'])} blocks but "
                             f"{len(entry['attention_modes'])} attention modes")
        for blk in entry["blocks"]:
            where = f"models.{label}.blocks[{blk['index']}]"
            for metric in result["metrics"]:
                values = blk["heads"][metric]
                if len(values) != levels or any(len(v) != heads for v in values):
                    raise ValueError(f"{where}.heads.{metric} is not [{levels}][{heads}]")
                if len(blk["mean"][metric]) != levels:
                    raise ValueError(f"{where}.mean.{metric} has not {levels} levels")
            for key in ("sink_share", "collapse", "massive_ratio", "massive_ratio_std",
                        "massive_tokens"):
                if len(blk[key]) != levels:
                    raise ValueError(f"{where}.{key} has not {levels} levels")
            shape = (levels, queries, rows * cols)
            maps = blk["maps"]
            if (len(maps), len(maps[0]), len(maps[0][0])) != shape:
                raise ValueError(f"{where}.maps is not {list(shape)}")


# --------------------------------------------------------------------------- loading


def load_models(cfg: Config, checkpoints: dict[str, str | Path],
                attention: dict[str, str] | None = None,
                device: str | torch.device = "cpu", choice: ModelChoice | None = None,
                say: Callable[[str], None] | None = None) -> dict[str, nn.Module]:
    """Build and load one model per checkpoint (`uvic.sampling.load.load_model`: strict,
    eval mode).

    Each model is the architecture its checkpoint was trained with
    (`uvic.run.architecture.resolve_model`: the model config stored in the file or its run's
    `config.json`; `cfg.model` for a file that records none, such as a released
    `nnet_ema.pth`, or with `choice.from_config`); `attention[label]` then runs it under
    another attention pattern, as asked. `say` gets one note per checkpoint.
    """
    models = {}
    for label, path in checkpoints.items():
        resolved = resolve_model(cfg, path, choice)
        model_cfg, note = resolved.model, resolved.note
        if (attention or {}).get(label):
            model_cfg = dataclasses.replace(model_cfg, attention=attention[label])
            note += f"; run with attention {attention[label]} as asked"
        if say is not None:
            say(f"{label}: {note}")
        models[label] = load_model(model_cfg, path, device)
    return models


def checkpoints_config(cfg: Config, checkpoints: dict[str, str | Path],
                       choice: ModelChoice | None = None) -> Config:
    """`cfg` with the diffusion settings the checkpoints were trained under (stored with
    them, `resolve_model`), which the noise levels follow; checkpoints trained under
    different ones are refused (the models see the same noised inputs)."""
    schedules = {label: resolve_model(cfg, path, choice).applied(cfg).diffusion
                 for label, path in checkpoints.items()}
    (first, diffusion), *others = schedules.items()
    for label, other in others:
        if other != diffusion:
            raise ValueError(f"checkpoints {first!r} and {label!r} were trained under different "
                             f"diffusion settings ({diffusion} vs {other}); analyze them apart")
    return dataclasses.replace(cfg, diffusion=diffusion)


def load_inputs(cfg: Config, num_images: int, split: str = "test",
                seed: int = 0) -> tuple[Tensor, Tensor | None]:
    """The first `num_images` items of the config's dataset: images (B, C, H, W) and,
    for text-to-image data, contexts (B, 77, clip_dim). MS-COCO items draw a latent and
    a caption at random; the torch RNG is seeded with `seed` so the draw is fixed."""
    from uvic.data.datasets import build_dataset  # here: it imports torchvision, only needed here

    if num_images < 1:
        raise ValueError(f"num_images must be >= 1, got {num_images}")
    dataset = build_dataset(cfg, split)
    if len(dataset) < num_images:
        raise ValueError(f"data.name={cfg.data.name!r} split {split!r} has {len(dataset)} "
                         f"items, fewer than the {num_images} asked for")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        items = [dataset[i] for i in range(num_images)]
    images = torch.stack([item["x"] for item in items])
    contexts = torch.stack([item["context"] for item in items]) if "context" in items[0] else None
    return images, contexts
