"""One validation entry point (`uvic.config.validation.validate`) runs the rules of every section,
which live with their domain (`uvic/<domain>/checks.py`); each rule is stated once.

The messages below are the ones users and the other tests see: one line naming the key
and the value. They are spelled out here, not built from the code's constants.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import uvic_kernels.fused_attention as fused_attention
from uvic.config import Config, ConfigError, apply_overrides
from uvic.config.models import check_backend_fits, check_model
from uvic.config.validation import validate
from uvic.models.uvit import build_model

TINY_MODEL = ["model.img_size=8", "model.embed_dim=32", "model.depth=2", "model.num_heads=2"]

# One broken rule per case: override -> the whole message.
MESSAGES = [
    ("data.name=lsun", "data.name='lsun' must be one of ('cifar10', 'mscoco', 'shapes', "
     "'imagenet', 'imagenet_features', 'celeba')"),
    ("data.num_workers=-1", "data.num_workers=-1 must be >= 0"),
    ("diffusion.schedule=cosine", "diffusion.schedule='cosine' must be one of "
     "('vp_continuous', 'scaled_linear')"),
    ("diffusion.p_uncond=1.0", "diffusion.p_uncond=1.0 must be in [0, 1)"),
    ("diffusion.min_snr_gamma=-1", "diffusion.min_snr_gamma=-1.0 must be >= 0 (0: off)"),
    ("diffusion.beta_max=0.05", "diffusion.beta_min=0.1, diffusion.beta_max=0.05: the noise "
     "schedule must not end below its start (0 <= beta_min <= beta_max, beta_max > 0 and "
     "finite)"),
    ("diffusion.num_train_timesteps=1", "diffusion.num_train_timesteps=1 must be >= 2"),
    ("train.grad_accum=0", "train.grad_accum=0 must be >= 1"),
    ("train.batch_size=0", "train.batch_size=0 must be >= 1"),
    ("train.max_steps=-1", "train.max_steps=-1 must be >= 0"),
    ("train.ema_decay=1.5", "train.ema_decay=1.5 must be in [0, 1]"),
    ("train.keep_last=0", "train.keep_last=0 must be >= 1"),
    ("train.keep_steps=[0]", "train.keep_steps=[0] must be steps >= 1"),
    ("train.mixed_precision=fp8",
     "train.mixed_precision='fp8' must be no, fp16, bf16 or empty (the launcher's)"),
    ("train.ckpt_every=-1", "train.ckpt_every=-1 must be >= 0 (0: never)"),
    ("train.n_grid=0", "train.n_grid=0 must be >= 1 (or train.sample_every=0: no grids)"),
    ("optim.lr=0", "optim.lr=0.0 must be > 0"),
    ("optim.betas=(0.9,1.5)", "optim.betas=(0.9, 1.5) must be in [0, 1)"),
    ("optim.weight_decay=-1", "optim.weight_decay=-1.0 must be >= 0"),
    ("optim.warmup_steps=-1", "optim.warmup_steps=-1 must be >= 0"),
    ("optim.grad_clip=-1", "optim.grad_clip=-1.0 must be >= 0"),
    ("optim.lr_schedule=linear",
     "optim.lr_schedule='linear' must be one of ('constant', 'cosine')"),
    ("eval.mode=fast",
     "eval.mode='fast' must be one of ('clean', 'legacy_pytorch', 'legacy_tensorflow')"),
    ("eval.features=clip", "eval.features='clip' must be one of ('inception', 'projection')"),
    ("eval.n_samples=1", "eval.n_samples=1 must be >= 2"),
    ("sample.steps=0", "sample.steps=0 must be >= 1"),
    ("sample.batch_size=0", "sample.batch_size=0 must be >= 1"),
    ("sample.decode_batch_size=0", "sample.decode_batch_size=0 must be >= 1"),
    ("sample.cfg_scale=inf", "sample.cfg_scale=inf must be finite"),
    ("sample.autoguidance_scale=1.0", "sample.autoguidance_scale=1.0 needs "
     "sample.autoguidance_ckpt (the weaker model's weights)"),
    ("sample.order=4", "sample.order=4 must be 1, 2 or 3 (DPM-Solver orders)"),
    ("sample.scheduler=Nope", "sample.scheduler='Nope' is neither one of ['dpm_solver++', "
     "'dpm_solver', 'dpm_solver++_fast_time_uniform', 'dpm_solver_fast_logsnr', "
     "'euler_maruyama', 'flow_euler', 'flow_heun', 'flow_euler_maruyama'] nor a diffusers "
     "scheduler class name"),
    ("sample.scheduler=dpm_solver_fast", "sample.scheduler='dpm_solver_fast' is retired: it was "
     "not the release's MS-COCO protocol; use 'dpm_solver++_fast_time_uniform' (the "
     "release's dpm_solver_pp.py: MS-COCO, ImageNet H/2 and H/4) or 'dpm_solver_fast_logsnr' "
     "(its dpm_solver_pytorch.py: ImageNet 64, ImageNet L/2 and L/4)"),
]
# model.* rules: validate says what building the model says.
MODEL_MESSAGES = [
    ("model.depth=3", "model.depth=3 must be even and >= 2 "
     "(depth/2 in-blocks + mid-block + depth/2 out-blocks)"),
    ("model.img_size=9", "model.img_size=9 is not divisible by model.patch_size=2"),
    ("model.attention_backend=cuda", "model.attention_backend='cuda': choose one of "
     "['auto', 'sdpa', 'torch', 'triton']"),
    ("model.attention=uvic", "model.attention_backend='sdpa' runs softmax, differential and "
     "differential_v2 attention only, but blocks [1] use 'cog'; use 'auto', 'triton' or "
     "'torch'"),
    ("model.attention=softmax,cog", "model.attention='softmax,cog': has 2 entries but depth 2 "
     "gives 3 blocks (in_blocks, mid_block, out_blocks)"),
    ("model.pos_embed_init=zeros",
     "model.pos_embed_init='zeros': choose one of ['normal', 'sincos']"),
]


@pytest.mark.parametrize("override, message", MESSAGES)
def test_every_rule_names_the_key_and_value(override: str, message: str) -> None:
    """Each section's rules, through the one entry point: the first broken rule's line."""
    assert validate(Config()) is not None
    with pytest.raises(ConfigError) as err:
        validate(apply_overrides(Config(), [override]))
    assert str(err.value) == message


@pytest.mark.parametrize("override, message", MODEL_MESSAGES)
def test_validate_checks_the_model_as_building_it_does(override: str, message: str) -> None:
    """The model section is checked before any work, by the rules `UViT` applies to its
    arguments (the same line, a ConfigError either way)."""
    cfg = apply_overrides(Config(), [*TINY_MODEL, "model.attention_backend=sdpa", override])
    with pytest.raises(ConfigError) as checked:
        validate(cfg)
    with pytest.raises(ConfigError) as built:
        build_model(cfg.model)
    assert str(checked.value) == str(built.value) == message


def test_sdpa_rule_is_the_kernels_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """"sdpa cannot run a Cog block" is stated once, in the kernels' BACKEND_MODES: the
    model's check and the kernel's input check both read it (a table that let sdpa run
    Cog would pass both)."""
    q = k = v = torch.zeros(1, 1, 2, 4)
    modes = ["softmax", "cog", "softmax"]
    cfg = apply_overrides(Config(), [*TINY_MODEL, "model.attention=uvic",
                                     "model.attention_backend=sdpa"])
    with pytest.raises(ValueError,
                       match="softmax, differential and differential_v2 attention only"):
        check_backend_fits("sdpa", modes)
    with pytest.raises(ValueError, match="softmax attention only"):
        fused_attention._check_inputs(q, k, v, "cog", None, "sdpa")
    monkeypatch.setitem(fused_attention.BACKEND_MODES, "sdpa", ("softmax", "cog"))
    check_backend_fits("sdpa", modes)
    check_model(cfg.model)
    fused_attention._check_inputs(q, k, v, "cog", None, "sdpa")


def test_a_discrete_schedule_that_ends_below_its_start_is_refused() -> None:
    cfg = apply_overrides(Config(), ["diffusion.schedule=scaled_linear",
                                     "diffusion.beta_start=0.012", "diffusion.beta_end=0.00085"])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert str(err.value) == (
        "diffusion.beta_start=0.012, diffusion.beta_end=0.00085: the noise schedule must not "
        "end below its start (0 < beta_start <= beta_end < 1)")
    validate(apply_overrides(Config(), ["diffusion.schedule=scaled_linear"]))


def test_scheduler_names_are_read_without_importing_diffusers() -> None:
    """A diffusers scheduler named by its class is checked against the names diffusers'
    source exports, without importing diffusers (which imports torch): a config's rules
    answer in a fraction of a second."""
    code = ("import sys\n"
            "from uvic.config import Config, ConfigError, apply_overrides\n"
            "from uvic.config.validation import validate\n"
            "validate(apply_overrides(Config(), ['sample.scheduler=DDPMScheduler']))\n"
            "try:\n"
            "    validate(apply_overrides(Config(), ['sample.scheduler=DDPMSchedular']))\n"
            "except ConfigError as err:\n"
            "    print(err)\n"
            "print(sorted(m for m in ('torch', 'diffusers') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "sample.scheduler='DDPMSchedular' is neither one of ['dpm_solver++', 'dpm_solver', "
        "'dpm_solver++_fast_time_uniform', 'dpm_solver_fast_logsnr', 'euler_maruyama', "
        "'flow_euler', 'flow_heun', 'flow_euler_maruyama'] nor a diffusers scheduler class "
        "name", "[]"]


def test_scheduler_names_are_diffusers_scheduler_classes() -> None:
    """The names read from diffusers' source are exactly its scheduler classes (those
    `diffusers_class` builds from), the deprecated ones included."""
    import diffusers
    from diffusers.schedulers.scheduling_utils import SchedulerMixin

    from uvic.config.diffusion import diffusers_class, diffusers_scheduler_names

    names = diffusers_scheduler_names()
    assert {"DDPMScheduler", "FlowMatchEulerDiscreteScheduler", "ScoreSdeVpScheduler"} <= names
    exported = {n for n in dir(diffusers) if n.endswith("Scheduler") and not n.startswith("Flax")
                and isinstance(getattr(diffusers, n), type)
                and issubclass(getattr(diffusers, n), SchedulerMixin)}
    assert exported <= names
    for name in names - exported:  # deprecated, or its optional dependency is missing
        try:
            assert issubclass(diffusers_class(name), SchedulerMixin), name
        except ConfigError:  # diffusers' placeholder for a missing dependency (torchsde)
            assert hasattr(diffusers, name), name
