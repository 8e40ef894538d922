"""ImageNet (class folders, 64 px pixels, 256 / 512 latent features) and CelebA data, in the
U-ViT release's crops, order and labels.

Everything runs on tiny data in the real on-disk formats (tests/datagen.py: ILSVRC-2012's
class folders of JPEGs, CelebA's img_align_celeba/ and list_eval_partition.txt) and a tiny
random diffusers VAE. References are computed here independently: the crops as explicit
chains of PIL operations worked out by hand for given image sizes, the moments by encoding
each crop alone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from datagen import make_celeba, make_imagenet, make_imagenet_features, tiny_vae, tiny_vae_folder
from diffusers import AutoencoderKL
from PIL import Image

from uvic.cli import extract_imagenet
from uvic.config import Config, ConfigError, apply_overrides
from uvic.data import imagenet_extraction as extraction
from uvic.data.base import DatasetError
from uvic.data.celeba import CelebAImages
from uvic.data.datasets import build_dataset
from uvic.data.imagenet import (
    ImageNetFeatures,
    ImageNetImages,
    adm_center_crop,
    read_class_folders,
)
from uvic.models import autoencoder

REPO = Path(__file__).resolve().parents[1]
BOX, BICUBIC, BILINEAR = Image.Resampling.BOX, Image.Resampling.BICUBIC, Image.Resampling.BILINEAR
EXTRACT = {"chunk_size": 4, "batch_size": 2, "progress": False}  # 9 images: chunks 4, 4, 1


def cfg(*overrides: str) -> Config:
    return apply_overrides(Config(), ["model.embed_dim=32", "model.depth=2",
                                      "model.num_heads=2", "data.num_workers=0", *overrides])


def signed(pixels: np.ndarray) -> torch.Tensor:
    """uint8 HWC -> float (C, H, W) in [-1, 1], as the release's ``arr / 127.5 - 1``."""
    return torch.from_numpy(pixels.astype(np.float32) / 127.5 - 1).permute(2, 0, 1)


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A tiny ImageNet and its 64 px features from one uninterrupted extraction."""
    root = tmp_path_factory.mktemp("imagenet")
    records = make_imagenet(root / "imagenet")
    features = make_imagenet_features(root, resolution=64, imagenet=root / "imagenet", **EXTRACT)
    return SimpleNamespace(root=root / "imagenet", train=root / "imagenet" / "train",
                           features=features, records=records)


# --------------------------------------------------------------------------- class folders


def test_class_folders_in_the_release_order(imagenet) -> None:
    listing = read_class_folders(imagenet.train)
    records = imagenet.records
    assert listing.classes == tuple(records["classes"]) == tuple(sorted(records["classes"]))
    relative = [str(p.relative_to(imagenet.train)) for p in records["files"]]
    assert listing.relative() == relative  # by class, then by file name (not by number)
    assert listing.labels.tolist() == records["labels"] == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    assert listing.class_counts().tolist() == [3, 2, 4]
    assert any(name.endswith(".png") for name in relative)  # every image type the release reads
    few = read_class_folders(imagenet.train, per_class=1)
    assert few.labels.tolist() == [0, 1, 2] and few.relative() == [relative[i] for i in (0, 3, 5)]


def test_class_folder_problems_are_named(tmp_path: Path) -> None:
    make_imagenet(tmp_path, per_class=(1, 1))
    with pytest.raises(DatasetError, match="not found") as err:
        read_class_folders(tmp_path / "val")
    assert str(tmp_path / "val") in str(err.value)
    (tmp_path / "train" / "n09999999").mkdir()
    (tmp_path / "train" / "n09999999" / "notes.txt").write_text("not an image")
    with pytest.raises(DatasetError, match="holds no images") as err:
        read_class_folders(tmp_path / "train")
    assert str(tmp_path / "train" / "n09999999") in str(err.value)
    assert "\n" not in str(err.value)
    flat = tmp_path / "flat"
    flat.mkdir()
    Image.new("RGB", (8, 8)).save(flat / "ILSVRC2012_val_00000001.JPEG")
    with pytest.raises(DatasetError, match="no class folders"):
        read_class_folders(flat)


# --------------------------------------------------------------------------- the crops


@pytest.mark.parametrize(("size", "expected"), [
    # 300x129 -> BOX 150x64 -> 75x32 -> 37x16 (short side 16 < 32: stop), no resize needed,
    # columns (37 - 16) // 2 = 10 onwards
    ((300, 129), lambda im: np.asarray(
        im.resize((150, 64), BOX).resize((75, 32), BOX).resize((37, 16), BOX))[:, 10:26]),
    # 45x71 -> BOX 22x35 -> BICUBIC to 16 x round(35 * 16 / 22) = 16x25, rows from 4
    ((45, 71), lambda im: np.asarray(
        im.resize((22, 35), BOX).resize((16, 25), BICUBIC))[4:20]),
    # 17x23: no halving; BICUBIC to 16 x round(23 * 16 / 17) = 16x22, rows from 3
    ((17, 23), lambda im: np.asarray(im.resize((16, 22), BICUBIC))[3:19]),
])
def test_adm_center_crop_worked_by_hand(size: tuple[int, int], expected) -> None:
    g = np.random.default_rng(0)
    image = Image.fromarray(g.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    got = adm_center_crop(image, 16)
    assert got.shape == (16, 16, 3) and got.dtype == np.uint8
    assert np.array_equal(got, expected(image))


def test_imagenet_items_crop_flip_and_label(imagenet) -> None:
    files, labels = imagenet.records["files"], imagenet.records["labels"]
    data = ImageNetImages(imagenet.train, 16, flip=True)
    assert len(data) == 9 and data.item_shape == (3, 16, 16) and data.num_classes == 3
    for i in (1, 4, 7):  # a grayscale JPEG, a wide one, the PNG
        crop = signed(adm_center_crop(Image.open(files[i]).convert("RGB"), 16))
        seen = set()
        for seed in range(8):
            torch.manual_seed(seed)
            item = data[i]
            assert item["y"].dtype == torch.int64 and int(item["y"]) == labels[i]
            flipped = torch.equal(item["x"], crop.flip(-1))
            assert flipped or torch.equal(item["x"], crop)
            seen.add(flipped)
        assert seen == {True, False}  # the release's flip of the crop, half the time
    plain = ImageNetImages(imagenet.train, 16, flip=False, labels=False)
    assert set(plain[0]) == {"x"}


def test_build_dataset_imagenet_checks_the_classes(imagenet, tmp_path: Path) -> None:
    base = ("data.name=imagenet", f"data.root={imagenet.root}", "model.img_size=16",
            "model.patch_size=4")
    for classes in (3, 4):  # the classes, or the classes and the null class
        data = build_dataset(cfg(*base, f"model.num_classes={classes}"))
        assert int(data[2]["y"]) == 0 and data.flip
    assert "y" not in build_dataset(cfg(*base))[0]  # an unconditional model: no labels
    with pytest.raises(ConfigError, match=r"model\.num_classes=1000 but .* has 3 classes: set 3,"
                                          r" or 4 with the classifier-free null class"):
        build_dataset(cfg(*base, "model.num_classes=1000"))
    with pytest.raises(ConfigError, match=r"data\.name='shapes' gives no class labels"):
        build_dataset(cfg("data.name=shapes", "data.num_images=4", "model.num_classes=10"))
    broken = tmp_path / "imagenet"
    shutil.copytree(imagenet.root, broken)
    bad = broken / "train" / imagenet.records["files"][3].relative_to(imagenet.train)
    bad.write_bytes(b"not a jpeg")
    data = build_dataset(cfg(*base[:1], f"data.root={broken}", *base[2:]))
    with pytest.raises(DatasetError, match="cannot read image") as err:
        data[3]
    assert str(bad) in str(err.value)


# --------------------------------------------------------------------------- CelebA


def test_celeba_train_split_and_the_release_crop(tmp_path: Path) -> None:
    names = make_celeba(tmp_path / "celeba", partitions=(0, 0, 1, 0, 2, 0))
    data = CelebAImages(tmp_path / "celeba", "train", 64, flip=True)
    assert data.names == [names[i] for i in (0, 1, 3, 5)]
    assert len(CelebAImages(tmp_path / "celeba", "val")) == 1
    assert CelebAImages(tmp_path / "celeba", "test").names == [names[4]]
    for i in range(len(data)):
        pixels = np.asarray(Image.open(data.file(i)).convert("RGB"))
        assert pixels.shape == (218, 178, 3)
        face = Image.fromarray(pixels[121 - 64:121 + 64, 89 - 64:89 + 64])  # centre (89, 121)
        expected = signed(np.asarray(face.resize((64, 64), BILINEAR)))
        seen = set()
        for seed in range(8):
            torch.manual_seed(seed)
            x = data[i]["x"]
            flipped = torch.allclose(x, expected.flip(-1), atol=1e-6)
            assert flipped or torch.allclose(x, expected, atol=1e-6)
            seen.add(flipped)
        assert seen == {True, False}
    # torchvision's layout (the release's root holds celeba/), through build_dataset
    (tmp_path / "tv").mkdir()
    shutil.move(tmp_path / "celeba", tmp_path / "tv" / "celeba")
    built = build_dataset(cfg("data.name=celeba", f"data.root={tmp_path / 'tv'}",
                              "model.img_size=64", "model.patch_size=4"))
    assert len(built) == 4 and "y" not in built[0]


def test_celeba_problems_are_named(tmp_path: Path) -> None:
    make_celeba(tmp_path, partitions=(0, 0, 1))
    with pytest.raises(DatasetError, match="img_align_celeba"):
        CelebAImages(tmp_path / "elsewhere")
    (tmp_path / "img_align_celeba" / "000002.jpg").unlink()
    with pytest.raises(DatasetError, match="1 of the 2 train images missing") as err:
        CelebAImages(tmp_path)
    assert str(tmp_path / "img_align_celeba" / "000002.jpg") in str(err.value)
    Image.new("RGB", (100, 100)).save(tmp_path / "img_align_celeba" / "000002.jpg")
    with pytest.raises(DatasetError, match=r"100x100, too small for the release's 128x128"):
        CelebAImages(tmp_path)[1]
    partition = tmp_path / "list_eval_partition.txt"
    partition.write_text(partition.read_text() + "000004.jpg train\n")
    with pytest.raises(DatasetError, match=r"list_eval_partition\.txt, line 4"):
        CelebAImages(tmp_path)
    partition.unlink()
    with pytest.raises(DatasetError, match=r"list_eval_partition\.txt"):
        CelebAImages(tmp_path)


# --------------------------------------------------------------------------- latent features


def read_arrays(folder: Path) -> dict[str, np.ndarray]:
    return {name: np.load(folder / f"{name}.npy") for name in ("moments", "moments_flip",
                                                               "labels")}


def test_features_are_the_moments_of_each_crop_and_its_mirror(imagenet) -> None:
    """Each row: the VAE moments of the release's crop at the extraction resolution and of
    that crop mirrored, each encoded alone here; the labels, classes and files in order."""
    folder = imagenet.features / "train"
    arrays = read_arrays(folder)
    vae = tiny_vae(0)
    for i, path in enumerate(imagenet.records["files"]):
        crop = signed(adm_center_crop(Image.open(path).convert("RGB"), 64))[None]
        with torch.no_grad():
            plain = vae.encode(crop).latent_dist.parameters[0].numpy()
            mirror = vae.encode(crop.flip(-1)).latent_dist.parameters[0].numpy()
        np.testing.assert_allclose(arrays["moments"][i], plain, rtol=0, atol=2e-5)
        np.testing.assert_allclose(arrays["moments_flip"][i], mirror, rtol=0, atol=2e-5)
    assert arrays["moments"].shape == (9, 8, 8, 8)  # 64 px -> 4 + 4 channels of 8 x 8
    assert arrays["labels"].tolist() == imagenet.records["labels"]
    assert json.loads((folder / "classes.json").read_text()) == imagenet.records["classes"]
    assert json.loads((folder / "files.json").read_text()) == read_class_folders(
        imagenet.train).relative()
    meta = json.loads((imagenet.features / "meta.json").read_text())["settings"]
    assert (meta["resolution"], meta["latent_shape"]) == (64, [4, 8, 8])


def test_feature_items_are_latents_of_both_and_labels(imagenet) -> None:
    data = ImageNetFeatures(imagenet.features, "train")
    arrays = read_arrays(imagenet.features / "train")
    assert len(data) == 18 and data.item_shape == (4, 8, 8) and data.num_classes == 3
    assert data.class_counts().tolist() == [3, 2, 4]
    for index, (row, source) in {2: (2, "moments"), 9 + 5: (5, "moments_flip")}.items():
        torch.manual_seed(1)
        item = data[index]
        torch.manual_seed(1)
        expected = autoencoder.sample_from_moments(torch.from_numpy(arrays[source][row]),
                                                   0.18215)
        assert torch.equal(item["x"], expected)
        assert int(item["y"]) == imagenet.records["labels"][row]
    once = ImageNetFeatures(imagenet.features, "train", flip=False, labels=False)
    assert len(once) == 9 and set(once[8]) == {"x"}
    base = ("data.name=imagenet_features", f"data.root={imagenet.features}",
            "model.in_chans=4", "model.patch_size=2", "model.num_classes=4")
    built = build_dataset(cfg(*base, "model.img_size=8", "data.scale_factor=0.5"))
    assert len(built) == 18 and built.scale_factor == 0.5
    with pytest.raises(ConfigError, match=r"holds latents 4x8x8 of 64x64 images, but "
                                          r"model.in_chans/img_size expect 4x32x32 \(256x256 "
                                          r"images\).*--resolution 256"):
        build_dataset(cfg(*base, "model.img_size=32"))


def test_labels_out_of_range_are_named(imagenet, tmp_path: Path) -> None:
    copy = tmp_path / "features"
    shutil.copytree(imagenet.features, copy)
    labels = np.load(copy / "train" / "labels.npy")
    labels[6] = 7
    np.save(copy / "train" / "labels.npy", labels)
    with pytest.raises(DatasetError, match=r"labels\.npy: label 7 at row 6 is outside "
                                           r"\[0, 3\) \(3 classes; 1 bad rows\)"):
        ImageNetFeatures(copy, "train")


def test_extraction_checks_before_encoding(imagenet, tmp_path: Path, capsys) -> None:
    """A missing split or an empty class folder stops the command in one line before the VAE
    is loaded; a finished folder is not redone; settings may not change."""
    status = extract_imagenet.main(["--imagenet", str(imagenet.root), "--out",
                                    str(tmp_path / "out"), "--splits", "train", "val",
                                    "--vae", str(tmp_path / "no-vae")])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and str(imagenet.root / "val") in err
    assert not (tmp_path / "out").exists()
    copy = tmp_path / "imagenet"
    shutil.copytree(imagenet.root, copy)
    (copy / "train" / "n01443537_empty").mkdir()
    assert extract_imagenet.main(["--imagenet", str(copy), "--out", str(tmp_path / "out"),
                                  "--vae", str(tmp_path / "no-vae")]) == 2
    err = capsys.readouterr().err
    assert f"{copy / 'train' / 'n01443537_empty'} holds no images" in err and "VAE" not in err
    listings = extraction.list_splits(imagenet.root, ["train"])
    with pytest.raises(DatasetError, match=r"latent_shape=\[4, 8, 8\], now latent_shape=\[4, 16"):
        extraction.extract_features(listings, imagenet.features, tiny_vae(0),
                                    vae_name="tiny-vae", resolution=128, **EXTRACT)


@pytest.mark.slow
def test_kill_mid_chunk_then_resume_gives_the_same_arrays(imagenet, tmp_path: Path,
                                                          monkeypatch) -> None:
    """A real SIGKILL after chunk 0 is committed and while chunk 1 is half written; the
    rerun encodes only the 5 images of chunks 1 and 2 and ends with the same arrays as the
    uninterrupted extraction."""
    out = tmp_path / "features"
    program = f"""
import os, signal
from datagen import tiny_vae
from uvic.data import imagenet_extraction as x
calls = []
real = x.encode_moments
def encode(vae, images):
    calls.append(1)
    if len(calls) == 4:  # chunk 1's second batch: its first batch is written, not committed
        os.kill(os.getpid(), signal.SIGKILL)
    return real(vae, images)
x.encode_moments = encode
x.extract_features(x.list_splits({str(imagenet.root)!r}, ["train"]), {str(out)!r},
                   tiny_vae(0), vae_name="tiny-vae", resolution=64, **{EXTRACT!r})
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO / "tests"), *os.environ.get("PYTHONPATH", "").split(os.pathsep)])}
    proc = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    progress = json.loads((out / "train" / "progress.json").read_text())
    assert progress["done_chunks"] == [0] and not progress["complete"]
    assert np.load(out / "train" / "moments.npy")[4].any()  # chunk 1, half written
    with pytest.raises(DatasetError, match=r"incomplete \(1/3 chunks\)"):
        ImageNetFeatures(out, "train")
    encoded = []

    def counting(vae: AutoencoderKL, images: torch.Tensor) -> torch.Tensor:
        encoded.append(len(images) // 2)  # each image with its mirror image
        return autoencoder.encode_moments(vae, images)

    monkeypatch.setattr(extraction, "encode_moments", counting)
    listings = extraction.list_splits(imagenet.root, ["train"])
    assert extraction.extract_features(listings, out, tiny_vae(0), vae_name="tiny-vae",
                                       resolution=64, **EXTRACT)
    assert sum(encoded) == 5
    resumed, reference = read_arrays(out / "train"), read_arrays(imagenet.features / "train")
    for name, array in reference.items():
        assert np.array_equal(resumed[name], array), name
    assert len(ImageNetFeatures(out, "train")) == 18
    with pytest.raises(DatasetError, match=r"chunk_size=4, now chunk_size=3"):
        extraction.extract_features(listings, out, tiny_vae(0), vae_name="tiny-vae",
                                    resolution=64, **(EXTRACT | {"chunk_size": 3}))


def test_corrupt_image_is_named_or_skipped(imagenet, tmp_path: Path) -> None:
    copy = tmp_path / "imagenet"
    shutil.copytree(imagenet.root, copy)
    bad = copy / "train" / imagenet.records["files"][4].relative_to(imagenet.train)
    bad.write_bytes(bad.read_bytes()[:150])  # a truncated JPEG
    listings = extraction.list_splits(copy, ["train"])
    with pytest.raises(extraction.CorruptImageError, match="--skip-corrupt") as err:
        extraction.extract_features(listings, tmp_path / "a", tiny_vae(0), vae_name="tiny-vae",
                                    resolution=64, **EXTRACT)
    assert str(bad) in str(err.value) and isinstance(err.value, DatasetError)
    assert extraction.extract_features(listings, tmp_path / "b", tiny_vae(0),
                                       vae_name="tiny-vae", resolution=64, skip_corrupt=True,
                                       **EXTRACT)
    skipped = json.loads((tmp_path / "b" / "train" / "progress.json").read_text())["skipped"]
    assert [(s["index"], s["file"]) for s in skipped] == [(4, str(bad))]
    data = ImageNetFeatures(tmp_path / "b", "train")
    assert len(data) == 16 and 4 not in data.indices and data.class_counts().tolist() == [3, 1, 4]
    reference = read_arrays(imagenet.features / "train")
    assert torch.equal(data.moments(4), torch.from_numpy(reference["moments"][5]))


def test_command_with_a_local_vae(imagenet, tmp_path: Path, capsys) -> None:
    vae = tiny_vae_folder(tmp_path / "vae", seed=0)
    out = tmp_path / "features"
    status = extract_imagenet.main([
        "--imagenet", str(imagenet.root), "--out", str(out), "--resolution", "64",
        "--vae", str(vae), "--batch-size", "2", "--chunk-size", "4", "--workers", "2",
        "--device", "cpu", "--per-class", "2", "--no-progress"])
    assert status == 0
    printed = capsys.readouterr().out
    assert "train: 6 images in 3 classes, latents 4x8x8" in printed
    assert f"features complete in {out}" in printed
    reference = read_arrays(imagenet.features / "train")
    rows = [0, 1, 3, 4, 5, 6]  # the first two images of each class
    for name, array in read_arrays(out / "train").items():  # batched otherwise: rounding
        np.testing.assert_allclose(array, reference[name][rows], rtol=0, atol=1e-5)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["settings"]["vae"] == str(vae) and meta["settings"]["per_class"] == 2
    assert "torch" in meta["versions"]
    with pytest.raises(SystemExit):
        extract_imagenet.parse_args(["--imagenet", "x", "--out", "y", "--resolution", "100"])
    assert "multiple of 8" in capsys.readouterr().err


def test_command_help_needs_no_torch() -> None:
    code = ("import sys; from uvic.cli.extract_imagenet import parse_args; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_load_vae_takes_a_pipelines_vae_subfolder(monkeypatch) -> None:
    """``owner/name/vae`` (the release's Stable Diffusion autoencoder for the L rows) loads
    a pipeline repository's VAE subfolder, from the cache first."""
    calls = []

    def from_pretrained(name, **kwargs):
        calls.append((name, kwargs.get("subfolder"), kwargs.get("local_files_only", False)))
        if kwargs.get("local_files_only"):
            raise OSError("not in the cache")
        return tiny_vae(0)

    monkeypatch.setattr(AutoencoderKL, "from_pretrained", from_pretrained)
    autoencoder.load_vae("CompVis/stable-diffusion-v1-4/vae")
    assert calls == [("CompVis/stable-diffusion-v1-4", "vae", True),
                     ("CompVis/stable-diffusion-v1-4", "vae", False)]
    calls.clear()
    autoencoder.load_vae("stabilityai/sd-vae-ft-ema")
    assert calls[0] == ("stabilityai/sd-vae-ft-ema", None, True)
