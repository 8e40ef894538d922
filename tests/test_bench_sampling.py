"""`uvic-bench-sampling` on the CPU: the JSON record schema and the FID-time projection."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from uvic.cli.bench_sampling import RECORD_KEYS, main, protocols
from uvic.config import load_config
from uvic.presets import preset_path


def test_smoke_run_writes_records_whose_projection_is_the_measured_rate(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "sampling.json"
    assert main(["--smoke", "--iters", "1", "--repeats", "1", "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    data = json.loads(out.read_text())
    for key in ("device", "python", "torch", "triton", "cuda", "date", "git_commit", "git_dirty"):
        assert key in data
    assert data["kind"] == "sampling" and data["device_type"] == "cpu"  # as the train kind's
    assert data["smoke"] and data["precision"] == "fp32"
    records = data["records"]
    assert {(r["dataset"], r["model"], r["backend"], r["compile"]) for r in records} == {
        (d, m, "torch", "off") for d in ("cifar10", "mscoco") for m in ("uvit", "uvic")}
    for r in records:
        assert set(RECORD_KEYS) <= r.keys()
        assert r["ms_per_eval"] > 0 and r["peak_mib"] is None  # no CUDA memory on the CPU
        assert math.isclose(r["images_per_s_per_eval"], r["batch"] / r["ms_per_eval"] * 1e3)
        decode = r["decode_images_per_s"]
        seconds_per_image = r["evals_per_image"] / r["images_per_s_per_eval"] + (
            1 / decode if decode else 0.0)
        assert math.isclose(r["projected_50k_minutes"], 50_000 * seconds_per_image / 60)
        assert math.isclose(r["projected_minutes"], r["n_samples"] * seconds_per_image / 60)
    by_dataset = {r["dataset"]: r for r in records}
    cifar, coco = by_dataset["cifar10"], by_dataset["mscoco"]
    # the release's protocols: Euler-Maruyama 1000 steps, 50k samples, unguided, pixels;
    # DPM-Solver++ "fast" 50 steps guided (two rows an image), 30k samples, VAE latents
    assert (cifar["evals_per_image"], cifar["n_samples"], cifar["batch"]) == (1000, 50_000, 2)
    assert cifar["decode_images_per_s"] is None
    assert (coco["evals_per_image"], coco["n_samples"], coco["batch"]) == (100, 30_000, 4)
    assert coco["decode_images_per_s"] > 0
    assert coco["protocol"].startswith("dpm_solver++_fast_time_uniform 50 steps, guidance 1")


def test_protocols_count_guidance_and_autoguidance() -> None:
    """A config's own protocol (no release one for its data) counts each network call:
    the quickstart's 50 DDPM steps with autoguidance run the model and its guide."""
    cfg = load_config(preset_path("quickstart"))
    assert cfg.sample.autoguidance_scale and not cfg.model.clip_dim
    (p,) = protocols(cfg.data.name, cfg)
    assert p["evals_per_image"] == cfg.sample.steps * 2
    assert "autoguidance" in p["protocol"]


def test_protocols_count_the_guidance_interval() -> None:
    """With `sample.guidance_interval`, only the calls inside it run twice the rows: the
    MS-COCO protocol's 50 evaluations (the release's update plan: each update's start and
    intermediate points), those at sigma = sigma_t / alpha_t in (0.3, 2.33] doubled."""
    from uvic.diffusion.samplers import ContinuousSchedule, fast_plan
    from uvic.diffusion.schedule import Diffusion

    cfg = load_config(preset_path("mscoco_uvit"), ["sample.guidance_interval=0.3,2.33"])
    diffusion = Diffusion(cfg.diffusion)
    sch = ContinuousSchedule(diffusion)
    times = [t for step in fast_plan(diffusion, cfg.sample.scheduler, 50)
             for t in (step.s, *step.mids)]
    inside = sum(0.3 < sch.sigma(t) / sch.alpha(t) <= 2.33 for t in times)
    assert len(times) == 50 and 0 < inside < 50
    release, own = protocols("mscoco", cfg)
    assert release["evals_per_image"] == 100
    assert own["evals_per_image"] == 50 + inside and "on sigma in (0.3, 2.33]" in own["protocol"]


@pytest.mark.parametrize("args, needle", [
    (["--compile", "off,fast"], "--compile: 'fast' is not one of off, default, reduce-overhead"),
    (["--datasets", "imagenet"], "--datasets: 'imagenet' is not one of cifar10, mscoco"),
    (["--backends", "cudnn"], "--backends: 'cudnn' is not one of"),
])
def test_bad_options_are_refused_in_one_line(args: list[str], needle: str,
                                             capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as err:
        main(args)
    assert err.value.code == 2 and needle in capsys.readouterr().err
