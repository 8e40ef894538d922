"""The release's evaluation protocol of every row (`uvic.evaluation.protocols.RELEASE_ROWS`)
and the configs' defaults, against the values read from the U-ViT release (baofff/U-ViT)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import readme_commands

from uvic.config import apply_overrides, load_config
from uvic.config.sampling import effective_cfg_scale
from uvic.evaluation.protocols import RELEASE_ROWS, protocol_of

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

# Read from the release, not from uvic: each config's `config.sample` (sample_steps,
# n_samples, mini_batch_size, algorithm, cfg/scale), the eval script its README runs it with
# (which picks the DPM-Solver file), and datasets.py's `fid_stat` path.
RELEASE_SAMPLE = {  # uvic preset: (eval script, algorithm, steps, n, batch, scale, fid_stat)
    "cifar10_uvit": ("eval.py", "euler_maruyama_sde", 1000, 50_000, 500, None,
                     "fid_stats_cifar10_train_pytorch.npz"),
    "celeba64_uvit_small": ("eval.py", "euler_maruyama_sde", 1000, 50_000, 500, None,
                            "fid_stats_celeba64_train_50000_ddim.npz"),
    "imagenet64_uvit_mid": ("eval.py", "dpm_solver", 50, 50_000, 200, None,
                            "fid_stats_imagenet64_guided_diffusion.npz"),
    "imagenet64_uvit_large": ("eval.py", "dpm_solver", 50, 50_000, 200, None,
                              "fid_stats_imagenet64_guided_diffusion.npz"),
    "imagenet256_uvit_large": ("eval_ldm.py", "dpm_solver", 50, 50_000, 50, 0.4,
                               "fid_stats_imagenet256_guided_diffusion.npz"),
    "imagenet256_uvit_huge": ("eval_ldm_discrete.py", "dpm_solver", 50, 50_000, 50, 0.4,
                              "fid_stats_imagenet256_guided_diffusion.npz"),
    "imagenet512_uvit_large": ("eval_ldm.py", "dpm_solver", 50, 50_000, 50, 0.7,
                               "fid_stats_imagenet512_guided_diffusion.npz"),
    "imagenet512_uvit_huge": ("eval_ldm_discrete.py", "dpm_solver", 50, 50_000, 50, 0.7,
                              "fid_stats_imagenet512_guided_diffusion.npz"),
    "mscoco_uvit": ("eval_t2i_discrete.py", "dpm_solver", 50, 30_000, 50, 1.0,
                    "fid_stats_mscoco256_val.npz"),
}
# What each (script, algorithm) runs, by uvic's name: eval.py and eval_ldm.py call
# dpm_solver_pytorch.py's sample(fast_version=True); eval_ldm_discrete.py and
# eval_t2i_discrete.py call dpm_solver_pp.py's sample (method "fast", time-uniform grid).
SAMPLERS = {("eval.py", "euler_maruyama_sde"): "euler_maruyama",
            ("eval.py", "dpm_solver"): "dpm_solver_fast_logsnr",
            ("eval_ldm.py", "dpm_solver"): "dpm_solver_fast_logsnr",
            ("eval_ldm_discrete.py", "dpm_solver"): "dpm_solver++_fast_time_uniform",
            ("eval_t2i_discrete.py", "dpm_solver"): "dpm_solver++_fast_time_uniform"}


def test_every_release_row_is_named() -> None:
    assert sorted(row.uvit for row in RELEASE_ROWS.values()) == sorted(RELEASE_SAMPLE)


@pytest.mark.parametrize("key", sorted(RELEASE_ROWS))
def test_row_protocol_is_the_release_one(key: str) -> None:
    row = RELEASE_ROWS[key]
    script, algorithm, steps, n, _batch, scale, stats = RELEASE_SAMPLE[row.uvit]
    p = row.protocol
    assert (p.sampler, p.steps, p.n_samples, p.fid_mode) == (
        SAMPLERS[script, algorithm], steps, n, "legacy_pytorch")
    assert p.guidance == (scale or 0.0)
    assert row.guidance_scale == (scale or 0.0) + 1.0  # diffusers' convention
    assert row.release_stats == stats
    small = row.uvit in ("cifar10_uvit", "mscoco_uvit")  # the release's *_uvit_small.py
    assert row.release_config == f"configs/{row.uvit}{'_small' if small else ''}.py"


@pytest.mark.parametrize("key", sorted(RELEASE_ROWS))
def test_configs_default_to_the_row_protocol(key: str) -> None:
    """Both the U-ViT preset and its U-ViC twin evaluate, by default, under the release's
    protocol; ImageNet and CelebA name the release's statistics file in eval.ref_stats."""
    row = RELEASE_ROWS[key]
    batch = RELEASE_SAMPLE[row.uvit][4]
    for preset in (row.uvit, row.uvic):
        cfg = load_config(CONFIGS / f"{preset}.py")
        assert protocol_of(cfg) == row.protocol, preset
        assert cfg.sample.batch_size == batch
        if key not in ("cifar10", "mscoco"):
            assert Path(cfg.eval.ref_stats).name == row.release_stats


def test_labels_name_both_guidance_conventions() -> None:
    assert RELEASE_ROWS["imagenet256_large"].label() == (
        "dpm_solver_fast_logsnr, 50 steps, guidance s=0.4 (diffusers guidance_scale=1.4), "
        "50000 samples, labels: uniform over 1000 classes, the release's statistics: "
        "fid_stats_imagenet256_guided_diffusion.npz")
    assert RELEASE_ROWS["celeba64_small"].label().startswith(
        "euler_maruyama, 1000 steps, no guidance, 50000 samples")
    assert RELEASE_ROWS["imagenet512_huge"].protocol.label() == (
        "dpm_solver++_fast_time_uniform 50 steps, guidance 0.7, labels uniform over 1000 classes, "
        "50000 samples, legacy_pytorch, "
        "ref fid_stats_imagenet512_guided_diffusion/train/512")


@pytest.mark.parametrize("preset,overrides,expected", [
    ("imagenet256_uvit_large", [], 0.4), ("imagenet256_uvit_large", ["diffusion.p_uncond=0"], 0),
    ("imagenet64_uvit_mid", ["sample.cfg_scale=2"], 0), ("mscoco_uvit", [], 1.0),
    ("cifar10_uvit", ["sample.cfg_scale=3"], 0), ("celeba64_uvit_small", [], 0)])
def test_protocol_guidance_is_what_sampling_applies(preset: str, overrides: list[str],
                                                    expected: float) -> None:
    """A class-conditional model guided against its null class records its guidance (it
    was recorded as 0 before: only text models counted)."""
    cfg = apply_overrides(load_config(CONFIGS / f"{preset}.py"), overrides)
    assert protocol_of(cfg).guidance == effective_cfg_scale(cfg) == expected
    unguided = dataclasses.replace(cfg, sample=dataclasses.replace(cfg.sample, cfg_scale=0.0))
    assert protocol_of(unguided).guidance == 0.0


def test_readme_fid_table_is_the_row_protocols() -> None:
    """docs/evaluation.md's table of the ImageNet and CelebA protocols states RELEASE_ROWS."""
    section = readme_commands.section("docs/evaluation.md", "## ImageNet and CelebA")
    lines = re.findall(r"^\| (CelebA|ImageNet) ([^|]+) \| (.+) \|$", section, flags=re.M)
    titles = {"CelebA 64": ["celeba64_small"], "ImageNet 64 M/4, L/4":
              ["imagenet64_mid", "imagenet64_large"]}
    assert len(lines) == 6
    for kind, name, cells in lines:
        title = f"{kind} {name.strip()}"
        keys = titles.get(title) or [f"imagenet{title.split()[1]}_"
                                     f"{'large' if ' L/' in title else 'huge'}"]
        sampler, guidance, _, stats = cells.split(" | ")
        for key in keys:
            p, row = RELEASE_ROWS[key].protocol, RELEASE_ROWS[key]
            assert sampler == f"`{p.sampler}`, {p.steps}"
            assert guidance == (f"{p.guidance:g} ({row.guidance_scale:g})" if p.guidance
                                else "none")
            assert stats in (f"`data/fid_stats/{row.release_stats}`", "the same")
            cfg = load_config(CONFIGS / f"{row.uvit}.py")
            assert stats == "the same" or stats == f"`{cfg.eval.ref_stats}`"
