"""`sample.guidance_interval`: guidance only where EDM's noise level
sigma = sigma_t / alpha_t lies in (low, high], the conditional model alone (one network
call) elsewhere.

References are written here independently: sigma from the schedules' closed forms (and,
between the scaled-linear table's steps, from the release solvers' own interpolation), a
DDIM loop by hand, and fake models whose conditional and unconditional outputs are known,
guided by hand at the noise levels the interval names.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import load_script
from torch import nn

from uvic.config import Config, ConfigError, DiffusionConfig, apply_overrides, load_config
from uvic.config.validation import validate
from uvic.diffusion.guidance_interval import (
    edm_sigma,
    guided_calls,
    inside,
    limited,
    sigma_of_time,
)
from uvic.diffusion.samplers import ContinuousSchedule, model_calls, run_sampler
from uvic.diffusion.schedule import Diffusion
from uvic.evaluation.protocols import protocol_from_result, protocol_of
from uvic.files import save_config
from uvic.sampling.generate import guided_eps, sample_images

VP = Diffusion(DiffusionConfig(schedule="vp_continuous"))
COCO = Diffusion(DiffusionConfig(schedule="scaled_linear"))
NULL = 3  # the fake model's null class


def closed_sigma(schedule: str, net_t: torch.Tensor) -> torch.Tensor:
    """sigma = sqrt((1 - alpha_bar) / alpha_bar) from the schedules' own formulas: the VP
    closed form at net time 999 t; the scaled-linear betas' cumulative product at step n,
    the release solvers' log-linear interpolation between steps (`ContinuousSchedule`)."""
    t = net_t.double()
    if schedule == "vp_continuous":
        s = t / 999.0
        ab = torch.exp(-0.5 * s**2 * (20.0 - 0.1) - 0.1 * s)
        return ((1 - ab) / ab).sqrt()
    betas = torch.linspace(math.sqrt(0.00085), math.sqrt(0.012), 1000, dtype=torch.float64) ** 2
    table = torch.cumprod(1 - betas, 0)
    out = []
    for n in t.reshape(-1).tolist():
        if n == round(n):
            ab = float(table[round(n) - 1])
            out.append(math.sqrt((1 - ab) / ab))
        else:
            sch = ContinuousSchedule(COCO)
            out.append(sch.sigma(n / 1000) / sch.alpha(n / 1000))
    return torch.tensor(out, dtype=torch.float64).view(t.shape)


class ClassEps(nn.Module):
    """A fake class-conditional noise predictor, eps = 0.3 x + 0.2 (y + 1) cos(t / 300):
    conditional and unconditional (y = NULL) outputs known in closed form. Logs each
    call's (rows, net time)."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.scale, self.calls = scale, []

    def forward(self, x, t, y=None, return_dict=True):
        self.calls.append((x.shape[0], float(t[0])))
        eps = self.scale * (0.3 * x + 0.2 * (y.double() + 1).view(-1, 1, 1, 1)
                            * torch.cos(t.double() / 300).view(-1, 1, 1, 1)).float()
        return eps if return_dict else (eps,)


def by_hand(schedule: str, s: float, interval: tuple[float, float], y: torch.Tensor,
            weak: ClassEps | None = None, w: float = 0.0):
    """A model that guides itself where the closed-form sigma of its time lies in the
    interval (c + s (c - u), then autoguidance by `weak` with scale w), and is the
    conditional model elsewhere: what the sampler must compute, asked with no guidance."""
    model = ClassEps()

    def eps(x, t, y=None, return_dict=True):
        c = model(x, t, y=y)
        sigma = float(closed_sigma(schedule, t[:1])[0])
        if interval[0] < sigma <= interval[1]:
            u = model(x, t, y=torch.full_like(y, NULL))
            g = c + s * (c - u)
            if weak is not None:
                b = weak(x, t, y=y) + s * (weak(x, t, y=y) - weak(x, t, y=torch.full_like(y, NULL)))
                g = g + w * (g - b)
            c = g
        return c if return_dict else (c,)

    return eps


def guided_times(calls: list[tuple[int, float]], rows: int) -> list[float]:
    return [t for n, t in calls if n == 2 * rows]


# --------------------------------------------------------------------------- noise level


@pytest.mark.parametrize("schedule", ["vp_continuous", "scaled_linear"])
def test_edm_sigma_is_the_schedules_noise_to_signal_ratio(schedule: str) -> None:
    diffusion = VP if schedule == "vp_continuous" else COCO
    steps = torch.arange(1000)
    net = diffusion.net_time(steps)  # every time diffusers' schedulers feed the network
    torch.testing.assert_close(edm_sigma(diffusion, net), closed_sigma(schedule, net),
                               rtol=1e-9, atol=0)
    # the release's "fast" solvers' times between the table's steps (N t, not integers)
    sch = ContinuousSchedule(diffusion)
    for t in (1e-4, 0.0123, 0.37, 0.999):
        want = sch.sigma(t) / sch.alpha(t)
        assert sigma_of_time(diffusion, t) == pytest.approx(want, rel=1e-9)
    # increasing in time: an interval of sigma is an interval of time
    sigma = edm_sigma(diffusion, net)
    assert bool((sigma[1:] > sigma[:-1]).all())


def test_inside_is_low_open_high_closed() -> None:
    sigma = torch.tensor([0.5, 0.50001, 2.0, 2.00001, math.inf])
    assert inside(sigma, (0.5, 2.0)).tolist() == [False, True, True, False, False]
    assert inside(sigma, (0.5, math.inf)).tolist() == [False, True, True, True, True]
    assert inside(sigma, ()).all()


# --------------------------------------------------------------------------- the sampler


def test_interval_guides_the_steps_a_hand_written_ddim_loop_guides() -> None:
    """DDIM (eta 0) written out by hand on the closed-form schedule, guided by hand where
    sigma is in (0.5, 20]: the sampler's images, and its network calls, are that loop's."""
    steps, s, interval, rows = 10, 1.5, (0.5, 20.0), 2
    noise = torch.randn(rows, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 2])
    model = ClassEps()
    got = sample_images(model, VP, noise, y=y, uncond_y=NULL, cfg_scale=s,
                        scheduler="DDIMScheduler", steps=steps, guidance_interval=interval)

    ref = ClassEps()
    x, guided, ks = noise.double(), [], [900 - 100 * i for i in range(steps)]
    for k in ks:
        net_t = torch.full((rows,), 999.0 * (k + 1) / 1000)
        ab = 1 / (1 + closed_sigma("vp_continuous", net_t[:1]) ** 2)
        ab_prev = (1 / (1 + closed_sigma("vp_continuous", torch.tensor([999.0 * (k - 99) / 1000]))
                        ** 2)) if k >= 100 else torch.ones(1, dtype=torch.float64)
        c = ref(x.float(), net_t, y=y).double()
        if interval[0] < float((1 / ab - 1).sqrt()) <= interval[1]:
            guided.append(float(net_t[0]))
            c = c + s * (c - ref(x.float(), net_t, y=torch.full_like(y, NULL)).double())
        x0 = (x - (1 - ab).sqrt() * c) / ab.sqrt()
        x = ab_prev.sqrt() * x0 + (1 - ab_prev).sqrt() * c
    torch.testing.assert_close(got.double(), x, rtol=1e-4, atol=1e-4)
    assert 0 < len(guided) < steps  # the interval cuts the chain: some steps unguided
    assert guided_times(model.calls, rows) == pytest.approx(guided)
    # one call per step; 2B rows on the guided ones only
    assert [n for n, _ in model.calls] == [2 * rows if t in guided else rows
                                           for _, t in model.calls]
    assert sum(n for n, _ in model.calls) == rows * (steps + len(guided))


@pytest.mark.parametrize(("schedule", "scheduler", "steps"), [
    ("vp_continuous", "dpm_solver++", 12),
    ("vp_continuous", "dpm_solver_fast_logsnr", 12),
    ("scaled_linear", "dpm_solver++_fast_time_uniform", 12),
    ("vp_continuous", "euler_maruyama", 20),
    ("scaled_linear", "DDPMScheduler", 10),
])
def test_every_sampler_guides_by_noise_level(schedule: str, scheduler: str, steps: int) -> None:
    """The release's protocols, Euler-Maruyama and a stochastic diffusers scheduler: the
    images equal those of a model guiding itself by hand by closed-form sigma, and only
    the steps with sigma in (low, high] run the unconditional rows and the guide."""
    diffusion = VP if schedule == "vp_continuous" else COCO
    interval, rows, s, w = (0.3, 3.0), 2, 0.8, 0.5
    noise = torch.randn(rows, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([1, 0])
    model, guide = ClassEps(), ClassEps(scale=0.7)
    kw = {"scheduler": scheduler, "steps": steps, "generator": torch.Generator().manual_seed(5)}
    got = sample_images(model, diffusion, noise, y=y, uncond_y=NULL, cfg_scale=s, guide=guide,
                        autoguidance_scale=w, guidance_interval=interval, **kw)
    kw["generator"] = torch.Generator().manual_seed(5)
    want = sample_images(by_hand(schedule, s, interval, y, ClassEps(scale=0.7), w), diffusion,
                         noise, y=y, **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    times = torch.tensor([t for _, t in model.calls])
    expect = inside(closed_sigma(schedule, times), interval)
    assert len(model.calls) == model_calls(diffusion, scheduler, steps)
    assert 0 < int(expect.sum()) < len(times)
    assert [n == 2 * rows for n, _ in model.calls] == expect.tolist()
    # the weaker model runs (guided, 2B rows) at the guided steps only
    assert [t for _, t in guide.calls] == times[expect].tolist()
    assert guided_calls(diffusion, interval, scheduler, steps) == (int(expect.sum()), len(times))


def today_eps_fn(model, guide, y, s, w):
    """The guided prediction as sampling formed it before the interval existed."""
    def eps_fn(x, t):
        eps = guided_eps(model, x, t, cfg_scale=s, y=y, uncond_y=NULL)
        if w != 0.0:
            weak = guided_eps(guide, x, t, cfg_scale=s, y=y, uncond_y=NULL)
            eps = eps + w * (eps - weak)
        return eps
    return eps_fn


@pytest.mark.parametrize("scheduler", ["dpm_solver++", "dpm_solver_fast_logsnr"])
def test_no_interval_is_todays_sampling_bit_for_bit(scheduler: str) -> None:
    noise = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(2))
    y = torch.tensor([2, 1])
    model, guide = ClassEps(), ClassEps(scale=0.5)
    kw = {"scheduler": scheduler, "steps": 9}
    today = run_sampler(today_eps_fn(model, guide, y, 1.2, 0.4), VP, noise, **kw)
    for interval in ((), (0.0, math.inf)):  # none, and one holding every noise level
        got = sample_images(model, VP, noise, y=y, uncond_y=NULL, cfg_scale=1.2, guide=guide,
                            autoguidance_scale=0.4, guidance_interval=interval, **kw)
        assert torch.equal(got, today)
    assert torch.equal(sample_images(model, VP, noise, y=y, uncond_y=NULL, cfg_scale=1.2, **kw),
                       run_sampler(today_eps_fn(model, guide, y, 1.2, 0.0), VP, noise, **kw))
    plain = lambda x, t: x  # noqa: E731
    assert limited(plain, None, VP, ()) is plain  # no interval: the guided function itself


def test_rows_at_different_noise_levels_each_get_their_own() -> None:
    guided = lambda x, t: x + 1  # noqa: E731
    plain = lambda x, t: x - 1  # noqa: E731
    eps = limited(guided, plain, VP, (0.3, 3.0))
    t = torch.tensor([1.0, 999.0 * 0.3, 999.0])  # sigma 0.002, 1.07, 152
    out = eps(torch.zeros(3, 1, 2, 2), t)
    assert out[:, 0, 0, 0].tolist() == [-1.0, 1.0, -1.0]


# --------------------------------------------------------------------------- the config


def imagenet(*sets: str) -> Config:
    return load_config(Path(__file__).parents[1] / "configs" / "imagenet256_uvit_large.py",
                       list(sets))


def test_config_key_parses_validates_and_round_trips_json(tmp_path: Path) -> None:
    cfg = validate(imagenet("sample.guidance_interval=0.3,inf"))
    assert cfg.sample.guidance_interval == (0.3, math.inf)
    assert imagenet("sample.guidance_interval=[]").sample.guidance_interval == ()
    assert Config().sample.guidance_interval == ()  # default: guided everywhere
    save_config(cfg, tmp_path / "config.json")
    assert load_config(tmp_path / "config.json") == cfg  # inf survives config.json


@pytest.mark.parametrize(("value", "words"), [
    ("1.0", "must be two noise levels"), ("0.1,1,2", "must be two noise levels"),
    ("2,1", "low=2.0 must be below high=1.0"), ("1,1", "must be below"),
    ("-0.5,2", "low=-0.5 must be finite and >= 0"), ("nan,2", "NaN is no noise level"),
    ("inf,inf", "must be finite"),
])
def test_bad_intervals_are_refused_in_one_line(value: str, words: str) -> None:
    with pytest.raises(ConfigError, match=r"sample\.guidance_interval=") as err:
        validate(imagenet(f"sample.guidance_interval={value}"))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_an_interval_with_nothing_guided_is_refused() -> None:
    cfg = load_config(Path(__file__).parents[1] / "configs" / "cifar10_uvit.py",
                      ["sample.guidance_interval=0.3,2"])
    with pytest.raises(ConfigError, match=r"nothing is guided.*unconditional"):
        validate(cfg)
    unguided = imagenet("sample.cfg_scale=0", "sample.guidance_interval=0.3,2")
    with pytest.raises(ConfigError, match="nothing is guided"):
        validate(unguided)
    # autoguidance alone is guidance the interval limits
    validate(apply_overrides(unguided, ["sample.autoguidance_scale=1",
                                        "sample.autoguidance_ckpt=early.safetensors"]))


def test_sample_cli_refuses_a_bad_interval_in_one_line(capsys: pytest.CaptureFixture) -> None:
    main = load_script("scripts/sample.py").main
    config = Path(__file__).parents[1] / "configs" / "imagenet256_uvit_large.py"
    rc = main(["--config", str(config), "--ckpt", "missing.pth", "--quiet", "--out", "o",
               "--set", "sample.guidance_interval=3,1"])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and len(err.splitlines()) == 1 and "sample.guidance_interval" in err


# --------------------------------------------------------------------------- the protocol


def test_protocol_records_the_interval_and_older_results_still_read() -> None:
    plain = protocol_of(imagenet())
    limited_p = protocol_of(imagenet("sample.guidance_interval=0.3,inf"))
    assert limited_p != plain and plain.guidance_interval == ()
    assert "guidance 0.4 on sigma in (0.3, inf]" in limited_p.label()
    assert "on sigma" not in plain.label()
    # a result JSON round trip (inf as null), and one written before the key
    result = json.loads(json.dumps({"protocol": limited_p.as_dict()}))
    assert protocol_from_result(result) == limited_p
    old = {k: v for k, v in plain.as_dict().items() if k != "guidance_interval"}
    assert protocol_from_result({"protocol": old}) == plain


def test_fid_samples_folder_records_the_interval(tmp_path: Path) -> None:
    from uvic.evaluation.fid import _check_samples_meta, _samples_meta

    def meta(cfg: Config) -> dict:
        return _samples_meta(cfg, "sha", 0, "fp32", None)

    plain, limited_cfg = imagenet(), imagenet("sample.guidance_interval=0.3,2")
    older = {k: v for k, v in meta(plain).items() if k != "guidance_interval"}
    (tmp_path / "samples.json").write_text(json.dumps(older))  # written before the key
    _check_samples_meta(tmp_path, meta(plain), write=False)  # still matches
    with pytest.raises(ValueError, match="guidance_interval"):
        _check_samples_meta(tmp_path, meta(limited_cfg), write=False)
    (tmp_path / "samples.json").write_text(json.dumps(meta(limited_cfg)))
    with pytest.raises(ValueError, match="guidance_interval"):
        _check_samples_meta(tmp_path, meta(plain), write=False)


# --------------------------------------------------------------------------- the pipeline


def tiny_pipeline(**kw: object):
    """A class-conditional pixel pipeline (tiny random U-ViT, DDIM) with a null class."""
    from diffusers import DDIMScheduler

    from uvic.models.uvit import UViT
    from uvic.pipelines import UViTPipeline

    torch.manual_seed(0)
    model = UViT(img_size=8, patch_size=2, embed_dim=16, depth=2, num_heads=2, num_classes=4,
                 attention="uvic", attention_backend="torch").eval()
    diffusion = {"schedule": "vp_continuous"}
    scheduler = DDIMScheduler(**VP.scheduler_kwargs(), clip_sample=False)
    pipe = UViTPipeline(transformer=model, scheduler=scheduler, diffusion=diffusion,
                        scale_factor=None, cfg_scale=0.5, null_class=NULL, **kw)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_pipeline_takes_the_interval_and_its_config_carries_the_default(tmp_path: Path) -> None:
    from uvic.sampling.noise import make_noise, sample_generators

    interval, labels, steps = (0.3, 5.0), [0, 2], 6
    pipe = tiny_pipeline(guidance_interval=[0.3, 5.0])
    rows: list[int] = []
    pipe.transformer.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))

    def run(p, **kw):
        return p(class_labels=labels, num_inference_steps=steps, output_type="latent",
                 generator=sample_generators(0, range(2)), **kw).images

    got = run(pipe)
    noise = make_noise((3, 8, 8), sample_generators(0, range(2)))
    want = sample_images(pipe.transformer, pipe.diffusion, noise, y=torch.tensor(labels),
                         uncond_y=NULL, cfg_scale=0.5, scheduler="DDIMScheduler", steps=steps,
                         guidance_interval=interval)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    net = VP.net_time(pipe.scheduler.timesteps)
    guided = inside(closed_sigma("vp_continuous", net), interval)
    assert 0 < int(guided.sum()) < steps
    assert rows[:steps] == [4 if g else 2 for g in guided.tolist()]  # 2B rows when guided

    everywhere = run(pipe, guidance_interval=())  # () overrides the default
    assert torch.equal(everywhere, run(tiny_pipeline()))
    assert (everywhere - got).abs().max() > 1e-3  # (float rounding: 1e-5)
    with pytest.raises(ValueError, match=r"guidance_interval=\[2.0, 1.0\]: low=2.0 must be"):
        run(pipe, guidance_interval=(2, 1))
    with pytest.raises(ValueError, match="two noise levels"):
        tiny_pipeline(guidance_interval=[1.0])

    pipe.save_pretrained(tmp_path / "saved")  # the default survives model_index.json
    loaded = type(pipe).from_pretrained(tmp_path / "saved")
    loaded.set_progress_bar_config(disable=True)
    assert list(loaded.config.guidance_interval) == [0.3, 5.0]
    assert torch.equal(run(loaded), got)
    tiny_pipeline(guidance_interval=[0.3, math.inf]).save_pretrained(tmp_path / "inf")
    loaded = type(pipe).from_pretrained(tmp_path / "inf")
    assert list(loaded.config.guidance_interval) == [0.3, None]  # null: no upper bound


def test_export_records_the_runs_interval() -> None:
    from uvic.config import DataConfig, ModelConfig, SampleConfig
    from uvic.models.uvit import build_model
    from uvic.pipelines.export import build_pipeline

    m = ModelConfig(img_size=8, patch_size=2, embed_dim=16, depth=2, num_heads=2,
                    num_classes=5, attention_backend="torch")
    for interval, recorded in (((0.3, 2.0), [0.3, 2.0]), ((), None)):
        cfg = Config(model=m, data=DataConfig(name="shapes", root=""),
                     sample=SampleConfig(guidance_interval=interval))
        pipe, _ = build_pipeline(validate(cfg), build_model(m), null_class=4)
        assert pipe.config.guidance_interval == recorded


def test_generate_and_the_training_grid_follow_the_config() -> None:
    """`generate` (uvic-sample, uvic-fid) and the training loop's grids sample under
    `sample.guidance_interval`: the guided network calls are those in it."""
    from uvic.config import DataConfig, ModelConfig, SampleConfig
    from uvic.models.uvit import build_model
    from uvic.sampling.generate import SampleGrid, generate

    m = ModelConfig(img_size=8, patch_size=2, embed_dim=16, depth=2, num_heads=2,
                    num_classes=5, attention_backend="torch")
    sample = SampleConfig(scheduler="dpm_solver++", steps=8, batch_size=2, cfg_scale=1.0,
                          guidance_interval=(0.3, 2.33))
    cfg = validate(Config(model=m, data=DataConfig(name="shapes", root=""), sample=sample))
    torch.manual_seed(0)
    model = build_model(m).eval()
    rows: list[int] = []
    model.register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[0]))
    inside_n, calls = guided_calls(VP, (0.3, 2.33), "dpm_solver++", 8)
    assert 0 < inside_n < calls == 8
    assert len(list(generate(model, VP, cfg, [0, 1], seed=0))) == 1  # one batch
    assert sorted(rows) == sorted([4] * inside_n + [2] * (calls - inside_n))
    rows.clear()
    SampleGrid(cfg, "cpu", seed=0, n=2).sample(model, VP)
    assert sorted(rows) == sorted([4] * inside_n + [2] * (calls - inside_n))


@pytest.mark.parametrize("interpolant", ["linear", "trigonometric"])
def test_noise_level_of_a_velocity_model_is_its_interpolants(interpolant):
    """Under flow matching sigma = sigma(t) / alpha(t) of the interpolant at t = net time
    / 999: t / (1 - t) (linear), tan(pi t / 2) (trigonometric); REPA's t <= 0.7 is 7/3."""
    from uvic.diffusion.guidance_interval import edm_sigma, sigma_of_time
    from uvic.diffusion.schedule import Diffusion

    diffusion = Diffusion(DiffusionConfig(objective="velocity", interpolant=interpolant))
    t = torch.tensor([0.05, 0.3, 0.7, 0.95], dtype=torch.float64)
    expected = t / (1 - t) if interpolant == "linear" else torch.tan(torch.pi * t / 2)
    torch.testing.assert_close(edm_sigma(diffusion, 999.0 * t), expected)
    if interpolant == "linear":
        assert sigma_of_time(diffusion, 0.7) == pytest.approx(7 / 3)
