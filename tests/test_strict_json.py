"""Every JSON uvic writes of a config whose guidance interval has no upper bound
(`sample.guidance_interval=0.3,inf`) is strict JSON: no `Infinity`, which non-Python
readers refuse. The bound is written as null and read back as inf."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from uvic.config import ConfigError, ModelConfig, from_dict, load_config, to_dict
from uvic.config.compare import config_diff
from uvic.config.validation import validate
from uvic.evaluation.protocols import protocol_from_result, protocol_of
from uvic.files import save_config
from uvic.presets import preset_path
from uvic.run.prepare import config_history, resume_record, save_run_config

OPEN = "sample.guidance_interval=0.3,inf"


def strict(text: str) -> Any:
    """json.loads refusing NaN, Infinity and -Infinity."""
    def refuse(name: str) -> None:
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_strict_json_refuses_infinity() -> None:
    with pytest.raises(ValueError, match="Infinity"):
        strict(json.dumps([0.3, math.inf]))


def test_config_files_write_the_open_bound_as_null(tmp_path: Path) -> None:
    """save_config, a run's config.json (with a resume that opened the interval) and
    to_dict: null where inf was, read back as inf."""
    cfg = load_config(preset_path("imagenet256_uvit_large"), [OPEN])
    assert cfg.sample.guidance_interval == (0.3, math.inf)
    save_config(cfg, tmp_path / "config.json")
    assert strict((tmp_path / "config.json").read_text())["sample"]["guidance_interval"] == [
        0.3, None]
    assert load_config(tmp_path / "config.json") == cfg
    assert from_dict(strict(json.dumps(to_dict(cfg)))) == cfg
    before = load_config(preset_path("imagenet256_uvit_large"),
                         ["sample.guidance_interval=0.3,2"])
    save_run_config(cfg, tmp_path / "run.json", [resume_record(5, config_diff(before, cfg))])
    strict((tmp_path / "run.json").read_text())
    assert [c for _, c in config_history(tmp_path / "run.json")] == [before, cfg]
    with pytest.raises(ConfigError, match=r"guidance_interval=\[inf, 2.0\]: low=inf"):
        validate(from_dict({"sample": {"guidance_interval": [None, 2.0]}}))  # no open low


def test_results_and_sample_records_are_strict(tmp_path: Path) -> None:
    """An FID result's protocol and config, and a samples folder's samples.json."""
    from uvic.evaluation.fid import _check_samples_meta, _samples_meta

    cfg = load_config(preset_path("imagenet256_uvit_large"), [OPEN])
    p = protocol_of(cfg)
    result = strict(json.dumps({"protocol": p.as_dict(), "config": to_dict(cfg)}))
    assert result["protocol"]["guidance_interval"] == [0.3, None]
    assert protocol_from_result(result) == p and "(0.3, inf]" in p.label()
    meta = _samples_meta(cfg, "sha", 0, "fp32", None)
    (tmp_path / "samples.json").write_text(json.dumps(meta))
    strict((tmp_path / "samples.json").read_text())
    _check_samples_meta(tmp_path, meta, write=False)  # the folder still matches


def test_pipeline_folder_is_strict_and_keeps_the_open_bound(tmp_path: Path) -> None:
    """model_index.json of an exported pipeline (and the transformer's config.json): null
    for the open bound; loaded back, the pipeline guides the same steps. (The scheduler's
    own file is diffusers': DPM-Solver's default lambda_min_clipped=-inf is written as
    -Infinity there, whatever the interval.)"""
    from uvic.models.uvit import build_model
    from uvic.pipelines import UViTPipeline
    from uvic.pipelines.export import build_pipeline
    from uvic.sampling.noise import sample_generators

    m = ModelConfig(img_size=8, patch_size=2, embed_dim=16, depth=2, num_heads=2,
                    num_classes=5, attention_backend="torch")
    data = {"name": "shapes", "root": ""}
    cfg = validate(from_dict({"model": dataclasses.asdict(m), "data": data,
                              "sample": {"guidance_interval": [0.3, None], "cfg_scale": 1.0,
                                         "steps": 4}}))
    torch.manual_seed(0)
    pipe, _ = build_pipeline(cfg, build_model(m), null_class=4)
    assert pipe.config.guidance_interval == [0.3, None]
    pipe.save_pretrained(tmp_path / "pipe")
    for file in ("model_index.json", "transformer/config.json"):
        strict((tmp_path / "pipe" / file).read_text())
    loaded = UViTPipeline.from_pretrained(tmp_path / "pipe")

    def run(p: UViTPipeline, **kw: Any) -> torch.Tensor:
        p.set_progress_bar_config(disable=True)
        return p(class_labels=[0, 2], num_inference_steps=4, output_type="latent",
                 generator=sample_generators(0, range(2)), **kw).images

    want = run(pipe, guidance_interval=(0.3, math.inf))
    assert torch.equal(run(loaded), want) and torch.equal(run(pipe), want)
    assert not torch.equal(run(pipe, guidance_interval=(0.3, 1.0)), want)


def test_configs_without_an_open_bound_write_what_they_did() -> None:
    cfg = load_config(preset_path("imagenet256_uvit_large"), ["sample.guidance_interval=0,2"])
    assert json.dumps(to_dict(cfg)) == json.dumps(dataclasses.asdict(cfg))
