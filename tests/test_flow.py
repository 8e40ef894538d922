"""Flow matching (diffusion.objective="velocity"): interpolants, the velocity loss, the flow
samplers and logit-normal times, checked against closed forms.

The reference is Gaussian data x0 ~ N(mu, c^2) per coordinate: x_t = a(t) x0 + s(t) e is
Gaussian, so the exact velocity E[a' x0 + s' e | x_t = x] and E[e | x_t = x] are linear
in x (Gaussian conditioning), written out here in float64 independently of uvic's code.
The ODE's flow map from N(0, 1) is then the increasing affine map z -> mu + c z.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from scipy.stats import kstest, norm

from uvic.config import Config, ConfigError, DiffusionConfig, apply_overrides, load_config
from uvic.config.validation import validate
from uvic.diffusion.flow import SDE_LAST_T, sample_times
from uvic.diffusion.samplers import model_calls, run_sampler
from uvic.diffusion.schedule import Diffusion, diffusion_loss
from uvic.sampling.noise import sample_generators

MU, C = 0.7, 0.4  # the data distribution N(MU, C^2)


def coefficients(name: str, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(a, s, a', s') of the interpolant, float64."""
    t = t.double()
    if name == "linear":
        return 1 - t, t, -torch.ones_like(t), torch.ones_like(t)
    th = math.pi / 2 * t
    return th.cos(), th.sin(), -math.pi / 2 * th.sin(), math.pi / 2 * th.cos()


def exact_velocity(name: str, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """E[a' x0 + s' e | x_t = x] for Gaussian data, float64."""
    a, s, da, ds = coefficients(name, t)
    var = a**2 * C**2 + s**2
    return da * MU + (da * a * C**2 + ds * s) / var * (x.double() - a * MU)


def exact_noise(name: str, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """E[e | x_t = x] for Gaussian data, float64."""
    a, s, _, _ = coefficients(name, t)
    return s / (a**2 * C**2 + s**2) * (x.double() - a * MU)


def v_fn(name: str):
    """The exact velocity as a network: (x, net time 999 t) -> v, float32."""
    def fn(x: torch.Tensor, net_t: torch.Tensor) -> torch.Tensor:
        t = (net_t.double() / 999.0).view(-1, *([1] * (x.dim() - 1)))
        return exact_velocity(name, x, t).float()
    return fn


def flow(interpolant: str = "linear", **kw) -> Diffusion:
    return Diffusion(DiffusionConfig(objective="velocity", interpolant=interpolant, **kw))


class ExactModel(torch.nn.Module):
    """A "network" whose output is the exact velocity (plus `shift`), diffusers-style."""

    def __init__(self, name: str, shift: float = 0.0) -> None:
        super().__init__()
        self.name, self.shift = name, shift

    def forward(self, x, t, return_dict=True):
        out = v_fn(self.name)(x, t) + self.shift
        return out if return_dict else (out,)


# --------------------------------------------------------------------------- training


@pytest.mark.parametrize("name", ["linear", "trigonometric"])
def test_training_inputs_follow_the_interpolant(name: str) -> None:
    """x_t = a x0 + s e and the target a' x0 + s' e, with the draws noise first, then t."""
    x0 = torch.randn(64, 3, 2, 2)
    x_t, net_t, target = flow(name).training_inputs(x0, torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)
    e = torch.randn(x0.shape, generator=g)
    t = torch.rand(64, generator=g).view(-1, 1, 1, 1)
    a, s, da, ds = coefficients(name, t)
    assert torch.allclose(net_t.double(), 999.0 * t.flatten().double(), atol=1e-4)
    assert torch.allclose(x_t.double(), a * x0 + s * e, atol=1e-6)
    assert torch.allclose(target.double(), da * x0 + ds * e, atol=1e-6)
    # the velocity is the time derivative of the interpolant (central difference)
    h = 1e-4
    a1, s1, _, _ = coefficients(name, t.double() + h)
    a0, s0, _, _ = coefficients(name, t.double() - h)
    fd = ((a1 - a0) * x0 + (s1 - s0) * e) / (2 * h)
    assert torch.allclose(target.double(), fd, atol=1e-6)


@pytest.mark.parametrize("name", ["linear", "trigonometric"])
def test_exact_velocity_is_the_loss_minimum(name: str) -> None:
    """With the exact v the velocity MSE is its irreducible value, E_t[Var(v | x_t)] in
    closed form; a shifted v costs the shift squared more."""
    diffusion = flow(name)
    batch = {"x": MU + C * torch.randn(4096, 8, generator=torch.Generator().manual_seed(0))}
    exact = diffusion_loss(ExactModel(name), diffusion, batch, torch.Generator().manual_seed(1))
    shifted = diffusion_loss(ExactModel(name, 0.1), diffusion, batch,
                             torch.Generator().manual_seed(1))
    t = torch.linspace(0, 1, 20001, dtype=torch.float64)
    a, s, da, ds = coefficients(name, t)
    cov = da * a * C**2 + ds * s
    irreducible = (da**2 * C**2 + ds**2 - cov**2 / (a**2 * C**2 + s**2)).mean().item()
    assert exact.item() == pytest.approx(irreducible, rel=0.03)
    # (p + 0.1 - y)^2 - (p - y)^2 = 0.01 + 0.2 (p - y), and p - y has mean 0: within 3.5 SE
    assert (shifted - exact).item() == pytest.approx(0.01, abs=0.003)


def test_logit_normal_times_follow_their_cdf() -> None:
    """t = sigmoid(N(m, s^2)): the KS distance to the closed-form CDF Phi((logit t - m) / s)
    is within sampling error, and the eps objective on vp_continuous draws them too."""
    cfg = DiffusionConfig(timestep_sampling="logit_normal", logit_normal_mean=0.4,
                          logit_normal_std=0.8)
    n = 20_000
    t = sample_times(cfg, n, torch.Generator().manual_seed(0)).double().numpy()
    assert ((t > 0) & (t < 1)).all()

    def cdf(u):
        return norm.cdf((np.log(u / (1 - u)) - 0.4) / 0.8)

    assert kstest(t, cdf).pvalue > 0.01
    assert kstest(t, "uniform").pvalue < 1e-6  # the check can fail
    _, net_t, _ = Diffusion(cfg).training_inputs(torch.zeros(n, 1),
                                                  torch.Generator().manual_seed(1))
    assert kstest(net_t.double().numpy() / 999.0, cdf).pvalue > 0.01


def test_defaults_keep_the_eps_path_bit_identical() -> None:
    """The release's noise-prediction path is untouched: the default config's inputs are the
    old formula's, draw for draw, and objective "eps" written out changes nothing."""
    default, explicit = DiffusionConfig(), DiffusionConfig(
        objective="eps", interpolant="linear", timestep_sampling="uniform")
    x0 = torch.randn(16, 3, 4, 4)
    got = Diffusion(default).training_inputs(x0, torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)  # main's training_inputs: noise, then t ~ U(0, 1)
    noise = torch.randn(x0.shape, generator=g)
    t = torch.rand(16, generator=g)
    abar = torch.exp(-0.5 * t**2 * (20.0 - 0.1) - 0.1 * t).view(-1, 1, 1, 1)
    assert torch.equal(got[0], abar.sqrt() * x0 + (1.0 - abar).sqrt() * noise)
    assert torch.equal(got[1], 999.0 * t) and torch.equal(got[2], noise)

    class Net(torch.nn.Module):
        def forward(self, x, t, return_dict=True):
            out = 0.3 * x + 1e-3 * t.view(-1, 1, 1, 1)
            return out if return_dict else (out,)

    losses = [diffusion_loss(Net(), Diffusion(cfg), {"x": x0}, torch.Generator().manual_seed(2))
              for cfg in (default, explicit)]
    assert torch.equal(losses[0], losses[1])
    noise = torch.randn(4, 3, 4, 4, generator=torch.Generator().manual_seed(9))
    images = [run_sampler(lambda x, t: Net()(x, t, return_dict=False)[0], Diffusion(cfg),
                          noise, scheduler="dpm_solver++", steps=5) for cfg in (default, explicit)]
    assert torch.equal(images[0], images[1])


# --------------------------------------------------------------------------- samplers


def affine_map(name: str, scheduler: str, steps: int) -> tuple[float, float]:
    """(slope, offset) of the sampler's map z -> x0 with the exact v (affine per coordinate)."""
    out = run_sampler(v_fn(name), flow(name), torch.tensor([[0.0], [1.0]]),
                      scheduler=scheduler, steps=steps).double()
    return (out[1] - out[0]).item(), out[0].item()


@pytest.mark.parametrize("name", ["linear", "trigonometric"])
def test_ode_samplers_carry_noise_to_the_data_distribution(name: str) -> None:
    """Euler and Heun with the exact v map N(0, 1) to N(MU, C^2): their error shrinks as
    1/steps (Euler) and 1/steps^2 (Heun) on a step-halving check."""
    def error(scheduler: str, steps: int) -> float:
        slope, offset = affine_map(name, scheduler, steps)
        return abs(slope - C) + abs(offset - MU)

    euler = [error("flow_euler", n) for n in (8, 16, 32)]
    heun = [error("flow_heun", n) for n in (8, 16, 32)]
    assert 1.6 < euler[0] / euler[1] < 2.5 and 1.6 < euler[1] / euler[2] < 2.5
    assert 3.0 < heun[0] / heun[1] < 5.0 and 3.0 < heun[1] / heun[2] < 5.0
    assert heun[2] < euler[2] / 5
    noise = torch.randn(4000, 16, generator=torch.Generator().manual_seed(0))
    x = run_sampler(v_fn(name), flow(name), noise, scheduler="flow_heun", steps=32)
    assert x.mean().item() == pytest.approx(MU, abs=4 * C / 250)
    assert x.std().item() == pytest.approx(C, rel=0.02)


@pytest.mark.parametrize("name", ["linear", "trigonometric"])
def test_euler_maruyama_matches_its_exact_chain(name: str) -> None:
    """Euler-Maruyama with the exact v: each step is x + h (v + E[e | x]) + sqrt(2 s |h|) z,
    affine in x, so the chain's mean and variance follow in closed form; 16,384 draws from
    per-sample generators agree with them within sampling error, and with N(MU, C^2)."""
    steps = 100
    gens = sample_generators(0, range(8))
    noise = torch.stack([torch.randn(2048, generator=torch.Generator().manual_seed(i))
                         for i in range(8)])
    x = run_sampler(v_fn(name), flow(name), noise, scheduler="flow_euler_maruyama",
                    steps=steps, generator=gens).double()
    grid = [*np.linspace(1.0, SDE_LAST_T, steps), 0.0]
    mean, var = 0.0, 1.0
    for i in range(steps):
        t, h = torch.tensor(grid[i], dtype=torch.float64), grid[i + 1] - grid[i]
        at = [torch.tensor(float(v), dtype=torch.float64) for v in (mean, mean + 1)]
        drift = [exact_velocity(name, v, t) + exact_noise(name, v, t) for v in at]
        slope = 1 + h * (drift[1] - drift[0]).item()
        mean = mean + h * drift[0].item()
        var = slope**2 * var + (2 * coefficients(name, t)[1].item() * -h if i < steps - 1 else 0)
    n = x.numel()
    assert x.mean().item() == pytest.approx(mean, abs=5 * math.sqrt(var / n))
    assert x.var().item() == pytest.approx(var, rel=5 * math.sqrt(2 / n))
    assert mean == pytest.approx(MU, abs=0.01) and var == pytest.approx(C**2, rel=0.1)
    # sample i is the same whatever the batch: its step noise is its own generator's
    alone = run_sampler(v_fn(name), flow(name), noise[3:4], scheduler="flow_euler_maruyama",
                        steps=steps, generator=sample_generators(0, [3]))
    assert torch.equal(alone[0].double(), x[3])


def test_diffusers_flow_match_euler_is_flow_euler() -> None:
    """diffusers' FlowMatchEulerDiscreteScheduler (sigma = t) takes Euler's steps: given
    flow_euler's grid it gives flow_euler's samples, and under its own name it runs on
    its own grid (1 .. 1/N, then 0)."""
    noise = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    ours = run_sampler(v_fn("linear"), flow(), noise, scheduler="flow_euler", steps=10)
    sched = FlowMatchEulerDiscreteScheduler()
    sched.set_timesteps(sigmas=np.linspace(1.0, 0.0, 11)[:-1].tolist())
    x = noise.clone()
    for k, sigma in zip(sched.timesteps, sched.sigmas, strict=False):
        x = sched.step(v_fn("linear")(x, torch.full((64,), 999.0 * float(sigma))), k,
                       x).prev_sample
    assert torch.allclose(x, ours, atol=1e-5)
    by_name = run_sampler(v_fn("linear"), flow(), noise,
                          scheduler="FlowMatchEulerDiscreteScheduler", steps=10)
    assert not torch.allclose(by_name, ours, atol=1e-3)  # another grid ...
    slope, offset = affine_map("linear", "FlowMatchEulerDiscreteScheduler", 200)
    assert slope == pytest.approx(C, abs=5e-3) and offset == pytest.approx(MU, abs=5e-3)
    assert model_calls(flow(), "FlowMatchEulerDiscreteScheduler", 10) == 10
    assert [model_calls(flow(), n, 10) for n in ("flow_euler", "flow_heun")] == [10, 19]


# --------------------------------------------------------------------------- config rules


@pytest.mark.parametrize("overrides, message", [
    (["diffusion.objective=x0"],
     "diffusion.objective='x0' must be one of ('eps', 'velocity')"),
    (["diffusion.interpolant=cosine"],
     "diffusion.interpolant='cosine' must be one of ('linear', 'trigonometric')"),
    (["diffusion.timestep_sampling=beta"],
     "diffusion.timestep_sampling='beta' must be one of ('uniform', 'logit_normal')"),
    (["diffusion.logit_normal_std=0"],
     "diffusion.logit_normal_std=0.0 must be > 0 and finite"),
    (["diffusion.interpolant=trigonometric"],
     "diffusion.interpolant='trigonometric' is for diffusion.objective='velocity' (eps uses "
     "diffusion.schedule)"),
    (["diffusion.objective=velocity", "diffusion.schedule=scaled_linear"],
     "diffusion.schedule='scaled_linear' with diffusion.objective='velocity': the interpolant "
     "replaces the schedule, leave diffusion.schedule='vp_continuous'"),
    (["diffusion.objective=velocity", "diffusion.min_snr_gamma=5"],
     "diffusion.min_snr_gamma=5.0 weights the noise MSE; it has no meaning with "
     "diffusion.objective='velocity' (set it to 0)"),
    (["diffusion.schedule=scaled_linear", "diffusion.timestep_sampling=logit_normal"],
     "diffusion.timestep_sampling='logit_normal' needs continuous time: "
     "diffusion.schedule='scaled_linear' draws discrete steps (use 'vp_continuous' or "
     "diffusion.objective='velocity')"),
    (["diffusion.objective=velocity"],  # the default sampler is dpm_solver++
     "sample.scheduler='dpm_solver++' samples noise-prediction models; "
     "diffusion.objective='velocity' takes one of ['flow_euler', 'flow_heun', "
     "'flow_euler_maruyama', 'FlowMatchEulerDiscreteScheduler']"),
    (["sample.scheduler=flow_heun"],
     "sample.scheduler='flow_heun' samples velocity models: it needs "
     "diffusion.objective='velocity' (this config predicts noise)"),
    (["diffusion.objective=velocity", "diffusion.interpolant=trigonometric",
      "sample.scheduler=FlowMatchEulerDiscreteScheduler"],
     "sample.scheduler='FlowMatchEulerDiscreteScheduler' assumes the linear interpolant; "
     "diffusion.interpolant='trigonometric' takes one of ['flow_euler', 'flow_heun', "
     "'flow_euler_maruyama']"),
])
def test_bad_combinations_are_one_line_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(apply_overrides(Config(), overrides))
    assert str(err.value) == message
    ok = apply_overrides(Config(), ["diffusion.objective=velocity", "sample.scheduler=flow_heun",
                                    "diffusion.timestep_sampling=logit_normal"])
    assert validate(ok) is ok


def test_samplers_refuse_the_other_objective() -> None:
    """run_sampler and model_calls (uvic-sample, the pipeline's sampler=) say which
    samplers fit."""
    noise = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="samples velocity models"):
        model_calls(Diffusion(DiffusionConfig()), "flow_heun", 5)
    with pytest.raises(ValueError, match="samples noise-prediction models"):
        model_calls(flow(), "dpm_solver++", 5)
    with pytest.raises(ValueError, match="samples velocity models"):
        run_sampler(v_fn("linear"), Diffusion(DiffusionConfig()), noise, scheduler="flow_euler")
    with pytest.raises(ValueError, match="samples noise-prediction models"):
        run_sampler(v_fn("linear"), flow(), noise, scheduler="dpm_solver++")
    cfg = dataclasses.replace(DiffusionConfig(), objective="velocity")
    assert Diffusion(cfg).cfg.objective == "velocity"


# --------------------------------------------------------------------------- end to end

REPO = Path(__file__).resolve().parents[1]
# a 16x16 U-ViT of width 32 on the shapes data, attention in PyTorch (the Triton
# interpreter is slow for training), 3 steps, one grid with the flow sampler at the end
TINY = ["model.img_size=16", "model.patch_size=4", "model.embed_dim=32", "model.depth=2",
        "model.num_heads=2", "model.attention_backend=torch", "data.num_workers=0",
        "data.num_images=8", "train.batch_size=4", "train.max_steps=3", "train.log_every=1",
        "train.ckpt_every=3", "train.sample_every=3", "train.n_grid=2",
        "train.mixed_precision=no", "optim.warmup_steps=0", "optim.lr=1e-3",
        "sample.autoguidance_scale=0", "sample.steps=3", "diffusion.objective=velocity",
        "diffusion.min_snr_gamma=0",
        "sample.scheduler=flow_euler_maruyama"]


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each train() builds its own Accelerator; reset Accelerate's process-wide state."""
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.mark.parametrize("attention", ["uvit", "uvic", "uvie", "uvis"])
def test_tiny_uvit_trains_and_samples_with_velocity(tmp_path: Path, attention: str) -> None:
    """Every attention mode trains through the one loop with the velocity objective
    (logit-normal times), draws its training grid with a flow sampler, and samples with
    each flow sampler, as diffusers' pipeline does from its export."""
    from uvic.models.uvit import build_model
    from uvic.pipelines.export import build_pipeline
    from uvic.run.weights import load_weights
    from uvic.sampling.generate import sample_images
    from uvic.sampling.noise import make_noise
    from uvic.training.trainer import train

    cfg = load_config(REPO / "configs" / "quickstart.py",
                      [*TINY, f"train.output_dir={tmp_path}", f"model.attention={attention}",
                       "diffusion.timestep_sampling=logit_normal"])
    train(cfg)
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in log)
    assert any(p.suffix == ".png" for p in (tmp_path / "samples").rglob("*"))
    model = build_model(cfg.model)
    load_weights(model, tmp_path / "ema.safetensors")
    model.eval()
    gens = sample_generators(0, range(2))
    noise = make_noise((3, 16, 16), gens)
    diffusion = Diffusion(cfg.diffusion)
    images = {name: sample_images(model, diffusion, noise, scheduler=name, steps=3,
                                  generator=sample_generators(0, range(2)))
              for name in ("flow_euler", "flow_heun", "flow_euler_maruyama",
                           "FlowMatchEulerDiscreteScheduler")}
    assert all(torch.isfinite(x).all() and x.shape == noise.shape for x in images.values())
    pipe, note = build_pipeline(cfg, model)
    assert type(pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert "saved as FlowMatchEulerDiscreteScheduler" in note
    assert pipe.config.diffusion["objective"] == "velocity"
    out = pipe(batch_size=2, num_inference_steps=3, latents=noise, output_type="latent",
               sampler="flow_heun").images
    assert torch.allclose(out, images["flow_heun"], atol=1e-5)
    out = pipe(batch_size=2, num_inference_steps=3, latents=noise, output_type="latent").images
    assert torch.allclose(out, images["FlowMatchEulerDiscreteScheduler"], atol=1e-5)


# --------------------------------------------------------------------------- configs


def test_flow_configs_are_the_release_recipe_with_flow_matching() -> None:
    """cifar10_uvit_flow / cifar10_uvic_flow: cifar10_uvit / cifar10_uvic with only the
    objective and the sampler changed."""
    for model in ("uvit", "uvic"):
        base = load_config(REPO / "configs" / f"cifar10_{model}.py")
        cfg = validate(load_config(REPO / "configs" / f"cifar10_{model}_flow.py"))
        assert cfg.name == f"cifar10_{model}_flow"
        assert cfg.train.output_dir == f"runs/cifar10_{model}_flow"
        d = cfg.diffusion
        assert (d.objective, d.interpolant, d.timestep_sampling) == ("velocity", "linear",
                                                                     "uniform")
        assert (cfg.sample.scheduler, cfg.sample.steps) == ("flow_heun", 50)
        same = dataclasses.replace(
            cfg, name=base.name, train=base.train,
            diffusion=dataclasses.replace(d, objective="eps"),
            sample=dataclasses.replace(cfg.sample, scheduler=base.sample.scheduler,
                                       steps=base.sample.steps))
        assert same == base


@pytest.mark.slow
def test_flow_configs_dry_run_states_their_compute(capsys, tmp_path: Path) -> None:
    """The release-table plan of the flow pair: the release's 500k x 128 training, and FID
    with Heun's 99 network calls per sample under a protocol that names the objective."""
    from uvic.cli import tables
    from uvic.experiments.runner import Row, Table

    table = Table(name="flow", description="", smoke_rows=(), smoke_help="", render=str,
                  rows=tuple(Row("cifar10_flow", m, f"cifar10_{m}_flow")
                             for m in ("uvit", "uvic")))
    assert tables.run(table, ["--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for model in ("uvit", "uvic"):
        assert f"- cifar10_flow / {model}: train 500,000 of 500,000 steps x 128 images" in out
    assert out.count("FID: 50,000 samples x 99 network calls = 4,950,000 image forwards; "
                     "protocol: flow_heun (velocity, linear interpolant) 50 steps, 50000 "
                     "samples, legacy_pytorch, ref cifar10/train/32") == 2
    assert not any(tmp_path.iterdir())
