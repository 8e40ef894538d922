"""The U-ViT release's CelebA and ImageNet rows: every config holds
the release's settings and builds its model, and its released checkpoints load strictly
and sample.

Expected values are the release's (baofff/U-ViT: its configs/*.py, and per its README the
script that trains each row, train.py, train_ldm.py or train_ldm_discrete.py, and the one
that evaluates it, eval.py, eval_ldm.py or eval_ldm_discrete.py), written out here
independently of our config files. Parameter counts come from the architecture's closed
form, checked against the U-ViT paper's model sizes (S 44M, M 131M, L 287M, H 501M).
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import readme_commands
import torch
from datagen import tiny_vae
from test_model import random_release_state_dict, ref_uvit, release_keys

from uvic.config import Config, load_config
from uvic.config.compare import config_diff
from uvic.config.validation import validate
from uvic.diffusion.samplers import run_sampler
from uvic.diffusion.schedule import Diffusion
from uvic.models.autoencoder import decode_latents
from uvic.models.uvit import build_model, resolve_attention
from uvic.run.weights import CheckpointError, load_weights

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

SIZES = {"S": (512, 12, 8), "M": (768, 16, 12), "L": (1024, 20, 16), "H": (1152, 28, 16)}
PAPER_MILLIONS = {"S": 44, "M": 131, "L": 287, "H": 501}  # U-ViT paper, Table 1 (rounded)
SHARED = {  # every row: the release's optimiser, EMA, seed, precision and FID code
    "model.mlp_ratio": 4.0, "model.qkv_bias": False, "model.mlp_time_embed": False,
    "model.skip": True, "model.clip_dim": 0,
    "optim.weight_decay": 0.03, "optim.betas": (0.99, 0.99), "optim.warmup_steps": 5000,
    "optim.grad_clip": 0.0, "optim.lr_schedule": "constant",
    "train.mixed_precision": "fp16", "train.ema_decay": 0.9999, "train.seed": 1234,
    "eval.n_samples": 50_000, "eval.mode": "legacy_pytorch",
}
CONTINUOUS = {"diffusion.schedule": "vp_continuous", "diffusion.beta_min": 0.1,
              "diffusion.beta_max": 20.0}  # train.py, train_ldm.py (sde.VPSDE's defaults)
DISCRETE = {"diffusion.schedule": "scaled_linear", "diffusion.beta_start": 0.00085,
            "diffusion.beta_end": 0.012, "diffusion.num_train_timesteps": 1000}
LOGSNR = {"sample.scheduler": "dpm_solver_fast_logsnr", "sample.steps": 50}  # dpm_solver_pytorch
TIME_UNIFORM = {"sample.scheduler": "dpm_solver++_fast_time_uniform", "sample.steps": 50}


def model(size: str, img: int, patch: int, chans: int, classes: int, conv: bool,
          checkpointing: bool) -> dict:
    dim, depth, heads = SIZES[size]
    return {"model.img_size": img, "model.patch_size": patch, "model.in_chans": chans,
            "model.embed_dim": dim, "model.depth": depth, "model.num_heads": heads,
            "model.num_classes": classes, "model.conv": conv,
            "model.grad_checkpointing": checkpointing}


def latents(res: int, p_uncond: float, vae: str, scale: float) -> dict:
    return {"data.name": "imagenet_features", "data.root": f"data/imagenet{res}_features",
            "data.random_flip": True, "data.scale_factor": 0.18215, "data.vae": vae,
            "diffusion.p_uncond": p_uncond, "sample.cfg_scale": scale,
            "sample.batch_size": 50, "train.batch_size": 1024, "optim.lr": 2e-4,
            "eval.ref_stats": f"data/fid_stats/fid_stats_imagenet{res}_guided_diffusion.npz",
            "eval.ref_res": res}


SD_VAE = "CompVis/stable-diffusion-v1-4/vae"  # the release's autoencoder_kl.pth
SD_VAE_EMA = "stabilityai/sd-vae-ft-ema"  # its autoencoder_kl_ema.pth
IMAGENET64 = {"data.name": "imagenet", "data.root": "data/imagenet", "data.random_flip": True,
              "diffusion.p_uncond": 0.0, "optim.lr": 3e-4, "train.batch_size": 1024,
              "train.max_steps": 300_000, "sample.cfg_scale": 0.0, "sample.batch_size": 200,
              "eval.ref_stats": "data/fid_stats/fid_stats_imagenet64_guided_diffusion.npz",
              "eval.ref_res": 64, **CONTINUOUS, **LOGSNR}
RELEASE: dict[str, tuple[str, dict]] = {  # row -> (model size, settings)
    "celeba64_uvit_small": ("S", {
        **model("S", 64, 4, 3, -1, True, False), **CONTINUOUS,
        "data.name": "celeba", "data.root": "data/celeba", "data.random_flip": True,
        "diffusion.p_uncond": 0.0, "optim.lr": 2e-4,
        "train.batch_size": 128, "train.max_steps": 500_000,
        "sample.scheduler": "euler_maruyama", "sample.steps": 1000, "sample.cfg_scale": 0.0,
        "sample.batch_size": 500,
        "eval.ref_stats": "data/fid_stats/fid_stats_celeba64_train_50000_ddim.npz",
        "eval.ref_res": 64}),
    "imagenet64_uvit_mid": ("M", {**model("M", 64, 4, 3, 1000, True, True), **IMAGENET64}),
    "imagenet64_uvit_large": ("L", {**model("L", 64, 4, 3, 1000, True, True), **IMAGENET64}),
    "imagenet256_uvit_large": ("L", {
        **model("L", 32, 2, 4, 1001, True, True), **latents(256, 0.15, SD_VAE, 0.4),
        **CONTINUOUS, **LOGSNR, "train.max_steps": 300_000}),
    "imagenet256_uvit_huge": ("H", {
        **model("H", 32, 2, 4, 1001, False, True), **latents(256, 0.1, SD_VAE_EMA, 0.4),
        **DISCRETE, **TIME_UNIFORM, "train.max_steps": 500_000}),
    "imagenet512_uvit_large": ("L", {
        **model("L", 64, 4, 4, 1001, True, True), **latents(512, 0.15, SD_VAE, 0.7),
        **CONTINUOUS, **LOGSNR, "train.max_steps": 500_000}),
    "imagenet512_uvit_huge": ("H", {
        **model("H", 64, 4, 4, 1001, False, True), **latents(512, 0.1, SD_VAE_EMA, 0.7),
        **DISCRETE, **TIME_UNIFORM, "train.max_steps": 500_000}),
}
TWINS = {name.replace("_uvit_", "_uvic_"): name for name in RELEASE}
ALL = [*RELEASE, *TWINS]


def release_of(name: str) -> str:
    return TWINS.get(name, name)


def get(cfg: Config, key: str):
    section, field = key.split(".")
    return getattr(getattr(cfg, section), field)


def param_count(img: int, patch: int, chans: int, dim: int, depth: int, classes: int,
                conv: bool) -> int:
    """The release's U-ViT in closed form: patch embedding, position embedding (time and
    label tokens too), label table, depth + 1 blocks of 12 D^2 + 10 D (qkv without bias,
    projection, MLP 4D, two LayerNorms), depth / 2 skip projections, final norm, head and
    the optional 3x3 conv."""
    tokens = (img // patch) ** 2 + 1 + (classes > 0)
    out = patch * patch * chans
    return (out * dim + dim + tokens * dim + max(classes, 0) * dim
            + (depth + 1) * (12 * dim * dim + 10 * dim) + depth // 2 * (2 * dim * dim + dim)
            + 2 * dim + dim * out + out + (9 * chans * chans + chans if conv else 0))


# --------------------------------------------------------------------------- configs (item 3)


@pytest.mark.parametrize("name", ALL)
def test_config_holds_the_release_settings(name: str) -> None:
    cfg = validate(load_config(CONFIGS / f"{name}.py"))
    assert cfg.name == name and cfg.train.output_dir == f"runs/{name}"
    _, settings = RELEASE[release_of(name)]
    for key, value in {**SHARED, **settings}.items():
        assert get(cfg, key) == value, f"{name}: {key} = {get(cfg, key)!r}, release {value!r}"


@pytest.mark.parametrize("name", list(TWINS))
def test_uvic_twin_differs_only_in_attention(name: str) -> None:
    uvic = load_config(CONFIGS / f"{name}.py")
    uvit = load_config(CONFIGS / f"{TWINS[name]}.py")
    assert set(config_diff(uvit, uvic)) == {"name", "model.attention", "train.output_dir"}
    modes = resolve_attention(uvic.model.attention, uvic.model.depth)
    assert modes == ["softmax"] + ["cog"] * (uvic.model.depth - 1) + ["softmax"]


@pytest.mark.parametrize("name", ALL)
def test_model_has_the_release_parameters_and_names(name: str) -> None:
    """At full size (on the meta device): the closed-form count, the paper's size, and the
    release's parameter names and shapes, in its order."""
    cfg = load_config(CONFIGS / f"{name}.py")
    size, _ = RELEASE[release_of(name)]
    m = cfg.model
    with torch.device("meta"):
        net = build_model(cfg.model)
    count = sum(p.numel() for p in net.parameters())
    assert count == param_count(m.img_size, m.patch_size, m.in_chans, m.embed_dim, m.depth,
                                m.num_classes, m.conv)
    assert round(count / 1e6) == PAPER_MILLIONS[size]
    expected = release_keys(**dataclasses.asdict(m))
    assert sum(math.prod(s) for s in expected.values()) == count
    got = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    assert got == expected and list(got) == list(expected)


# --------------------------------------------------------------------------- checkpoints (item 7)


def tiny_row(name: str, **extra: str) -> Config:
    """The row's config at test size (width 32, depth 2, 16 tokens) with its real parameter
    names: label table, null class, conv or not, patch size and channels are the row's."""
    cfg = load_config(CONFIGS / f"{name}.py")
    overrides = ["model.embed_dim=32", "model.depth=2", "model.num_heads=2",
                 "model.attention_backend=torch", f"model.img_size={4 * cfg.model.patch_size}",
                 *(f"{k}={v}" for k, v in extra.items())]
    return load_config(CONFIGS / f"{name}.py", overrides)


def release_checkpoint(cfg: Config, path: Path) -> dict[str, torch.Tensor]:
    """A `nnet_ema.pth` as the release writes it: torch.save of its state dict (random)."""
    release = random_release_state_dict(dataclasses.asdict(cfg.model), seed=3)
    state = {k: v.float() for k, v in release.items()}
    torch.save(state, path)
    return state


def guided_eps(net: torch.nn.Module, cfg: Config, y: torch.Tensor):
    """The release's guided noise prediction (eval.py, eval_ldm*.py): eps = c + s (c - u),
    u at the null class, the last label (1000 of 1001); no guidance where s = 0."""
    scale, null = cfg.sample.cfg_scale, cfg.model.num_classes - 1

    def eps(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if scale == 0:
            return net(x, t, y=y).sample
        both = net(torch.cat([x, x]), torch.cat([t, t]),
                   y=torch.cat([y, torch.full_like(y, null)])).sample
        cond, uncond = both.chunk(2)
        return cond + scale * (cond - uncond)

    return eps


@pytest.mark.parametrize("name", list(RELEASE))
def test_released_checkpoint_loads_strictly_and_samples(name: str, tmp_path: Path) -> None:
    """A release-format checkpoint of the row loads strictly into U-ViT and its U-ViC twin,
    computes the release's network (its float64 functional form, conv=False included), and
    samples under the row's evaluation protocol with labels (and the null class's guidance
    where the release guides), decoded by a VAE for the latent rows."""
    cfg = tiny_row(name, **{"sample.steps": "20"} if "celeba" in name else {})
    ckpt = tmp_path / "nnet_ema.pth"
    state = release_checkpoint(cfg, ckpt)
    assert ("label_emb.weight" in state) == (cfg.model.num_classes > 0)
    assert ("final_layer.weight" in state) == cfg.model.conv
    net = build_model(cfg.model).eval()
    load_weights(net, ckpt)  # strict
    twin = build_model(tiny_row(name.replace("_uvit_", "_uvic_")).model).eval()
    load_weights(twin, ckpt)

    g = torch.Generator().manual_seed(0)
    shape = (cfg.model.in_chans, cfg.model.img_size, cfg.model.img_size)
    x, t = torch.randn(3, *shape, generator=g), torch.tensor([1.0, 500.0, 999.0])
    y = None
    if cfg.model.num_classes > 0:  # a real class, the last one, and the null class if any
        y = torch.tensor([0, 999, cfg.model.num_classes - 1])
    with torch.no_grad():
        out = net(x, t, y=y).sample
    sd = {k: v.double() for k, v in state.items()}
    ref = ref_uvit(sd, dataclasses.asdict(cfg.model), ["softmax"] * 3, x.double(), t.double(), y=y)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-5)

    noise = torch.randn(2, *shape, generator=g)
    labels = torch.tensor([7, 998]) if cfg.model.num_classes > 0 else None
    eps = guided_eps(net, cfg, labels) if labels is not None else (lambda x, t: net(x, t).sample)
    with torch.no_grad():
        z = run_sampler(eps, Diffusion(cfg.diffusion), noise, scheduler=cfg.sample.scheduler,
                        steps=cfg.sample.steps, order=cfg.sample.order,
                        generator=[torch.Generator().manual_seed(i) for i in range(2)])
        images = z.clamp(-1, 1) if cfg.data.name != "imagenet_features" else decode_latents(
            tiny_vae(), z, cfg.data.scale_factor)
    assert torch.isfinite(z).all() and z.shape == noise.shape
    side = cfg.model.img_size * (8 if cfg.data.name == "imagenet_features" else 1)
    assert images.shape == (2, 3, side, side) and images.abs().max() <= 1


def test_a_checkpoint_of_another_row_is_refused(tmp_path: Path) -> None:
    """Strict loading tells the rows apart: an H checkpoint (no final conv) does not load
    into an L model, nor a 1000-class one into a model with the null class."""
    huge, large = tiny_row("imagenet256_uvit_huge"), tiny_row("imagenet256_uvit_large")
    release_checkpoint(huge, tmp_path / "huge.pth")
    with pytest.raises(CheckpointError, match=r"missing keys.*final_layer\.weight"):
        load_weights(build_model(large.model), tmp_path / "huge.pth")
    in64 = tiny_row("imagenet64_uvit_mid", **{"model.in_chans": "4", "model.img_size": "8",
                                              "model.patch_size": "2"})  # all but the classes
    release_checkpoint(in64, tmp_path / "in64.pth")
    with pytest.raises(CheckpointError, match=r"label_emb\.weight: file \(1000, 32\) vs "
                                              r"model \(1001, 32\)"):
        load_weights(build_model(large.model), tmp_path / "in64.pth")


def test_readme_table_is_the_configs() -> None:
    """Every row of docs/training.md's table of these configs states what the config holds."""
    rows = re.findall(r"^\| `(\w+)`, `(\w+)` \| (.+) \|$", readme_commands.section(
        "docs/training.md", "## ImageNet and CelebA: data and configs"), flags=re.M)
    assert {uvit for uvit, _, _ in rows} == set(RELEASE)
    for uvit, uvic, cells in rows:
        assert TWINS[uvic] == uvit
        cfg = load_config(CONFIGS / f"{uvit}.py")
        model_cell, _, objective, training, sampler, guidance = cells.split(" | ")
        m = cfg.model
        with torch.device("meta"):
            count = sum(p.numel() for p in build_model(m).parameters())
        assert f"/{m.patch_size}, {count / 1e6:.1f}M" in model_cell, (uvit, model_cell)
        assert ("no final conv" in model_cell) == (not m.conv)
        assert objective == {"vp_continuous": "continuous VP",
                             "scaled_linear": "discrete scaled-linear"}[cfg.diffusion.schedule]
        assert training == (f"{cfg.train.max_steps // 1000}k x {cfg.train.batch_size}, "
                            f"{cfg.optim.lr:.0e}".replace("e-0", "e-"))
        assert sampler == f"`{cfg.sample.scheduler}`, " + (
            f"{cfg.sample.steps} steps" if "celeba" in uvit else str(cfg.sample.steps))
        assert guidance == (f"{cfg.sample.cfg_scale}" if cfg.sample.cfg_scale else "none")
