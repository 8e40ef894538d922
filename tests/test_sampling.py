"""DPM-Solver sampling, guidance, time inputs, seeding, grids and the sample.py CLI."""

from __future__ import annotations

import io
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import load_script
from datagen import make_mscoco_features, tiny_clip_folder, tiny_vae, tiny_vae_folder
from PIL import Image
from torch import nn

from uvic.config import (
    Config,
    ConfigError,
    DataConfig,
    DiffusionConfig,
    ModelConfig,
    SampleConfig,
    apply_overrides,
)
from uvic.config.validation import validate
from uvic.diffusion.samplers import make_scheduler
from uvic.diffusion.schedule import Diffusion
from uvic.models.uvit import build_model
from uvic.run.weights import save_safetensors
from uvic.sampling.assets import to_pixels
from uvic.sampling.generate import generate, guided_eps, sample_images
from uvic.sampling.images import MIN_GRID_WIDTH, grid_upscale, save_comparison_grid, save_grid
from uvic.sampling.load import load_guide
from uvic.sampling.noise import make_noise, sample_generators

REPO = Path(__file__).resolve().parents[1]
VP = DiffusionConfig(schedule="vp_continuous")
COCO = DiffusionConfig(schedule="scaled_linear")


def tiny_config(**model: object) -> Config:
    """A tiny unconditional U-ViC on 8x8 'shapes' pixels, 3-step DPM-Solver++ (attention
    in PyTorch: the Triton CPU interpreter is correct but slow)."""
    m = {"img_size": 8, "patch_size": 2, "embed_dim": 32, "depth": 2, "num_heads": 2,
         "attention": "uvic", "attention_backend": "torch", **model}
    return Config(name="tiny", model=ModelConfig(**m), data=DataConfig(name="shapes", root=""),
                  sample=SampleConfig(steps=3, batch_size=4, cfg_scale=0.0))


def tiny_model(cfg: Config, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(cfg.model).eval()


# --------------------------------------------------------------------------- exact solutions


def alpha_bar_of_net_time(schedule: str, t: torch.Tensor) -> torch.Tensor:
    """Invert the release's time conventions with the schedule formulas (float64)."""
    t = t.double()
    if schedule == "vp_continuous":
        s = t / 999.0
        return torch.exp(-0.5 * s**2 * (20.0 - 0.1) - 0.1 * s)
    betas = torch.linspace(math.sqrt(0.00085), math.sqrt(0.012), 1000, dtype=torch.float64) ** 2
    return torch.cumprod(1 - betas, 0)[t.round().long() - 1]


class PointMassEps(nn.Module):
    """The exact noise predictor when all data is one point m:
    eps(x_t, t) = (x_t - sqrt(ab) m) / sqrt(1 - ab), ab read from the network time.
    Every deterministic solver then lands exactly on m, but only if it feeds the network
    the right time and the right (scaled) input."""

    def __init__(self, schedule: str, m: torch.Tensor) -> None:
        super().__init__()
        self.schedule, self.m = schedule, m
        self.times: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor, t: torch.Tensor, context=None, return_dict=True):
        self.times.append(t.clone())
        ab = alpha_bar_of_net_time(self.schedule, t).view(-1, 1, 1, 1)
        eps = ((x.double() - ab.sqrt() * self.m) / (1 - ab).sqrt()).float()
        return eps if return_dict else (eps,)


@pytest.mark.parametrize("schedule", ["vp_continuous", "scaled_linear"])
@pytest.mark.parametrize("scheduler", ["dpm_solver++", "DDIMScheduler", "EulerDiscreteScheduler"])
def test_solvers_recover_point_mass(schedule: str, scheduler: str) -> None:
    diffusion = Diffusion(DiffusionConfig(schedule=schedule))
    m = torch.linspace(-0.8, 0.8, 2 * 3 * 4 * 4, dtype=torch.float64).view(2, 3, 4, 4)
    model = PointMassEps(schedule, m)
    noise = make_noise((3, 4, 4), sample_generators(0, [0, 1]))
    x0 = sample_images(model, diffusion, noise, scheduler=scheduler, steps=10)
    assert len(model.times) == 10
    torch.testing.assert_close(x0.double(), m, atol=2e-4, rtol=0)


def test_wrong_time_does_not_recover_point_mass() -> None:
    """Control for the test above: a model that misreads the time lands elsewhere."""
    diffusion = Diffusion(VP)
    m = torch.full((1, 3, 4, 4), 0.5, dtype=torch.float64)

    class OffByOne(PointMassEps):
        def forward(self, x, t, context=None, return_dict=True):
            return super().forward(x, t + 30.0, return_dict=return_dict)

    noise = make_noise((3, 4, 4), sample_generators(0, [0]))
    x0 = sample_images(OffByOne("vp_continuous", m), diffusion, noise, steps=10)
    assert (x0.double() - m).abs().max() > 1e-2


def test_time_inputs_cifar10_50_steps() -> None:
    diffusion = Diffusion(VP)
    model = PointMassEps("vp_continuous", torch.zeros(1, 3, 4, 4, dtype=torch.float64))
    sample_images(model, diffusion, torch.randn(2, 3, 4, 4), steps=50)
    sched = make_scheduler(diffusion)  # the logSNR-uniform grid of dpm_solver++
    sched.set_timesteps(50)
    ks = sched.timesteps.double()
    seen = torch.stack(model.times)  # (50, B)
    assert seen.shape == (50, 2) and seen.dtype == torch.float32
    assert seen[0, 0].item() == pytest.approx(999.0, abs=1e-4)  # 999 * t with t = 1
    torch.testing.assert_close(seen.double(), (999.0 * (ks + 1) / 1000)[:, None].expand(50, 2),
                               atol=1e-4, rtol=0)


def test_time_inputs_mscoco() -> None:
    diffusion = Diffusion(COCO)
    model = PointMassEps("scaled_linear", torch.zeros(1, 4, 4, 4, dtype=torch.float64))
    sample_images(model, diffusion, torch.randn(1, 4, 4, 4), steps=50)
    sched = make_scheduler(diffusion)
    sched.set_timesteps(50)
    seen = torch.cat(model.times).double()
    torch.testing.assert_close(seen, sched.timesteps.double() + 1)
    assert seen.max() == 1000 and seen.min() >= 1


# --------------------------------------------------------------------------- guidance


class ContextEps(nn.Module):
    """A fake text-conditional model whose output depends on x, t and the context."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []

    def forward(self, x, t, context=None, return_dict=True):
        self.batches.append(x.shape[0])
        c = context.mean(dim=(1, 2)).view(-1, 1, 1, 1)
        eps = 0.3 * x + c * torch.cos(t / 100).view(-1, 1, 1, 1) + context[:, :1, :1, None]
        return eps if return_dict else (eps,)


def test_guided_eps_formula() -> None:
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(3, 2, 4, 4, generator=g), torch.tensor([10.0, 500.0, 999.0])
    context, uncond = torch.randn(3, 5, 6, generator=g), torch.randn(5, 6, generator=g)
    model = ContextEps()
    cond = model(x, t, context=context)
    unc = model(x, t, context=uncond.expand(3, 5, 6))
    model.batches.clear()
    for s in (0.5, 1.0, 3.0):
        got = guided_eps(model, x, t, context=context, uncond_context=uncond, cfg_scale=s)
        torch.testing.assert_close(got, cond + s * (cond - unc))
        # diffusers' convention with guidance_scale g = s + 1 gives the same
        torch.testing.assert_close(got, unc + (s + 1) * (cond - unc))
    assert model.batches == [6, 6, 6]  # one batched forward of 2B per call
    model.batches.clear()
    got = guided_eps(model, x, t, context=context, uncond_context=uncond, cfg_scale=0.0)
    torch.testing.assert_close(got, cond)
    assert model.batches == [3]  # s = 0: conditional pass only


def test_guidance_errors() -> None:
    x, t = torch.zeros(1, 3, 4, 4), torch.zeros(1)
    with pytest.raises(ValueError, match="unconditional"):
        guided_eps(lambda x, t: x, x, t, cfg_scale=1.0)
    with pytest.raises(ValueError, match="uncond_context"):
        guided_eps(ContextEps(), x, t, context=torch.zeros(1, 2, 2), cfg_scale=1.0)


def test_sampling_with_guidance_matches_manual_guidance() -> None:
    diffusion = Diffusion(COCO)
    g = torch.Generator().manual_seed(1)
    context, uncond = torch.randn(2, 5, 6, generator=g), torch.randn(5, 6, generator=g)
    noise = torch.randn(2, 2, 4, 4, generator=g)
    model = ContextEps()

    def manual(s):
        def eps(x, t, context=None, return_dict=True):
            c, u = model(x, t, context=context), model(x, t, context=uncond.expand_as(context))
            return c + s * (c - u) if return_dict else (c + s * (c - u),)
        return eps

    for s in (0.0, 1.0):
        got = sample_images(model, diffusion, noise, context=context, uncond_context=uncond,
                            cfg_scale=s, steps=8)
        want = sample_images(manual(s), diffusion, noise, context=context, steps=8)
        torch.testing.assert_close(got, want)
    conditional_only = sample_images(model, diffusion, noise, context=context, steps=8)
    torch.testing.assert_close(
        sample_images(model, diffusion, noise, context=context, uncond_context=uncond,
                      cfg_scale=0.0, steps=8), conditional_only)


class ScaledTanhEps(nn.Module):
    """A fixed noise predictor c * tanh(x) * (1 + t / 1000): models that differ by a scale."""

    def __init__(self, c: float) -> None:
        super().__init__()
        self.c = c

    def forward(self, x: torch.Tensor, t: torch.Tensor, context=None, return_dict=True):
        eps = self.c * torch.tanh(x) * (1 + t.view(-1, 1, 1, 1) / 1000)
        return eps if return_dict else (eps,)


def test_autoguidance_extrapolates_away_from_the_weaker_model() -> None:
    diffusion = Diffusion(VP)
    noise = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(3))
    good, weak = ScaledTanhEps(1.0), ScaledTanhEps(0.25)

    def run(model, **kw):
        return sample_images(model, diffusion, noise, steps=6, **kw)

    for s in (0.5, 2.0):
        # eps = g + s (g - b) = (1 + 0.75 s) g: the sampler sees a model scaled by that
        got = run(good, guide=weak, autoguidance_scale=s)
        # (float32 rounding of the two forms, through 6 solver steps: ~1e-5 relative)
        torch.testing.assert_close(got, run(ScaledTanhEps(1 + 0.75 * s)), rtol=1e-4, atol=1e-4)
        assert (got - run(good)).abs().max() > 1e-2
    # a guide equal to the model changes nothing, and scale 0 never calls the guide
    torch.testing.assert_close(run(good, guide=ScaledTanhEps(1.0), autoguidance_scale=3.0),
                               run(good))
    assert torch.equal(run(good, guide=None, autoguidance_scale=0.0), run(good))
    with pytest.raises(ValueError, match="needs a guide model"):
        run(good, autoguidance_scale=1.0)


def test_load_guide_resolves_from_the_run_folder(tmp_path: Path) -> None:
    cfg = tiny_config()
    run = tmp_path / "run"
    early = run / "checkpoints" / "step_000010" / "ema.safetensors"
    early.parent.mkdir(parents=True)
    weak = tiny_model(cfg, seed=1)
    save_safetensors(weak, early)
    assert load_guide(cfg, run / "ema.safetensors") is None  # autoguidance off: no file read
    on = apply_overrides(cfg, ["sample.autoguidance_scale=1.0",
                               "sample.autoguidance_ckpt=checkpoints/step_000010/ema.safetensors"])
    # from a run's ema.safetensors, and from a later checkpoint of the same run
    for ckpt in (run / "ema.safetensors", run / "checkpoints" / "step_000020" / "ema.safetensors"):
        guide = load_guide(on, ckpt)
        assert all(torch.equal(a, b) for a, b in zip(guide.state_dict().values(),
                                                      weak.state_dict().values()))
    absolute = apply_overrides(on, [f"sample.autoguidance_ckpt={early}"])
    assert load_guide(absolute, tmp_path / "elsewhere" / "model.safetensors") is not None
    missing = apply_overrides(
        on, ["sample.autoguidance_ckpt=checkpoints/step_000099/ema.safetensors"])
    needle = r"sample\.autoguidance_ckpt=.*step_000099.*keep_steps"
    with pytest.raises(FileNotFoundError, match=needle):
        load_guide(missing, run / "ema.safetensors")


def test_a_guide_with_the_sampled_weights_is_refused_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A guide that is the sampled model (the same file, or the last checkpoint's copy of
    a run's ema.safetensors) would change nothing at twice the cost: refused, one line."""
    cfg = tiny_config()
    run = tmp_path / "run"
    last = run / "checkpoints" / "step_000020" / "ema.safetensors"
    last.parent.mkdir(parents=True)
    save_safetensors(tiny_model(cfg, seed=1), last)
    shutil.copyfile(last, run / "ema.safetensors")
    save_safetensors(tiny_model(cfg, seed=2),
                     run / "checkpoints" / "step_000010" / "ema.safetensors")
    guided = ["sample.autoguidance_scale=1.0",
              "sample.autoguidance_ckpt=checkpoints/step_000020/ema.safetensors"]
    for ckpt in (run / "ema.safetensors", last):
        with pytest.raises(ConfigError, match=r"step_000020/ema\.safetensors holds the same "
                                              r"weights as the sampled"):
            load_guide(apply_overrides(cfg, guided), ckpt)
    earlier = apply_overrides(cfg, [guided[0], guided[1].replace("20", "10")])
    assert load_guide(earlier, run / "ema.safetensors") is not None

    config = write_tiny_config(tmp_path / "tiny.py")
    main = load_script("scripts/sample.py").main
    status = main(["--config", str(config), "--ckpt", str(run / "ema.safetensors"),
                   "--n", "2", "--quiet", "--out", str(tmp_path / "out"),
                   *[w for o in guided for w in ("--set", o)]])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("error: sample.autoguidance_ckpt=")
    assert err.count("\n") == 1 and "same weights" in err
    assert not (tmp_path / "out" / "grid.png").exists()


def test_autoguidance_settings_are_validated() -> None:
    needle = r"sample\.autoguidance_scale=1\.0 needs sample\.autoguidance_ckpt"
    with pytest.raises(ConfigError, match=needle):
        validate(apply_overrides(tiny_config(), ["sample.autoguidance_scale=1.0"]))
    with pytest.raises(ConfigError, match=r"sample\.autoguidance_scale=nan"):
        validate(apply_overrides(tiny_config(), ["sample.autoguidance_scale=nan",
                                                 "sample.autoguidance_ckpt=x"]))


def test_batched_guidance_equals_two_passes_of_real_model() -> None:
    cfg = tiny_config(clip_dim=16, num_clip_token=4)
    model = tiny_model(cfg)
    g = torch.Generator().manual_seed(2)
    x, t = torch.randn(3, 3, 8, 8, generator=g), torch.tensor([1.0, 400.0, 999.0])
    context, uncond = torch.randn(3, 4, 16, generator=g), torch.randn(4, 16, generator=g)
    with torch.no_grad():
        c, u = (model(x, t, context=context).sample,
                model(x, t, context=uncond.expand(3, 4, 16)).sample)
        got = guided_eps(model, x, t, context=context, uncond_context=uncond, cfg_scale=1.0)
    torch.testing.assert_close(got, 2 * c - u, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- seeding


class Tamed(nn.Module):
    """An untrained U-ViT's outputs blow up under DPM-Solver (x0 = (x - sigma eps) / alpha
    with alpha(1) ~ 0.007), saturating every pixel. Add it, scaled down, to the exact noise
    predictor of data ~ N(0, 0.5^2) so images stay in range and depend on the noise."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x, t, context=None, return_dict=True):
        ab = alpha_bar_of_net_time("vp_continuous", t).float().view(-1, 1, 1, 1)
        exact = (1 - ab).sqrt() * x / (0.25 * ab + 1 - ab)
        eps = exact + 0.02 * self.net(x, t).sample
        return eps if return_dict else (eps,)


@pytest.mark.parametrize("scheduler", ["dpm_solver++", "dpm_solver++_fast_time_uniform",
                                       "dpm_solver_fast_logsnr", "euler_maruyama"])
def test_same_seed_same_images_and_batch_independence(scheduler: str) -> None:
    """Also for Euler-Maruyama, whose step noise comes from the per-sample generators."""
    cfg = tiny_config()
    cfg.sample.scheduler = scheduler
    cfg.sample.steps = 20 if scheduler == "euler_maruyama" else 3
    model, diffusion = Tamed(tiny_model(cfg)), Diffusion(cfg.diffusion)

    def run(seed: int, indices: list[int], batch: int) -> torch.Tensor:
        cfg.sample.batch_size = batch
        out = dict()
        for idx, images in generate(model, diffusion, cfg, indices, seed=seed):
            out.update(zip(idx, images))
        return torch.stack([out[i] for i in sorted(out)])

    a = run(0, list(range(5)), batch=5)
    assert a.shape == (5, 3, 8, 8) and a.min() >= 0 and a.max() <= 1
    assert torch.equal(a, run(0, list(range(5)), batch=5))
    assert not torch.allclose(a, run(1, list(range(5)), batch=5), atol=1e-3)
    # sample i depends only on (seed, i): other batching, other order, a subset
    torch.testing.assert_close(run(0, list(range(5)), batch=2), a, atol=1e-5, rtol=0)
    torch.testing.assert_close(run(0, [3, 1], batch=2), a[[1, 3]], atol=1e-5, rtol=0)


def test_noise_is_per_index_and_per_seed() -> None:
    full = make_noise((3, 4, 4), sample_generators(7, range(6)))
    assert torch.equal(make_noise((3, 4, 4), sample_generators(7, [4])), full[4:5])
    assert abs(full.mean()) < 0.2 and abs(full.std() - 1) < 0.2
    # every (seed, index) pair gets its own noise; torch's CPU generator would keep only
    # the low 32 bits of a packed seed, so (seed << 32 | index) gives equal noise for all seeds
    pairs = [(0, 0), (0, 1), (1, 0), (1, 1), (2**32 - 1, 0), (0, 2**32 - 1)]
    noises = make_noise((8,), [sample_generators(s, [i])[0] for s, i in pairs])
    assert len({tuple(n.tolist()) for n in noises}) == len(pairs)
    with pytest.raises(ValueError, match="seed"):
        sample_generators(-1, [0])
    with pytest.raises(ValueError, match="index"):
        sample_generators(0, [2**32])


# --------------------------------------------------------------------------- pixels and grids


def test_to_pixels() -> None:
    cfg = tiny_config()
    x = torch.tensor([-1.5, -1.0, 0.0, 1.0, 2.0]).view(1, 1, 1, 5).expand(1, 3, 1, 5)
    torch.testing.assert_close(to_pixels(cfg, x)[0, 0, 0], torch.tensor([0, 0, 0.5, 1, 1]))
    coco = Config(data=DataConfig(name="mscoco"), model=ModelConfig(in_chans=4, img_size=4))
    with pytest.raises(ValueError, match="load_vae"):
        to_pixels(coco, torch.zeros(1, 4, 4, 4))
    coco.sample.decode_batch_size = 2
    images = to_pixels(coco, torch.randn(3, 4, 4, 4), vae=tiny_vae())
    assert images.shape == (3, 3, 32, 32) and images.min() >= 0 and images.max() <= 1


def test_grid_sizes(tmp_path: Path) -> None:
    images = torch.rand(6, 3, 8, 8)
    path = save_grid(images, tmp_path / "g.png", nrow=3)
    assert Image.open(path).size == (3 * 10 + 2, 2 * 10 + 2)  # make_grid, padding 2
    pixels = np.asarray(Image.open(path))
    expected = np.round(images[4].permute(1, 2, 0).numpy() * 255).astype(np.uint8)
    np.testing.assert_array_equal(pixels[12:20, 12:20], expected)  # row 1, column 1
    per_row = Image.open(save_grid(images, tmp_path / "c.png", nrow=3, captions=["a", "b"]))
    assert per_row.width == 32 and per_row.height > 22
    labelled = Image.open(save_grid(images, tmp_path / "l.png", nrow=3, labels=["x", "y"]))
    assert labelled.height == 22 and labelled.width > 32
    with pytest.raises(ValueError, match="captions"):
        save_grid(images, tmp_path / "bad.png", nrow=3, captions=["a", "b", "c", "d"])
    both = Image.open(save_comparison_grid({"U-ViT": images, "U-ViC": images},
                                           tmp_path / "cmp.png", nrow=3))
    assert both.width == 2 * 32 + 8 and both.height > 22


@pytest.mark.parametrize(("n", "width", "nrow"), [(16, 16, None), (5, 8, 3), (64, 32, 8),
                                                (2, 600, None), (16, 16, 16)])
def test_grid_upscale_is_the_smallest_factor_reaching_512(tmp_path: Path, n, width, nrow) -> None:
    images = torch.rand(n, 3, width, width)

    def saved(panels: int, upscale: int | None) -> int:
        if panels == 1:
            return Image.open(save_grid(images, tmp_path / "g.png", nrow=nrow,
                                        upscale=upscale)).width
        return Image.open(save_comparison_grid({"a": images, "b": images}, tmp_path / "c.png",
                                               nrow=nrow, upscale=upscale)).width

    for panels in (1, 2):
        factor = grid_upscale(n, width, nrow, panels)
        assert saved(panels, None) == saved(panels, factor) >= MIN_GRID_WIDTH
        assert factor == 1 or saved(panels, factor - 1) < MIN_GRID_WIDTH
    with pytest.raises(ValueError, match="upscale factor"):
        save_grid(images, tmp_path / "bad.png", upscale=0)


@pytest.mark.parametrize(("scheduler", "per_batch"), [
    ("dpm_solver++", 3), ("dpm_solver++_fast_time_uniform", 3), ("dpm_solver_fast_logsnr", 3),
    ("HeunDiscreteScheduler", 5)])
def test_progress_bar_counts_solver_steps(monkeypatch: pytest.MonkeyPatch, scheduler: str,
                                          per_batch: int) -> None:
    """One bar over steps x batches, moving at every network evaluation, with the images
    done beside it (not one tick per batch)."""
    import uvic.sampling.generate as sampling

    bars = []
    real_tqdm = sampling.tqdm

    def recording_tqdm(*args, **kwargs):
        bars.append(real_tqdm(*args, file=io.StringIO(), **kwargs))
        return bars[-1]

    monkeypatch.setattr(sampling, "tqdm", recording_tqdm)
    cfg = apply_overrides(tiny_config(), [f"sample.scheduler={scheduler}"])
    model = tiny_model(cfg)
    seen = []  # the bar's count at each network evaluation
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: (seen.append(bars[-1].n),
                                                          forward(*a, **k))[1])
    images = list(generate(model, Diffusion(cfg.diffusion), cfg, range(5), seed=0,
                           progress=True))  # batches of 4 and 1
    assert [len(i) for i, _ in images] == [4, 1]
    assert len(bars) == 1 and bars[0].total == 2 * per_batch
    assert seen == list(range(2 * per_batch)) and bars[0].n == 2 * per_batch
    assert "images 5/5" in str(bars[0])


# --------------------------------------------------------------------------- sample.py CLI


def write_tiny_config(path: Path, **model: object) -> Path:
    extra = ", ".join(f"{k}={v!r}" for k, v in model.items())
    path.write_text(
        "from uvic.config import Config, DataConfig, ModelConfig, SampleConfig\n\n\n"
        "def get_config():\n"
        "    return Config(name='tiny', model=ModelConfig(img_size=8, patch_size=2, "
        "embed_dim=32, depth=2, num_heads=2, attention='uvic', attention_backend='torch'"
        f"{', ' + extra if extra else ''}),"
        " data=DataConfig(name='shapes', root=''),"
        " sample=SampleConfig(steps=3, batch_size=3, cfg_scale=0.0))\n"
    )
    return path


def run_sample_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "sample.py"), *args, "--quiet"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)


@pytest.mark.slow
def test_sample_cli_single_and_comparison(tmp_path: Path) -> None:
    config = write_tiny_config(tmp_path / "tiny.py")
    cfg = tiny_config()
    for seed in (0, 1):
        save_safetensors(tiny_model(cfg, seed), tmp_path / f"m{seed}.safetensors")
    one = run_sample_cli("--config", str(config), "--ckpt", str(tmp_path / "m0.safetensors"),
                         "--n", "5", "--seed", "3", "--save-individual",
                         "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    singles = sorted((tmp_path / "one" / "samples").glob("*.png"))
    assert [p.name for p in singles] == [f"{i:06d}.png" for i in range(5)]
    # the grid is enlarged by default to >= 512 px (8 px images, 3 a row: 21x, 512 px),
    # nearest neighbour: each pixel of a sample is a 21 x 21 block
    grid = np.asarray(Image.open(tmp_path / "one" / "grid.png")).astype(int)
    assert grid.shape[:2] == (2 * (8 * 21 + 2) + 2, 3 * (8 * 21 + 2) + 2) == (342, 512)
    first = np.asarray(Image.open(singles[0])).astype(int)
    np.testing.assert_array_equal(grid[2:2 + 168, 2:2 + 168],
                                  first.repeat(21, axis=0).repeat(21, axis=1))
    record = json.loads((tmp_path / "one" / "sample_config.json").read_text())
    assert record["seed"] == 3 and record["config"]["model"]["attention"] == "uvic"

    # two checkpoints, same seed: the first one's images are those of the run above
    two = run_sample_cli("--config", str(config), "--ckpt", str(tmp_path / "m0.safetensors"),
                         "--label", "U-ViT", "--ckpt", str(tmp_path / "m1.safetensors"),
                         "--label", "U-ViC", "--n", "5", "--seed", "3", "--batch-size", "2",
                         "--save-individual", "--upscale", "1", "--out", str(tmp_path / "two"))
    assert two.returncode == 0, two.stderr
    # grid.png is the main grid (the comparison), as the README's outputs table says
    assert sorted(p.name for p in (tmp_path / "two").glob("*.png")) == [
        "grid.png", "grid_U-ViC.png", "grid_U-ViT.png"]
    cmp = Image.open(tmp_path / "two" / "grid.png")
    assert cmp.width == 2 * 32 + 8 and cmp.height > 22
    for label in ("U-ViT", "U-ViC"):
        assert Image.open(tmp_path / "two" / f"grid_{label}.png").size == (32, 22)
        assert len(list((tmp_path / "two" / label).glob("*.png"))) == 5
    record = json.loads((tmp_path / "two" / "sample_config.json").read_text())
    assert record["config"]["sample"]["batch_size"] == 2
    assert record["checkpoints"]["U-ViC"] == str(tmp_path / "m1.safetensors")
    for i in range(5):
        first = np.asarray(Image.open(tmp_path / "one" / "samples" / f"{i:06d}.png")).astype(int)
        same = np.asarray(Image.open(tmp_path / "two" / "U-ViT" / f"{i:06d}.png")).astype(int)
        other = np.asarray(Image.open(tmp_path / "two" / "U-ViC" / f"{i:06d}.png")).astype(int)
        assert np.abs(first - same).max() <= 1  # batch 3 vs 2: float rounding at most
        assert np.abs(first - other).max() > 10  # other weights, same noise


def test_sample_cli_refuses_bad_upscale_and_clashing_labels(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    config = write_tiny_config(tmp_path / "tiny.py")
    save_safetensors(tiny_model(tiny_config()), tmp_path / "m.safetensors")
    main = load_script("scripts/sample.py").main
    common = ["--config", str(config), "--ckpt", str(tmp_path / "m.safetensors"), "--quiet",
              "--n", "2", "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as stop:
        main([*common, "--upscale", "0"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "argument --upscale: must be >= 1, got 0")
    # two labels that would write the same grid_<label>.png
    rc = main([*common, "--ckpt", str(tmp_path / "m.safetensors"), "--label", "a b",
               "--label", "a_b"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "grid_a_b.png" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_sample_cli_text_to_image(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """MS-COCO path on tiny real models: feature folder, CLIP prompts, guidance, VAE."""
    features = make_mscoco_features(tmp_path / "coco", n_images={"val": 2}, resolution=64)
    vae = tiny_vae_folder(tmp_path / "vae")
    clip = tiny_clip_folder(tmp_path / "clip")
    config = write_tiny_config(tmp_path / "t2i.py", in_chans=4, clip_dim=32)
    overrides = ["--set", "data.name=mscoco", "--set", f"data.root={features}",
                 "--set", f"data.vae={vae}", "--set", f"data.clip_model={clip}",
                 "--set", "data.clip_pretrained=", "--set", "diffusion.schedule=scaled_linear"]
    main = load_script("scripts/sample.py").main
    bad = main(["--config", str(config), "--ckpt", str(tmp_path / "nope.pth"), "--out",
                str(tmp_path / "o"), *overrides])
    assert bad == 2 and "nope.pth" in capsys.readouterr().err
    cfg = tiny_config(in_chans=4, clip_dim=32)
    save_safetensors(tiny_model(cfg), tmp_path / "t2i.safetensors")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red bus\n\na dog on a surfboard\n")
    common = ["--config", str(config), "--ckpt", str(tmp_path / "t2i.safetensors"), "--quiet",
              "--cfg-scale", "1.0", *overrides]
    assert main([*common, "--prompts", str(prompts), "--n", "4", "--upscale", "1", "--out",
                 str(tmp_path / "p")]) == 0
    grid = Image.open(tmp_path / "p" / "grid.png")
    assert grid.width == 2 * 66 + 2 and grid.height > 2 * 66 + 2  # 64 px images + captions
    record = json.loads((tmp_path / "p" / "sample_config.json").read_text())
    assert record["prompts"] == ["a red bus", "a dog on a surfboard"] and record["guidance"] == 1
    # without --prompts: the feature folder's sample prompts
    assert main([*common, "--n", "2", "--out", str(tmp_path / "f")]) == 0
    stored = json.loads((features / "sample_prompts.json").read_text())
    assert json.loads((tmp_path / "f" / "sample_config.json").read_text())["prompts"] == stored


# --------------------------------------------------------------------------- class labels


def test_class_conditional_generation_cycles_labels_and_guides_against_the_null_class():
    """A class-conditional model trained with a null class (p_uncond > 0, the release's
    ImageNet 256) samples image i as class i mod K (K = num_classes - 1 real classes),
    guided by sample.cfg_scale against the null class; any batching gives the same images;
    without a null class there is no guidance and every id is a real class."""
    cfg = tiny_config(num_classes=5, attention="uvit")
    cfg = apply_overrides(cfg, ["diffusion.p_uncond=0.1", "sample.cfg_scale=0.4",
                                "sample.scheduler=euler_maruyama"])
    model, diffusion = tiny_model(cfg), Diffusion(cfg.diffusion)
    seen: list[torch.Tensor] = []
    forward = model.forward
    model.forward = lambda x, t, **kw: (seen.append(kw["y"]), forward(x, t, **kw))[1]
    indices = list(range(7))
    images = torch.cat([b for _, b in generate(model, diffusion, cfg, indices, seed=3)])
    # batches of 4 and 3 samples; each call runs the conditional and null halves together
    assert torch.equal(seen[0], torch.tensor([0, 1, 2, 3, 4, 4, 4, 4]))
    assert torch.equal(seen[-1], torch.tensor([0, 1, 2, 4, 4, 4]))  # samples 4-6
    gens = sample_generators(3, indices)
    expected = to_pixels(cfg, sample_images(
        model, diffusion, make_noise((3, 8, 8), gens), y=torch.tensor([0, 1, 2, 3, 0, 1, 2]),
        uncond_y=4, cfg_scale=0.4, scheduler="euler_maruyama", steps=3, generator=gens))
    assert torch.allclose(images, expected, atol=1e-6)
    rebatched = apply_overrides(cfg, ["sample.batch_size=3"])
    again = torch.cat([b for _, b in generate(model, diffusion, rebatched, indices, seed=3)])
    assert torch.allclose(images, again, atol=1e-6)

    seen.clear()  # no null class: no guidance, labels over all 5 ids
    plain = apply_overrides(cfg, ["diffusion.p_uncond=0"])
    list(generate(model, diffusion, plain, indices, seed=3))
    assert torch.equal(seen[-1], torch.tensor([4, 0, 1]))
