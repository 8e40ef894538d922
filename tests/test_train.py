"""Training loop: objective, EMA, data order, checkpoints, exact resume after a kill,
two processes, NaN handling and the CLI's errors. Tiny models on the CPU."""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import readme_commands
import record_batches
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import set_seed
from conftest import load_script
from datagen import make_cifar10, make_mscoco_features, patch_cifar10_checksums, tiny_vae_folder
from record_batches import read_records, recording_loss
from safetensors.torch import load_file, save_file

import uvic.training.checkpoints as checkpoints_module
import uvic.training.trainer as train_module
from uvic.config import Config, ConfigError, load_config
from uvic.data.datasets import SHAPES_SEEDS, ShapesDataset, build_dataset, to_signed
from uvic.data.order import EpochSampler, SeededItems
from uvic.diffusion.schedule import Diffusion, diffusion_loss
from uvic.models.uvit import build_model
from uvic.run.architecture import stored_model_config
from uvic.run.folder import RunFolder, checkpoint_problem
from uvic.run.lock import LOCK_FILE
from uvic.run.prepare import config_history
from uvic.run.weights import CheckpointError, load_weights
from uvic.seeds import derive_seed, noise_seed
from uvic.training.ema import EMA
from uvic.training.launch import make_accelerator
from uvic.training.optim import warmup_constant
from uvic.training.trainer import Trainer, TrainError, train

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))

# A 45k-parameter U-ViT on 32x32 shapes: 64 patch tokens, width 32, 3 blocks. Attention
# in PyTorch: conftest.py sets TRITON_INTERPRET=1, and the interpreter is slow for training.
TINY = ["model.embed_dim=32", "model.depth=2", "model.num_heads=2", "model.patch_size=4",
        "model.attention_backend=torch",
        "data.num_workers=0", "train.mixed_precision=no", "train.sample_every=0",
        "sample.steps=2", "train.n_grid=2",
        # the release's 32x32, constant LR and DPM-Solver, not the quickstart's demo settings
        "model.img_size=32", "optim.lr_schedule=constant", "sample.scheduler=dpm_solver++",
        "sample.autoguidance_scale=0"]  # no guide: it would be the step-1000 checkpoint


def shapes_overrides(out: Path, *extra: str) -> list[str]:
    return [f"train.output_dir={out}", *TINY, "data.num_images=16", "train.batch_size=4",
            "optim.lr=1e-3", "optim.warmup_steps=5", "train.log_every=2", "train.ckpt_every=3",
            "train.keep_last=2", *extra]


def shapes_config(out: Path, *extra: str) -> Config:
    return load_config(REPO / "configs" / "quickstart.py", shapes_overrides(out, *extra))


def read_log(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each train() builds its own Accelerator; reset Accelerate's process-wide singletons."""
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(scope="module")
def coco_features(tmp_path_factory) -> dict[str, Path]:
    """Tiny MS-COCO feature folder (latents 4x8x8, contexts 77x32) and a tiny VAE folder."""
    root = tmp_path_factory.mktemp("coco")
    features = make_mscoco_features(root, {"train": 6, "val": 2})
    return {"features": features, "vae": tiny_vae_folder(root / "vae")}


def coco_config(out: Path, features: dict[str, Path], *extra: str) -> Config:
    overrides = [
        f"train.output_dir={out}", f"data.root={features['features']}",
        f"data.vae={features['vae']}", "model.in_chans=4", "model.img_size=8",
        "model.patch_size=2", "model.embed_dim=32", "model.depth=2", "model.num_heads=2",
        "model.clip_dim=32", "model.attention_backend=torch", "data.num_workers=0",
        "train.mixed_precision=no", "train.batch_size=4", "train.n_grid=2", "sample.steps=2",
        *extra,
    ]
    return load_config(REPO / "configs" / "mscoco_uvit.py", overrides)


# --------------------------------------------------------------------------- pieces


def test_ema_update_matches_float64_reference():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    ema = EMA(model, decay=0.9)
    start = {k: v.double().clone() for k, v in model.state_dict().items()}
    assert same_tensors(ema.state_dict(), model.state_dict())  # exact copy at step 0
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    ema.update(model)
    for key, value in model.state_dict().items():
        expected = 0.9 * start[key] + 0.1 * value.double()
        torch.testing.assert_close(ema.state_dict()[key].double(), expected, atol=1e-7, rtol=0)
    assert all(not p.requires_grad for p in ema.model.parameters())


def test_warmup_is_the_release_schedule():
    factor = warmup_constant(4)
    assert [factor(s) for s in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert warmup_constant(0)(0) == 1.0


def test_data_order_and_item_randomness_are_pure_functions_of_the_position():
    sampler = EpochSampler(10, seed=3)
    sampler.set_epoch(1)
    first = list(sampler)
    assert sorted(i for _, i in first) == list(range(10)) and {e for e, _ in first} == {1}
    assert first == list(sampler)  # same epoch, same order
    sampler.set_epoch(2)
    assert [i for _, i in sampler] != [i for _, i in first]

    flips = SeededItems(ShapesDataset(4, size=8, seed=0, flip=True), seed=5)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = [flips[(e, i)]["x"] for e in range(8) for i in range(4)]
    assert torch.equal(torch.get_rng_state(), before)  # global RNG untouched
    b = [flips[(e, i)]["x"] for e in range(8) for i in range(4)]
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    plain = [to_signed(image) for image in flips.dataset.images]
    flipped = [not torch.equal(x, plain[k % 4]) for k, x in enumerate(a)]
    assert all(torch.equal(x, plain[k % 4].flip(-1)) for k, x in enumerate(a) if flipped[k])
    assert 0 < sum(flipped) < len(a)  # some items flipped, some not
    assert derive_seed(1, 2, 0, 5, 0) != derive_seed(1, 2, 1, 5, 0)  # per-process noise differs


class RecordingModel(torch.nn.Module):
    """Returns a fixed linear function of its inputs and records them."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(0.5))
        self.calls: list[dict] = []

    def forward(self, x, t, context=None, return_dict=True):
        self.calls.append({"x": x, "t": t, "context": context})
        eps = self.w * x + 1e-3 * t.view(-1, 1, 1, 1)
        return eps if return_dict else (eps,)


def test_diffusion_loss_is_noise_mse_with_caption_dropping():
    cfg = load_config(REPO / "configs" / "mscoco_uvit.py")
    diffusion = Diffusion(cfg.diffusion)
    torch.manual_seed(0)
    n = 2000
    batch = {"x": torch.randn(n, 4, 2, 2), "context": torch.randn(n, 3, 5)}
    empty = torch.randn(3, 5)
    model = RecordingModel()
    loss = diffusion_loss(model, diffusion, batch, torch.Generator().manual_seed(7),
                          empty_context=empty, p_uncond=0.1)

    # Independent float64 reference: same draws (drop mask first, then the schedule's).
    g = torch.Generator().manual_seed(7)
    drop = torch.rand(n, generator=g) < 0.1
    noise = torch.randn(batch["x"].shape, generator=g)
    k = torch.randint(0, 1000, (n,), generator=g)
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float64) ** 2
    abar = torch.cumprod(1 - betas, 0)[k].view(-1, 1, 1, 1)
    x_t = abar.sqrt() * batch["x"].double() + (1 - abar).sqrt() * noise.double()
    pred = 0.5 * x_t + 1e-3 * (k.double() + 1).view(-1, 1, 1, 1)
    expected = ((pred - noise.double()) ** 2).mean()
    assert torch.allclose(loss.double(), expected, rtol=1e-5)

    seen = model.calls[0]["context"]
    dropped = (seen == empty).flatten(1).all(1)
    assert torch.equal(dropped, drop)
    assert torch.equal(seen[~drop], batch["context"][~drop])
    assert 0.08 < drop.float().mean() < 0.12
    assert torch.equal(model.calls[0]["t"], k.float() + 1)  # network sees n = k + 1


class LabelRecordingModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.labels: list[torch.Tensor] = []

    def forward(self, x, t, y=None, return_dict=True):
        self.labels.append(y)
        return 0.5 * x if return_dict else (0.5 * x,)


def test_class_labels_are_dropped_to_the_null_class():
    """Classifier-free training of a class-conditional model (the release's ImageNet 256:
    p_uncond 0.15, null class = the last id): each label becomes the null class with
    probability p_uncond, drawn first from the step's generator; without a null class
    the dropping is refused rather than silently skipped."""
    cfg = load_config(REPO / "configs" / "mscoco_uvit.py")
    diffusion = Diffusion(cfg.diffusion)
    n, null = 4000, 1000
    y = torch.randint(0, null, (n,), generator=torch.Generator().manual_seed(1))
    batch = {"x": torch.randn(n, 4, 2, 2), "y": y}
    model = LabelRecordingModel()
    diffusion_loss(model, diffusion, batch, torch.Generator().manual_seed(7), p_uncond=0.15,
                   null_class=null)
    drop = torch.rand(n, generator=torch.Generator().manual_seed(7)) < 0.15
    seen = model.labels[0]
    assert torch.equal(seen[drop], torch.full((int(drop.sum()),), null))
    assert torch.equal(seen[~drop], y[~drop])
    assert 0.13 < drop.float().mean() < 0.17
    with pytest.raises(ValueError, match="null class"):
        diffusion_loss(model, diffusion, batch, torch.Generator(), p_uncond=0.15)
    diffusion_loss(model, diffusion, batch, torch.Generator().manual_seed(7), p_uncond=0.0)
    assert torch.equal(model.labels[-1], y)  # p_uncond 0: labels as they are


@pytest.mark.parametrize("config", ["cifar10_uvit.py", "mscoco_uvit.py"])
def test_min_snr_weighting_matches_formula(config):
    """diffusion.min_snr_gamma = 5: each sample's noise MSE times min(SNR, 5) / SNR, with
    SNR = alpha_bar / (1 - alpha_bar) at its drawn noise level (float64 reference)."""
    cfg = load_config(REPO / "configs" / config,
                      ["diffusion.min_snr_gamma=5", "diffusion.p_uncond=0"])
    diffusion = Diffusion(cfg.diffusion)
    n = 4000
    x = torch.randn(n, 3, 2, 2, generator=torch.Generator().manual_seed(0))
    loss = diffusion_loss(RecordingModel(), diffusion, {"x": x}, torch.Generator().manual_seed(3))

    g = torch.Generator().manual_seed(3)  # the schedule's draws: noise, then the level
    noise = torch.randn(x.shape, generator=g).double()
    if config == "cifar10_uvit.py":  # continuous VP, betas 0.1..20; the network sees 999 t
        t = torch.rand(n, generator=g).double()
        abar = torch.exp(-0.5 * t**2 * (20.0 - 0.1) - 0.1 * t)
        net_t = 999.0 * t
    else:  # Stable Diffusion's discrete betas; the network sees k + 1
        k = torch.randint(0, 1000, (n,), generator=g)
        betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float64) ** 2
        abar = torch.cumprod(1 - betas, 0)[k]
        net_t = k.double() + 1
    x_t = abar.sqrt().view(-1, 1, 1, 1) * x.double() + (1 - abar).sqrt().view(-1, 1, 1, 1) * noise
    mse = ((0.5 * x_t + 1e-3 * net_t.view(-1, 1, 1, 1) - noise) ** 2).flatten(1).mean(1)
    snr = abar / (1 - abar)
    expected = (mse * snr.clamp(max=5.0) / snr).mean()
    assert torch.allclose(loss.double(), expected, rtol=1e-4)
    assert not torch.allclose(loss.double(), mse.mean(), rtol=1e-2)  # the weights matter
    assert (snr > 5).any() and (snr < 5).any()  # both sides of gamma were drawn


def test_min_snr_gamma_must_not_be_negative():
    with pytest.raises(ConfigError, match=r"diffusion\.min_snr_gamma=-1\.0 must be >= 0"):
        Diffusion(load_config(REPO / "configs" / "quickstart.py",
                              ["diffusion.min_snr_gamma=-1"]).diffusion)


# --------------------------------------------------------------------------- runs


def test_run_folder_knows_where_a_file_belongs(tmp_path):
    """RunFolder names every path of a run; the run of a weights file or checkpoint."""
    run = RunFolder(tmp_path / "run")
    assert (run.config, run.log, run.summary, run.ema) == tuple(
        tmp_path / "run" / name for name in ("config.json", "log.jsonl", "summary.json",
                                             "ema.safetensors"))
    assert run.checkpoint(7) == tmp_path / "run" / "checkpoints" / "step_000007"
    assert run.staging(7).name == "step_000007.tmp" and run.staging(7).parent == run.checkpoints_dir
    assert run.sample_grid(7) == tmp_path / "run" / "samples" / "step_000007.png"
    for weights in (run.ema, run.checkpoint(7) / RunFolder.EMA):
        assert RunFolder.of_weights(weights).root == run.root
    assert RunFolder.of_checkpoint(run.checkpoint(7)).root == run.root
    loose = tmp_path / "checkpoints" / "nnet_ema.pth"  # a file in a folder named checkpoints
    assert RunFolder.of_weights(loose).root == loose.parent
    relative = RunFolder("").checkpoint(10) / RunFolder.EMA  # sample.autoguidance_ckpt's form
    assert str(relative) == "checkpoints/step_000010/ema.safetensors"
    assert run.checkpoints() == [] and run.latest_checkpoint() is None


@pytest.mark.parametrize("attention", ["uvit", "uvic", "uvis"])
def test_trains_on_cifar10_files(tmp_path, monkeypatch, attention):
    make_cifar10(tmp_path / "cifar", n_per_batch=4)  # 20 training images
    patch_cifar10_checksums(monkeypatch, tmp_path / "cifar")
    out = tmp_path / "run"
    cfg = shapes_config(out, "data.name=cifar10", f"data.root={tmp_path / 'cifar'}",
                        f"model.attention={attention}", "train.max_steps=4",
                        "train.ckpt_every=2", "train.keep_last=1", "train.sample_every=4")
    assert train(cfg) == out.resolve()

    # what the run wrote is what RunFolder knows of, each where it says
    run = RunFolder(out)
    # (posthoc_ema/ only with train.posthoc_ema_stds, off by default)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        {*RunFolder.OUTPUTS, LOCK_FILE} - {RunFolder.POSTHOC_EMA})
    assert [c.name for c in run.checkpoints()] == ["step_000004"]  # keep_last=1
    assert run.latest_checkpoint() == run.checkpoint(4) and run.sample_grid(4).is_file()
    assert sorted(p.name for p in run.checkpoint(4).iterdir()) == sorted(
        [RunFolder.CONFIG, RunFolder.EMA, RunFolder.TRAINER_STATE, "model.safetensors",
         "optimizer.bin", "random_states_0.pkl", "scheduler.bin", "custom_checkpoint_0.pkl"])
    log = read_log(out)
    assert [r["step"] for r in log] == [2, 4]
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in log)
    # LR after s optimizer steps: lr * min(s / warmup, 1) -- stepped once per step
    assert [r["lr"] for r in log] == pytest.approx([1e-3 * 2 / 5, 1e-3 * 4 / 5])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_loss"] == log[-1]["loss"]
    assert (out / "samples" / "step_000004.png").is_file()
    assert load_config(out / "config.json") == cfg

    ema = build_model(cfg.model)
    load_weights(ema, out / "ema.safetensors")  # strict: the exported EMA fits the model
    assert ema.attention_modes[1] == {"uvic": "cog", "uvis": "sigmoid"}.get(attention, "softmax")
    ckpt = out / "checkpoints" / "step_000004"
    assert same_tensors(load_file(out / "ema.safetensors"), load_file(ckpt / "ema.safetensors"))
    for weights in (out / "ema.safetensors", ckpt / "ema.safetensors"):  # carry their model
        assert stored_model_config(weights) == (cfg.model, f"metadata of {weights}")
    model = load_file(ckpt / "model.safetensors")
    assert not same_tensors(model, load_file(ckpt / "ema.safetensors"))  # EMA lags the model


@pytest.mark.parametrize("attention", ["uvit", "uvic"])
def test_trains_on_mscoco_features(tmp_path, coco_features, attention, monkeypatch):
    monkeypatch.setattr(train_module, "diffusion_loss", recording_loss(tmp_path))
    out = tmp_path / "run"
    # grad_accum=2: 2 micro-batches of 2 per optimizer step; p_uncond=0.5 drops captions
    cfg = coco_config(out, coco_features, f"model.attention={attention}", "train.max_steps=3",
                      "train.grad_accum=2", "diffusion.p_uncond=0.5", "optim.warmup_steps=4",
                      "train.log_every=1", "train.ckpt_every=2", "train.sample_every=2")
    train(cfg)

    log = read_log(out)
    assert [r["step"] for r in log] == [1, 2, 3]
    assert [r["lr"] for r in log] == pytest.approx([2e-4 * s / 4 for s in (1, 2, 3)])
    assert all(np.isfinite(r["loss"]) for r in log)
    # each optimizer step trains on 2 micro-batches of 2, each with its own noise
    micro = read_records(tmp_path, rank=0)
    assert [m["seed"] for m in micro] == [noise_seed(cfg.train.seed, 0, s, m)
                                          for s in range(3) for m in (0, 1)]
    assert all(len(m["sums"]) == 2 for m in micro)
    assert [c.name for c in RunFolder(out).checkpoints()] == ["step_000002", "step_000003"]
    assert (out / "samples" / "step_000002.png").is_file()  # CFG grid decoded by the VAE
    assert (out / "samples" / "step_000003.png").is_file()  # final grid
    load_weights(build_model(cfg.model), out / "ema.safetensors")


@pytest.mark.parametrize("attention", ["uvit", "uvis"])
def test_loss_goes_down_on_one_fixed_batch(tmp_path, attention):
    """Four images, one batch per step: the model must fit them (loss well below 1). U-ViS
    (sigmoid attention) with a learnable bias per head too: it trains, and the bias moves."""
    out = tmp_path / "run"
    cfg = shapes_config(out, "data.num_images=4", "data.random_flip=false", "train.max_steps=30",
                        "optim.lr=1e-2", "optim.warmup_steps=0", "optim.weight_decay=0",
                        "train.log_every=5", "train.ckpt_every=0", f"model.attention={attention}",
                        f"model.sigmoid_bias_learnable={attention == 'uvis'}")
    train(cfg)
    log = read_log(out)
    assert all(np.isfinite(r["loss"]) for r in log)
    assert log[-1]["loss"] < 0.85 * log[0]["loss"]
    if attention == "uvis":  # 64 patches + the time token: the bias starts at -log 65
        weights = load_file(out / "checkpoints" / "step_000030" / "model.safetensors")
        bias = weights["mid_block.attn.sigmoid_bias"]
        assert torch.isfinite(bias).all() and bias.shape == (2,)
        assert (bias + math.log(65)).abs().min() > 1e-3

    # Same fixed noise levels and noise for the initial and the trained weights.
    set_seed(cfg.train.seed)
    initial = build_model(cfg.model)  # the run's initial weights depend on the seed only
    trained = build_model(cfg.model)
    load_weights(trained, out / "checkpoints" / "step_000030" / "model.safetensors")
    data = build_dataset(cfg)
    batch = {"x": torch.stack([data[i]["x"] for i in range(4)])}
    diffusion = Diffusion(cfg.diffusion)

    @torch.no_grad()
    def fixed_loss(model):
        g = torch.Generator().manual_seed(0)
        return np.mean([diffusion_loss(model, diffusion, batch, g).item() for _ in range(16)])

    assert fixed_loss(trained) < 0.8 * fixed_loss(initial)


# --------------------------------------------------------------------------- resume


@pytest.mark.slow
def test_resume_after_kill_reaches_the_same_weights(tmp_path):
    """SIGKILL a real run after a checkpoint, resume it: bitwise the uninterrupted run."""
    killed = tmp_path / "killed"
    cmd = [PYTHON, str(REPO / "scripts" / "train.py"), "--config",
           str(REPO / "configs" / "quickstart.py"),
           *[f"--set={o}" for o in shapes_overrides(killed, "train.max_steps=100000")]]
    stderr = tmp_path / "stderr.txt"  # a file, not a pipe: the progress bar never blocks
    with open(stderr, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 240
        while (not RunFolder(killed).checkpoints()
               or RunFolder(killed).checkpoints()[-1].name < "step_000006"):
            assert proc.poll() is None, stderr.read_text()[-2000:]
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # Leftovers of a kill during a save, and a folder without trainer state: never picked.
    (killed / "checkpoints" / "step_999999.tmp").mkdir()
    (killed / "checkpoints" / "step_999998").mkdir()
    with open(killed / "log.jsonl", "a") as f:
        f.write('{"step": 99999, "lo')  # a line cut short by the kill
    latest = int(RunFolder(killed).checkpoints()[-1].name.split("_")[1])
    target = latest + 4  # crosses the next checkpoint and an epoch boundary

    # Resumed with 2 DataLoader workers, the reference with none: item randomness (flips)
    # does not depend on the workers either.
    train(shapes_config(killed, f"train.max_steps={target}", "data.num_workers=2"),
          resume="latest")
    reference = tmp_path / "reference"
    train(shapes_config(reference, f"train.max_steps={target}"))

    assert not (killed / "checkpoints" / "step_999999.tmp").exists()  # cleaned up
    name = f"step_{target:06d}"
    for file in ("model.safetensors", "ema.safetensors"):
        a = load_file(killed / "checkpoints" / name / file)
        b = load_file(reference / "checkpoints" / name / file)
        assert same_tensors(a, b), file
    steps = [r["step"] for r in read_log(killed)]
    assert steps == sorted(set(steps)) and steps[-1] == target  # no duplicated log lines
    assert [r["loss"] for r in read_log(killed)] == [r["loss"] for r in read_log(reference)]
    state = json.loads((killed / "checkpoints" / name / "trainer_state.json").read_text())
    assert (state["epoch"], state["batch_in_epoch"]) == divmod(target, 4)


README_CPU_COMMAND = ("ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 "
                      "scripts/train.py --config configs/quickstart.py --output-dir runs/cpu2")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_see_different_data(tmp_path):
    """The README's command for several CPU processes (gloo) starts two, which say so at
    start and each get their own half of the data.

    The batches are recorded by tests/record_batches.py, launched in place of
    scripts/train.py with the same launcher arguments; it runs scripts/train.py itself."""
    out, debug = tmp_path / "run", tmp_path / "debug"
    debug.mkdir()
    assert README_CPU_COMMAND in readme_commands.readme_commands()
    env_vars, words = readme_commands.split_env(shlex.split(README_CPU_COMMAND))
    assert env_vars == {"ACCELERATE_USE_CPU": "1"} and words[:2] == ["accelerate", "launch"]
    script = words.index("scripts/train.py")
    recorder = str(Path(record_batches.__file__).relative_to(REPO))
    # the README's command at test size; a free port, as other tests may launch at once
    cmd = [ACCELERATE, "launch", "--main_process_port", str(free_port()), *words[2:script],
           recorder, *words[script + 1:],
           *[f"--set={o}" for o in shapes_overrides(out, "train.max_steps=4")],
           "--output-dir", str(out)]
    env = {**os.environ, **env_vars, record_batches.FOLDER_ENV: str(debug),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("launch: 2 processes (MULTI_CPU, gloo) on 2 x cpu; mixed precision no "
            "(train.mixed_precision)") in done.stdout.splitlines()

    # 16 images, 2 processes x 2 per batch: 4 steps are one epoch, split without overlap.
    ranks = [read_records(debug, rank) for rank in range(2)]
    seen = [sorted(round(s, 4) for rec in recs for s in rec["sums"]) for recs in ranks]
    assert len(seen[0]) == len(seen[1]) == 8 and not set(seen[0]) & set(seen[1])
    images = ShapesDataset(16, size=32, seed=SHAPES_SEEDS["train"])
    expected = sorted(round(images[i]["x"].double().sum().item(), 4) for i in range(16))
    assert sorted(seen[0] + seen[1]) == expected
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["steps"] == 4
    assert summary["launch"] == {"num_processes": 2, "distributed_type": "MULTI_CPU",
                                 "backend": "gloo", "devices": ["cpu", "cpu"],
                                 "mixed_precision": "no",
                                 "precision_from": "train.mixed_precision", "compile": "off"}
    ckpt = out / "checkpoints" / "step_000004"
    assert (ckpt / "random_states_0.pkl").is_file() and (ckpt / "random_states_1.pkl").is_file()


# --------------------------------------------------------------------------- failures


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, str(REPO / "scripts" / "train.py"), *args],
                          capture_output=True, text=True, timeout=300)


def load_cli():
    return load_script("scripts/train.py")


def test_cli_config_typo_is_one_line_error(tmp_path):
    done = run_cli("--config", str(REPO / "configs" / "quickstart.py"),
                   "--set", "train.batch_sise=3", "--output-dir", str(tmp_path / "run"))
    assert done.returncode == 2
    assert done.stderr.startswith("error: unknown config key 'train.batch_sise'")
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("problem, needle", [
    ("cifar10_missing", "CIFAR-10 not found"),
    ("mscoco_missing", "MS-COCO features missing"),
    ("batch_not_divisible", "train.batch_size=4 is not divisible"),
    ("bad_model", "model.depth=3 must be even"),
])
def test_cli_bad_data_is_one_line_error(tmp_path, capsys, problem, needle):
    extra = {
        "cifar10_missing": ["data.name=cifar10", f"data.root={tmp_path / 'nothing'}"],
        "mscoco_missing": ["data.name=mscoco", f"data.root={tmp_path / 'nothing'}",
                           "model.in_chans=4", "model.img_size=8", "model.clip_dim=32"],
        "batch_not_divisible": ["train.grad_accum=3"],
        "bad_model": ["model.depth=3"],
    }[problem]
    args = ["--config", str(REPO / "configs" / "quickstart.py")]
    for o in shapes_overrides(tmp_path / "run", *extra):
        args += ["--set", o]
    assert load_cli().main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and len(err.strip().splitlines()) == 1


def test_resume_refuses_a_different_model(tmp_path, capsys):
    out = tmp_path / "run"
    train(shapes_config(out, "train.max_steps=3"))
    args = ["--config", str(REPO / "configs" / "quickstart.py"), "--resume", "latest"]
    for o in shapes_overrides(out, "train.max_steps=6", "model.attention=uvic"):
        args += ["--set", o]
    assert load_cli().main(args) == 2
    err = capsys.readouterr().err
    assert "refusing to resume" in err and "model.attention: 'uvit'" in err
    with pytest.raises(TrainError, match="already has checkpoints"):
        train(shapes_config(out, "train.max_steps=6"))  # fresh start over a run: refused


@pytest.mark.parametrize("nan_from, log_every", [(6, 3), (7, 5)])
def test_nan_loss_stops_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, nan_from, log_every):
    """NaN from step `nan_from` on; checkpoints every 4 steps. (6, 3): caught when logging
    step 6; (7, 5): caught before writing the step-8 checkpoint."""
    real_loss = train_module.diffusion_loss
    calls = []

    def poisoned(*args, **kwargs):
        calls.append(1)
        loss = real_loss(*args, **kwargs)
        return loss * float("nan") if len(calls) >= nan_from else loss

    monkeypatch.setattr(train_module, "diffusion_loss", poisoned)
    out = tmp_path / "run"
    cfg = shapes_config(out, "train.max_steps=12", "train.ckpt_every=4",
                        f"train.log_every={log_every}")
    with pytest.raises(TrainError, match=r"loss is nan .*step_000004 is kept"):
        train(cfg)
    assert [c.name for c in RunFolder(out).checkpoints()] == ["step_000004"]
    assert not list((out / "checkpoints").glob("*.tmp"))
    weights = load_file(out / "checkpoints" / "step_000004" / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in weights.values())
    assert same_tensors(load_file(out / "ema.safetensors"),
                        load_file(out / "checkpoints" / "step_000004" / "ema.safetensors"))


def test_keep_steps_are_saved_and_never_pruned(tmp_path):
    out = tmp_path / "run"
    # step 2 is no multiple of ckpt_every=3: it is saved for keep_steps alone
    cfg = shapes_config(out, "train.max_steps=7", "train.keep_last=1", "train.keep_steps=[2]")
    assert cfg.train.keep_steps == (2,)
    train(cfg)
    assert [c.name for c in RunFolder(out).checkpoints()] == ["step_000002", "step_000007"]
    assert load_config(out / "config.json").train.keep_steps == (2,)  # saved and read back
    with pytest.raises(ConfigError, match=r"train\.keep_steps=\[0\] must be steps >= 1"):
        train(shapes_config(tmp_path / "bad", "train.keep_steps=0"))


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.keep_last=0"):
        train(shapes_config(tmp_path / "run", "train.keep_last=0"))


def test_refuses_processes_that_do_not_see_each_other(tmp_path, monkeypatch):
    """WORLD_SIZE=2 but Accelerate runs alone (e.g. --multi_gpu on a CPU machine)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(TrainError, match="ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu"):
        train(shapes_config(tmp_path / "run"))


@pytest.mark.slow
def test_cpu_flag_with_several_processes_is_refused(tmp_path):
    """`accelerate launch --cpu --num_processes 2` starts one process: refused in one line
    (the launcher's own traceback follows it), nothing written."""
    out = tmp_path / "run"
    cmd = [ACCELERATE, "launch", "--cpu", "--num_processes", "2",
           str(REPO / "scripts" / "train.py"), "--config", str(REPO / "configs" / "quickstart.py"),
           *[f"--set={o}" for o in shapes_overrides(out, "train.max_steps=4")]]
    launcher_vars = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in launcher_vars}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert ours == ["error: accelerate launch was asked for several processes but started only "
                    "this one (its one-process launcher, used with --cpu, ignores "
                    "--num_processes); for N CPU processes run "
                    "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N "
                    "scripts/train.py ..."], done.stderr[-3000:]
    assert not out.exists()


def wait_for_exec(pid: int, cmdline: bytes, timeout: float = 10.0) -> None:
    """Wait until process `pid` runs `cmdline`: before its exec, /proc shows the forking
    process's environment (or none), which would make the check read the wrong parent."""
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}/cmdline").read_bytes() != cmdline:
        assert time.monotonic() < deadline, f"process {pid} did not start {cmdline!r}"
        time.sleep(0.01)


def test_a_users_own_master_addr_is_no_launch_of_several(tmp_path, monkeypatch):
    """The check looks at who set MASTER_ADDR: the launcher (absent from the parent's
    environment: refused) or the user (present there too: a single process is fine)."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    cfg = shapes_config(tmp_path)
    for parent_has_it in (False, True):
        extra = {"MASTER_ADDR": "127.0.0.1"} if parent_has_it else {}
        parent = subprocess.Popen(["sleep", "60"], env={"PATH": os.environ["PATH"], **extra})
        try:
            wait_for_exec(parent.pid, b"sleep\x0060\x00")  # its own environment, not ours
            monkeypatch.setattr(os, "getppid", lambda pid=parent.pid: pid)
            if parent_has_it:
                assert make_accelerator(cfg.train, RunFolder(tmp_path)).num_processes == 1
            else:
                with pytest.raises(TrainError, match="asked for several processes"):
                    make_accelerator(cfg.train, RunFolder(tmp_path))
        finally:
            parent.kill()
            parent.wait()
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_errors_under_an_elastic_launcher_are_printed_once(tmp_path, monkeypatch, capsys):
    """Under torch's elastic launcher (accelerate launch --multi_gpu) every process writes
    its error line to the launcher's error file, whose report shows it; only rank 0 prints
    it on stderr."""
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    args = ["--config", str(REPO / "configs" / "quickstart.py"), "--set", "train.batch_sise=3"]
    for rank, printed in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        assert load_cli().main(args) == 2
        written = json.loads(error_file.read_text())["message"]
        assert written.startswith("error: unknown config key 'train.batch_sise'")
        assert capsys.readouterr().err == (f"{written}\n" if printed else "")
        error_file.unlink()


def test_precision_follows_the_launcher_unless_the_config_sets_it(tmp_path, monkeypatch, capsys):
    """train.mixed_precision empty: the launcher's (ACCELERATE_MIXED_PRECISION); set: the
    config's, and a launcher setting it overrides is named."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    launcher = shapes_config(tmp_path, "train.mixed_precision=")
    acc = make_accelerator(launcher.train, RunFolder(tmp_path))
    assert acc.mixed_precision == "bf16"
    assert "overrides the launcher" not in capsys.readouterr().out
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    config_no = shapes_config(tmp_path, "train.mixed_precision=no")
    acc = make_accelerator(config_no.train, RunFolder(tmp_path))
    assert acc.mixed_precision == "no"
    assert "train.mixed_precision=no overrides the launcher's --mixed_precision bf16" in (
        capsys.readouterr().out)


# --------------------------------------------------------------------------- reliability
# Each refusal: one line naming the file, key or value, exit status 2, and nothing that was
# already on disk changed (`snapshot`; the lock file only records its last holder).


def snapshot(folder: Path) -> dict[str, str]:
    """Relative path -> SHA-256 of every file under `folder` (the lock file left out)."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != LOCK_FILE}


def cli_error(capsys, out: Path, *extra: str, resume: str | None = None,
              overwrite: bool = False) -> str:
    """Run the train CLI in this process; it must fail with one line. Returns that line."""
    args = ["--config", str(REPO / "configs" / "quickstart.py")]
    args += ["--resume", resume] if resume else []
    args += ["--overwrite"] if overwrite else []
    for o in shapes_overrides(out, *extra):
        args += ["--set", o]
    capsys.readouterr()
    assert load_cli().main(args) == 2
    err = capsys.readouterr().err
    # the progress bar may precede it (on stderr, redrawn with carriage returns)
    lines = [line for line in err.replace("\r", "\n").splitlines()
             if line.strip() and "quickstart:" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0].strip()


class KilledHere(BaseException):
    """Stands for a kill: raised at one exact point of a checkpoint save."""


def test_kill_between_checkpoint_rename_and_ema_export_is_repaired(tmp_path, monkeypatch):
    """Item 1: killed after step_000006 is renamed into place but before ema.safetensors is
    exported; a resume with nothing left to train makes the run-root EMA the latest one."""
    out = tmp_path / "run"
    real_commit = checkpoints_module.commit_checkpoint

    def commit_then_die(tmp: Path, final: Path) -> None:
        real_commit(tmp, final)
        if final.name == "step_000006":
            raise KilledHere

    monkeypatch.setattr(checkpoints_module, "commit_checkpoint", commit_then_die)
    with pytest.raises(KilledHere):
        train(shapes_config(out, "train.max_steps=6"))
    monkeypatch.undo()
    (out / ".ema.safetensors.tmp99999").write_bytes(b"half an export")  # killed inside it
    latest = out / "checkpoints" / "step_000006" / "ema.safetensors"
    step3 = out / "checkpoints" / "step_000003" / "ema.safetensors"
    assert same_tensors(load_file(out / "ema.safetensors"), load_file(step3))  # stale

    train(shapes_config(out, "train.max_steps=6"), resume="latest")  # nothing left to train
    assert same_tensors(load_file(out / "ema.safetensors"), load_file(latest))
    assert not list(out.glob(".ema.safetensors.tmp*"))
    assert [c.name for c in RunFolder(out).checkpoints()] == ["step_000003", "step_000006"]


@pytest.mark.slow
def test_second_run_in_the_same_folder_is_refused(tmp_path, capsys):
    """Item 2: a run folder in use is locked; a second run (here U-ViC into a U-ViT run) is
    refused naming the holder and changes nothing; the first run then finishes alone."""
    out = tmp_path / "run"
    first = Trainer(shapes_config(out, "train.max_steps=3"))
    before = snapshot(out)
    err = cli_error(capsys, out, "model.attention=uvic", "train.max_steps=3")
    assert err.startswith(f"error: {out.resolve()} is in use by another run "
                          f"(pid {os.getpid()} on ")
    # the same from another process (the lock is the operating system's, not this process's)
    other = run_cli("--config", str(REPO / "configs" / "quickstart.py"),
                    *[f"--set={o}" for o in shapes_overrides(out, "model.attention=uvic")])
    assert other.returncode == 2
    assert other.stderr.strip() == err  # one line, naming this process as the holder
    assert snapshot(out) == before
    first.fit()
    assert load_config(out / "config.json").model.attention == "uvit"
    assert [r["step"] for r in read_log(out)] == [2, 3]
    # the lock ends with the run: continuing it is allowed
    train(shapes_config(out, "train.max_steps=4"), resume="latest")
    assert RunFolder(out).checkpoints()[-1].name == "step_000004"


def test_fresh_start_over_a_previous_run_needs_overwrite(tmp_path, capsys):
    """Item 3: outputs of a previous run (its checkpoints removed) are not overwritten by a
    fresh start, nor by --resume latest; --overwrite replaces them deliberately."""
    out = tmp_path / "run"
    train(shapes_config(out, "train.max_steps=3"))
    shutil.rmtree(out / "checkpoints")
    before = snapshot(out)
    err = cli_error(capsys, out, "train.max_steps=3", "optim.lr=5e-4")
    assert err.startswith(f"error: {out.resolve()} already holds a previous run "
                          "(ema.safetensors, log.jsonl, summary.json")
    assert "--overwrite to replace it" in err
    err = cli_error(capsys, out, "train.max_steps=3", resume="latest-or-new")
    assert "already holds a previous run (ema.safetensors, summary.json)" in err
    err = cli_error(capsys, out, "train.max_steps=3", resume="latest", overwrite=True)
    assert "--overwrite replaces a run and --resume latest continues it" in err
    assert snapshot(out) == before

    args = ["--config", str(REPO / "configs" / "quickstart.py"), "--overwrite"]
    for o in shapes_overrides(out, "train.max_steps=3", "optim.lr=5e-4"):
        args += ["--set", o]
    assert load_cli().main(args) == 0
    assert load_config(out / "config.json").optim.lr == 5e-4
    assert [r["lr"] for r in read_log(out)] == pytest.approx([5e-4 * 2 / 5, 5e-4 * 3 / 5])
    assert [c.name for c in RunFolder(out).checkpoints()] == ["step_000003"]


def test_resume_applies_new_optimizer_settings_and_refuses_a_new_seed(tmp_path, capsys):
    """Item 4: config.json describes what ran. Changed optim values are applied to the
    restored optimizer and LR schedule; a changed train.seed is refused."""
    out = tmp_path / "run"
    train(shapes_config(out, "train.max_steps=3"))
    changed = ("optim.lr=5e-4", "optim.weight_decay=0.1", "optim.betas=(0.9,0.95)",
               "optim.warmup_steps=8")
    capsys.readouterr()
    trainer = Trainer(shapes_config(out, "train.max_steps=6", *changed), resume="latest")
    printed = capsys.readouterr().out.splitlines()
    assert ("note: the LR schedule changes at step 3 (optim.lr 0.001 -> 0.0005, "
            "optim.warmup_steps 5 -> 8): LR 0.0006 at step 3 under the old one; from here on "
            "0.000188 at step 3, warm-up toward 0.0005 (at step 8) until the run ends: "
            "0.000375 at step 6") in printed
    assert ("warning: optim.warmup_steps=8 is not shorter than the run (train.max_steps=6): "
            "the LR warms up for the whole run, reaching 0.000375 at its last step "
            "(optim.lr=0.0005 at step 8) (fine for a short check run; for a real one set "
            "optim.warmup_steps below train.max_steps)") in printed
    group = trainer.optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(5e-4 * 3 / 8)
    assert (group["betas"], group["weight_decay"]) == ((0.9, 0.95), 0.1)
    trainer.fit()
    assert group["betas"] == (0.9, 0.95) and group["weight_decay"] == 0.1
    assert [r["lr"] for r in read_log(out)] == pytest.approx(
        [1e-3 * 2 / 5, 1e-3 * 3 / 5, 5e-4 * 4 / 8, 5e-4 * 6 / 8])
    saved = load_config(out / "config.json").optim
    assert (saved.lr, saved.weight_decay, saved.betas, saved.warmup_steps) == (
        5e-4, 0.1, (0.9, 0.95), 8)

    before = snapshot(out)
    err = cli_error(capsys, out, "train.max_steps=9", *changed, "train.seed=7", resume="latest")
    assert "train.seed=7 but the run was started with train.seed=1234" in err
    assert snapshot(out) == before


def test_resume_latest_needs_a_checkpoint(tmp_path, capsys):
    """`--resume latest` into a folder without checkpoints (a typo) is refused naming the
    folder, which is not created; `--resume latest-or-new` starts the run, then continues
    it."""
    typo = tmp_path / "rnu"
    err = cli_error(capsys, typo, "train.max_steps=3", resume="latest")
    assert err == (f"error: --resume latest: no checkpoint in {typo.resolve()} to resume (check "
                   "train.output_dir; --resume latest-or-new starts a new run where there is "
                   "none)")
    assert not typo.exists()
    for steps, said in ((3, f"note: no checkpoint in {typo.resolve()}: starting a new run"),
                        (6, "resumed from")):
        args = ["--config", str(REPO / "configs" / "quickstart.py"), "--resume", "latest-or-new"]
        for o in shapes_overrides(typo, f"train.max_steps={steps}"):
            args += ["--set", o]
        assert load_cli().main(args) == 0
        assert said in capsys.readouterr().out
    assert [c.name for c in RunFolder(typo).checkpoints()] == ["step_000003", "step_000006"]


def test_resume_records_every_change_in_config_json(tmp_path):
    """config.json is the current config plus the changes of each resume, at the step they
    took effect; each checkpoint holds the history up to its step; the original is the
    first config of config_history."""
    out = tmp_path / "run"
    original = shapes_config(out, "train.max_steps=3")
    train(original)
    first = shapes_config(out, "train.max_steps=6", "optim.lr=5e-4")
    train(first, resume="latest")
    train(first, resume="latest")  # nothing to train: nothing recorded
    second = shapes_config(out, "train.max_steps=7", "optim.lr=5e-4", "train.log_every=1")
    train(second, resume="latest")

    saved = json.loads((out / "config.json").read_text())
    assert [(r["step"], r["changes"]) for r in saved["resumes"]] == [
        (3, {"optim.lr": [1e-3, 5e-4], "train.max_steps": [3, 6]}),
        (6, {"train.max_steps": [6, 7], "train.log_every": [2, 1]})]
    assert all(time.strptime(r["time"], "%Y-%m-%dT%H:%M:%S+00:00") for r in saved["resumes"])
    assert load_config(out / "config.json") == second  # --config run/config.json: the latest
    assert config_history(out / "config.json") == [(0, original), (3, first), (6, second)]
    checkpoints = out / "checkpoints"
    assert config_history(checkpoints / "step_000006" / "config.json") == [(0, original),
                                                                          (3, first)]
    assert ((checkpoints / "step_000007" / "config.json").read_text()
            == (out / "config.json").read_text())
    assert [r["lr"] for r in read_log(out)][-2:] == pytest.approx([5e-4, 5e-4])


def test_resume_below_or_at_the_run_step(tmp_path, capsys, six_step_run):
    """train.max_steps below the checkpoint's step is refused in one line; at the step there
    is nothing to train, and the run folder (config.json, summary.json) is kept."""
    out = tmp_path / "run"
    shutil.copytree(six_step_run, out)
    before = snapshot(out)
    err = cli_error(capsys, out, "train.max_steps=4", resume="latest")
    ckpt = out.resolve() / "checkpoints" / "step_000006"
    assert err == (f"error: train.max_steps=4 is below step 6 of {ckpt}: a resume cannot "
                   "undo steps (set train.max_steps >= 6)")
    assert snapshot(out) == before

    args = ["--config", str(REPO / "configs" / "quickstart.py"), "--resume", "latest"]
    for o in shapes_overrides(out, "train.max_steps=6", "optim.lr=5e-4"):
        args += ["--set", o]
    assert load_cli().main(args) == 0
    assert ("note: the run is at step 6 = train.max_steps: nothing to train; its config.json "
            "and summary.json are kept (ignored: optim.lr, train.output_dir)"
            ) in capsys.readouterr().out
    assert snapshot(out) == before
    assert json.loads((out / "summary.json").read_text())["final_loss"] == read_log(out)[-1]["loss"]


def test_schedule_change_on_resume_is_announced(tmp_path, capsys):
    """Raising train.max_steps moves the cosine schedule's end: a note says the LR at this
    step before and now and what it does from here on, and the log follows it. A constant
    LR does not depend on train.max_steps: no note."""
    out = tmp_path / "cosine"
    train(shapes_config(out, "train.max_steps=6", "optim.lr_schedule=cosine"))
    capsys.readouterr()
    train(shapes_config(out, "train.max_steps=10", "optim.lr_schedule=cosine"), resume="latest")

    def cosine(step: int) -> float:  # warm-up 5 steps, then cosine to 0 at step 10
        return 1e-3 * 0.5 * (1 + math.cos(math.pi * (step - 5) / (10 - 5)))

    assert (f"note: the LR schedule changes at step 6 (train.max_steps 6 -> 10): LR 0 at step 6 "
            f"under the old one; from here on {cosine(6):.3g} at step 6, cosine decay to 0 at "
            "step 10") in capsys.readouterr().out.splitlines()
    log = read_log(out)[3:]
    assert [r["step"] for r in log] == [8, 10]
    assert [r["lr"] for r in log] == pytest.approx([cosine(8), 0.0])

    out = tmp_path / "constant"
    train(shapes_config(out, "train.max_steps=3"))
    capsys.readouterr()
    train(shapes_config(out, "train.max_steps=6"), resume="latest")
    assert "LR schedule" not in capsys.readouterr().out


@pytest.fixture(scope="module")
def six_step_run(tmp_path_factory) -> Path:
    """A finished run with checkpoints step_000003 and step_000006 (copied per test)."""
    out = tmp_path_factory.mktemp("six") / "run"
    train(shapes_config(out, "train.max_steps=6"))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return out


@pytest.mark.parametrize("victim", ["model.safetensors", "optimizer.bin", "scheduler.bin",
                                    "trainer_state.json", "custom_checkpoint_0.pkl"])
def test_truncated_latest_checkpoint_is_named_and_can_be_skipped(
        tmp_path, capsys, six_step_run, victim):
    """Item 5: a truncated file in the latest checkpoint: --resume latest names it and the
    way out; --resume latest-intact continues from step_000003, saying what it skipped."""
    out = tmp_path / "run"
    shutil.copytree(six_step_run, out)
    path = out / "checkpoints" / "step_000006" / victim
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    before = snapshot(out)
    err = cli_error(capsys, out, "train.max_steps=9", resume="latest")
    assert err.startswith(f"error: cannot resume from {path}: truncated or corrupt (")
    assert err.endswith("--resume latest-intact falls back to the newest intact one "
                        "(of step_000003)")
    assert snapshot(out) == before

    args = ["--config", str(REPO / "configs" / "quickstart.py"), "--resume", "latest-intact"]
    for o in shapes_overrides(out, "train.max_steps=9"):
        args += ["--set", o]
    assert load_cli().main(args) == 0
    said = capsys.readouterr().out
    assert f"note: skipped step_000006: {path}: truncated or corrupt" in said
    assert "resumed from" in said and "step_000003 at step 3" in said
    assert [c.name for c in RunFolder(out).checkpoints()] == ["step_000006", "step_000009"]
    assert checkpoint_problem(out / "checkpoints" / "step_000006") is None  # rewritten


def poison(path: Path) -> str:
    """Write NaN into the first element of the largest tensor of a safetensors file, as
    bad bytes would (the file stays well-formed); returns that tensor's name."""
    tensors = load_file(path)
    name = max(tensors, key=lambda k: tensors[k].numel())
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, path)
    return name


@pytest.mark.parametrize("extra, needle", [
    (["train.keep_steps=[]"], "is neither a checkpoint this run keeps (train.keep_steps=[]"),
    (["train.keep_steps=[2000]"], "is neither a checkpoint this run keeps (train.keep_steps="
                                  "[2000]"),
])
def test_a_guide_the_run_will_not_write_is_refused_before_training(tmp_path, capsys, extra,
                                                                   needle):
    """The quickstart preset guides its samples with the step-1000 checkpoint; a
    run that does not keep it would train, then fail when sampled. uvic-train says so
    before any step, with the rule of uvic-quickstart (one rule:
    uvic.config.sampling.check_guide)."""
    out = tmp_path / "run"
    err = cli_error(capsys, out, "train.max_steps=6", "sample.autoguidance_scale=1.0", *extra)
    assert err.startswith("error: sample.autoguidance_ckpt='checkpoints/step_001000/ema."
                          "safetensors' ") and needle in err, err
    assert not out.exists()
    guide = tmp_path / "guide.safetensors"  # a guide from elsewhere that exists: accepted
    guide.write_bytes(b"read when the run is sampled")
    train(shapes_config(out, "train.max_steps=1", "sample.autoguidance_scale=1.0",
                        f"sample.autoguidance_ckpt={guide}"))


@pytest.mark.parametrize("extra, when", [
    ([], "ends before step 1000"),  # the preset's guide, never written in 6 steps
    (["train.keep_steps=[6]", "sample.autoguidance_ckpt=checkpoints/step_000006/ema."
      "safetensors"], "ends at step 6"),  # the final model: guided by itself
])
def test_a_run_that_ends_before_its_guide_samples_unguided_with_a_note(tmp_path, capsys, extra,
                                                                       when):
    """A short try of the quickstart's config: trained, its config.json unguided, and one
    note says so and how to keep autoguidance."""
    out = tmp_path / "run"
    trainer = Trainer(shapes_config(out, "train.max_steps=6", "sample.autoguidance_scale=1.0",
                                    *extra))
    trainer.lock.release()
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and f"train.max_steps=6 {when}" in notes[0]
    assert notes[0].endswith("sample.autoguidance_ckpt=checkpoints/step_000002/ema.safetensors")
    assert trainer.cfg.sample.autoguidance_scale == 0
    assert load_config(out / "config.json").sample.autoguidance_scale == 0


def test_nan_weights_in_a_checkpoint_are_refused_and_skipped(tmp_path, capsys, six_step_run):
    """NaN bytes in the latest checkpoint's weights: --resume latest names the file
    and tensor (no training on them); latest-intact continues from step 3; a divergence
    afterwards names the checkpoint that was checked, not the newest one."""
    out = tmp_path / "run"
    shutil.copytree(six_step_run, out)
    path = out / "checkpoints" / "step_000006" / "model.safetensors"
    tensor = poison(path)
    before = snapshot(out)
    err = cli_error(capsys, out, "train.max_steps=9", resume="latest")
    assert err == (f"error: cannot resume from {path}: tensor {tensor!r} holds NaN or inf "
                   "values (a corrupt file, or weights of a diverged run); --resume "
                   "latest-intact falls back to the newest intact one (of step_000003)")
    assert snapshot(out) == before
    with pytest.raises(TrainError, match=r"loss is nan .*the last good checkpoint "
                       r".*step_000003 is kept"), pytest.MonkeyPatch.context() as patch:
        real_loss = train_module.diffusion_loss
        patch.setattr(train_module, "diffusion_loss",
                      lambda *a, **k: real_loss(*a, **k) * float("nan"))
        train(shapes_config(out, "train.max_steps=9", "train.ckpt_every=100"),
              resume="latest-intact")


def test_nan_weights_are_refused_where_they_are_loaded(tmp_path, capsys, six_step_run):
    """Sampling NaN EMA weights would write a black grid: the load names file and tensor."""
    ema = tmp_path / "ema.safetensors"
    shutil.copyfile(six_step_run / "ema.safetensors", ema)
    tensor = poison(ema)
    model = build_model(shapes_config(tmp_path / "unused").model)
    with pytest.raises(CheckpointError, match=rf"{ema}: tensor '{tensor}' holds NaN or inf"):
        load_weights(model, ema)
    sample = load_script("scripts/sample.py")
    capsys.readouterr()
    assert sample.main(["--ckpt", str(ema), "--config", str(REPO / "configs" / "quickstart.py"),
                        *[f"--set={o}" for o in TINY], "--n", "2",
                        "--out", str(tmp_path / "samples")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and f"tensor '{tensor}' holds NaN or inf" in err
    assert not (tmp_path / "samples").exists()


@pytest.mark.parametrize("override, needle", [
    ("sample.scheduler=DPMSolverMultistep",
     "sample.scheduler='DPMSolverMultistep' is neither one of ['dpm_solver++', 'dpm_solver', "
     "'dpm_solver++_fast_time_uniform', 'dpm_solver_fast_logsnr', 'euler_maruyama', "
     "'flow_euler', 'flow_heun', 'flow_euler_maruyama']"),
    ("sample.steps=0", "sample.steps=0 must be >= 1"),
    ("sample.order=7", "sample.order=7 must be 1, 2 or 3"),
    ("optim.betas=(0.9,1.5)", "optim.betas=(0.9, 1.5) must be in [0, 1)"),
])
def test_every_section_is_validated_before_training(tmp_path, capsys, six_step_run,
                                                    override, needle):
    """Item 6: a bad sample.* value (used first at the first sample grid) stops a fresh run
    and a resume before any step, naming the key and value."""
    fresh = tmp_path / "fresh"
    err = cli_error(capsys, fresh, "train.max_steps=6", "train.sample_every=3", override)
    assert err == f"error: {needle}" or err.startswith(f"error: {needle}")
    assert not fresh.exists()
    out = tmp_path / "run"
    shutil.copytree(six_step_run, out)
    before = snapshot(out)
    assert needle in cli_error(capsys, out, "train.max_steps=9", override, resume="latest")
    assert snapshot(out) == before


def test_disk_full_or_read_only_run_folder_is_one_line(tmp_path, capsys, monkeypatch):
    """Item 8: a checkpoint write failing with ENOSPC names the path and the space needed,
    keeps the last good checkpoint and leaves no half-written folder; a resume that still
    cannot write clears the leftover first; a read-only run folder is one line."""
    out = tmp_path / "run"
    train(shapes_config(out, "train.max_steps=3"))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    good = out / "checkpoints" / "step_000003"
    kept = snapshot(good)
    real_save_state = Accelerator.save_state

    def full_disk(self, output_dir=None, **kwargs):
        partial = Path(output_dir) / "model.safetensors"
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(partial))

    monkeypatch.setattr(Accelerator, "save_state", full_disk)
    err = cli_error(capsys, out, "train.max_steps=6", resume="latest")
    partial = out / "checkpoints" / "step_000006.tmp" / "model.safetensors"
    assert err.startswith(f"error: cannot write checkpoint {partial}: "
                          f"{os.strerror(errno.ENOSPC)} (a checkpoint needs about ")
    assert err.endswith(f"MiB); the last good checkpoint {good.resolve()} is kept")
    assert snapshot(good) == kept and RunFolder(out).checkpoints() == [good.resolve()]
    assert not (out / "checkpoints" / "step_000006.tmp").exists()
    monkeypatch.setattr(Accelerator, "save_state", real_save_state)

    # Still full at the resume: the leftover of a killed save is cleared, then one line.
    (out / "checkpoints" / "step_000006.tmp").mkdir()

    def no_space(cfg, path, resumes):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    import uvic.run.prepare as run_folder  # where the run folder is prepared

    monkeypatch.setattr(run_folder, "save_run_config", no_space)
    err = cli_error(capsys, out, "train.max_steps=6", resume="latest")
    assert err == (f"error: cannot write to the run folder: {out.resolve() / 'config.json'} "
                   f"({os.strerror(errno.ENOSPC)})")
    assert not (out / "checkpoints" / "step_000006.tmp").exists()
    monkeypatch.undo()

    # Read-only folder (simulated: tests may run as root, which chmod does not stop).
    import uvic.run.lock as runlock
    real_open = os.open

    def read_only(path, *args, **kwargs):
        if str(path).endswith(LOCK_FILE):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, *args, **kwargs)

    before = snapshot(out)
    monkeypatch.setattr(runlock.os, "open", read_only)
    err = cli_error(capsys, out, "train.max_steps=6", resume="latest")
    monkeypatch.undo()
    assert err == (f"error: cannot write to the run folder {out.resolve()} "
                   f"({os.strerror(errno.EROFS)})")
    assert snapshot(out) == before
