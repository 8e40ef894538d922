"""A checkpoint carries its architecture: sampling, the autoguidance guide and the attention
analysis build each checkpoint as the model config it was trained with (its safetensors
metadata, else its run's config.json); `--config` only supplies the sampler. A conflicting
explicit `--set model.*` is refused in one line, `--model-from-config` overrides, and a
released .pth (no config) takes `--config`'s model. Tiny models on the CPU."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import load_script
from PIL import Image

from uvic.config import Config, ConfigError, DataConfig, ModelConfig, SampleConfig
from uvic.diffusion.schedule import Diffusion
from uvic.files import save_config
from uvic.models.uvit import build_model
from uvic.run.weights import load_weights, save_safetensors
from uvic.sampling.generate import generate
from uvic.sampling.images import to_uint8
from uvic.sampling.load import load_guide

REPO = Path(__file__).resolve().parents[1]
TINY = {"img_size": 8, "patch_size": 2, "embed_dim": 32, "depth": 2, "num_heads": 2,
        "attention_backend": "torch"}
N, SEED = 3, 5


def tiny_cfg(attention: str = "uvit", **model: object) -> Config:
    return Config(name="tiny", model=ModelConfig(**{**TINY, "attention": attention, **model}),
                  data=DataConfig(name="shapes", root=""),
                  sample=SampleConfig(steps=3, batch_size=2, cfg_scale=0.0))


def write_config_py(path: Path, attention: str) -> Path:
    """A configs/*.py-style file, like configs/quickstart.py: the sampler, and a model
    section that need not be the checkpoint's."""
    model = ", ".join(f"{k}={v!r}" for k, v in {**TINY, "attention": attention}.items())
    path.write_text(
        "from uvic.config import Config, DataConfig, ModelConfig, SampleConfig\n\n\n"
        "def get_config():\n"
        f"    return Config(name='tiny', model=ModelConfig({model}),\n"
        "                  data=DataConfig(name='shapes', root=''),\n"
        "                  sample=SampleConfig(steps=3, batch_size=2, cfg_scale=0.0))\n")
    return path


def fake_run(folder: Path, cfg: Config, seed: int, metadata: bool = False) -> Path:
    """A run folder as the trainer leaves it: config.json and ema.safetensors (with the
    model config in its metadata when `metadata`, as runs write it now)."""
    folder.mkdir(parents=True)
    save_config(cfg, folder / "config.json")
    torch.manual_seed(seed)
    meta = None
    if metadata:
        from uvic.run.architecture import model_metadata

        meta = model_metadata(cfg.model)
    save_safetensors(build_model(cfg.model), folder / "ema.safetensors", metadata=meta)
    return folder / "ema.safetensors"


def pixels_of(cfg: Config, ckpt: Path, n: int = N, seed: int = SEED) -> np.ndarray:
    """uint8 (n, H, W, 3) samples of the weights `ckpt` built as `cfg.model`."""
    model = build_model(cfg.model)
    load_weights(model, ckpt)
    model.eval()
    images = torch.cat([b for _, b in generate(model, Diffusion(cfg.diffusion), cfg, range(n),
                                               seed=seed)])
    return to_uint8(images).numpy().astype(int)


def written(folder: Path, n: int = N) -> np.ndarray:
    return np.stack([np.asarray(Image.open(folder / f"{i:06d}.png")).astype(int)
                     for i in range(n)])


def sample_main():
    return load_script("scripts/sample.py").main


def sample(*args: str) -> int:
    return sample_main()(["--n", str(N), "--seed", str(SEED), "--quiet", "--save-individual",
                          *args])


# --------------------------------------------------------------------------- uvic-sample


@pytest.mark.parametrize("where", ["run folder", "metadata"])
def test_side_by_side_samples_each_checkpoint_as_trained(tmp_path, capsys, where):
    """The README's side-by-side command: a U-ViT config, a U-ViT and a U-ViC run. The
    U-ViC half must be U-ViC's samples, from the run's config.json (files written before
    the metadata) or from the file's own metadata (a file copied out of its run)."""
    uvit, uvic = tiny_cfg("uvit"), tiny_cfg("uvic")
    config = write_config_py(tmp_path / "quickstart.py", "uvit")
    a = fake_run(tmp_path / "runs" / "uvit", uvit, seed=0)
    b = fake_run(tmp_path / "runs" / "uvic", uvic, seed=1, metadata=where == "metadata")
    if where == "metadata":  # copied out of its run folder: only the metadata knows
        b = Path(shutil.copy(b, tmp_path / "uvic_ema.safetensors"))
    out = tmp_path / "compare"
    assert sample("--config", str(config), "--ckpt", str(a), "--ckpt", str(b),
                  "--label", "U-ViT", "--label", "U-ViC", "--out", str(out)) == 0
    printed = capsys.readouterr().out
    expected = pixels_of(uvic, b)  # same batches as the CLI's: the very same pixels
    assert np.array_equal(written(out / "U-ViC"), expected)
    # control: the same weights built as U-ViT give other images (what the bug wrote)
    assert np.abs(pixels_of(uvit, b) - expected).max() > 1
    assert np.array_equal(written(out / "U-ViT"), pixels_of(uvit, a))
    # one note per checkpoint: the architecture, its source, the --config value not used
    note = next(line for line in printed.splitlines() if line.startswith("U-ViC: "))
    source = f"metadata of {b}" if where == "metadata" else str(b.parent / "config.json")
    assert "attention uvic (SCS)" in note and f"from {source}" in note
    assert f"{config} has model.attention='uvit', not used" in note
    assert "attention uvit (SSS)" in next(line for line in printed.splitlines()
                                          if line.startswith("U-ViT: "))


def test_explicit_model_override_is_refused_in_one_line(tmp_path, capsys):
    ckpt = fake_run(tmp_path / "run", tiny_cfg("uvic"), seed=1)
    config = write_config_py(tmp_path / "c.py", "uvic")
    out = tmp_path / "out"
    rc = sample("--config", str(config), "--ckpt", str(ckpt), "--set", "model.attention=uvit",
                "--out", str(out))
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and not out.exists()
    assert "model.attention='uvit' (--set)" in err
    assert f"model.attention='uvic' ({tmp_path / 'run' / 'config.json'})" in err
    assert "--model-from-config" in err and str(ckpt) in err
    # an explicit value equal to the checkpoint's, or a runtime one, is no conflict
    assert sample("--config", str(config), "--ckpt", str(ckpt), "--set", "model.depth=2",
                  "--set", "model.attention_backend=torch", "--out", str(out)) == 0


def test_model_from_config_builds_the_config_model(tmp_path, capsys):
    uvit, uvic = tiny_cfg("uvit"), tiny_cfg("uvic")
    ckpt = fake_run(tmp_path / "run", uvic, seed=1)
    config = write_config_py(tmp_path / "c.py", "uvic")
    out = tmp_path / "out"
    assert sample("--config", str(config), "--ckpt", str(ckpt), "--set", "model.attention=uvit",
                  "--model-from-config", "--out", str(out)) == 0
    assert np.array_equal(written(out / "samples"), pixels_of(uvit, ckpt))
    assert not np.array_equal(written(out / "samples"), pixels_of(uvic, ckpt))
    note = capsys.readouterr().out
    assert "(--model-from-config)" in note and "has model.attention='uvic'" in note


def test_a_model_that_does_not_fit_names_its_fields_and_a_report(tmp_path, capsys):
    """--model-from-config with another size: one short line naming the first differing
    fields (the config's and the checkpoint's values), and a file with all of them and
    every tensor that differs (not thousands of characters of key names)."""
    ckpt = fake_run(tmp_path / "run", tiny_cfg("uvic"), seed=1, metadata=True)
    config = write_config_py(tmp_path / "c.py", "uvic")
    out = tmp_path / "out"
    assert sample("--config", str(config), "--ckpt", str(ckpt), "--model-from-config",
                  "--set", "model.depth=4", "--set", "model.embed_dim=64",
                  "--set", "model.num_heads=4", "--set", "model.mlp_ratio=2",
                  "--out", str(out)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and len(err) < 600, err
    assert err.startswith(f"error: {ckpt} does not fit the model built for it: "
                          "model.embed_dim=64 (the checkpoint's: 32), model.depth=4 (the "
                          "checkpoint's: 2), model.num_heads=4 (the checkpoint's: 2) and 2 "
                          f"more, as recorded in metadata of {ckpt}; "), err
    report = Path(err.rsplit("(every difference: ", 1)[1].rstrip(")"))
    lines = report.read_text().splitlines()
    assert "model.mlp_ratio=2.0 (the checkpoint's: 4.0)" in lines
    assert "model.attention='uvic' (SCCCS) (the checkpoint's: 'uvic' (SCS))" in lines
    assert any(line.startswith("shape mismatch: ") for line in lines)
    assert any(line.startswith("missing keys: ") for line in lines)  # the added blocks
    report.unlink()
    assert not out.exists()


def test_release_pth_takes_the_config_model(tmp_path, capsys):
    """A released nnet_ema.pth records no config: --config (with --set) gives its model,
    and the note says so."""
    uvit, uvic = tiny_cfg("uvit"), tiny_cfg("uvic")
    torch.manual_seed(2)
    pth = tmp_path / "nnet_ema.pth"
    torch.save(build_model(uvic.model).state_dict(), pth)
    config = write_config_py(tmp_path / "c.py", "uvic")
    for attention, cfg in (("uvic", uvic), ("uvit", uvit)):
        out = tmp_path / attention
        assert sample("--config", str(config), "--ckpt", str(pth), "--out", str(out),
                      "--set", f"model.attention={attention}") == 0
        assert np.array_equal(written(out / "samples"), pixels_of(cfg, pth))
        assert f"from {config} (the file records no model config)" in capsys.readouterr().out


def test_side_by_side_refuses_checkpoints_with_different_inputs(tmp_path, capsys):
    a = fake_run(tmp_path / "a", tiny_cfg("uvit"), seed=0)
    b = fake_run(tmp_path / "b", tiny_cfg("uvic", img_size=4), seed=1)
    config = write_config_py(tmp_path / "c.py", "uvit")
    rc = sample("--config", str(config), "--ckpt", str(a), "--ckpt", str(b),
                "--out", str(tmp_path / "out"))
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "model.img_size=8" in err and "model.img_size=4" in err


# --------------------------------------------------------------------------- the guide


def test_guide_is_built_as_its_own_checkpoint(tmp_path):
    """Autoguidance's weaker model comes from its own checkpoint folder's config.json,
    whatever --config's model says."""
    uvic = tiny_cfg("uvic")
    run = tmp_path / "run"
    ckpt = fake_run(run, uvic, seed=1)
    early = run / "checkpoints" / "step_000010"
    early.mkdir(parents=True)
    save_config(uvic, early / "config.json")
    torch.manual_seed(3)
    save_safetensors(build_model(uvic.model), early / "ema.safetensors")
    on = dataclasses.replace(tiny_cfg("uvit"), sample=SampleConfig(
        steps=3, batch_size=2, cfg_scale=0.0, autoguidance_scale=1.0,
        autoguidance_ckpt="checkpoints/step_000010/ema.safetensors"))
    guide = load_guide(on, ckpt)
    assert guide.attention_modes == ["softmax", "cog", "softmax"]
    # a guide that does not take the sampled model's inputs is refused
    small = tiny_cfg("uvic", img_size=4)
    save_config(small, early / "config.json")
    torch.manual_seed(3)
    save_safetensors(build_model(small.model), early / "ema.safetensors")
    with pytest.raises(ConfigError, match=r"model\.img_size=8.*model\.img_size=4"):
        load_guide(on, ckpt)


# --------------------------------------------------------------------------- analysis


def test_analysis_builds_each_checkpoint_as_trained(tmp_path):
    from uvic.analysis import load_models

    uvic = tiny_cfg("uvic", embed_dim=24, num_heads=3)  # wider than the config's model
    ckpt = fake_run(tmp_path / "run", uvic, seed=1)
    models = load_models(tiny_cfg("uvit"), {"x": ckpt})
    assert models["x"].attention_modes == ["softmax", "cog", "softmax"]
    assert models["x"].pos_embed.shape[-1] == 24
