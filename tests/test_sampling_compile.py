"""Compiled sampling (`sample.compile`): static batches, batched guidance, compiled = eager.

Two tests compile (inductor on the CPU, a tiny model, a few steps: slow on 2 cores); the
others check the padding and the guidance arithmetic eagerly.
"""

from __future__ import annotations

import pytest
import torch
from test_sampling import alpha_bar_of_net_time, tiny_config, tiny_model
from torch import nn
from torch._dynamo.utils import counters

import uvic.sampling.generate as generate_module
from uvic.config import Config, ConfigError, apply_overrides
from uvic.config.validation import validate
from uvic.diffusion.schedule import Diffusion
from uvic.sampling.compiled import CudaGraphSafe, compile_network, static_batch
from uvic.sampling.generate import SampleGrid, generate, sample_images


class TamedLabels(nn.Module):
    """`test_sampling.Tamed` for a class-conditional network (so images do not saturate
    and depend on every input), recording the batch size of each call (eager only: a
    compiled forward would recompile at each new length of the list)."""

    def __init__(self, net: nn.Module, record: bool = True) -> None:
        super().__init__()
        self.net = net
        self.batches: list[int] | None = [] if record else None

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, return_dict=True):
        if self.batches is not None:
            self.batches.append(x.shape[0])
        ab = alpha_bar_of_net_time("vp_continuous", t).float().view(-1, 1, 1, 1)
        exact = (1 - ab).sqrt() * x / (0.25 * ab + 1 - ab)
        eps = exact + 0.05 * self.net(x, t, y=y, return_dict=False)[0]
        return eps if return_dict else (eps,)


def labelled_config(**sample: object) -> Config:
    """A tiny class-conditional U-ViC with a null class, guided (s = 0.5) and autoguided
    (s = 0.7), sampled by Euler-Maruyama (its step noise comes from the per-sample
    generators, so the padding must not shift any sample's draws)."""
    cfg = tiny_config(num_classes=4)
    overrides = ["diffusion.p_uncond=0.1", "sample.cfg_scale=0.5",
                 "sample.autoguidance_scale=0.7", "sample.autoguidance_ckpt=x",
                 "sample.scheduler=euler_maruyama", "sample.steps=20"]
    return apply_overrides(cfg, overrides + [f"sample.{k}={v}" for k, v in sample.items()])


def run(model: nn.Module, guide: nn.Module, cfg: Config, n: int = 5) -> torch.Tensor:
    """Images of samples 0..n-1 (seed 7), in index order."""
    out = {}
    for idx, images in generate(model, Diffusion(cfg.diffusion), cfg, list(range(n)), seed=7,
                                guide=guide):
        out.update(zip(idx, images, strict=True))
    assert sorted(out) == list(range(n))
    return torch.stack([out[i] for i in range(n)])


def test_sample_compile_is_validated() -> None:
    for mode in ("off", "default", "reduce-overhead", "max-autotune"):
        validate(apply_overrides(tiny_config(), [f"sample.compile={mode}"]))
    with pytest.raises(ConfigError, match=r"^sample\.compile='fast' must be one of off, "
                                          r"default, reduce-overhead, max-autotune$"):
        validate(apply_overrides(tiny_config(), ["sample.compile=fast"]))
    with pytest.raises(ConfigError, match=r"^sample\.compile='fast' must be one of"):
        compile_network(nn.Identity(), "fast")  # the same rule where it is used
    identity = nn.Identity()
    assert compile_network(identity, "off") is identity


def test_static_batch() -> None:
    assert static_batch([4], 4) == [4, 4, 4, 4]
    assert static_batch([8, 9, 10], 3) == [8, 9, 10]
    with pytest.raises(ValueError, match="a batch of 3 samples cannot be padded to 2"):
        static_batch([1, 2, 3], 2)


def test_padding_the_last_batch_leaves_the_images_unchanged(monkeypatch) -> None:
    """A compiled run pads its last batch to the run's batch size (here eagerly: the
    compile itself is `test_compiled_sampling_equals_eager`'s); 5 images at batch 4
    (the last padded from 1 to 4) are those of batch 8 (padded from 5 to 8) and batch 1."""
    cfg = labelled_config(compile="default")
    model, guide = TamedLabels(tiny_model(cfg, 0)), TamedLabels(tiny_model(cfg, 1))
    monkeypatch.setattr(generate_module, "compile_network", lambda net, mode: net)
    padded = run(model, guide, cfg)
    inside = ((padded > 0) & (padded < 1)).float().mean()
    assert padded.std() > 0.1 and inside > 0.8, (padded.std(), inside)  # not saturated
    # every network call of the run saw one batch: 2 x 4 rows (conditional + null class)
    assert set(model.batches) == set(guide.batches) == {8}
    assert len(model.batches) == 2 * 20  # two batches of 20 steps
    eager = run(model, guide, apply_overrides(cfg, ["sample.compile=off"]))
    assert model.batches[-1] == 2 * 1  # without compile the last batch is not padded
    torch.testing.assert_close(padded, eager, atol=1e-5, rtol=0)
    for batch in (8, 1):
        model.batches.clear()
        other = run(model, guide, apply_overrides(cfg, [f"sample.batch_size={batch}"]))
        assert set(model.batches) == {2 * min(batch, 5)}
        torch.testing.assert_close(other, eager, atol=1e-5, rtol=0)


def test_batched_guidance_equals_the_unbatched_formula() -> None:
    """Classifier-free guidance runs the conditional and null-class rows of a network in
    one call of 2B; autoguidance, whose guide is another network, one such call each; the
    result is the formula of four separate calls, g = c + s (c - u), eps = g + a (g - b)."""
    cfg = labelled_config()
    model, guide = TamedLabels(tiny_model(cfg, 0)), TamedLabels(tiny_model(cfg, 1))
    s, a, null = 0.5, 0.7, 3
    noise = torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 2, 1])
    diffusion = Diffusion(cfg.diffusion)

    def unbatched(x: torch.Tensor, t: torch.Tensor, return_dict=True):
        def guided(net: TamedLabels) -> torch.Tensor:
            c, u = net(x, t, y=y), net(x, t, y=torch.full_like(y, null))
            return c + s * (c - u)
        g, b = guided(model), guided(guide)
        return g + a * (g - b) if return_dict else (g + a * (g - b),)

    kw = {"scheduler": "dpm_solver++", "steps": 4}
    want = sample_images(unbatched, diffusion, noise, **kw)
    model.batches.clear()
    got = sample_images(model, diffusion, noise, y=y, uncond_y=null, cfg_scale=s, guide=guide,
                        autoguidance_scale=a, **kw)
    assert model.batches == [6] * 4  # one call of 2B per solver step
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got - sample_images(model, diffusion, noise, y=y, **kw)).abs().max() > 1e-3


@pytest.mark.slow
def test_compiled_sampling_equals_eager() -> None:
    """`sample.compile=default` (inductor): the same images as eager, one graph per network
    with no break (fullgraph) for all batches, the padded last one included."""
    cfg = labelled_config(compile="default")
    model, guide = (TamedLabels(tiny_model(cfg, seed), record=False) for seed in (0, 1))
    eager = run(model, guide, apply_overrides(cfg, ["sample.compile=off", "sample.batch_size=1"]))
    torch._dynamo.reset()
    counters.clear()
    compiled = run(model, guide, cfg)
    assert not counters["graph_break"]
    # one graph for all calls: both batches have one shape (no recompilation for the last,
    # padded one), and the guide shares the model's graph (same architecture; the weights
    # are graph inputs)
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_compiled_grid_follows_the_weights_and_compiles_once() -> None:
    """The training grids compile once per run (mode reduce-overhead: CUDA graphs on a
    GPU, inductor on the CPU) and sample the weights as they are at each grid, as the EMA
    updates them in place."""
    cfg = apply_overrides(tiny_config(), ["sample.compile=reduce-overhead",
                                          "sample.scheduler=DDPMScheduler", "sample.steps=3"])
    model, diffusion = tiny_model(cfg), Diffusion(cfg.diffusion)
    grid = SampleGrid(cfg, "cpu", seed=3, n=4)
    torch._dynamo.reset()
    counters.clear()
    first = grid.sample(model, diffusion)
    assert isinstance(grid.network(model), CudaGraphSafe)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9)  # an EMA-like in-place update between grids
    second = grid.sample(model, diffusion)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1
    eager = SampleGrid(apply_overrides(cfg, ["sample.compile=off"]), "cpu", seed=3, n=4)
    torch.testing.assert_close(second, eager.sample(model, diffusion), atol=1e-4, rtol=0)
    assert (first - second).abs().max() > 1e-3
