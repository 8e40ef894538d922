"""FID / KID of a checkpoint with clean-fid (`evaluate`): generate N samples, extract their
features, compare them with reference statistics, and write a result JSON that names its
protocol (the U-ViT release's protocols: `uvic.evaluation.protocols`, docs/evaluation.md).

Sample i is the PNG `{i:06d}.png`, seeded by (seed, i): a run resumes where it stopped and
splits over any number of processes (Accelerate) with identical results.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import json
import os
import platform
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from uvic.config import Config, ModelConfig, to_dict
from uvic.config.sampling import check_guidance, effective_cfg_scale, fid_label_draw
from uvic.config.validation import validate
from uvic.data.datasets import MSCOCOFeatures, build_dataset
from uvic.evaluation.metrics import MetricsPlan
from uvic.evaluation.protocols import SAMPLES_META, protocol_of
from uvic.evaluation.reference import (
    ReferenceStats,
    default_stats_dir,
    reference_statistics,
    stats_plan,
)
from uvic.evaluation.reference import ReferenceStatsInvalid as ReferenceStatsInvalid
from uvic.evaluation.reference import ReferenceStatsMissing as ReferenceStatsMissing
from uvic.evaluation.statistics import InceptionWeightsMissing as InceptionWeightsMissing
from uvic.evaluation.statistics import (
    build_inception,
    check_inception,
    extractor_tag,
    feature_statistics,
    files_features,
    frechet_distance,
    kernel_distance,
    stand_in_features,
)
from uvic.files import write_json
from uvic.run.architecture import ModelChoice, ResolvedModel, resolve_model
from uvic.run.folder import checkpoint_step
from uvic.run.weights import file_sha256
from uvic.sampling.assets import is_latent
from uvic.sampling.generate import distributed_state, sample_checkpoint
from uvic.sampling.images import save_images
from uvic.sampling.labels import FIDLabels, fid_labels

if TYPE_CHECKING:
    from accelerate import PartialState

SAMPLE_NAME = re.compile(r"^(\d+)\.png$")
VAE_FACTOR = 8  # the Stable Diffusion KL-f8 autoencoder: 32x32 latents -> 256x256 pixels
PROTOCOL_N = {"cifar10": 50_000, "mscoco": 30_000}  # the paper's sample counts


# --------------------------------------------------------------------------- samples on disk


def existing_samples(folder: str | Path) -> set[int]:
    """Indices of the samples already in `folder` (files named `{index:06d}.png`)."""
    folder = Path(folder)
    if not folder.is_dir():
        return set()
    return {int(m.group(1)) for p in folder.iterdir() if (m := SAMPLE_NAME.match(p.name))}


def _samples_meta(cfg: Config, ckpt_sha: str, seed: int, precision: str,
                  labels: FIDLabels | None) -> dict[str, Any]:
    """What determines the images: a resumed run must match it exactly (the class labels'
    draw only for class-conditional models, so older folders of the others still match)."""
    s = cfg.sample
    return {
        "checkpoint_sha256": ckpt_sha, "seed": seed, "precision": precision,
        "model": to_dict(cfg)["model"], "diffusion": to_dict(cfg)["diffusion"],
        "scheduler": s.scheduler, "steps": s.steps, "order": s.order,
        "scheduler_kwargs": s.scheduler_kwargs,
        "cfg_scale": effective_cfg_scale(cfg), "data": cfg.data.name,
        "captions": cfg.eval.captions if cfg.model.clip_dim > 0 else "",
        **({"labels": labels.record(fid_label_draw(cfg))} if labels is not None else {}),
        **protocol_of(cfg).sampling_record(),  # older folders: interval [], no autoguidance
    }


def _check_samples_meta(folder: Path, meta: dict[str, Any], write: bool) -> None:
    path = folder / SAMPLES_META
    if path.is_file():
        old = {"guidance_interval": [], **json.loads(path.read_text())}
        for key in dict.fromkeys([*meta, "autoguidance", "guide"]):  # those two: if set
            if old.get(key) != meta.get(key):
                raise ValueError(
                    f"{folder} holds samples made with other settings ({key}: "
                    f"{old.get(key)!r} != {meta.get(key)!r}); use another --samples-dir or "
                    "empty it")
    elif write:
        if existing_samples(folder):
            raise ValueError(f"{folder} holds samples but no {SAMPLES_META}; "
                             "use another --samples-dir or empty it")
        write_json(path, meta)


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


def model_label(model: ModelConfig) -> str:
    """Row label of a result: U-ViT / U-ViC for the presets, else the attention spec."""
    return {"uvit": "U-ViT", "uvic": "U-ViC"}.get(model.attention.strip().lower(),
                                                 model.attention)


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
    out_json: str | Path | None = None,
    samples_dir: str | Path | None = None,
    feat_extractor: Callable | None = None,
    *,
    config_path: str | Path | None = None,
    stats_dir: str | Path | None = None,
    allow_download: bool = False,
    feature_batch_size: int = 64,
    num_workers: int | None = None,
    progress: bool = True,
    choice: ModelChoice | None = None,
    say: Callable[[str], None] | None = None,
    guidance_option: str | None = None,
) -> dict[str, Any]:
    """Generate eval.n_samples samples of the checkpoint (resumable), compute FID and KID,
    write JSON.

    Sampler settings (seed and precision too) come from cfg.sample, the protocol from
    cfg.eval (samples, mode, reference).
    Runs on every process of an `accelerate launch` (each samples its share); the main
    process then extracts features and returns the result (other processes return {}).
    `feat_extractor` replaces Inception (tests): a callable mapping (B, 3, 299, 299) images
    in [0, 255] to features (B, F); without it, cfg.eval.features picks Inception or the
    download-free `ProjectionFeatures` stand-in (results labelled not comparable with FID).
    Raises InceptionWeightsMissing / InceptionWeightsCorrupt / ReferenceStatsMissing (from
    `uvic.evaluation.statistics`) before sampling anything: the Inception network is loaded first.
    The model is built as `resolve_model(cfg, ckpt_path, choice)` says (the checkpoint's
    own architecture); `say` (main process) gets a one-line note stating it.
    `guidance_option` (a command line's guidance scale): refused if unguided (`check_guidance`).
    """
    t_start = time.perf_counter()
    validate(cfg)
    if feat_extractor is None:
        feat_extractor = stand_in_features(cfg.eval)  # None: Inception
    state = distributed_state()
    say = say if state.is_main_process else None
    job = _job(cfg, ckpt_path, out_json, samples_dir, stats_dir, choice, say)
    check_guidance(job.cfg, guidance_option)
    extractor = _check_protocol(job, feat_extractor, allow_download, state)
    ckpt_sha = file_sha256(job.ckpt)
    generated, t_sampling = _generate(job, ckpt_sha, progress, choice, say,
                                      state)
    state.wait_for_everyone()
    if not state.is_main_process:
        return {}

    t0 = time.perf_counter()
    workers = num_workers if num_workers is not None else min(8, os.cpu_count() or 1)
    ref, feats = _features(job, feat_extractor, extractor, allow_download, feature_batch_size,
                           workers, progress, state.device)
    fid = frechet_distance(*feature_statistics(feats), ref.mu, ref.sigma)
    kid = kernel_distance(ref.feats, feats, seed=cfg.sample.seed) if ref.feats is not None else None
    times = {"total": time.perf_counter() - t_start, "sampling": t_sampling,
             "features": time.perf_counter() - t0}
    result = {
        **_describe(job, ckpt_sha, config_path, extractor_tag(feat_extractor)),
        "n": job.n,
        "fid": fid,
        "kid": kid,
        "mode": job.cfg.eval.mode,
        "feature_extractor": extractor_tag(feat_extractor),
        "reference": ref.source, "reference_digest": ref.digest,  # see fingerprint.digest
        "samples_dir": str(job.samples_dir),
        "result_json": str(job.out_json),
        "generated": generated,
        "reused": job.n - generated,
        "wall_time_s": times,
        "device": _device_name(state.device),
        "num_processes": state.num_processes,
        "versions": versions(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": to_dict(job.cfg),
    }
    job.metrics.add_to(result, job, feats, ref, feature_batch_size, workers, progress)
    write_json(job.out_json, result)
    return result


@dataclass
class _Job:
    """One evaluation: the config with the checkpoint's model, the checkpoint, where its
    samples, result and reference statistics go."""

    cfg: Config
    ckpt: Path
    resolved: ResolvedModel
    n: int
    out_json: Path
    samples_dir: Path
    stats_dir: Path
    metrics: MetricsPlan | None = None  # eval.metrics beside FID, set by _check_protocol


def _job(cfg: Config, ckpt_path: str | Path, out_json: str | Path | None,
         samples_dir: str | Path | None, stats_dir: str | Path | None,
         choice: ModelChoice | None, say: Callable[[str], None] | None) -> _Job:
    """What `evaluate` was asked, with its defaults, and the checkpoint's architecture
    (`say` gets its note)."""
    n = cfg.eval.n_samples
    if n < 2:
        raise ValueError(f"eval.n_samples={n}: FID needs at least 2 samples")
    ckpt_path = Path(ckpt_path)
    if not ckpt_path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {ckpt_path}")
    resolved = resolve_model(cfg, ckpt_path, choice)
    if say is not None:
        say(resolved.note)
    cfg = resolved.applied(cfg)  # what the samples come from: its model and schedule
    stem = f"{cfg.name}_{ckpt_path.parent.name}_{ckpt_path.stem}"
    out_json = Path(out_json) if out_json is not None else Path("runs/fid") / f"{stem}.json"
    samples_dir = (Path(samples_dir) if samples_dir is not None
                   else out_json.with_name(f"{out_json.stem}_samples"))
    stats_dir = Path(stats_dir) if stats_dir is not None else default_stats_dir()
    return _Job(cfg, ckpt_path, resolved, n, out_json, samples_dir, stats_dir)


def _check_protocol(job: _Job, feat_extractor: Callable | None, allow_download: bool,
                    state: PartialState) -> Callable | None:
    """Fail fast (before hours of sampling) on a wrong resolution, missing Inception
    weights or missing statistics; the feature extractor to score the samples with."""
    cfg, mode = job.cfg, job.cfg.eval.mode
    res = cfg.model.img_size * (VAE_FACTOR if is_latent(cfg.data) else 1)
    if cfg.eval.ref_res != res:
        raise ValueError(f"eval.ref_res={cfg.eval.ref_res} but the samples are {res}x{res} "
                         "pixels; the reference must have the samples' resolution")
    if feat_extractor is None and not allow_download:
        check_inception(cfg.eval, mode)
    stats_plan(cfg, mode, feat_extractor, job.stats_dir, allow_download)
    job.metrics = MetricsPlan.check(cfg, job.stats_dir, feat_extractor, allow_download, state)
    # Load the Inception network now, not after sampling: a corrupt weights file must
    # stop the evaluation before hours of sampling (InceptionWeightsCorrupt).
    extractor = feat_extractor
    if extractor is None and (state.is_main_process or not allow_download):
        extractor = build_inception(cfg.eval, mode, state.device, allow_download)
    return extractor


def _generate(job: _Job, ckpt_sha: str, progress: bool, choice: ModelChoice | None,
              say: Callable[[str], None] | None, state: PartialState) -> tuple[int, float]:
    """Sample what the sample folder lacks (each process every num_processes-th missing
    index) after checking that its samples were made with the same settings; returns the
    number of samples that were missing (made by all processes) and the sampling time."""
    seed, precision = job.cfg.sample.seed, job.cfg.sample.precision
    labels = fid_labels(job.cfg, seed)  # class-conditional models
    meta = _samples_meta(job.cfg, ckpt_sha, seed, precision, labels)
    if state.is_main_process:
        _check_samples_meta(job.samples_dir, meta, write=True)
    state.wait_for_everyone()
    _check_samples_meta(job.samples_dir, meta, write=False)
    done = existing_samples(job.samples_dir)
    todo = [i for i in range(job.n) if i not in done]
    mine = todo[state.process_index :: state.num_processes]
    t0 = time.perf_counter()
    if mine:
        cfg = job.cfg
        context_fn = caption_context_fn(cfg, seed) if cfg.model.clip_dim > 0 else None
        for indices, images in sample_checkpoint(
            cfg, job.ckpt, mine, seed=seed, device=state.device, precision=precision,
            context_fn=context_fn, progress=progress and state.is_main_process,
            choice=choice, say=say, label_fn=labels,
        ):
            save_images(images, job.samples_dir, indices)
    return len(todo), time.perf_counter() - t0


def _features(job: _Job, feat_extractor: Callable | None, extractor: Callable | None,
              allow_download: bool, batch_size: int, workers: int, progress: bool,
              device: torch.device) -> tuple[ReferenceStats, np.ndarray]:
    """The reference statistics and the features of the samples (main process)."""
    missing = [i for i in range(job.n) if i not in existing_samples(job.samples_dir)]
    if missing:
        raise RuntimeError(f"{job.samples_dir}: samples {missing[:5]} missing after generation")
    mode = job.cfg.eval.mode
    ref = reference_statistics(
        job.cfg, feat_extractor, mode=mode, device=device, stats_dir=job.stats_dir,
        allow_download=allow_download, batch_size=batch_size, num_workers=workers,
        progress=progress,
    )
    files = [job.samples_dir / f"{i:06d}.png" for i in range(job.n)]
    feats = files_features(files, extractor, mode=mode, device=device,
                           batch_size=batch_size, num_workers=workers,
                           description=f"samples {job.samples_dir.name}", progress=progress)
    return ref, feats


def _describe(job: _Job, ckpt_sha: str, config_path: str | Path | None,
              features: str) -> dict[str, Any]:
    """The result's account of what was evaluated: model, data, checkpoint, protocol,
    sampler."""
    cfg = job.cfg
    return {
        "name": cfg.name,
        "model": model_label(cfg.model),
        "attention": cfg.model.attention,
        "model_source": job.resolved.source,
        "dataset": cfg.data.name,
        "config_path": str(config_path) if config_path is not None else None,
        "checkpoint": str(job.ckpt),
        "checkpoint_sha256": ckpt_sha,
        "step": checkpoint_step(job.ckpt),
        "protocol": protocol_of(cfg, job.n, features).as_dict(),
        "sampler": {"scheduler": cfg.sample.scheduler, "steps": cfg.sample.steps,
                    "order": cfg.sample.order, "scheduler_kwargs": cfg.sample.scheduler_kwargs,
                    "precision": cfg.sample.precision, "seed": cfg.sample.seed},
        "guidance": effective_cfg_scale(cfg),
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return f"{device.type}: {platform.processor() or platform.machine()}"


