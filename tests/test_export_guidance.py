"""`uvic-export` carries what sampling needs: the autoguidance guide (the run's own early
EMA), its scale and the guidance interval, so that `UViTPipeline.from_pretrained(folder)`
samples the images `uvic-sample` samples with the same seed. A guide that is not there is
refused in one line, never dropped. Tiny random models at 16x16 (CPU, attention in PyTorch)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_hub import perturbed

from uvic.cli.export import main as export_main
from uvic.cli.sample import main as sample_main
from uvic.config import load_config
from uvic.files import save_config
from uvic.pipelines import UViTPipeline
from uvic.run.architecture import model_metadata
from uvic.run.folder import RunFolder
from uvic.run.weights import save_safetensors
from uvic.sampling.noise import sample_generators

REPO = Path(__file__).resolve().parents[1]
GUIDE = "checkpoints/step_000001/ema.safetensors"
# the quickstart's protocol (DDPM, autoguidance 1 by the run's own early EMA), shrunk
TINY = ["model.embed_dim=32", "model.depth=2", "model.num_heads=2",
        "model.attention_backend=torch", "sample.steps=4", "sample.batch_size=4",
        "train.max_steps=2", "train.keep_steps=[1]", f"sample.autoguidance_ckpt={GUIDE}"]




def write_run(folder: Path, *extra: str) -> Path:
    """A run folder as training leaves it: config.json, ema.safetensors (the final EMA) and
    the kept step-1 checkpoint's EMA, another model: the guide."""
    cfg = load_config(REPO / "configs" / "quickstart.py", [*TINY, *extra])
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, output_dir=str(folder)))
    save_config(cfg, folder / "config.json")
    save_safetensors(perturbed(cfg, 0), folder / RunFolder.EMA,
                     metadata=model_metadata(cfg.model))
    (folder / GUIDE).parent.mkdir(parents=True)
    save_safetensors(perturbed(cfg, 1), folder / GUIDE, metadata=model_metadata(cfg.model))
    return folder


def pngs(folder: Path) -> np.ndarray:
    return np.stack([np.asarray(Image.open(p)) for p in sorted(folder.glob("*.png"))])


def loaded(folder: Path) -> UViTPipeline:
    """The exported pipeline, attention in PyTorch as the run has it (the export leaves the
    backend to the loader)."""
    pipe = UViTPipeline.from_pretrained(folder)
    for net in (pipe.transformer, pipe.guide):
        if net is not None:
            net.set_attention(net.attention_modes, backend="torch")
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("extra", [[], ["sample.guidance_interval=0.5,20"]],
                         ids=["quickstart", "interval"])
def test_exported_pipeline_samples_as_uvic_sample(tmp_path: Path, extra: list[str],
                                                  capsys) -> None:
    run = write_run(tmp_path / "run", *extra)
    assert sample_main(["--config", str(run / "config.json"), "--ckpt", str(run / RunFolder.EMA),
                        "--n", "3", "--seed", "7", "--save-individual", "--quiet",
                        "--out", str(tmp_path / "s")]) == 0
    expected = pngs(tmp_path / "s" / "samples")
    assert export_main([str(run), "--out", str(tmp_path / "pipe")]) == 0
    assert "autoguidance 1 by the guide checkpoints/step_000001/ema.safetensors" in (
        capsys.readouterr().out)
    index = json.loads((tmp_path / "pipe" / "model_index.json").read_text())
    assert index["guide"] == ["uvic.models.uvit", "UViT"] and index["autoguidance_scale"] == 1.0
    assert index["guidance_interval"] == ([0.5, 20.0] if extra else None)

    pipe = loaded(tmp_path / "pipe")
    images = pipe(batch_size=3, num_inference_steps=4,
                  generator=sample_generators(7, range(3))).images
    np.testing.assert_array_equal(np.stack([np.asarray(i) for i in images]), expected)
    # the guide matters: unguided, the same noise gives other images
    plain = pipe(batch_size=3, num_inference_steps=4, autoguidance_scale=0,
                 generator=sample_generators(7, range(3))).images
    assert not np.array_equal(np.stack([np.asarray(i) for i in plain]), expected)


def test_a_missing_guide_is_refused_not_dropped(tmp_path: Path, capsys) -> None:
    run = write_run(tmp_path / "run")
    shutil.rmtree(run / "checkpoints")
    assert export_main([str(run), "--out", str(tmp_path / "pipe")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: sample.autoguidance_ckpt='{GUIDE}'")
    assert "sample.autoguidance_scale=0" in err and not (tmp_path / "pipe").exists()
    # asked for, unguided: no guide saved, and the pipeline says it has none
    assert export_main([str(run), "--out", str(tmp_path / "plain"),
                        "--set", "sample.autoguidance_scale=0"]) == 0
    pipe = loaded(tmp_path / "plain")
    assert pipe.guide is None and pipe.config.autoguidance_scale is None
    assert not (tmp_path / "plain" / "guide").exists()
    with pytest.raises(ValueError, match=r"autoguidance_scale=1\.0 needs a guide"):
        pipe(batch_size=1, num_inference_steps=2, autoguidance_scale=1.0)
