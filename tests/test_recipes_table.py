"""The modern-recipe configs (configs/imagenet256_*_large_flow.py, cifar10_*_flow.py) and
`uvic-recipes-table`: the configs are the release rows' with only the recipe changed and its
numbers are the papers', the dry-run states each row's compute (network calls counted from
the configs and the samplers' time grids, written out here independently), and the smoke
runs the whole chain (REPA, logit-normal times, the SDE, the guidance interval, post-hoc
EMA snapshots) and resumes.

The papers' numbers below are written from REPA's training command and sampler defaults
(Yu et al. 2024) and LightningDiT (Yao et al. 2025), not read from the configs.
"""

from __future__ import annotations

import dataclasses
import json
import re
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from readme_commands import argv, section

from uvic.cli.tables import recipes_table
from uvic.config import load_config
from uvic.config.validation import validate
from uvic.evaluation.recipes_table import RECIPE_ROWS

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# docs/recipes.md's commands, run here as the page writes them
DRY_RUN = "python scripts/reproduce_recipes_table.py --dry-run"
CALIBRATED = r"; ~[0-9.]+ [a-z]+ \(calibrated\)"  # a time the dry run measures on its machine
SMOKE = "python scripts/reproduce_recipes_table.py --smoke"

# REPA's SiT-XL/2 recipe on ImageNet 256, and LightningDiT's times.
REPA = {
    "diffusion.objective": "velocity", "diffusion.interpolant": "linear",
    "diffusion.timestep_sampling": "logit_normal", "diffusion.logit_normal_mean": 0.0,
    "diffusion.logit_normal_std": 1.0, "diffusion.p_uncond": 0.1,
    "train.repa_encoder": "vit_base_patch14_dinov2.lvd142m", "train.repa_weight": 0.5,
    "train.repa_projector_dim": 2048, "train.batch_size": 256, "train.max_steps": 400_000,
    "train.mixed_precision": "fp16", "train.ema_decay": 0.9999,
    "optim.lr": 1e-4, "optim.betas": (0.9, 0.999), "optim.weight_decay": 0.0,
    "optim.warmup_steps": 0, "optim.grad_clip": 1.0, "optim.lr_schedule": "constant",
    "sample.scheduler": "flow_euler_maruyama", "sample.steps": 250,
}
REPA_DEPTH, REPA_BLOCK = 28, 8  # SiT-XL/2's blocks; REPA aligns the 8th block's output
REPA_CFG, REPA_HIGH_T, SDE_LAST_T = 1.8, 0.7, 0.04  # diffusers' scale; t <= 0.7 guided


def get(cfg, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def test_large_flow_configs_are_the_release_row_under_repas_recipe() -> None:
    """imagenet256_{uvit,uvic}_large_flow: REPA's and LightningDiT's numbers; REPA's block
    at the same fraction of U-ViT-L's depth; guidance 1.8 in diffusers' convention on
    t <= 0.7; everything else (network, data format, FID protocol) the release row's."""
    for model in ("uvit", "uvic"):
        base = load_config(CONFIGS / f"imagenet256_{model}_large.py")
        cfg = validate(load_config(CONFIGS / f"imagenet256_{model}_large_flow.py"))
        assert cfg.name == f"imagenet256_{model}_large_flow"
        assert cfg.train.output_dir == f"runs/imagenet256_{model}_large_flow"
        for key, value in REPA.items():
            assert get(cfg, key) == value, key
        # the output of block repa_block + 1 (1-based) of U-ViT-L's 2 (depth // 2) + 1
        blocks = 2 * (cfg.model.depth // 2) + 1
        assert blocks == 21
        assert Fraction(cfg.train.repa_block + 1, blocks) == Fraction(REPA_BLOCK, REPA_DEPTH)
        # v = u + w (c - u) is v = c + (w - 1) (c - u): uvic's cfg_scale is w - 1
        assert cfg.sample.cfg_scale == REPA_CFG - 1
        low, high = cfg.sample.guidance_interval
        assert low == 0 and high == pytest.approx(REPA_HIGH_T / (1 - REPA_HIGH_T), rel=1e-12)
        assert cfg.data.root != base.data.root  # features with the encoder's: own folder
        changed = [*REPA, "train.repa_block", "sample.cfg_scale", "sample.guidance_interval",
                   "data.root", "train.output_dir"]
        same = dataclasses.replace(cfg, name=base.name)
        for key in changed:  # every other setting is the release row's
            section, name = key.split(".")
            same = dataclasses.replace(same, **{section: dataclasses.replace(
                getattr(same, section), **{name: get(base, key)})})
        assert same == base


def test_large_flow_docstring_names_the_extraction_and_the_error() -> None:
    """The config's docstring gives the extraction command for its data.root and encoder,
    and the one-line error a run without the features stops with, as the code words it."""
    from uvic.config import ConfigError
    from uvic.training.repa import stored_features

    cfg = load_config(CONFIGS / "imagenet256_uvit_large_flow.py")
    doc = " ".join((CONFIGS / "imagenet256_uvit_large_flow.py").read_text()
                   .split('"""')[1].replace("\\\n", " ").split())
    assert (f"uvic-extract-imagenet --imagenet data/imagenet --out {cfg.data.root} "
            f"--resolution 256 --repa-encoder {cfg.train.repa_encoder}") in doc
    grid = cfg.model.img_size // cfg.model.patch_size
    missing = cfg.data.root + "_missing"
    with pytest.raises(ConfigError) as err:
        stored_features(dataclasses.replace(
            cfg, data=dataclasses.replace(cfg.data, root=missing)), grid)
    assert str(err.value).replace(missing, "<folder>") in doc


def sde_guided(steps: int, low: float, high: float) -> int:
    """Calls of REPA's Euler-Maruyama (times linspace(1, 0.04, steps), then one noiseless
    step from 0.04 to 0 without a call) whose sigma = t / (1 - t) lies in (low, high]."""
    t = np.linspace(1.0, SDE_LAST_T, steps)
    with np.errstate(divide="ignore"):
        sigma = t / (1.0 - t)
    return int(((sigma > low) & (sigma <= high)).sum())


@pytest.mark.slow
def test_dry_run_states_the_compute_of_the_four_rows(capsys, tmp_path: Path) -> None:
    """Per row: steps x batch, REPA's encoder where on, and the FID calls: Heun 2 steps - 1;
    the SDE steps plus one unconditional pass for each call in the guidance interval."""
    assert recipes_table([*argv(DRY_RUN)[2:], "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert not any(tmp_path.iterdir())
    for key, row in RECIPE_ROWS.items():
        for model in ("uvit", "uvic"):
            cfg = load_config(CONFIGS / f"{getattr(row, model)}.py")
            t, s, n = cfg.train, cfg.sample, cfg.eval.n_samples
            head = f"- {key} / {model}: train {t.max_steps:,} of {t.max_steps:,} steps x "
            assert f"{head}{t.batch_size} images" in out
            block = out.split(head)[1].split("\n- ")[0]
            if s.scheduler == "flow_heun":
                assert not s.guidance_interval and not t.repa_encoder
                calls = 2 * s.steps - 1
                assert f"FID: {n:,} samples x {calls} network calls = {n * calls:,}" in block
                assert "REPA" not in block
            else:
                guided = sde_guided(s.steps, *s.guidance_interval)
                assert 0 < guided < s.steps
                calls = s.steps + guided
                assert (f"FID: {n:,} samples x {calls} network calls = {n * calls:,} image "
                        f"forwards ({s.steps} sampler calls, {guided} of them guided") in block
                assert f"REPA: {t.repa_encoder} features read from {cfg.data.root}" in block
    assert out.count("REPA: ") == 2
    # docs/recipes.md's excerpt is this output, and its saving is these counts
    text = section("docs/recipes.md", "## The recipe configs")
    excerpt = re.search(r"\n```\n(- .*?)```", text, flags=re.S).group(1).splitlines()
    timeless = [re.sub(CALIBRATED, "", line) for line in out.splitlines()]  # this machine's
    assert len(excerpt) == 5 and all(re.sub(CALIBRATED, "", line) in timeless
                                     for line in excerpt)
    assert all(re.search(CALIBRATED, line) for line in excerpt if "REPA:" not in line)
    saved = re.search(r"saves (\d+) of the (\d+) passes", " ".join(text.split())).groups()
    s = load_config(CONFIGS / "imagenet256_uvit_large_flow.py").sample
    guided = sde_guided(s.steps, *s.guidance_interval)
    assert [int(x) for x in saved] == [s.steps - guided, 2 * s.steps]


@pytest.mark.slow
def test_smoke_chain_runs_every_recipe_and_resumes(tmp_path: Path, capsys) -> None:
    """Both rows, both models, at smoke size: REPA on latents with the tiny encoder's stored
    features, logit-normal times, the SDE guided inside the interval, Heun, post-hoc EMA
    snapshots; a second run skips every stage."""
    out = tmp_path / "rt"
    assert recipes_table([*argv(SMOKE)[2:], "--out", str(out), "--quiet"]) == 0
    first = capsys.readouterr().out
    meta = json.loads((out / "data" / "imagenet_features" / "meta.json").read_text())
    assert meta["settings"]["repa"]["grid"] == 4  # 8 x 8 latents in 2 x 2 patches
    for key in RECIPE_ROWS:
        for model in ("uvit", "uvic"):
            run = out / "runs" / f"{key}_{model}"
            assert f"{key} / {model}: trained to step 30" in first
            cfg = json.loads((run / "config.json").read_text())
            r = json.loads((out / "fid" / f"{key}_{model}.json").read_text())
            assert r["attention"] == model and r["n"] == 16
            assert r["protocol"]["features"] == "projection"
            assert cfg["diffusion"]["objective"] == "velocity"
            log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
            if key == "imagenet256_large_flow":
                assert cfg["diffusion"]["timestep_sampling"] == "logit_normal"
                assert r["protocol"]["sampler"].startswith("flow_euler_maruyama")
                assert r["protocol"]["guidance"] == 0.8
                assert r["protocol"]["guidance_interval"] == [0.0, 7 / 3]
                assert all(np.isfinite(x["repa_loss"]) for x in log if "loss" in x)
            else:
                assert r["protocol"]["sampler"].startswith("flow_heun")
                snaps = sorted(p.name for p in (run / "posthoc_ema").iterdir())
                assert snaps == [f"step_{s:07d}_std{d}.safetensors" for s in (10, 20, 30)
                                 for d in ("0.050", "0.100")]
    table = (out / "recipes_table.md").read_text()
    for row in RECIPE_ROWS.values():
        assert f"| {row.title} (`{row.uvit}`) | " in table
    assert table.count("Smoke note (") == 2

    assert recipes_table([*argv(SMOKE)[2:], "--out", str(out), "--quiet"]) == 0
    second = capsys.readouterr().out
    assert second.count("trained (skipped)") == 4
    assert second.count("(skipped: result exists)") == 4
    assert (out / "recipes_table.md").read_text() == table


def test_plan_counts_autoguidance_and_repas_encoder_on_pixels() -> None:
    """With autoguidance beside classifier-free guidance a guided call is 4 passes (the
    weaker network's too), still only inside the interval; on pixel data REPA's encoder
    runs once per training image (steps x batch)."""
    from uvic.config import apply_overrides
    from uvic.diffusion.guidance_interval import sampling_calls as fid_calls
    from uvic.experiments.runner import repa_cost

    cfg = load_config(CONFIGS / "imagenet256_uvit_large_flow.py")
    s = cfg.sample
    guided = sde_guided(s.steps, *s.guidance_interval)
    assert fid_calls(cfg) == (s.steps + guided, s.steps, guided)
    auto = apply_overrides(cfg, ["sample.autoguidance_scale=1.0"])
    assert fid_calls(auto) == (s.steps + 3 * guided, s.steps, guided)
    alone = apply_overrides(cfg, ["sample.cfg_scale=0", "sample.guidance_interval=[]"])
    assert fid_calls(alone) == (s.steps, s.steps, 0)
    assert repa_cost(load_config(CONFIGS / "cifar10_uvit_flow.py")) == ""
    pixels = load_config(CONFIGS / "cifar10_uvit_flow.py",
                         ["train.repa_encoder=vit_base_patch14_dinov2.lvd142m"])
    t = pixels.train
    assert f"+ {t.max_steps * t.batch_size:,} forwards of the frozen " in repa_cost(pixels)
