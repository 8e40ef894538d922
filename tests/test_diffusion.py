"""Noise schedules of uvic.diffusion against docs/conventions.md (float64 NumPy)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, DPMSolverMultistepScheduler, EulerDiscreteScheduler

from uvic.config import DiffusionConfig
from uvic.diffusion.samplers import make_scheduler
from uvic.diffusion.schedule import Diffusion

# diffusers' own time-uniform DPM-Solver grid (our default is logSNR-uniform): the
# grid these tests write out by hand
TIME_UNIFORM = {"use_lu_lambdas": False}

T = 1000


def vp_alpha_bar(t: np.ndarray) -> np.ndarray:
    """alpha_bar(t) = exp(-0.5 t^2 (20 - 0.1) - 0.1 t): the CIFAR-10 VP schedule."""
    return np.exp(-0.5 * t**2 * (20.0 - 0.1) - 0.1 * t)


def scaled_linear_alpha_bar() -> np.ndarray:
    """Stable Diffusion's betas = linspace(sqrt(0.00085), sqrt(0.012), 1000)^2."""
    betas = np.linspace(np.sqrt(0.00085), np.sqrt(0.012), T, dtype=np.float64) ** 2
    return np.cumprod(1.0 - betas)


def grid_t() -> np.ndarray:
    return np.arange(1, T + 1, dtype=np.float64) / T  # t_i = (i + 1) / 1000


@pytest.fixture(scope="module")
def vp() -> Diffusion:
    return Diffusion(DiffusionConfig(schedule="vp_continuous"))


@pytest.fixture(scope="module")
def coco() -> Diffusion:
    return Diffusion(DiffusionConfig(schedule="scaled_linear"))


def test_vp_table_matches_closed_form(vp: Diffusion) -> None:
    table = vp.alphas_cumprod()
    assert table.dtype == torch.float64 and table.shape == (T,)
    np.testing.assert_allclose(table.numpy(), vp_alpha_bar(grid_t()), rtol=1e-12, atol=0)
    # the table is the exact cumulative product of the betas handed to diffusers
    betas = np.asarray(vp.scheduler_kwargs()["trained_betas"], dtype=np.float64)
    np.testing.assert_allclose(np.cumprod(1.0 - betas), vp_alpha_bar(grid_t()), rtol=1e-10)


@pytest.mark.parametrize("name", ["dpm_solver++", "DDIMScheduler", "EulerDiscreteScheduler"])
def test_diffusers_alphas_cumprod_match_vp(vp: Diffusion, name: str) -> None:
    sched = make_scheduler(vp, name)
    got = sched.alphas_cumprod.double().numpy()
    np.testing.assert_allclose(got, vp_alpha_bar(grid_t()), rtol=1e-5, atol=1e-7)


def test_scaled_linear_table(coco: Diffusion) -> None:
    np.testing.assert_allclose(coco.alphas_cumprod().numpy(), scaled_linear_alpha_bar(), rtol=1e-12)
    got = make_scheduler(coco, scheduler_kwargs=TIME_UNIFORM).alphas_cumprod.double().numpy()
    np.testing.assert_allclose(got, scaled_linear_alpha_bar(), rtol=1e-5, atol=1e-7)


def sigma(alpha_bar: float) -> float:
    """diffusers' sigma = sqrt((1 - alpha_bar) / alpha_bar)."""
    return float(np.sqrt((1.0 - alpha_bar) / alpha_bar))


def test_dpm_solver_50_step_grid_vp(vp: Diffusion) -> None:
    sched = make_scheduler(vp, "dpm_solver++", order=2, scheduler_kwargs=TIME_UNIFORM)
    assert isinstance(sched, DPMSolverMultistepScheduler)
    assert sched.config.algorithm_type == "dpmsolver++" and sched.config.solver_order == 2
    sched.set_timesteps(50)
    ks = sched.timesteps.numpy()
    assert len(ks) == 50 and ks[0] == 999
    # diffusers' "linspace" spacing: round(linspace(0, 999, 51))[::-1][:-1]
    expected_k = np.round(np.linspace(0, T - 1, 51))[::-1][:-1].astype(np.int64)
    np.testing.assert_array_equal(ks, expected_k)
    # first noise level: t = 1 exactly; last: t = (k_last + 1) / 1000; then sigma = 0
    np.testing.assert_allclose(sched.sigmas[0].item(), sigma(vp_alpha_bar(1.0)), rtol=1e-5)
    t_last = (ks[-1] + 1) / T
    np.testing.assert_allclose(sched.sigmas[-2].item(), sigma(vp_alpha_bar(t_last)), rtol=1e-5)
    assert sched.sigmas[-1].item() == 0.0
    # the network sees 999 t for every step
    net = vp.net_time(sched.timesteps).numpy()
    np.testing.assert_allclose(net, 999.0 * (ks + 1) / T, rtol=1e-6)
    assert net[0] == pytest.approx(999.0)


def test_dpm_solver_50_step_grid_scaled_linear(coco: Diffusion) -> None:
    sched = make_scheduler(coco, scheduler_kwargs=TIME_UNIFORM)
    sched.set_timesteps(50)
    ab = scaled_linear_alpha_bar()
    ks = sched.timesteps.numpy()
    np.testing.assert_allclose(sched.sigmas[0].item(), sigma(ab[999]), rtol=1e-5)
    np.testing.assert_allclose(sched.sigmas[-2].item(), sigma(ab[ks[-1]]), rtol=1e-5)
    np.testing.assert_array_equal(coco.net_time(sched.timesteps).numpy(), ks + 1.0)


def test_training_inputs_vp(vp: Diffusion) -> None:
    x0 = torch.randn(64, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    x_t, net_t, noise = vp.training_inputs(x0, torch.Generator().manual_seed(2))
    assert net_t.shape == (64,) and net_t.dtype == torch.float32
    assert (net_t >= 0).all() and (net_t <= 999).all() and net_t.std() > 100  # t ~ U(0, 1)
    t = net_t.double().numpy() / 999.0
    ab = vp_alpha_bar(t)[:, None, None, None]
    expected = np.sqrt(ab) * x0.double().numpy() + np.sqrt(1 - ab) * noise.double().numpy()
    np.testing.assert_allclose(x_t.double().numpy(), expected, rtol=1e-4, atol=1e-5)
    # seeded: the same generator seed gives the same draw, another seed does not
    again = vp.training_inputs(x0, torch.Generator().manual_seed(2))
    other = vp.training_inputs(x0, torch.Generator().manual_seed(3))
    assert torch.equal(again[0], x_t) and torch.equal(again[1], net_t)
    assert not torch.equal(other[1], net_t)


def test_training_inputs_scaled_linear(coco: Diffusion) -> None:
    x0 = torch.randn(256, 4, 4, 4, generator=torch.Generator().manual_seed(4))
    x_t, net_t, noise = coco.training_inputs(x0, torch.Generator().manual_seed(5))
    n = net_t.double().numpy()
    assert np.array_equal(n, np.round(n)) and n.min() >= 1 and n.max() <= 1000
    assert len(np.unique(n)) > 100  # k ~ U{0..999}
    ab = scaled_linear_alpha_bar()[n.astype(np.int64) - 1][:, None, None, None]
    expected = np.sqrt(ab) * x0.double().numpy() + np.sqrt(1 - ab) * noise.double().numpy()
    np.testing.assert_allclose(x_t.double().numpy(), expected, rtol=1e-4, atol=1e-5)


def test_add_noise_and_net_time_scaled_linear(coco: Diffusion) -> None:
    k = torch.tensor([0, 1, 500, 999])
    x0, noise = torch.ones(4, 1), torch.full((4, 1), 2.0)
    got = coco.train_scheduler.add_noise(x0, noise, k).double().numpy()[:, 0]
    ab = scaled_linear_alpha_bar()[k.numpy()]
    np.testing.assert_allclose(got, np.sqrt(ab) + 2 * np.sqrt(1 - ab), rtol=1e-5)
    np.testing.assert_array_equal(coco.net_time(k).numpy(), [1.0, 2.0, 501.0, 1000.0])


def test_net_time_vp(vp: Diffusion) -> None:
    k = torch.tensor([0, 499, 999])
    np.testing.assert_allclose(vp.net_time(k).numpy(), [0.999, 499.5, 999.0], rtol=1e-6)


def test_make_scheduler_by_class_name(vp: Diffusion) -> None:
    assert isinstance(make_scheduler(vp, "DDIMScheduler"), DDIMScheduler)
    assert isinstance(make_scheduler(vp, "EulerDiscreteScheduler"), EulerDiscreteScheduler)
    assert make_scheduler(vp, "dpm_solver", order=3).config.algorithm_type == "dpmsolver"
    assert make_scheduler(vp, "DDIMScheduler").config.clip_sample is False
    with pytest.raises(ValueError, match="NoSuchScheduler"):
        make_scheduler(vp, "NoSuchScheduler")
    with pytest.raises(ValueError, match="UNet2DModel"):
        make_scheduler(vp, "UNet2DModel")  # a diffusers class, but not a scheduler


def test_bad_schedule_name() -> None:
    with pytest.raises(ValueError, match="cosine"):
        Diffusion(DiffusionConfig(schedule="cosine"))
