"""FID / KID of a checkpoint with clean-fid: generate N samples, extract features, compare.

Protocol (the U-ViT release's, see `uvic.evaluation.protocols` and docs/conventions.md): CIFAR-10,
50,000 unconditional samples (Euler-Maruyama, 1000 steps) against the CIFAR-10 train set
(clean-fid's named statistics `cifar10`/train/32, or statistics built from a local CIFAR-10
copy); MS-COCO 256, 30,000 samples whose captions are drawn from the val split, the
release's DPM-Solver "fast" 50 steps with guidance `eps = c + 1.0 (c - u)`, against val2014
at 256x256 (center crop, resize). `evaluate` does all of it and writes a result JSON; every
result names its protocol (`uvic.evaluation.protocols.protocol_of`), and `eval/fid_table.py` turns a
folder of results into the paper's Table 3. Inception features and reference statistics
come from `uvic.evaluation.statistics`. eval.features=projection swaps Inception for a download-free
stand-in (reference statistics built with it from local images): the pipeline runs end to
end offline, and every result and table says its number is not comparable with FID.

Frechet distance: our own float64 implementation. clean-fid 0.1.35 computes it with
`scipy.linalg.sqrtm(..., disp=False)`, and SciPy 1.18 removed `disp`, so
`cleanfid.fid.compute_fid` / `frechet_distance` fail there. We never call them.

The model is the architecture the checkpoint was trained with (`uvic.run.folder.
resolve_model`: its stored model config; the config's for a released nnet_ema.pth, or with
`ModelChoice(from_config=True)`); the result (its `model`, `attention` and `config`) and
the sample folder's settings describe that model, not the given config's `model.*`.

Samples are PNG files `{index:06d}.png`. Sample i is seeded by (seed, i) (see
`uvic.sampling.noise.SampleGenerator`), so a run can be interrupted and resumed (samples on disk
are kept) and split over any number of processes (Accelerate) with identical results.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata as md
import json
import os
import platform
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from cleanfid.fid import kernel_distance as cleanfid_kid
from scipy import linalg

from uvic.config import Config, to_dict
from uvic.data.datasets import MSCOCOFeatures, build_dataset
from uvic.diffusion.schedule import Diffusion
from uvic.evaluation.protocols import SAMPLES_META, protocol_of
from uvic.evaluation.statistics import InceptionWeightsMissing as InceptionWeightsMissing
from uvic.evaluation.statistics import ReferenceStatsMissing as ReferenceStatsMissing
from uvic.evaluation.statistics import (
    build_inception,
    check_inception,
    default_stats_dir,
    extractor_tag,
    feature_statistics,
    files_features,
    reference_statistics,
    stand_in_features,
    stats_plan,
)
from uvic.run.files import write_json
from uvic.run.folder import ModelChoice, checkpoint_step, resolve_model
from uvic.run.weights import file_sha256
from uvic.sampling.generate import (
    SamplingAssets,
    build_loaded,
    distributed_state,
    effective_cfg_scale,
    generate,
    is_latent,
    load_guide,
)
from uvic.sampling.images import save_images
from uvic.validation import validate

SAMPLE_NAME = re.compile(r"^(\d+)\.png$")
VAE_FACTOR = 8  # the Stable Diffusion KL-f8 autoencoder: 32x32 latents -> 256x256 pixels
PROTOCOL_N = {"cifar10": 50_000, "mscoco": 30_000}  # the paper's sample counts


# --------------------------------------------------------------------------- distances


def frechet_distance(
    mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray
) -> float:
    """||mu1 - mu2||^2 + Tr(S1 + S2 - 2 (S1 S2)^(1/2)), in float64.

    Tr((S1 S2)^(1/2)) is the sum of the square roots of the eigenvalues of S1 S2, which
    are those of the symmetric PSD matrix S1^(1/2) S2 S1^(1/2): two `eigh` calls, no
    complex arithmetic, and no `scipy.linalg.sqrtm(disp=...)` (removed in SciPy 1.18).
    """
    mu1 = np.atleast_1d(np.asarray(mu1, dtype=np.float64))
    mu2 = np.atleast_1d(np.asarray(mu2, dtype=np.float64))
    s1 = np.atleast_2d(np.asarray(sigma1, dtype=np.float64))
    s2 = np.atleast_2d(np.asarray(sigma2, dtype=np.float64))
    if mu1.shape != mu2.shape or s1.shape != s2.shape or s1.shape != (mu1.size, mu1.size):
        raise ValueError(f"FID statistics do not match: mu {mu1.shape} vs {mu2.shape}, "
                         f"sigma {s1.shape} vs {s2.shape}")
    w, v = linalg.eigh((s1 + s1.T) / 2)
    s1_half = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    m = s1_half @ s2 @ s1_half
    tr_covmean = np.sqrt(np.clip(linalg.eigvalsh((m + m.T) / 2), 0, None)).sum()
    diff = mu1 - mu2
    return float(diff @ diff + np.trace(s1) + np.trace(s2) - 2.0 * tr_covmean)


def kernel_distance(feats1: np.ndarray, feats2: np.ndarray, seed: int = 0) -> float:
    """KID with clean-fid's estimator (100 subsets of up to 1000), seeded: clean-fid draws
    the subsets from NumPy's global RNG, which we seed and then restore."""
    state = np.random.get_state()
    try:
        np.random.seed(seed)
        return float(cleanfid_kid(np.asarray(feats1, np.float64), np.asarray(feats2, np.float64)))
    finally:
        np.random.set_state(state)


# --------------------------------------------------------------------------- samples on disk


def existing_samples(folder: str | Path) -> set[int]:
    """Indices of the samples already in `folder` (files named `{index:06d}.png`)."""
    folder = Path(folder)
    if not folder.is_dir():
        return set()
    return {int(m.group(1)) for p in folder.iterdir() if (m := SAMPLE_NAME.match(p.name))}


def _samples_meta(cfg: Config, ckpt_sha: str, seed: int, precision: str) -> dict[str, Any]:
    """What determines the images: a resumed run must match it exactly."""
    s = cfg.sample
    return {
        "checkpoint_sha256": ckpt_sha, "seed": seed, "precision": precision,
        "model": to_dict(cfg)["model"], "diffusion": to_dict(cfg)["diffusion"],
        "scheduler": s.scheduler, "steps": s.steps, "order": s.order,
        "scheduler_kwargs": s.scheduler_kwargs,
        "cfg_scale": effective_cfg_scale(cfg), "data": cfg.data.name,
        "captions": cfg.eval.captions if cfg.model.clip_dim > 0 else "",
    }


def _check_samples_meta(folder: Path, meta: dict[str, Any], write: bool) -> None:
    path = folder / SAMPLES_META
    if path.is_file():
        old = json.loads(path.read_text())
        for key, value in meta.items():
            if old.get(key) != value:
                raise ValueError(
                    f"{folder} holds samples made with other settings ({key}: "
                    f"{old.get(key)!r} != {value!r}); use another --samples-dir or empty it"
                )
    elif write:
        if existing_samples(folder):
            raise ValueError(f"{folder} holds samples but no {SAMPLES_META}; "
                             "use another --samples-dir or empty it")
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(meta, indent=2) + "\n")


# --------------------------------------------------------------------------- text contexts


def caption_context_fn(cfg: Config, seed: int) -> Callable[[list[int]], torch.Tensor]:
    """Contexts for text-to-image FID: sample i gets a caption of a random val image (image
    and caption drawn with a generator seeded by (seed, i), so it does not depend on
    batching). eval.captions is a split folder of the feature layout (`<root>/val`)."""
    if cfg.eval.captions:
        folder = Path(cfg.eval.captions)
        dataset = MSCOCOFeatures(folder.parent, folder.name, scale_factor=cfg.data.scale_factor)
    else:
        dataset = build_dataset(cfg, "val")

    def context_fn(indices: list[int]) -> torch.Tensor:
        rows = []
        for i in indices:
            rng = np.random.default_rng([seed, int(i), 1])  # 1: the caption stream
            contexts = dataset.contexts(int(rng.integers(len(dataset))))
            rows.append(contexts[int(rng.integers(len(contexts)))])
        return torch.stack(rows)

    return context_fn


# --------------------------------------------------------------------------- evaluation


def model_label(cfg: Config) -> str:
    """Row label of a result: U-ViT / U-ViC for the presets, else the attention spec."""
    return {"uvit": "U-ViT", "uvic": "U-ViC"}.get(cfg.model.attention.strip().lower(),
                                                 cfg.model.attention)


def versions() -> dict[str, str]:
    """Versions of the libraries that determine a result."""
    out = {"python": platform.python_version()}
    for dist in ("torch", "diffusers", "clean-fid", "numpy", "scipy", "pillow", "accelerate",
                 "uvic"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[dist] = md.version(dist)
    return out


def evaluate(
    cfg: Config,
    ckpt_path: str | Path,
    n: int | None = None,
    out_json: str | Path | None = None,
    samples_dir: str | Path | None = None,
    feat_extractor: Callable | None = None,
    *,
    config_path: str | Path | None = None,
    seed: int = 0,
    precision: str = "fp32",
    stats_dir: str | Path | None = None,
    allow_download: bool = False,
    feature_batch_size: int = 64,
    num_workers: int | None = None,
    progress: bool = True,
    choice: ModelChoice | None = None,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Generate `n` samples of the checkpoint (resumable), compute FID and KID, write JSON.

    Sampler settings come from cfg.sample, the protocol from cfg.eval (mode, reference).
    Runs on every process of an `accelerate launch` (each samples its share); the main
    process then extracts features and returns the result (other processes return {}).
    `feat_extractor` replaces Inception (tests): a callable mapping (B, 3, 299, 299) images
    in [0, 255] to features (B, F); without it, cfg.eval.features picks Inception or the
    download-free `ProjectionFeatures` stand-in (results labelled not comparable with FID).
    Raises InceptionWeightsMissing / InceptionWeightsCorrupt / ReferenceStatsMissing (from
    `uvic.evaluation.statistics`) before sampling anything: the Inception network is loaded first.
    The model is built as `resolve_model(cfg, ckpt_path, choice)` says (the checkpoint's
    own architecture); `say` (main process) gets a one-line note stating it.
    """
    t_start = time.perf_counter()
    validate(cfg)
    if feat_extractor is None:
        feat_extractor = stand_in_features(cfg)  # None: Inception
    state = distributed_state()
    mode = cfg.eval.mode
    n = int(n if n is not None else cfg.eval.n_samples)
    if n < 2:
        raise ValueError(f"FID needs at least 2 samples, got n={n}")
    ckpt_path = Path(ckpt_path)
    if not ckpt_path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {ckpt_path}")
    resolved = resolve_model(cfg, ckpt_path, choice)
    say = say if state.is_main_process else None
    if say is not None:
        say(resolved.note)
    cfg = dataclasses.replace(cfg, model=resolved.model)  # what the samples come from
    stem = f"{cfg.name}_{ckpt_path.parent.name}_{ckpt_path.stem}"
    out_json = Path(out_json) if out_json is not None else Path("runs/fid") / f"{stem}.json"
    samples_dir = (Path(samples_dir) if samples_dir is not None
                   else out_json.with_name(f"{out_json.stem}_samples"))
    stats_dir = Path(stats_dir) if stats_dir is not None else default_stats_dir()
    workers = num_workers if num_workers is not None else min(8, os.cpu_count() or 1)

    # Fail fast (before hours of sampling) on a wrong resolution, missing Inception
    # weights or missing statistics.
    res = cfg.model.img_size * (VAE_FACTOR if is_latent(cfg) else 1)
    if cfg.eval.ref_res != res:
        raise ValueError(f"eval.ref_res={cfg.eval.ref_res} but the samples are {res}x{res} "
                         "pixels; the reference must have the samples' resolution")
    if feat_extractor is None and not allow_download:
        check_inception(cfg, mode)
    stats_plan(cfg, mode, feat_extractor, stats_dir, allow_download)
    # Load the Inception network now, not after sampling: a corrupt weights file must
    # stop the evaluation before hours of sampling (InceptionWeightsCorrupt).
    extractor = feat_extractor
    if extractor is None and (state.is_main_process or not allow_download):
        extractor = build_inception(cfg, mode, state.device, allow_download)

    ckpt_sha = file_sha256(ckpt_path)
    meta = _samples_meta(cfg, ckpt_sha, seed, precision)
    if state.is_main_process:
        _check_samples_meta(samples_dir, meta, write=True)
    state.wait_for_everyone()
    _check_samples_meta(samples_dir, meta, write=False)

    # Sampling: each process takes every num_processes-th missing index.
    done = existing_samples(samples_dir)
    todo = [i for i in range(n) if i not in done]
    mine = todo[state.process_index :: state.num_processes]
    t0 = time.perf_counter()
    if mine:
        device = state.device
        model = build_loaded(cfg.model, ckpt_path, device)
        guide = load_guide(cfg, ckpt_path, device, choice, say=say)
        diffusion = Diffusion(cfg.diffusion)
        assets = SamplingAssets.from_config(cfg, device)
        context_fn = caption_context_fn(cfg, seed) if cfg.model.clip_dim > 0 else None
        for indices, images in generate(
            model, diffusion, cfg, mine, seed=seed, context_fn=context_fn,
            uncond_context=assets.uncond, vae=assets.vae, device=device, precision=precision,
            progress=progress and state.is_main_process, guide=guide,
        ):
            save_images(images, samples_dir, indices)
        del model, guide, assets
    t_sampling = time.perf_counter() - t0
    state.wait_for_everyone()
    if not state.is_main_process:
        return {}

    # Features and distances (main process).
    missing = [i for i in range(n) if i not in existing_samples(samples_dir)]
    if missing:
        raise RuntimeError(f"{samples_dir}: samples {missing[:5]} missing after generation")
    t0 = time.perf_counter()
    device = state.device
    ref = reference_statistics(
        cfg, feat_extractor, mode=mode, device=device, stats_dir=stats_dir,
        allow_download=allow_download, batch_size=feature_batch_size, num_workers=workers,
        progress=progress,
    )
    files = [samples_dir / f"{i:06d}.png" for i in range(n)]
    feats = files_features(files, extractor, mode=mode, device=device,
                           batch_size=feature_batch_size, num_workers=workers,
                           description=f"samples {samples_dir.name}", progress=progress)
    mu, sigma = feature_statistics(feats)
    fid = frechet_distance(mu, sigma, ref.mu, ref.sigma)
    kid = kernel_distance(ref.feats, feats, seed=seed) if ref.feats is not None else None
    t_features = time.perf_counter() - t0

    result = {
        "name": cfg.name,
        "model": model_label(cfg),
        "attention": cfg.model.attention,
        "model_source": resolved.source,
        "dataset": cfg.data.name,
        "config_path": str(config_path) if config_path is not None else None,
        "checkpoint": str(ckpt_path),
        "checkpoint_sha256": ckpt_sha,
        "step": checkpoint_step(ckpt_path),
        "protocol": protocol_of(cfg, n, extractor_tag(feat_extractor)).as_dict(),
        "sampler": {"scheduler": cfg.sample.scheduler, "steps": cfg.sample.steps,
                    "order": cfg.sample.order, "scheduler_kwargs": cfg.sample.scheduler_kwargs,
                    "precision": precision, "seed": seed},
        "guidance": effective_cfg_scale(cfg),
        "n": n,
        "fid": fid,
        "kid": kid,
        "mode": mode,
        "feature_extractor": extractor_tag(feat_extractor),
        "reference": ref.source,
        "samples_dir": str(samples_dir),
        "result_json": str(out_json),
        "generated": len(todo),
        "reused": n - len(todo),
        "wall_time_s": {"total": time.perf_counter() - t_start, "sampling": t_sampling,
                        "features": t_features},
        "device": _device_name(device),
        "num_processes": state.num_processes,
        "versions": versions(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": to_dict(cfg),
    }
    write_json(out_json, result)
    return result


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return f"{device.type}: {platform.processor() or platform.machine()}"


