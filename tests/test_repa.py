"""REPA: the frozen timm encoder loaded from a local folder, the
alignment loss against a hand computation, where its gradients go, training with it on
the Shapes data (U-ViT and U-ViC), exact resumption with the projector, stored encoder
features of latent datasets, and the plain run left as it was.

The encoder is timm's real DINOv2 class, randomly initialised and shrunk to one block of
width 32 (tests/datagen.py `tiny_repa_encoder`), saved in timm's hub layout.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import readme_commands
import timm
import torch
import torch.nn.functional as F
from accelerate.state import AcceleratorState, GradientState
from datagen import (
    make_imagenet,
    make_imagenet_features,
    make_mscoco_features,
    tiny_repa_encoder,
    tiny_vae_folder,
)
from PIL import Image
from safetensors.torch import load_file
from test_train import (
    cli_error,
    coco_config,
    load_cli,
    read_log,
    same_tensors,
    shapes_config,
)

from uvic.config import Config, ConfigError, apply_overrides
from uvic.data.base import to_signed
from uvic.data.datasets import build_dataset
from uvic.data.imagenet import adm_center_crop
from uvic.data.mscoco_extraction import load_image
from uvic.models.repa_encoder import load_encoder
from uvic.models.uvit import build_model
from uvic.training.repa import (
    FEATURES_KEY,
    Repa,
    alignment_loss,
    build_repa,
    stored_features,
)
from uvic.training.trainer import Trainer, train

REPA = ["train.repa_projector_dim=16", "train.repa_block=1"]


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each train() builds its own Accelerator; reset Accelerate's process-wide singletons."""
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(scope="module")
def encoder_folder(tmp_path_factory) -> Path:
    return tiny_repa_encoder(tmp_path_factory.mktemp("repa") / "encoder")


def repa_config(out: Path, encoder: Path, *extra: str) -> Config:
    return shapes_config(out, f"train.repa_encoder={encoder}", *REPA, *extra)


# --------------------------------------------------------------------------- encoder


def test_encoder_loads_the_local_folder_and_gives_patch_features(encoder_folder):
    """The folder's weights in timm's class, built for the model's token grid (8 x 8
    patches of 14: 112 px, the position embedding resampled), and the features are the
    last layer's patch tokens of the resized, normalised images (computed here by hand)."""
    encoder = load_encoder(str(encoder_folder), grid=8)
    saved = load_file(encoder_folder / "model.safetensors")
    model = encoder.model
    assert type(model) is timm.models.vision_transformer.VisionTransformer
    assert torch.equal(model.patch_embed.proj.weight, saved["patch_embed.proj.weight"])
    assert model.pos_embed.shape == (1, 1 + 64, 32) and saved["pos_embed"].shape == (1, 17, 32)
    assert (encoder.size, encoder.dim) == (112, 32)
    assert not any(p.requires_grad for p in encoder.parameters())
    encoder.train()
    assert not model.training  # frozen: stays in eval mode

    images = torch.rand(2, 3, 32, 32) * 2 - 1
    x = F.interpolate((images + 1) / 2, size=(112, 112), mode="bicubic", antialias=True)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)  # ImageNet's, DINOv2's
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    expected = model.norm(model.blocks(model._pos_embed(model.patch_embed((x - mean) / std))))
    features = encoder(images)
    assert features.shape == (2, 64, 32)
    torch.testing.assert_close(features, expected[:, 1:], rtol=1e-5, atol=1e-5)


def test_encoder_loads_a_dinov2_release_file_for_a_timm_name(tmp_path):
    """A timm name with a local weights file in DINOv2's own release format (its keys and
    mask_token, the position embedding of 518 px): timm converts and resamples it."""
    torch.manual_seed(0)
    release = timm.create_model("vit_small_patch14_dinov2", pretrained=False, num_classes=0)
    state = {**release.state_dict(), "mask_token": torch.zeros(1, 384)}
    assert state["pos_embed"].shape == (1, 1 + 37 * 37, 384)
    torch.save(state, tmp_path / "dinov2_vits14_pretrain.pth")
    encoder = load_encoder("vit_small_patch14_dinov2", str(tmp_path / "dinov2_vits14_pretrain.pth"),
                           grid=4)
    assert encoder.model.pos_embed.shape == (1, 1 + 16, 384) and encoder.size == 56
    loaded = encoder.model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items()
               if k not in ("pos_embed", "mask_token"))
    with pytest.raises(ConfigError, match=r"^train.repa_encoder=vit_nope is neither a timm "):
        load_encoder("vit_nope")


def test_missing_encoder_files_are_one_line(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"^train.repa_encoder_weights: no such file: "
                                          rf"{tmp_path}/dinov2\.pth$"):
        load_encoder("vit_small_patch14_dinov2", str(tmp_path / "dinov2.pth"))
    with pytest.raises(ConfigError, match=rf"no encoder folder {tmp_path}/nowhere "):
        load_encoder(str(tmp_path / "nowhere"))
    err = cli_error(capsys, tmp_path / "run", "train.repa_encoder=vit_small_patch14_dinov2",
                    f"train.repa_encoder_weights={tmp_path}/dinov2.pth")
    assert err == f"error: train.repa_encoder_weights: no such file: {tmp_path}/dinov2.pth"
    err = cli_error(capsys, tmp_path / "run", "train.repa_weight=-1",
                    "train.repa_encoder=vit_small_patch14_dinov2")
    assert err == "error: train.repa_weight=-1.0 must be >= 0"


# --------------------------------------------------------------------------- loss


def test_alignment_loss_is_the_mean_negative_cosine():
    """Against float64 sums written out: -(a . b) / (|a| |b|), averaged over tokens."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 5, 7, generator=gen), torch.randn(3, 5, 7, generator=gen)
    a64, b64 = a.double(), b.double()
    cos = [(a64[i, j] @ b64[i, j]) / (a64[i, j].norm() * b64[i, j].norm())
           for i in range(3) for j in range(5)]
    expected = -sum(cos) / 15
    assert math.isclose(alignment_loss(a, b).item(), expected.item(), rel_tol=1e-6)
    assert math.isclose(alignment_loss(a, 2.5 * a).item(), -1.0, rel_tol=1e-6)


@pytest.mark.parametrize("extra", [[], ["model.num_classes=3", "model.grad_checkpointing=true"]])
def test_loss_gradients_reach_projector_and_blocks_up_to_the_chosen_one(encoder_folder,
                                                                        extra):
    """The hooked output's patch tokens (time and label tokens dropped) through the
    projector against the encoder's features, times repa_weight; the gradient reaches the
    projector and the blocks up to `repa_block`, not the later blocks nor the encoder."""
    cfg = apply_overrides(Config(), ["model.img_size=16", "model.patch_size=2",
                                     "model.embed_dim=32", "model.depth=4", "model.num_heads=2",
                                     "model.attention_backend=torch", "train.repa_weight=0.5",
                                     f"train.repa_encoder={encoder_folder}", *REPA, *extra])
    model = build_model(cfg)
    repa = build_repa(cfg, model, torch.device("cpu"))
    assert isinstance(repa, Repa)
    kept = {}
    model.blocks()[1].register_forward_hook(lambda m, i, out: kept.update(h=out))
    x = torch.rand(2, 3, 16, 16) * 2 - 1
    y = torch.tensor([0, 2]) if extra else None
    model(x, torch.tensor([10.0, 500.0]), y=y)
    loss = repa.loss({"x": x})
    tokens = kept["h"][:, model.extras:]
    assert tokens.shape == (2, 64, 32)
    expected = 0.5 * alignment_loss(repa.projector(tokens), repa.encoder(x))
    assert torch.equal(loss, expected)
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0
               for p in repa.projector.parameters())
    blocks = model.blocks()
    assert blocks[0].attn.qkv.weight.grad.abs().sum() > 0
    assert blocks[1].mlp.fc2.weight.grad.abs().sum() > 0
    assert all(p.grad is None for b in blocks[2:] for p in b.parameters())
    assert all(p.grad is None and not p.requires_grad for p in repa.encoder.parameters())
    with pytest.raises(ConfigError, match=r"train.repa_block=5 but the model has 5 blocks"):
        build_repa(apply_overrides(cfg, ["train.repa_block=5"]), model, torch.device("cpu"))


# --------------------------------------------------------------------------- training


@pytest.mark.parametrize("attention", ["uvit", "uvic"])
def test_trains_with_repa_and_keeps_the_projector_out_of_the_model(tmp_path, encoder_folder,
                                                                  attention):
    out = tmp_path / "run"
    train(repa_config(out, encoder_folder, "train.max_steps=4", f"model.attention={attention}"))
    log = read_log(out)
    assert [r["step"] for r in log] == [2, 4]
    assert all(math.isfinite(r["repa_loss"]) and -1 <= r["repa_loss"] <= 1 for r in log)
    checkpoint = out / "checkpoints" / "step_000004"
    projector = load_file(checkpoint / "model_1.safetensors")
    assert {k: tuple(v.shape) for k, v in projector.items()} == {
        "0.weight": (16, 32), "0.bias": (16,), "2.weight": (16, 16), "2.bias": (16,),
        "4.weight": (32, 16), "4.bias": (32,)}  # model width 32 -> 16 -> 16 -> encoder 32
    model_keys = set(build_model(shapes_config(out).model).state_dict())
    for exported in (checkpoint / "model.safetensors", checkpoint / "ema.safetensors",
                     out / "ema.safetensors"):
        assert set(load_file(exported)) == model_keys


def test_resume_carries_the_projector(tmp_path, encoder_folder, capsys):
    """Stopped at step 3 and resumed to 6: bitwise the uninterrupted run's model, EMA,
    projector and optimizer state. Turning REPA off (or on) at a resume is refused."""
    split, whole = tmp_path / "split", tmp_path / "whole"
    train(repa_config(split, encoder_folder, "train.max_steps=3"))
    train(repa_config(split, encoder_folder, "train.max_steps=6"), resume="latest")
    train(repa_config(whole, encoder_folder, "train.max_steps=6"))
    for name in ("model.safetensors", "model_1.safetensors", "ema.safetensors"):
        a = load_file(split / "checkpoints" / "step_000006" / name)
        b = load_file(whole / "checkpoints" / "step_000006" / name)
        assert same_tensors(a, b), name
    opt = [torch.load(run / "checkpoints" / "step_000006" / "optimizer.bin", weights_only=True)
           for run in (split, whole)]
    assert all(torch.equal(opt[0]["state"][k]["exp_avg"], opt[1]["state"][k]["exp_avg"])
               for k in opt[1]["state"])
    assert read_log(split)[-1]["repa_loss"] == read_log(whole)[-1]["repa_loss"]  # steps 5-6
    err = cli_error(capsys, split, "train.max_steps=9", resume="latest")
    assert err.startswith(f"error: refusing to resume from {split.resolve()}/checkpoints/"
                          "step_000006: REPA's projector differs from the checkpoint's "
                          "(train.repa_encoder: ")


def test_repa_off_is_the_plain_run(tmp_path, encoder_folder):
    """Off (the default): no hook, no projector, the optimizer on the model's parameters
    only, the checkpoint files of before. On with weight 0: the model trains bit for bit
    as with it off (the projector's draws and its optimizer change nothing of the model)."""
    off, zero = tmp_path / "off", tmp_path / "zero"
    trainer = Trainer(shapes_config(off, "train.max_steps=4"))
    assert trainer.repa.modules == ()
    assert not any(b._forward_hooks for b in trainer.model.blocks())
    params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert [id(p) for p in params] == [id(p) for p in trainer.model.parameters()]
    trainer.fit()
    train(repa_config(zero, encoder_folder, "train.max_steps=4", "train.repa_weight=0"))
    step = "checkpoints/step_000004"
    assert "model_1.safetensors" not in {p.name for p in (off / step).iterdir()}
    for name in ("model.safetensors", "ema.safetensors"):
        assert same_tensors(load_file(off / step / name), load_file(zero / step / name)), name
    assert ([r["loss"] for r in read_log(off)] == [r["loss"] for r in read_log(zero)])
    assert "repa_loss" not in read_log(off)[0]


# --------------------------------------------------------------------------- latents


def test_latent_features_store_encoder_features(tmp_path, encoder_folder, capsys,
                                                 monkeypatch):
    """The ImageNet extractor stores the encoder's features of every crop (float16); items
    carry them (mirrored on the grid for mirrored items), and a run trains with them. A
    folder without them is one line naming it and the command that makes them."""
    make_imagenet(tmp_path / "imagenet")
    plain = make_imagenet_features(tmp_path / "plain", imagenet=tmp_path / "imagenet")
    encoder = load_encoder(str(encoder_folder), grid=4)
    root = make_imagenet_features(tmp_path, imagenet=tmp_path / "imagenet", repa=encoder,
                                  repa_name=str(encoder_folder))
    meta = json.loads((root / "meta.json").read_text())["settings"]["repa"]
    assert meta == {"encoder": str(encoder_folder.resolve()), "grid": 4, "dim": 32,
                    "input_size": 56}
    stored = np.load(root / "train" / "repa.npy")
    assert stored.shape == (9, 16, 32) and stored.dtype == np.float16
    latent = ["data.name=imagenet_features", "model.in_chans=4", "model.img_size=8",
              "model.patch_size=2", "model.num_classes=4", "data.scale_factor=0.18215"]
    data = build_dataset(repa_config(tmp_path / "run", encoder_folder, f"data.root={root}",
                                     *latent))
    files = json.loads((root / "train" / "files.json").read_text())
    crop = to_signed(adm_center_crop(Image.open(root.parent / "imagenet" / "train" / files[3])
                                     .convert("RGB"), 64))
    direct = encoder(crop[None])[0]
    torch.testing.assert_close(data[3][FEATURES_KEY], direct, atol=2e-3, rtol=2e-3)
    mirrored = data[9 + 3][FEATURES_KEY].view(4, 4, 32).flip(1).reshape(16, 32)
    assert torch.equal(mirrored, data[3][FEATURES_KEY])

    train(repa_config(tmp_path / "run", encoder_folder, f"data.root={root}", *latent,
                      "train.max_steps=2", "diffusion.p_uncond=0.1"))
    # the folder named relative to another directory matches; another grid does not
    monkeypatch.chdir(encoder_folder.parent)
    relative = repa_config(tmp_path / "run3", Path(encoder_folder.name), f"data.root={root}",
                           *latent)
    assert stored_features(relative, 4) == 32
    with pytest.raises(ConfigError, match=r"with 2x2 tokens but .*meta.json stores features "
                                          r"of .* on a 4x4 grid; extract them with "
                                          r"uvic-extract-imagenet .* --repa-grid 2$"):
        stored_features(relative, 2)
    assert math.isfinite(read_log(tmp_path / "run")[-1]["repa_loss"])
    err = cli_error(capsys, tmp_path / "run2", f"train.repa_encoder={encoder_folder}",
                    f"data.root={plain}", *latent)
    assert err.startswith(f"error: train.repa_encoder: data.root={plain} holds latents "
                          "without REPA encoder features; extract them with "
                          f"uvic-extract-imagenet --out {plain} --repa-encoder")


DOCS_COMMAND = ("python scripts/train.py --config configs/quickstart.py --set "
                "train.repa_encoder=models/dinov2_vits14 --set train.repa_block=1 --set "
                "train.output_dir=runs/quickstart_repa")


def test_the_documented_command_trains_with_repa(tmp_path, encoder_folder, monkeypatch):
    """docs/training.md's REPA command (readme_commands), its encoder folder the tiny one
    and 2 steps: it trains and logs repa_loss."""
    assert DOCS_COMMAND in readme_commands.readme_commands(readme_commands.page(
        "docs/training.md"))
    words = readme_commands.argv(DOCS_COMMAND)
    assert Path(words[1]).name == "train.py"
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "dinov2_vits14").symlink_to(encoder_folder)
    monkeypatch.chdir(tmp_path)
    tiny = ["train.max_steps=2", "train.log_every=1", "train.sample_every=0",
            "data.num_images=8", "train.batch_size=4", "data.num_workers=0",
            "model.attention_backend=torch", "train.mixed_precision=no",
            "sample.autoguidance_scale=0"]
    assert load_cli().main([*words[2:], *[a for o in tiny for a in ("--set", o)]]) == 0
    log = read_log(tmp_path / "runs" / "quickstart_repa")
    assert [r["step"] for r in log] == [1, 2] and all("repa_loss" in r for r in log)


def test_mscoco_features_store_encoder_features(tmp_path, encoder_folder):
    """The MS-COCO extractor stores the encoder's features of every image; items carry
    them and a text-to-image run trains with them."""
    encoder = load_encoder(str(encoder_folder), grid=4)
    root = make_mscoco_features(tmp_path, {"train": 4}, repa=encoder,
                                repa_name=str(encoder_folder))
    assert json.loads((root / "meta.json").read_text())["settings"]["repa"]["grid"] == 4
    features = {"features": root, "vae": tiny_vae_folder(tmp_path / "vae")}
    cfg = coco_config(tmp_path / "run", features, f"train.repa_encoder={encoder_folder}",
                      *REPA, "train.max_steps=2", "train.sample_every=0")
    data = build_dataset(cfg)
    image = load_image(sorted((tmp_path / "coco" / "train2014").glob("*.jpg"))[1], 64)
    assert data[1][FEATURES_KEY].shape == (16, 32)
    torch.testing.assert_close(data[1][FEATURES_KEY], encoder(image[None])[0], atol=2e-3,
                               rtol=2e-3)
    train(cfg)
    assert math.isfinite(read_log(tmp_path / "run")[-1]["repa_loss"])
