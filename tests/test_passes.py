"""Network passes per image, the unit of every cost estimate: one count
(`uvic.diffusion.guidance_interval.sampling_passes`) that the dry-run plans share, checked
against the solver's calls and the guidance interval counted on their own."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from uvic.cli import compare, tables
from uvic.config import apply_overrides, load_config
from uvic.config.diffusion import sampler_calls
from uvic.diffusion.guidance_interval import guided_calls, sampling_passes
from uvic.diffusion.schedule import Diffusion
from uvic.experiments import runner
from uvic.experiments.tables import RELEASE_TABLE
from uvic.presets import preset_path

INTERVAL = "sample.guidance_interval=0.3,2.33"


def counted(cfg) -> tuple[int, int]:
    """(calls in the interval, all calls) of the config's sampler, by running it."""
    s = cfg.sample
    return guided_calls(Diffusion(cfg.diffusion), s.guidance_interval, s.scheduler, s.steps,
                        s.order, s.scheduler_kwargs)


def test_passes_follow_the_sampler_and_the_interval() -> None:
    """Heun's 2 steps - 1 calls; guided passes only inside the interval (x 2 classifier-free,
    x 2 again with an autoguidance model)."""
    flow = load_config(preset_path("cifar10_uvit_flow"))
    assert flow.sample.scheduler == "flow_heun"
    assert sampling_passes(flow) == sampler_calls("flow_heun", flow.sample.steps) == 99
    base = load_config(preset_path("imagenet256_uvit_large"))
    assert sampling_passes(base) == 2 * base.sample.steps  # guided everywhere
    cfg = apply_overrides(base, [INTERVAL])
    inside_n, calls = counted(cfg)
    assert 0 < inside_n < calls == cfg.sample.steps
    assert sampling_passes(cfg) == calls + inside_n
    auto = apply_overrides(cfg, ["sample.autoguidance_scale=0.5",
                                 "sample.autoguidance_ckpt=guide.safetensors"])
    assert sampling_passes(auto) == calls + 3 * inside_n
    plain = apply_overrides(cfg, ["sample.cfg_scale=0"])  # nothing to limit
    assert sampling_passes(plain) == calls


@pytest.mark.slow
def test_compare_plan_counts_the_interval(tmp_path: Path, capsys) -> None:
    """uvic-compare's dry run: autoguidance (the quickstart's) only inside the interval."""
    argv = ["--dry-run", "--steps", "1500", "--set", "eval.n_samples=128", "--set", INTERVAL,
            "--out", str(tmp_path)]
    assert compare.main(argv) == 0
    cfg = apply_overrides(load_config(preset_path("quickstart")), [INTERVAL])
    inside_n, calls = counted(cfg)
    assert inside_n < calls
    passes = calls + inside_n
    out = capsys.readouterr().out
    assert f"128 x {passes} network calls = {128 * passes:,} image forwards" in out


def test_table_plan_counts_the_interval() -> None:
    """uvic-release-table / uvic-table3's plan: a guided row under an interval."""
    table = RELEASE_TABLE
    args = tables.parse_args(table, ["--only", "imagenet256_large", "--out", "unused"])
    jobs = [dataclasses.replace(j, cfg=apply_overrides(j.cfg, [INTERVAL]))
            for j in runner.make_jobs(table, args)]
    inside_n, calls = counted(jobs[0].cfg)
    passes = calls + inside_n
    assert passes < 2 * calls
    assert f"50,000 samples x {passes} network calls" in runner.plan(jobs)
