"""The metrics `uvic-fid` reports beside FID (`eval.metrics`, docs/evaluation.md): FD-DINOv2
(`uvic.evaluation.dinov2`) and precision/recall (`uvic.evaluation.precision_recall`).

`MetricsPlan.check` checks every input (weights, reference images, reference features)
before sampling; DINOv2 reference statistics are cached under a fingerprint of the images,
the encoder and the preprocessing. With eval.metrics = ("fid",), the default, nothing here
runs.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from uvic.config import Config
from uvic.evaluation import dinov2
from uvic.evaluation import fingerprint as fp
from uvic.evaluation.precision_recall import precision_recall
from uvic.evaluation.reference import (
    ReferenceImages,
    ReferenceStats,
    ReferenceStatsMissing,
    reference_images,
    stats_plan,
)
from uvic.evaluation.statistics import (
    extractor_tag,
    feature_statistics,
    frechet_distance,
    list_images,
)
from uvic.files import atomic_write

if TYPE_CHECKING:
    from accelerate import PartialState


@dataclass
class MetricsPlan:
    """The metrics beside FID one evaluation computes, checked before sampling."""

    cfg: Config
    stats_dir: Path
    features: str = "inception"  # FID's extractor (tag), for precision/recall
    encoder: dinov2.DINOv2Encoder | None = None
    weights: Path | None = None
    images: ReferenceImages | None = None
    extra: tuple[str, ...] = field(default=())
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @classmethod
    def check(cls, cfg: Config, stats_dir: Path, feat_extractor: Callable | None,
              allow_download: bool, state: PartialState | None = None) -> MetricsPlan:
        """What eval.metrics asks beyond FID, with its inputs checked (one line each on a
        missing file); the main process of `state` (None: this one) builds the DINOv2
        encoder too."""
        load = state is None or state.is_main_process
        ev = cfg.eval
        plan = cls(cfg, stats_dir, extractor_tag(feat_extractor),
                   extra=tuple(m for m in ev.metrics if m != "fid"))
        if state is not None:
            plan.device = state.device
        if plan.needs_dinov2:
            if load or not allow_download:  # one process downloads: the main one
                plan.weights = dinov2.resolve_weights(ev.dinov2_path, allow_download)
            plan.images = reference_images(cfg, stats_dir)
            if plan.images is None:
                raise ReferenceStatsMissing(
                    "FD-DINOv2 and DINOv2 precision/recall need reference images: set "
                    "eval.ref_images to a folder of them (or data.root to a local copy)")
            plan.images.check()
            if load:
                plan.encoder = dinov2.DINOv2Encoder(plan.weights)
        if "precision_recall" in plan.extra and ev.pr_features == "inception":
            _check_reference_features(cfg, feat_extractor, stats_dir, allow_download)
        return plan

    @property
    def needs_dinov2(self) -> bool:
        return "fd_dinov2" in self.extra or (
            "precision_recall" in self.extra and self.cfg.eval.pr_features == "dinov2")

    def add_to(self, result: dict[str, Any], job: Any, feats: np.ndarray,
               ref: ReferenceStats, batch_size: int, workers: int,
               progress: bool) -> None:
        """Compute the metrics on the `result["n"]` samples in `job.samples_dir` (FID's
        `feats` and reference `ref` for Inception precision/recall) and record them in
        `result` (main process, on the device of `check`'s state)."""
        if not self.extra:
            return
        samples_dir, device = job.samples_dir, self.device
        t0 = time.perf_counter()
        records: dict[str, Any] = {}
        files = [samples_dir / f"{i:06d}.png" for i in range(result["n"])]
        if self.needs_dinov2:
            assert self.encoder is not None, "the main process builds the encoder in check"
            real = self._dinov2_reference(device, batch_size, workers, progress)
            fake = dinov2.files_features(files, self.encoder, device=device,
                                         batch_size=batch_size, num_workers=workers,
                                         description="DINOv2 samples", progress=progress)
            fake = fake.astype(np.float32).astype(np.float64)  # as the cached reference
        if "fd_dinov2" in self.extra:
            mu, sigma = feature_statistics(fake)
            result["fd_dinov2"] = frechet_distance(mu, sigma, real.mu, real.sigma)
            records["fd_dinov2"] = {**self._encoder_record(), "reference": real.source,
                                    "reference_digest": real.digest}
        if "precision_recall" in self.extra:
            on_dinov2 = self.cfg.eval.pr_features == "dinov2"
            reals, fakes = (real.feats, fake) if on_dinov2 else (ref.feats, feats)
            records["precision_recall"] = self._precision_recall(
                result, reals, fakes, self.cfg.sample.seed, device,
                self._encoder_record() if on_dinov2 else {"features": self.features})
        result["protocol"]["metrics"] = records
        result["wall_time_s"]["metrics"] = time.perf_counter() - t0

    def _encoder_record(self) -> dict[str, Any]:
        assert self.encoder is not None
        return {"features": self.encoder.identity["name"],
                "weights": self.encoder.identity["weights"], "weights_file": str(self.weights),
                "preprocessing": dinov2.PROTOCOL}

    def _precision_recall(self, result: dict[str, Any], reals: np.ndarray | None,
                          fakes: np.ndarray, seed: int, device: torch.device,
                          features: dict[str, Any]) -> dict[str, Any]:
        ev = self.cfg.eval
        if reals is None:  # checked before sampling; a file may change since
            raise ReferenceStatsMissing("precision/recall: the reference statistics hold no "
                                        "features; set eval.ref_images to build them")
        n_ref = min(len(reals), ev.pr_n_ref or len(fakes))
        if n_ref < len(reals):  # a seeded subset, in the reference's order
            pick = np.random.default_rng([seed, 3]).choice(len(reals), n_ref, replace=False)
            reals = reals[np.sort(pick)]
        k = ev.pr_k
        if min(len(reals), len(fakes)) <= k:
            raise ValueError(f"precision/recall with eval.pr_k={k} needs more than {k} "
                             f"samples and reference images, got {len(fakes)} and {len(reals)}")
        precision, recall = precision_recall(reals, fakes, k, device=device)
        result["precision"], result["recall"] = precision, recall
        return {**features, "k": k, "n_ref": n_ref, "n_samples": len(fakes),
                "distance": "euclidean, float64"}

    def _dinov2_reference(self, device: torch.device, batch_size: int, workers: int,
                          progress: bool) -> ReferenceStats:
        """DINOv2 statistics and features of the reference images, from the cache while
        its fingerprint matches, else built and cached."""
        assert self.encoder is not None and self.images is not None
        res = self.cfg.eval.ref_res
        identity = {k: self.encoder.identity[k] for k in ("name", "weights")}
        fingerprint = {"version": fp.VERSION, "source": self.images.source(),
                       "mode": dinov2.PROTOCOL, "features": identity, "res": res}
        path = self.stats_dir / (f"{self.images.key}_dinov2-{identity['weights'][:8]}"
                                 f"_{res}.npz")
        reason = fp.stale(path, fingerprint) if path.is_file() else "none yet"
        if not reason:
            with np.load(path) as data:
                return ReferenceStats(data["mu"], data["sigma"],
                                      data["feats"].astype(np.float64),
                                      f"{data['source']} ({path})", fp.digest(fingerprint))
        if path.is_file():
            print(f"rebuilding the DINOv2 reference statistics {path}: {reason}",
                  file=sys.stderr)
        folder = self.images.prepare()
        files = list_images(folder)
        if len(files) < 2:
            raise ReferenceStatsMissing(f"reference images {folder}: found {len(files)} images")
        feats = dinov2.files_features(files, self.encoder, crop=res, device=device,
                                      batch_size=batch_size, num_workers=workers,
                                      description=f"DINOv2 reference {folder.name}",
                                      progress=progress).astype(np.float32)
        mu, sigma = feature_statistics(feats)
        source = f"{self.images.description}, {len(files)} images, {identity['name']}"
        with atomic_write(path, suffix=".npz") as tmp:
            np.savez_compressed(tmp, mu=mu, sigma=sigma, feats=feats, source=np.array(source),
                                fingerprint=fp.encode(fingerprint))
        return ReferenceStats(mu, sigma, feats.astype(np.float64), f"{source} ({path})",
                              fp.digest(fingerprint))


def _check_reference_features(cfg: Config, feat_extractor: Callable | None, stats_dir: Path,
                              allow_download: bool) -> None:
    """Inception precision/recall needs the reference's features, not only mu and sigma:
    a statistics file without `feats` (nor a `<stem>_kid.npz` beside it) is refused."""
    plan = stats_plan(cfg, cfg.eval.mode, feat_extractor, stats_dir, allow_download)
    if plan.kind != "file":  # built from images, or downloaded with clean-fid's _kid file
        return
    kid = plan.path.with_name(f"{plan.path.stem}_kid.npz")
    with np.load(plan.path) as data:
        if {"feats", "arr_0"} & set(data.files) or kid.is_file():
            return
    raise ReferenceStatsMissing(
        f"precision/recall needs the reference's features, and {plan.path} holds only mu "
        f"and sigma: set eval.ref_images to the reference images (or put {kid.name} beside "
        "it, or use eval.pr_features=dinov2)")


def summary_line(result: dict[str, Any]) -> str:
    """The metrics beside FID in one line ("" when there are none)."""
    records = (result.get("protocol") or {}).get("metrics") or {}
    parts = []
    if "fd_dinov2" in result:
        parts.append(f"FD-DINOv2 {result['fd_dinov2']:.3f} "
                     f"({records.get('fd_dinov2', {}).get('features', 'dinov2')})")
    if "precision" in result:
        pr = records.get("precision_recall", {})
        parts.append(f"precision {result['precision']:.4f}  recall {result['recall']:.4f} "
                     f"(k={pr.get('k')}, {pr.get('features')} features, "
                     f"{pr.get('n_ref')} reference images)")
    return "  ".join(parts)
