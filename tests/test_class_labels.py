"""Class labels: `uvic-sample --class-labels`, FID's labels drawn
as the U-ViT release draws them, and the one-line errors of conditioning a model cannot take.

References are independent of uvic's code: the release's own draws (its datasets.py
`sample_label`: `torch.randint(0, 1000, ...)` for the latent ImageNet rows,
`torch.multinomial(cnt, n, replacement=True)` of the training images per class for ImageNet
64), compared by a chi-square test; the class of "a uniformly drawn training image" read off
the class-folder listing image by image; and images sampled by `generate` with explicit labels.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from conftest import load_script
from datagen import make_imagenet, make_imagenet_features
from PIL import Image
from scipy.stats import chi2_contingency

import uvic.evaluation.fid as fid
from uvic.cli import train as train_cli
from uvic.config import Config, DataConfig, EvalConfig, ModelConfig, SampleConfig, apply_overrides
from uvic.data.base import DatasetError
from uvic.data.imagenet import read_class_folders
from uvic.diffusion.schedule import Diffusion
from uvic.evaluation.protocols import protocol_from_result, protocol_of
from uvic.evaluation.statistics import ProjectionFeatures
from uvic.models.uvit import build_model
from uvic.presets import preset_path
from uvic.run.weights import save_safetensors
from uvic.sampling.generate import generate
from uvic.sampling.images import save_grid, to_uint8
from uvic.sampling.labels import (
    LABEL_STREAM,
    FIDLabels,
    class_caption,
    class_names,
    fid_labels,
    resolve_class_labels,
)

N_DRAWS = 30_000


def tiny(num_classes: int = 5, p_uncond: float = 0.1, **overrides: str) -> Config:
    """A tiny class-conditional U-ViT on 8x8 pixels (num_classes - 1 classes and the null
    class when p_uncond > 0), 3 Euler-Maruyama steps, guidance 0.5."""
    cfg = Config(
        name="tiny_classes",
        model=ModelConfig(img_size=8, patch_size=2, embed_dim=32, depth=2, num_heads=2,
                          attention="uvit", attention_backend="torch", num_classes=num_classes),
        data=DataConfig(name="shapes", root=""),
        sample=SampleConfig(scheduler="euler_maruyama", steps=3, batch_size=3, cfg_scale=0.5),
        eval=EvalConfig(n_samples=6, ref_stats="shapes", ref_res=8),
    )
    return apply_overrides(cfg, [f"diffusion.p_uncond={p_uncond}",
                                 *(f"{k}={v}" for k, v in overrides.items())])


def saved_model(cfg: Config, path: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    save_safetensors(model, path)
    return model


def images_of(model: torch.nn.Module, cfg: Config, n: int, labels: list[int],
              seed: int = 0) -> np.ndarray:
    """uint8 images of samples 0..n-1 with explicit labels: the independent reference."""
    batches = generate(model, Diffusion(cfg.diffusion), cfg, range(n), seed=seed,
                       label_fn=lambda idx: torch.tensor([labels[i] for i in idx]))
    return to_uint8(torch.cat([b for _, b in batches])).numpy()


def histogram(labels: torch.Tensor | np.ndarray, classes: int) -> np.ndarray:
    return np.bincount(np.asarray(labels), minlength=classes)


def same_distribution(a: np.ndarray, b: np.ndarray) -> float:
    """p-value of a chi-square test that two histograms come from one distribution."""
    return chi2_contingency(np.stack([a, b]))[1]


# --------------------------------------------------------------------------- FID's labels


def test_fid_labels_are_the_releases_uniform_draw_for_latents() -> None:
    """ImageNet 256 / 512 latents (the release's ImageNet{256,512}Features.sample_label:
    torch.randint(0, 1000)): uniform over the 1000 real classes, never the null class."""
    cfg = apply_overrides(Config(), ["data.name=imagenet_features", "model.num_classes=1001",
                                     "diffusion.p_uncond=0.15"])
    labels = fid_labels(cfg, seed=7)
    assert labels == FIDLabels(7, 1000) and labels.counts is None
    ours = labels(range(N_DRAWS))
    assert ours.dtype == torch.long and int(ours.min()) >= 0 and int(ours.max()) <= 999
    torch.manual_seed(0)
    release = torch.randint(0, 1000, (N_DRAWS,))
    assert same_distribution(histogram(ours, 1000), histogram(release, 1000)) > 1e-3
    # the image of sample i is a function of (seed, i): any order, batch or subset
    assert torch.equal(labels([17, 3, 29_999]), ours[[17, 3, 29_999]])
    assert not torch.equal(FIDLabels(8, 1000)(range(100)), ours[:100])
    assert protocol_of(cfg).labels == "uniform over 1000 classes"


def test_fid_labels_follow_the_training_class_frequencies_for_imagenet64(tmp_path: Path) -> None:
    """ImageNet 64 pixels (the release's ImageNet.sample_label: multinomial of the images
    per class of the train folder): a uniformly drawn training image's class."""
    make_imagenet(tmp_path / "imagenet", per_class=(3, 2, 4))
    cfg = apply_overrides(Config(), ["data.name=imagenet", f"data.root={tmp_path / 'imagenet'}",
                                     "model.num_classes=3", "diffusion.p_uncond=0"])
    labels = fid_labels(cfg, seed=1)
    assert labels.classes == 3 and labels.counts.tolist() == [3, 2, 4]
    ours = labels(range(N_DRAWS))
    torch.manual_seed(0)
    release = torch.multinomial(torch.tensor([3.0, 2.0, 4.0]), N_DRAWS, replacement=True)
    assert same_distribution(histogram(ours, 3), histogram(release, 3)) > 1e-3
    uniform = torch.randint(0, 3, (N_DRAWS,))  # the test tells the two draws apart
    assert same_distribution(histogram(ours, 3), histogram(uniform, 3)) < 1e-9
    # image by image: the class of training image u, u from sample i's own generator
    listing = read_class_folders(tmp_path / "imagenet" / "train")
    for i in (0, 1, 5, 123):
        u = np.random.default_rng([1, i, LABEL_STREAM]).integers(len(listing))
        assert int(labels([i])[0]) == listing.labels[u]
    assert protocol_of(cfg).labels == "3 classes in training-set frequencies"
    record = labels.record("x")
    assert record["images"] == 9 and len(record["counts_sha256"]) == 64

    with pytest.raises(ValueError, match=r"has 3 class folders but tiny has 5 classes"):
        fid_labels(apply_overrides(cfg, ["model.num_classes=6", "diffusion.p_uncond=0.1",
                                         "name=tiny"]), seed=1)
    with pytest.raises(DatasetError, match=str(tmp_path / "nowhere" / "train")):
        fid_labels(apply_overrides(cfg, [f"data.root={tmp_path / 'nowhere'}"]), seed=1)
    assert fid_labels(apply_overrides(cfg, ["model.num_classes=-1"]), seed=1) is None


def test_fid_of_a_class_conditional_model_samples_the_release_labels(tmp_path: Path) -> None:
    """evaluate() shows sample i the class FIDLabels draws for (seed, i), whatever the batch
    size; its samples record and its protocol name the draw and the guidance."""
    cfg = tiny()  # 4 real classes + the null class 4
    model = saved_model(cfg, tmp_path / "ema.safetensors")
    cfg = apply_overrides(cfg, ["eval.n_samples=6", "sample.seed=2"])
    common = {"feat_extractor": ProjectionFeatures("tiny16"),
              "stats_dir": tmp_path / "stats", "num_workers": 0, "progress": False}
    result = fid.evaluate(cfg, tmp_path / "ema.safetensors", out_json=tmp_path / "a.json",
                          **common)
    labels = FIDLabels(2, 4)(range(6)).tolist()
    assert labels != [i % 4 for i in range(6)]  # not the grids' cycle
    expected = images_of(model, cfg, 6, labels, seed=2)
    samples = tmp_path / "a_samples"
    got = np.stack([np.asarray(Image.open(samples / f"{i:06d}.png")) for i in range(6)])
    np.testing.assert_array_equal(got, expected)
    protocol = protocol_from_result(result)
    assert protocol.labels == "uniform over 4 classes" and protocol.guidance == 0.5
    assert "labels uniform over 4 classes" in result["protocol"]["label"]
    meta = json.loads((samples / "samples.json").read_text())
    assert meta["labels"] == {"draw": "uniform over 4 classes", "classes": 4}

    rebatched = apply_overrides(cfg, ["sample.batch_size=4"])
    fid.evaluate(rebatched, tmp_path / "ema.safetensors", out_json=tmp_path / "b.json",
                 **common)
    again = np.stack([np.asarray(Image.open(tmp_path / "b_samples" / f"{i:06d}.png"))
                      for i in range(6)])
    assert np.abs(again.astype(int) - expected).max() <= 1  # float rounding at most


# --------------------------------------------------------------------------- uvic-sample


@pytest.fixture
def sample_main():
    return load_script("scripts/sample.py").main


def write_config(cfg: Config, path: Path) -> Path:
    from uvic.files import save_config

    save_config(cfg, path)
    return path


def one_line_error(capsys: pytest.CaptureFixture, rc: int) -> str:
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_sample_class_labels_fill_one_grid_row_each(tmp_path: Path, sample_main, capsys) -> None:
    cfg = tiny()
    config = write_config(cfg, tmp_path / "config.json")
    model = saved_model(cfg, tmp_path / "m.safetensors")
    out = tmp_path / "o"
    rc = sample_main(["--config", str(config), "--ckpt", str(tmp_path / "m.safetensors"),
                      "--class-labels", "3,1", "--n", "5", "--seed", "4", "--upscale", "1",
                      "--save-individual", "--quiet", "--out", str(out)])
    stdout = capsys.readouterr().out
    assert rc == 0
    assert "classes shown: 3, 1 (2 images each, one grid row per class)" in stdout
    record = json.loads((out / "sample_config.json").read_text())
    assert record["class_labels"] == [3, 3, 1, 1] and record["n"] == 4  # 5 // 2 each
    got = np.stack([np.asarray(Image.open(out / "samples" / f"{i:06d}.png")) for i in range(4)])
    np.testing.assert_array_equal(got, images_of(model, cfg, 4, [3, 3, 1, 1], seed=4))
    grid = Image.open(out / "grid.png")
    assert grid.width == 2 * 10 + 2 and grid.height > 2 * 10 + 2  # 2 a row, captions below

    # without --class-labels: image i shows class i mod 4, captioned
    rc = sample_main(["--config", str(config), "--ckpt", str(tmp_path / "m.safetensors"),
                      "--n", "5", "--quiet", "--out", str(tmp_path / "d")])
    assert rc == 0 and "classes shown: 0, 1, 2, 3, 0 (one image each)" in capsys.readouterr().out
    assert json.loads((tmp_path / "d" / "sample_config.json").read_text())["class_labels"] == [
        0, 1, 2, 3, 0]


@pytest.mark.parametrize(("overrides", "args", "needle"), [
    ({}, ["--class-labels", "4"],
     "--class-labels 4 is outside [0, 4) (tiny_classes has 4 classes; 4 is its null class)"),
    ({}, ["--class-labels", "2,-1"], "--class-labels -1 is outside [0, 4)"),
    ({"num_classes": -1}, ["--class-labels", "1"],
     "--class-labels given but tiny_classes is unconditional (model.num_classes=-1, "
     "model.clip_dim=0): it takes no class labels"),
    ({"num_classes": -1}, ["--cfg-scale", "0.5"],
     "--cfg-scale 0.5: guidance needs a text-conditional model or a class-conditional one "
     "trained with a null class; tiny_classes is unconditional (model.num_classes=-1"),
    ({"num_classes": -1}, ["--set", "sample.cfg_scale=2"], "--set sample.cfg_scale=2: guidance"),
    ({"p_uncond": 0.0}, ["--cfg-scale", "0.4"],
     "tiny_classes is class-conditional (model.num_classes=5, without a null class: "
     "diffusion.p_uncond=0)"),
])
def test_sample_refuses_labels_and_guidance_a_model_cannot_take(
        tmp_path: Path, sample_main, capsys, overrides: dict, args: list[str],
        needle: str) -> None:
    classes = overrides.get("num_classes", 5)
    cfg = tiny(classes, overrides.get("p_uncond", 0.1))
    config = write_config(apply_overrides(cfg, ["sample.cfg_scale=0"]), tmp_path / "c.json")
    saved_model(cfg, tmp_path / "m.safetensors")
    rc = sample_main(["--config", str(config), "--ckpt", str(tmp_path / "m.safetensors"),
                      "--n", "2", "--quiet", "--out", str(tmp_path / "o"), *args])
    err = one_line_error(capsys, rc)
    assert needle in err
    assert not (tmp_path / "o").exists()
    # guidance 0, said explicitly, is no guidance: accepted
    if "--cfg-scale" in args:
        assert sample_main(["--config", str(config), "--ckpt", str(tmp_path / "m.safetensors"),
                            "--n", "1", "--quiet", "--out", str(tmp_path / "z"),
                            "--cfg-scale", "0"]) == 0


def test_a_single_captioned_image_makes_a_grid(tmp_path: Path) -> None:
    """`--class-labels 207 --n 1`: one image, captioned (make_grid leaves a lone image
    unpadded; the grid pads it as it pads several)."""
    image = torch.rand(1, 3, 8, 8)
    grid = Image.open(save_grid(image, tmp_path / "g.png", captions=["class 207"]))
    assert grid.width == 8 + 2 * 2 and grid.height > 8 + 2 * 2
    pixels = np.asarray(grid)[2:10, 2:10]
    np.testing.assert_array_equal(pixels, to_uint8(image)[0].numpy())


def test_sample_class_labels_must_be_numbers_or_wordnet_ids(tmp_path: Path, sample_main,
                                                           capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        sample_main(["--config", "c.py", "--ckpt", "m.pth", "--out", "o",
                     "--class-labels", "207,tench"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "argument --class-labels: 'tench' is neither a class number nor a WordNet id (give "
        "ids like 207,360 or n01440764)")


def test_wordnet_ids_name_imagenet_classes(tmp_path: Path) -> None:
    """ImageNet's class folders are named by WordNet id, and so may the classes
    of --class-labels be: by the training folders where data.root has them (their sorted
    order is the label order), else by ILSVRC-2012's 1000; grid captions carry the id and,
    where ImageNet knows it, the name."""
    root = tmp_path / "imagenet"
    for wnid in ("n01530575", "n01440764", "n01443537"):  # written unsorted
        (root / "train" / wnid).mkdir(parents=True)
    cfg = tiny(4, 0.1, **{"data.name": "imagenet", "data.root": str(root)})
    assert class_names(cfg) == ["n01440764", "n01443537", "n01530575"]
    assert resolve_class_labels(cfg, ["n01530575", 0]) == [2, 0]
    assert class_caption(0, class_names(cfg)) == "class 0 n01440764 tench"
    assert class_caption(2, None) == "class 2"
    with pytest.raises(ValueError, match=r"--class-labels n09999999 is not one of the 3 "):
        resolve_class_labels(cfg, ["n09999999"])

    release = tiny(1001, 0.1, **{"data.name": "imagenet_features",
                                 "data.root": str(tmp_path / "nowhere")})
    assert resolve_class_labels(release, ["n01440764", "n02099601"]) == [0, 207]
    assert class_caption(207, class_names(release)) == "class 207 n02099601 golden retriever"
    with pytest.raises(ValueError, match="tiny_classes has no WordNet class names "
                       r"\(data.name='shapes'\); give class numbers"):
        resolve_class_labels(tiny(), ["n01440764"])


def test_fid_refuses_guidance_on_an_unconditional_model(tmp_path: Path, capsys) -> None:
    """Before any sampling or Inception loading."""
    cfg = tiny(-1)
    config = write_config(apply_overrides(cfg, ["sample.cfg_scale=0"]), tmp_path / "c.json")
    saved_model(cfg, tmp_path / "m.safetensors")
    rc = load_script("eval/fid.py").main([
        "--config", str(config), "--ckpt", str(tmp_path / "m.safetensors"), "--n", "4",
        "--cfg-scale", "1", "--samples-dir", str(tmp_path / "s"), "--quiet"])
    err = one_line_error(capsys, rc)
    assert "--cfg-scale 1: guidance needs" in err and "unconditional" in err
    assert not (tmp_path / "s").exists()


# --------------------------------------------------------------------------- data, by uvic-train


@pytest.fixture(scope="module")
def features(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_imagenet_features(tmp_path_factory.mktemp("features"), resolution=64)


def train_error(capsys: pytest.CaptureFixture, *overrides: str) -> str:
    """uvic-train of the ImageNet-256 preset, made tiny, must stop with one line."""
    tiny_run = ["model.embed_dim=32", "model.depth=2", "model.num_heads=2",
                "model.attention_backend=torch", "model.grad_checkpointing=false",
                "train.mixed_precision=no", "data.num_workers=0", "train.max_steps=1",
                "train.batch_size=2", "train.sample_every=0"]
    args = ["--config", str(preset_path("imagenet256_uvit_large"))]
    for item in (*tiny_run, *overrides):
        args += ["--set", item]
    try:
        rc = train_cli.main(args)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    return one_line_error(capsys, rc)


def test_train_names_labels_out_of_range(features: Path, tmp_path: Path, capsys) -> None:
    copy = tmp_path / "features"
    shutil.copytree(features, copy)
    labels = np.load(copy / "train" / "labels.npy")
    labels[4] = 3  # 3 classes: ids 0, 1, 2
    np.save(copy / "train" / "labels.npy", labels)
    err = train_error(capsys, f"data.root={copy}", "model.img_size=8", "model.num_classes=4",
                      f"train.output_dir={tmp_path / 'run'}")
    assert f"{copy / 'train' / 'labels.npy'}: label 3 at row 4 is outside [0, 3)" in err


def test_train_names_features_of_the_wrong_latent_size(features: Path, tmp_path: Path,
                                                       capsys) -> None:
    err = train_error(capsys, f"data.root={features}", "model.num_classes=4",
                      f"train.output_dir={tmp_path / 'run'}")  # the preset's 4x32x32
    assert (f"data.root={features} holds latents 4x8x8 of 64x64 images, but "
            "model.in_chans/img_size expect 4x32x32 (256x256 images)") in err


def test_train_names_a_class_folder_without_images(tmp_path: Path, capsys) -> None:
    make_imagenet(tmp_path / "imagenet", per_class=(1, 1))
    (tmp_path / "imagenet" / "train" / "n09999999").mkdir()
    err = train_error(capsys, "data.name=imagenet", f"data.root={tmp_path / 'imagenet'}",
                      "model.in_chans=3", "model.img_size=8", "model.num_classes=3",
                      f"train.output_dir={tmp_path / 'run'}")
    assert f"{tmp_path / 'imagenet' / 'train' / 'n09999999'} holds no images" in err
