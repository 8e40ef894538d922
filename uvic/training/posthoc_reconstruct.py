"""Post-hoc EMA reconstruction (EDM2): the weights of a power-function EMA of any length
sigma_rel, built after training from the snapshots a run saved (`uvic.training.posthoc_ema`),
as a checkpoint folder that samples, evaluates and exports like any other.

    uvic-posthoc-ema runs/cifar10_uvic --sigma-rel 0.08 --out runs/cifar10_uvic/phema_0.080

The coefficients are the least-squares fit of the requested profile by the snapshots'
profiles (`solve_coefficients`); docs/training.md, "Post-hoc EMA", has the details.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from uvic.config.training import check_sigma_rel
from uvic.files import write_json
from uvic.run.folder import RunFolder
from uvic.run.prepare import read_run_config, save_run_config
from uvic.run.weights import nonfinite_entry, nonfinite_message, save_safetensors
from uvic.training.posthoc_ema import POSTHOC_METADATA_KEY, sigma_to_gamma, solve_coefficients

REPORT = "posthoc_ema.json"


class PosthocError(ValueError):
    """A reconstruction cannot be made: the message names the folder, file or value."""


@dataclass(frozen=True)
class Snapshot:
    """One saved profile: its file, step, sigma_rel and exponent gamma."""

    path: Path
    step: int
    sigma_rel: float
    gamma: float


@dataclass
class Reconstruction:
    """What `reconstruct` built: the request, the snapshots and their coefficients, the
    fit (relative L2 distance of the profiles) and the file written. The fit bounds the
    weights' error: |error| <= fit * ||p|| * ||theta - mean theta|| (Cauchy-Schwarz)."""

    sigma_rel: float
    gamma: float
    step: int
    snapshots: list[Snapshot]
    coefficients: list[float]
    fit: float
    weights: Path

    def describe(self) -> str:
        """One line on the reconstruction and its fit."""
        stds = ", ".join(f"{s:g}" for s in sorted({s.sigma_rel for s in self.snapshots}))
        steps = sorted({s.step for s in self.snapshots})
        return (f"post-hoc EMA sigma_rel {self.sigma_rel:g} (gamma {self.gamma:.2f}) at step "
                f"{self.step} from {len(self.snapshots)} snapshots (sigma_rel {stds}; steps "
                f"{steps[0]}-{steps[-1]}): profile fit error {100 * self.fit:.3g}% (relative "
                f"L2), sum |coefficients| {sum(abs(c) for c in self.coefficients):.3g}")


def read_snapshots(run_dir: str | Path) -> list[Snapshot]:
    """The snapshots of the run folder `run_dir`, oldest first (their step, sigma_rel and
    gamma from each file's metadata). A missing folder, no snapshot or a file without the
    metadata is a PosthocError naming it."""
    run = RunFolder(Path(run_dir))
    if not run.root.is_dir():
        raise PosthocError(f"run folder not found: {run.root}")
    files = sorted(run.posthoc_ema.glob("*.safetensors")) if run.posthoc_ema.is_dir() else []
    if not files:
        raise PosthocError(f"no post-hoc EMA snapshots in {run.posthoc_ema} (train with "
                           "--set train.posthoc_ema_stds=[0.05,0.1] to save them)")
    found = []
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                record = json.loads((f.metadata() or {})[POSTHOC_METADATA_KEY])
            found.append(Snapshot(path, int(record["step"]), float(record["sigma_rel"]),
                                  float(record["gamma"])))
        except (SafetensorError, OSError, KeyError, TypeError, ValueError) as err:
            raise PosthocError(f"{path}: not a post-hoc EMA snapshot ({type(err).__name__}: "
                               f"{err})") from err
    return sorted(found, key=lambda s: (s.step, s.sigma_rel))


def reconstruct(run_dir: str | Path, sigma_rel: float, out: str | Path,
                step: int | None = None,
                say: Callable[[str], None] | None = None) -> Reconstruction:
    """Write the weights of the power-function EMA `sigma_rel` at `step` (a step with
    snapshots; default the newest) of the run `run_dir` into the new (or empty) folder
    `out`, from the snapshots up to that step (summed in float64), with the run's config.json
    (a relative sample.autoguidance_ckpt made absolute); bad input is a PosthocError or
    ConfigError naming it."""
    check_sigma_rel(sigma_rel, f"--sigma-rel {sigma_rel}")
    run, out = RunFolder(Path(run_dir)), Path(out)
    snapshots = read_snapshots(run.root)
    steps = sorted({s.step for s in snapshots})
    step = steps[-1] if step is None else step
    if step not in steps:
        raise PosthocError(f"--step {step}: no snapshots at that step in {run.posthoc_ema} "
                           f"(steps {_listing(steps)})")
    if not run.config.is_file():
        raise PosthocError(f"{run.config} not found: the reconstruction needs the run's config")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PosthocError(f"--out {out}: exists and is not an empty folder")
    used = [s for s in snapshots if s.step <= step]
    gamma = sigma_to_gamma(sigma_rel)
    coefficients, fit = solve_coefficients(np.array([s.step for s in used]),
                                           np.array([s.gamma for s in used]), step, gamma)
    state, metadata = combine(used, coefficients)
    result = Reconstruction(sigma_rel, gamma, step, used, [float(c) for c in coefficients],
                            fit, out / RunFolder.EMA)
    record = {"step": step, "sigma_rel": sigma_rel, "gamma": gamma, "fit": fit,
              "snapshots": len(used)}
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(state, result.weights,
                     metadata={**metadata, POSTHOC_METADATA_KEY: json.dumps(record)})
    cfg, resumes = read_run_config(run.config)
    guide = Path(cfg.sample.autoguidance_ckpt)
    if cfg.sample.autoguidance_ckpt and not guide.is_absolute():  # a file of the run
        cfg = dataclasses.replace(cfg, sample=dataclasses.replace(
            cfg.sample, autoguidance_ckpt=str((run.root / guide).resolve())))
    save_run_config(cfg, out / RunFolder.CONFIG, resumes)
    write_json(out / REPORT, {**record, "run": str(run.root.resolve()), "coefficients": [
        {"file": s.path.name, "step": s.step, "sigma_rel": s.sigma_rel, "coefficient": c}
        for s, c in zip(used, result.coefficients)]})
    if say is not None:
        say(result.describe())
    return result


def combine(snapshots: list[Snapshot], coefficients: np.ndarray
            ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """sum_i c_i snapshot_i, accumulated in float64 and stored in each tensor's dtype
    (a non-floating tensor is the newest snapshot's); and the newest snapshot's metadata
    but its own post-hoc record. Snapshots that hold different tensors are refused."""
    total: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for snapshot, c in zip(snapshots, coefficients):
        state = load_file(str(snapshot.path), device="cpu")
        dtypes = {k: v.dtype for k, v in state.items()}
        bad = nonfinite_entry(state)
        if bad is not None:
            raise PosthocError(f"{snapshot.path}: {nonfinite_message(bad)}")
        if total and (state.keys() != total.keys() or any(
                state[k].shape != total[k].shape for k in total)):
            raise PosthocError(f"{snapshot.path}: holds other tensors than "
                               f"{snapshots[0].path.name} (snapshots of different models)")
        for key, value in state.items():
            if not value.is_floating_point():
                total[key] = value
            elif key in total:
                total[key] += float(c) * value.double()
            else:
                total[key] = float(c) * value.double()
    newest = snapshots[-1].path
    with safe_open(str(newest), framework="pt") as f:
        metadata = {k: v for k, v in (f.metadata() or {}).items() if k != POSTHOC_METADATA_KEY}
    return {k: v.to(dtypes[k]) for k, v in total.items()}, metadata


def _listing(steps: list[int]) -> str:
    shown = ", ".join(map(str, steps[:10]))
    return shown + (f", ... {steps[-1]}" if len(steps) > 10 else "")
