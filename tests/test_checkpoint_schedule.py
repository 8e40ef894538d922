"""A checkpoint carries its noise schedule as it carries its architecture.

At test size: a run of the quickstart config (`diffusion` beta_max
10) sampled with `--config configs/cifar10_uvit.py` (beta_max 20) samples with beta_max
10, and the one-line note lists the `diffusion.*` values not used next to the `model.*`
ones. The EMA file's `uvic.diffusion` metadata records the settings; an explicit
`--set diffusion.*` that differs is refused unless `--model-from-config`; a file written
before the metadata held them takes its run's config.json; a released `.pth` the
config's. FID, the pipeline export and the attention analysis use the same settings.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import load_script
from PIL import Image
from safetensors import safe_open

from uvic.config import ConfigError, load_config
from uvic.diffusion.schedule import Diffusion
from uvic.files import save_config
from uvic.run.architecture import (
    DIFFUSION_METADATA_KEY,
    ModelChoice,
    model_metadata,
    resolve_model,
)
from uvic.run.weights import load_weights, save_safetensors
from uvic.sampling.generate import generate
from uvic.sampling.images import to_uint8

REPO = Path(__file__).resolve().parents[1]
CIFAR = str(REPO / "configs" / "cifar10_uvit.py")
# the quickstart at test size (tests/test_train.py's), two steps of training
TRAIN = ["model.embed_dim=32", "model.depth=2", "model.num_heads=2", "model.patch_size=4",
         "model.attention_backend=torch", "data.num_workers=0", "train.mixed_precision=no",
         "train.sample_every=0", "train.n_grid=2", "data.num_images=8", "train.batch_size=4",
         "train.max_steps=2", "train.log_every=1", "train.ckpt_every=2", "train.keep_steps=[]",
         "sample.autoguidance_scale=0"]  # no guide: the preset's is the step-1000 checkpoint
SAMPLE = ["--set", "sample.steps=2", "--set", "sample.batch_size=4",
          "--set", "model.attention_backend=torch"]
N, SEED = 3, 2


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A quickstart run (beta_max 10), trained by `uvic-train`."""
    out = tmp_path_factory.mktemp("quickstart") / "run"
    args = ["--config", str(REPO / "configs" / "quickstart.py"), "--output-dir", str(out)]
    for item in TRAIN:
        args += ["--set", item]
    assert load_script("scripts/train.py").main(args) == 0
    return out


def sample(*args: str) -> int:
    return load_script("scripts/sample.py").main(
        ["--n", str(N), "--seed", str(SEED), "--quiet", "--save-individual", *args])


def written(folder: Path) -> np.ndarray:
    return np.stack([np.asarray(Image.open(folder / f"{i:06d}.png")).astype(int)
                     for i in range(N)])


def pixels(run: Path, beta_max: float) -> np.ndarray:
    """The run's EMA sampled with the cifar10 config's sampler under `beta_max`."""
    trained = load_config(run / "config.json")
    cfg = load_config(CIFAR, ["sample.steps=2", "sample.batch_size=4"])
    cfg = dataclasses.replace(cfg, model=trained.model,
                              diffusion=dataclasses.replace(trained.diffusion, beta_max=beta_max))
    model = build(cfg, run / "ema.safetensors")
    images = torch.cat([b for _, b in generate(model, Diffusion(cfg.diffusion), cfg, range(N),
                                               seed=SEED)])
    return to_uint8(images).numpy().astype(int)


def build(cfg, ckpt: Path):
    from uvic.models.uvit import build_model

    model = build_model(cfg.model)
    load_weights(model, ckpt)
    return model.eval()


def test_the_weights_file_records_its_diffusion_settings(run: Path) -> None:
    for path in (run / "ema.safetensors", run / "checkpoints" / "step_000002" / "ema.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            stored = json.loads(f.metadata()[DIFFUSION_METADATA_KEY])
        assert stored == dataclasses.asdict(load_config(run / "config.json").diffusion)
        assert stored["beta_max"] == 10.0 and stored["min_snr_gamma"] == 5.0


def test_the_metadata_is_written_in_one_order(tmp_path: Path) -> None:
    """safetensors writes metadata in hash order, which changes from process to process;
    the weights files sort it, so the same weights and settings give the same bytes (the
    checkpoint's SHA-256 names it in FID results and sample folders)."""
    cfg = load_config(CIFAR, ["model.embed_dim=32", "model.depth=2", "model.num_heads=2"])
    from uvic.models.uvit import build_model

    path = tmp_path / "ema.safetensors"
    save_safetensors(build_model(cfg.model), path,
                     metadata={"z": "1", **model_metadata(cfg.model, cfg.diffusion), "a": "2"})
    raw = path.read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert list(header["__metadata__"]) == ["a", DIFFUSION_METADATA_KEY, "uvic.model", "z"]
    assert resolve_model(cfg, path).diffusion == cfg.diffusion


def test_a_checkpoint_samples_with_its_stored_schedule(run: Path, tmp_path: Path,
                                                        capsys) -> None:
    out = tmp_path / "samples"
    assert sample("--config", CIFAR, "--ckpt", str(run / "ema.safetensors"), "--out", str(out),
                  *SAMPLE) == 0
    note = capsys.readouterr().out.splitlines()[0]
    assert "diffusion.beta_max=20.0" in note and "model.embed_dim=512" in note
    assert note.endswith("not used for this checkpoint")
    record = json.loads((out / "sample_config.json").read_text())["models"]["samples"]
    assert record["diffusion"]["beta_max"] == 10.0
    got = written(out / "samples")
    assert np.array_equal(got, pixels(run, 10.0))
    assert np.abs(got - pixels(run, 20.0)).max() > 1  # what the bug sampled
    # an explicit value equal to the stored one is no conflict
    assert sample("--config", CIFAR, "--ckpt", str(run / "ema.safetensors"),
                  "--out", str(tmp_path / "same"), "--set", "diffusion.beta_max=10", *SAMPLE) == 0
    assert np.array_equal(written(tmp_path / "same" / "samples"), got)


def test_explicit_conflicting_schedule_is_refused_unless_from_config(run: Path, tmp_path: Path,
                                                                    capsys) -> None:
    ckpt = run / "ema.safetensors"
    out = tmp_path / "refused"
    assert sample("--config", CIFAR, "--ckpt", str(ckpt), "--out", str(out),
                  "--set", "diffusion.beta_max=20", *SAMPLE) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not out.exists()
    assert "diffusion.beta_max=20.0 (--set)" in err and "diffusion.beta_max=10.0" in err
    assert f"metadata of {ckpt}" in err and "--model-from-config" in err
    # --model-from-config: the config's model and schedule (here the run's own model)
    out = tmp_path / "forced"
    assert sample("--config", str(run / "config.json"), "--ckpt", str(ckpt), "--out", str(out),
                  "--set", "diffusion.beta_max=20", "--set", "sample.scheduler=euler_maruyama",
                  "--set", "sample.autoguidance_scale=0", "--model-from-config", *SAMPLE) == 0
    assert "(--model-from-config)" in capsys.readouterr().out
    assert np.array_equal(written(out / "samples"), pixels(run, 20.0))


def test_an_older_file_takes_its_run_config(run: Path, tmp_path: Path) -> None:
    """Weights written before the metadata held the schedule (the model config only)."""
    old = shutil.copytree(run, tmp_path / "old")
    cfg = load_config(old / "config.json")
    model = build(cfg, old / "ema.safetensors")
    save_safetensors(model, old / "ema.safetensors", metadata=model_metadata(cfg.model))
    resolved = resolve_model(load_config(CIFAR), old / "ema.safetensors")
    assert resolved.diffusion == cfg.diffusion
    assert f"(diffusion.* from {old / 'config.json'})" in resolved.note
    # no metadata and no run folder around: the given config's settings
    alone = tmp_path / "alone.safetensors"
    save_safetensors(model, alone, metadata=model_metadata(cfg.model))
    resolved = resolve_model(load_config(CIFAR), alone)
    assert resolved.diffusion is None
    assert resolved.applied(load_config(CIFAR)).diffusion == load_config(CIFAR).diffusion


def test_release_pth_takes_the_config_schedule(tmp_path: Path) -> None:
    cfg = load_config(CIFAR, ["model.embed_dim=32", "model.depth=2", "model.num_heads=2"])
    from uvic.models.uvit import build_model

    torch.save(build_model(cfg.model).state_dict(), tmp_path / "nnet_ema.pth")
    resolved = resolve_model(cfg, tmp_path / "nnet_ema.pth")
    assert resolved.diffusion is None and resolved.applied(cfg).diffusion == cfg.diffusion


def test_fid_export_and_analysis_use_the_stored_schedule(run: Path, tmp_path: Path) -> None:
    from uvic.analysis.core import checkpoints_config
    from uvic.evaluation.fid import _job
    from uvic.pipelines.export import export

    ckpt = run / "ema.safetensors"
    cifar = load_config(CIFAR, ["eval.n_samples=2"])
    job = _job(cifar, ckpt, tmp_path / "fid.json", None, tmp_path / "stats", None, None)
    assert job.cfg.diffusion.beta_max == 10.0 and job.cfg.model.img_size == 16
    export(ckpt, tmp_path / "exported", config=CIFAR)
    index = json.loads((tmp_path / "exported" / "model_index.json").read_text())
    assert index["diffusion"]["beta_max"] == 10.0 and index["scale_factor"] is None
    assert "beta_start" not in index["diffusion"]  # the scaled-linear schedule's, not this one's
    scheduler = json.loads((tmp_path / "exported" / "scheduler" / "scheduler_config.json")
                           .read_text())
    assert (scheduler["beta_schedule"], scheduler["beta_end"]) == ("linear", 10.0 / 1000)
    assert checkpoints_config(cifar, {"a": ckpt}).diffusion.beta_max == 10.0
    other = shutil.copytree(run, tmp_path / "other")
    trained = load_config(other / "config.json")
    save_config(dataclasses.replace(trained, diffusion=dataclasses.replace(
        trained.diffusion, beta_max=15.0)), other / "config.json")
    save_safetensors(build(trained, other / "ema.safetensors"), other / "ema.safetensors",
                     metadata=model_metadata(trained.model))  # an older file: its config.json
    with pytest.raises(ValueError, match="different diffusion settings"):
        checkpoints_config(cifar, {"a": ckpt, "b": other / "ema.safetensors"})
    with pytest.raises(ConfigError, match="refusing to sample"):
        resolve_model(cifar, ckpt, ModelChoice.from_overrides(["diffusion.beta_max=20"]))
