"""Datasets, MS-COCO feature extraction, CLIP text states and VAE helpers.

Everything runs on small data written in the real formats (tests/datagen.py) and tiny
randomly initialised models of the real classes (diffusers AutoencoderKL, open_clip CLIP).
References are computed independently here: the release's crop written with numpy slicing,
the text states with a hand-built causal mask in float64, open_clip's own `encode_text`.
"""

from __future__ import annotations

import copy
import json
import pickle
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import open_clip
import pytest
import torch
import torchvision
from datagen import (
    fake_cifar10_checksums,
    make_cifar10,
    make_coco,
    patch_cifar10_checksums,
    tiny_clip,
    tiny_clip_folder,
    tiny_vae,
    tiny_vae_folder,
)
from diffusers import AutoencoderKL
from PIL import Image
from torch.utils.data import DataLoader

from uvic.cli import extract_mscoco as extract_cli
from uvic.config import Config, ConfigError, apply_overrides
from uvic.data import mscoco_extraction as extraction
from uvic.data.datasets import (
    DatasetError,
    MSCOCOFeatures,
    ShapesDataset,
    build_dataset,
    load_empty_context,
    load_sample_prompts,
    save_shapes_folder,
)
from uvic.models import autoencoder
from uvic.models.text_encoder import ClipLoadError, ClipTextEncoder

EOT, SOT = 49407, 49406
SCALE = 0.23010


def make_cfg(*overrides: str) -> Config:
    return apply_overrides(Config(), list(overrides))


# --------------------------------------------------------------------------- CIFAR-10


@pytest.fixture(scope="module")
def cifar(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("cifar")
    return SimpleNamespace(root=root, pixels=make_cifar10(root, n_per_batch=3, seed=1))


def test_cifar10_items_are_the_pickled_pixels_in_signed_range(cifar: SimpleNamespace) -> None:
    cfg = make_cfg("data.name=cifar10", f"data.root={cifar.root}", "data.random_flip=false")
    with fake_cifar10_checksums(cifar.root):
        splits = {"train": build_dataset(cfg, "train"), "test": build_dataset(cfg, "val")}
    for name, dataset in splits.items():
        reference = torch.from_numpy(cifar.pixels[name]).permute(0, 3, 1, 2).double() / 127.5 - 1
        x = torch.stack([dataset[i]["x"] for i in range(len(dataset))])
        assert x.dtype == torch.float32 and x.shape == (len(reference), 3, 32, 32)
        torch.testing.assert_close(x.double(), reference, atol=1e-6, rtol=0)
        assert x.min() >= -1 and x.max() <= 1
    assert len(splits["train"]) == 15 and len(splits["test"]) == 3


def test_cifar10_random_flip_only_on_train(cifar: SimpleNamespace, monkeypatch) -> None:
    patch_cifar10_checksums(monkeypatch, cifar.root)
    cfg = make_cfg("data.name=cifar10", f"data.root={cifar.root}", "data.random_flip=true")
    train, val = build_dataset(cfg, "train"), build_dataset(cfg, "val")
    torch.manual_seed(0)
    flipped = 0
    for _ in range(4):
        for i in range(len(train)):
            original = torch.from_numpy(cifar.pixels["train"][i]).permute(2, 0, 1) / 127.5 - 1
            x = train[i]["x"]
            is_flipped = torch.allclose(x, original.flip(-1), atol=1e-6)
            assert is_flipped or torch.allclose(x, original, atol=1e-6)
            flipped += is_flipped
    assert 10 < flipped < 50  # about half of 60
    original = torch.from_numpy(cifar.pixels["test"][0]).permute(2, 0, 1) / 127.5 - 1
    assert all(torch.allclose(val[0]["x"], original, atol=1e-6) for _ in range(10))


def test_cifar10_missing_or_corrupt_gives_clear_error(tmp_path: Path,
                                                      cifar: SimpleNamespace) -> None:
    cfg = make_cfg("data.name=cifar10", f"data.root={tmp_path / 'nowhere'}")
    with pytest.raises(DatasetError) as err:
        build_dataset(cfg)
    message = str(err.value)
    assert str(tmp_path / "nowhere" / "cifar-10-batches-py") in message
    assert "data_batch_1" in message and "batches.meta" in message
    assert "data.download=true" in message and "\n" not in message
    # fake files without the patched checksums fail torchvision's MD5 check
    with pytest.raises(DatasetError, match="MD5"):
        build_dataset(make_cfg("data.name=cifar10", f"data.root={cifar.root}"))


@pytest.mark.parametrize("damage, needle", [
    ("no_data_key", "data_batch_2 lacks the key(s) data"),
    ("not_a_pickle", "data_batch_2 is not a readable pickle"),
])
def test_cifar10_malformed_batch_names_the_file(tmp_path: Path, damage: str,
                                                needle: str) -> None:
    """A CIFAR-10 batch that passes the MD5 check but is not what torchvision reads
    (e.g. written by hand) was a raw KeyError: 'data'; it is one line naming the file."""
    make_cifar10(tmp_path)
    batch = tmp_path / "cifar-10-batches-py" / "data_batch_2"
    if damage == "no_data_key":
        batch.write_bytes(pickle.dumps({"labels": [0], "pixels": b"\0"}))
    else:
        batch.write_bytes(b"not a pickle")
    with fake_cifar10_checksums(tmp_path), pytest.raises(DatasetError) as err:
        build_dataset(make_cfg("data.name=cifar10", f"data.root={tmp_path}"))
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert str(batch) in str(err.value)


def test_cifar10_failed_download_does_not_advise_downloading(tmp_path: Path,
                                                            monkeypatch) -> None:
    """Offline, data.download=true fails: the advice is to copy the files, not to pass the
    setting that just failed."""
    def offline(*args, **kwargs):
        raise OSError("no network")
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "download", offline)
    with pytest.raises(DatasetError) as err:
        build_dataset(make_cfg("data.name=cifar10", f"data.root={tmp_path}",
                               "data.download=true"))
    message = str(err.value)
    assert message.startswith(f"CIFAR-10 download to {tmp_path} failed (no network)")
    assert "data.download=true" not in message and "cifar-10-python.tar.gz" in message


def test_dataset_shape_must_fit_the_model(cifar: SimpleNamespace) -> None:
    with fake_cifar10_checksums(cifar.root), pytest.raises(ConfigError, match=r"model\.in_chans"):
        build_dataset(make_cfg("data.name=cifar10", f"data.root={cifar.root}",
                               "model.img_size=16"))
    with pytest.raises(ConfigError, match=r"data\.name"):
        build_dataset(make_cfg("data.name=lsun"))
    with pytest.raises(ValueError, match="split"):
        build_dataset(make_cfg("data.name=shapes", "data.num_images=2"), "holdout")


# --------------------------------------------------------------------------- Shapes


def test_shapes_deterministic_per_seed_and_index() -> None:
    a, b = ShapesDataset(4, seed=3), ShapesDataset(9, seed=3)
    other = ShapesDataset(4, seed=4)
    for i in range(4):
        assert torch.equal(a[i]["x"], b[i]["x"])  # depends on (seed, i) only
        assert not torch.equal(a[i]["x"], other[i]["x"])
    assert not torch.equal(a[0]["x"], a[1]["x"])
    x = a[0]["x"]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32
    assert x.min() >= -1 and x.max() <= 1


def test_shapes_look_like_shapes_on_a_plain_background() -> None:
    images = ShapesDataset(32, seed=0).images.astype(np.int64)  # (n, 32, 32, 3) uint8
    for image in images:
        colours, counts = np.unique(image.reshape(-1, 3), axis=0, return_counts=True)
        background = colours[counts.argmax()]
        assert counts.max() > 0.2 * 32 * 32  # a plain background
        far = np.linalg.norm(image - background, axis=-1) > 100
        assert 0.03 < far.mean() < 0.9  # a clearly visible shape, not noise
        corners = image[[0, 0, -1, -1], [0, -1, 0, -1]]
        assert (np.abs(corners - background).max(axis=-1) <= 2).sum() >= 2


def test_shapes_splits_differ_and_flip(tmp_path: Path) -> None:
    cfg = make_cfg("data.name=shapes", "data.num_images=6", "data.random_flip=true")
    train, val = build_dataset(cfg, "train"), build_dataset(cfg, "val")
    assert not any(np.array_equal(t, v) for t in train.images for v in val.images)
    torch.manual_seed(0)
    draws = [train[0]["x"] for _ in range(20)]
    plain = torch.from_numpy(train.images[0]).permute(2, 0, 1) / 127.5 - 1
    assert all(torch.allclose(d, plain) or torch.allclose(d, plain.flip(-1)) for d in draws)
    assert any(torch.allclose(d, plain.flip(-1)) for d in draws)
    val_plain = torch.from_numpy(val.images[0]).permute(2, 0, 1) / 127.5 - 1
    assert all(torch.allclose(val[0]["x"], val_plain) for _ in range(10))  # never flipped
    folder = save_shapes_folder(tmp_path / "png", 3, seed=0)
    for i in range(3):
        assert np.array_equal(np.asarray(Image.open(folder / f"{i:06d}.png")), train.images[i])


# --------------------------------------------------------------------------- CLIP text encoder


@pytest.fixture(scope="module")
def clip_model() -> open_clip.CLIP:
    return tiny_clip(seed=0)


CAPTIONS = ["A red double decker bus driving down a city street.", "", "two cats"]
LONG = " ".join(["a very long caption about a kitchen"] * 30)


def test_tokenize_pads_with_eot_like_the_release(clip_model) -> None:
    encoder = ClipTextEncoder(model=clip_model)
    tokens = encoder.tokenize([*CAPTIONS, LONG])
    raw = open_clip.get_tokenizer("ViT-L-14-quickgelu")([*CAPTIONS, LONG])  # pads with 0
    assert tokens.shape == (4, 77) and tokens.dtype == torch.int64
    for row, raw_row in zip(tokens, raw):
        eot = int((row == EOT).nonzero()[0])
        assert row[0] == SOT
        assert torch.equal(row[: eot + 1], raw_row[: eot + 1])
        assert (row[eot + 1 :] == EOT).all()
        assert (raw_row[eot + 1 :] == 0).all()
    assert torch.equal(tokens[1, :2], torch.tensor([SOT, EOT]))  # "" -> start, end, padding
    # too long: truncated to 77 with end-of-text kept in the last position, no padding
    assert tokens[3, -1] == EOT and (tokens[3, :-1] != EOT).all()


def release_tokens(texts: list[str]) -> torch.Tensor:
    """open_clip's tokens with every position after the first EOT set to EOT (plain loop)."""
    tokens = open_clip.get_tokenizer("ViT-L-14-quickgelu")(texts)
    for row in tokens:
        eot = row.tolist().index(EOT)
        row[eot + 1 :] = EOT
    return tokens


def manual_text_states(model: open_clip.CLIP, tokens: torch.Tensor) -> torch.Tensor:
    """Reference in float64 with a hand-built causal mask, block by block."""
    model = copy.deepcopy(model).double()
    n = tokens.shape[1]
    mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)  # no future keys
    x = model.token_embedding.weight[tokens] + model.positional_embedding
    for block in model.transformer.resblocks:
        x = block(x, attn_mask=mask)
    return model.ln_final(x)


def test_text_states_match_manual_computation_and_encode_text(clip_model) -> None:
    encoder = ClipTextEncoder(model=clip_model)
    states = encoder.encode(CAPTIONS)
    assert states.shape == (3, 77, 32) and states.dtype == torch.float32 and encoder.width == 32
    tokens = encoder.tokenize(CAPTIONS)
    reference = manual_text_states(clip_model, tokens)
    torch.testing.assert_close(states.double(), reference, atol=2e-5, rtol=1e-5)
    # open_clip's pooled vector is the end-of-text state (before projection)
    eot = (tokens == EOT).int().argmax(dim=1)
    pooled = states[torch.arange(3), eot] @ clip_model.text_projection
    with torch.no_grad():
        torch.testing.assert_close(pooled, clip_model.encode_text(tokens), atol=1e-5, rtol=1e-4)


def test_padding_changes_states_after_eot_only(clip_model) -> None:
    """The trap: causal attention keeps positions <= EOT, but later positions differ."""
    encoder = ClipTextEncoder(model=clip_model)
    zero_padded = open_clip.get_tokenizer("ViT-L-14-quickgelu")(["a dog on a beach"])
    eot = int((zero_padded[0] == EOT).nonzero()[0])
    with torch.no_grad():
        ours, theirs = encoder(encoder.tokenize(["a dog on a beach"])), encoder(zero_padded)
    torch.testing.assert_close(ours[:, : eot + 1], theirs[:, : eot + 1])
    assert (ours[:, eot + 1 :] - theirs[:, eot + 1 :]).abs().amax() > 1e-2


def test_clip_loading_from_local_folder_and_clear_errors(tmp_path: Path, clip_model,
                                                         monkeypatch) -> None:
    name = tiny_clip_folder(tmp_path / "clip", seed=0)
    loaded = ClipTextEncoder(name, pretrained="ignored-with-local-dir")
    torch.testing.assert_close(loaded.encode(CAPTIONS),
                               ClipTextEncoder(model=clip_model).encode(CAPTIONS))
    missing = tmp_path / "models" / "open_clip_model.safetensors"
    with pytest.raises(ClipLoadError, match=r"data\.clip_pretrained") as err:
        ClipTextEncoder("ViT-L-14-quickgelu", str(missing))
    assert str(missing) in str(err.value)

    with pytest.raises(ClipLoadError, match="empty"):  # never silently random weights
        ClipTextEncoder("ViT-L-14-quickgelu", "")

    def offline(*args, **kwargs):
        raise RuntimeError("Failed to download weights for tag 'openai': no network")

    monkeypatch.setattr(open_clip, "create_model", offline)
    with pytest.raises(ClipLoadError, match="huggingface-cli download") as err:
        ClipTextEncoder("ViT-L-14-quickgelu", "openai")
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- VAE helpers


@pytest.fixture(scope="module")
def vae() -> AutoencoderKL:
    return tiny_vae(seed=0)


def test_encode_moments_and_decode_latents(vae) -> None:
    torch.manual_seed(0)
    images = torch.rand(5, 3, 64, 64) * 2 - 1
    moments = autoencoder.encode_moments(vae, images)
    assert moments.shape == (5, 8, 8, 8)
    with torch.no_grad():
        posterior = vae.encode(images).latent_dist
    torch.testing.assert_close(moments[:, :4], posterior.mean)
    torch.testing.assert_close(moments[:, 4:], posterior.logvar)
    z = 3.0 * torch.randn(5, 4, 8, 8)
    decoded = autoencoder.decode_latents(vae, z, SCALE, batch_size=2)  # 3 chunks
    with torch.no_grad():
        direct = vae.decode(z / SCALE).sample
    assert decoded.shape == (5, 3, 64, 64) and decoded.dtype == torch.float32
    torch.testing.assert_close(decoded, direct.clamp(-1, 1), atol=1e-5, rtol=1e-5)
    assert decoded.min() >= -1 and decoded.max() <= 1


def test_sample_from_moments_statistics() -> None:
    mean = torch.linspace(-2.0, 3.0, 16).reshape(4, 2, 2)
    logvar = torch.linspace(-4.0, 1.5, 16).reshape(4, 2, 2)
    moments = torch.cat([mean, logvar]).expand(20000, 8, 2, 2)
    z = autoencoder.sample_from_moments(moments, SCALE, torch.Generator().manual_seed(0))
    assert z.shape == (20000, 4, 2, 2)
    std = SCALE * torch.exp(0.5 * logvar)
    assert ((z.mean(0) - SCALE * mean).abs() < 5 * std / 20000**0.5).all()
    assert ((z.std(0) / std - 1).abs() < 0.03).all()


def test_load_vae_from_folder_and_clear_errors(tmp_path: Path, vae, monkeypatch) -> None:
    folder = tiny_vae_folder(tmp_path / "vae", seed=0)
    loaded = autoencoder.load_vae(str(folder))
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    for key, value in vae.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    tiny_vae_folder(tmp_path / "pipeline" / "vae", seed=0)  # a Stable Diffusion pipeline folder
    assert isinstance(autoencoder.load_vae(str(tmp_path / "pipeline")), AutoencoderKL)
    with pytest.raises(autoencoder.VAELoadError, match="huggingface-cli download") as err:
        autoencoder.load_vae(str(tmp_path / "missing" / "vae"))
    assert str(tmp_path / "missing" / "vae") in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(autoencoder.VAELoadError, match=r"config\.json"):
        autoencoder.load_vae(str(tmp_path / "empty"))

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(AutoencoderKL, "from_pretrained", offline)
    with pytest.raises(autoencoder.VAELoadError, match=r"data\.vae") as err:
        autoencoder.load_vae("stabilityai/sd-vae-ft-ema")
    assert "stabilityai/sd-vae-ft-ema" in str(err.value) and "\n" not in str(err.value)


# --------------------------------------------------------------------------- MS-COCO features

EXTRACT = {"resolution": 64, "chunk_size": 2, "batch_size": 2, "progress": False,
           "vae_name": "tiny-vae", "clip_model": "tiny-clip", "clip_pretrained": ""}


@pytest.fixture(scope="module")
def coco(tmp_path_factory: pytest.TempPathFactory, vae, clip_model) -> SimpleNamespace:
    """A tiny COCO and its features extracted in one uninterrupted run."""
    root = tmp_path_factory.mktemp("mscoco")
    records = make_coco(root / "coco", {"train": 5, "val": 3}, seed=0)
    encoder = ClipTextEncoder(model=clip_model)
    complete = extraction.extract_features(root / "coco", root / "features", vae, encoder,
                                       **EXTRACT)
    assert complete
    return SimpleNamespace(root=root, coco=root / "coco", features=root / "features",
                           records=records, encoder=encoder, clip=clip_model)


def release_crop(path: Path, size: int) -> torch.Tensor:
    """The U-ViT release's center_crop written independently: numpy slicing + LANCZOS."""
    img = np.asarray(Image.open(path).convert("RGB"))
    crop = min(img.shape[:2])
    img = img[(img.shape[0] - crop) // 2 : (img.shape[0] + crop) // 2,
              (img.shape[1] - crop) // 2 : (img.shape[1] + crop) // 2]
    img = np.asarray(Image.fromarray(img).resize((size, size), Image.LANCZOS), dtype=np.float32)
    return torch.from_numpy(img / 127.5 - 1.0).permute(2, 0, 1)


def read_split(folder: Path) -> dict[str, object]:
    arrays = {name: np.load(folder / f"{name}.npy")
              for name in ("moments", "contexts", "caption_offsets", "image_ids")}
    return arrays | {"captions": json.loads((folder / "captions.json").read_text())}


def test_extraction_checks_every_input_before_the_first_image(tmp_path: Path, vae,
                                                              clip_model) -> None:
    """A missing val captions file (or image) is found
    before the train split is extracted; nothing is written."""
    coco = tmp_path / "coco"
    make_coco(coco, {"train": 3, "val": 2}, seed=1)
    (coco / "annotations" / "captions_val2014.json").unlink()
    encoder = ClipTextEncoder(model=clip_model)
    with pytest.raises(extraction.DatasetError) as info:
        extraction.extract_features(coco, tmp_path / "features", vae, encoder, **EXTRACT)
    message = str(info.value)
    assert message.startswith("COCO captions file not found: "
                              f"{coco / 'annotations' / 'captions_val2014.json'}")
    assert len(message.splitlines()) == 1 and not (tmp_path / "features").exists()

    make_coco(coco, {"train": 3, "val": 2}, seed=1)
    image = sorted((coco / "val2014").iterdir())[0]
    image.unlink()
    with pytest.raises(extraction.DatasetError, match=f"COCO image not found: {image} "
                                                  r"\(1 of 2 val images missing\)"):
        extraction.extract_features(coco, tmp_path / "features", vae, encoder, **EXTRACT)
    assert not (tmp_path / "features").exists()


def test_extracted_features_match_independent_computation(coco, vae) -> None:
    for split, records in coco.records.items():
        stored = read_split(coco.features / split)
        assert stored["image_ids"].tolist() == sorted(r["id"] for r in records)
        assert stored["captions"] == [c for r in records for c in r["captions"]]
        counts = np.diff(stored["caption_offsets"])
        assert counts.tolist() == [len(r["captions"]) for r in records]
        images = torch.stack([release_crop(r["file"], 64) for r in records])
        with torch.no_grad():
            posterior = vae.encode(images).latent_dist
        expected = torch.cat([posterior.mean, posterior.logvar], dim=1)
        assert stored["moments"].shape == (len(records), 8, 8, 8)
        assert stored["moments"].dtype == np.float32
        torch.testing.assert_close(torch.from_numpy(stored["moments"]), expected,
                                   atol=1e-5, rtol=1e-5)
        contexts = torch.from_numpy(stored["contexts"].astype(np.float32))
        assert stored["contexts"].dtype == np.float32  # the release's dtype by default
        reference = manual_text_states(coco.clip, release_tokens(stored["captions"])).float()
        torch.testing.assert_close(contexts, reference, atol=2e-5, rtol=1e-5)
    empty = np.load(coco.features / "empty_context.npy")
    assert empty.shape == (77, 32) and empty.dtype == np.float32
    torch.testing.assert_close(torch.from_numpy(empty), coco.encoder.encode([""])[0])
    prompts = json.loads((coco.features / "sample_prompts.json").read_text())
    assert prompts == extraction.SAMPLE_PROMPTS and len(prompts) == 8
    assert np.load(coco.features / "sample_contexts.npy").shape == (8, 77, 32)
    meta = json.loads((coco.features / "meta.json").read_text())["settings"]
    assert meta["scale_factor"] == SCALE and meta["resolution"] == 64 and "49407" in meta["padding"]
    assert meta["latent_shape"] == [4, 8, 8] and meta["context_shape"] == [77, 32]


def test_dataset_draws_a_caption_of_the_right_image(coco) -> None:
    dataset = MSCOCOFeatures(coco.features, "train", scale_factor=SCALE)
    assert len(dataset) == 5
    torch.manual_seed(0)
    for i in range(len(dataset)):
        own = dataset.contexts(i)
        others = torch.cat([dataset.contexts(j) for j in range(len(dataset)) if j != i])
        seen = set()
        for _ in range(60):
            item = dataset[i]
            assert item["x"].shape == (4, 8, 8) and item["x"].dtype == torch.float32
            assert item["context"].shape == (77, 32) and item["context"].dtype == torch.float32
            match = [k for k in range(len(own)) if torch.equal(item["context"], own[k])]
            assert len(match) == 1
            assert not any(torch.equal(item["context"], o) for o in others)
            seen.add(match[0])
        assert seen == set(range(len(own)))  # every caption gets drawn
        assert dataset.captions(i) == coco.records["train"][i]["captions"]


def test_dataset_latents_have_the_stored_statistics(coco, tmp_path: Path) -> None:
    """Known moments written into a copy: samples have mean*scale and exp(logvar/2)*scale."""
    features = shutil.copytree(coco.features, tmp_path / "features")
    moments = np.lib.format.open_memmap(features / "train" / "moments.npy", mode="r+")
    mean = np.linspace(-3, 3, 256, dtype=np.float32).reshape(4, 8, 8)
    logvar = np.linspace(-5, 1.5, 256, dtype=np.float32).reshape(4, 8, 8)
    moments[2] = np.concatenate([mean, logvar])
    moments.flush()
    dataset = MSCOCOFeatures(features, "train", scale_factor=SCALE)
    torch.manual_seed(0)
    z = torch.stack([dataset[2]["x"] for _ in range(4000)]).double()
    std = SCALE * np.exp(0.5 * logvar.astype(np.float64))
    assert (np.abs(z.mean(0).numpy() - SCALE * mean) < 5 * std / np.sqrt(4000)).all()
    assert (np.abs(z.std(0).numpy() / std - 1) < 0.08).all()


def test_dataloader_workers_are_seeded_and_reproducible(coco) -> None:
    dataset = MSCOCOFeatures(coco.features, "train", scale_factor=SCALE)

    def run(seed: int) -> list[dict[str, torch.Tensor]]:
        loader = DataLoader(dataset, batch_size=2, num_workers=2,
                            generator=torch.Generator().manual_seed(seed))
        return list(loader)

    first, again, other = run(0), run(0), run(1)
    assert all(torch.equal(a["x"], b["x"]) and torch.equal(a["context"], b["context"])
               for a, b in zip(first, again))
    assert not torch.equal(first[0]["x"], other[0]["x"])
    assert first[0]["x"].shape == (2, 4, 8, 8) and first[0]["context"].shape == (2, 77, 32)


def test_build_dataset_mscoco_and_contexts(coco) -> None:
    cfg = make_cfg("data.name=mscoco", f"data.root={coco.features}", "model.in_chans=4",
                   "model.img_size=8", "model.clip_dim=32")
    assert isinstance(build_dataset(cfg, "train"), MSCOCOFeatures)
    assert len(build_dataset(cfg, "val")) == 3
    assert load_empty_context(cfg.data).shape == (77, 32)
    prompts, contexts = load_sample_prompts(cfg.data)
    assert prompts == extraction.SAMPLE_PROMPTS and contexts.shape == (8, 77, 32)
    with pytest.raises(ConfigError, match=r"model\.clip_dim"):
        build_dataset(apply_overrides(cfg, ["model.clip_dim=768"]))
    with pytest.raises(DatasetError, match=r"extract_mscoco_features\.py") as err:
        MSCOCOFeatures(coco.root / "nothing", "train")
    assert str(coco.root / "nothing" / "train") in str(err.value)


def test_resume_after_interruption_gives_the_same_arrays(coco, vae, tmp_path: Path,
                                                         monkeypatch) -> None:
    out = tmp_path / "features"
    assert not extraction.extract_features(coco.coco, out, vae, coco.encoder, max_chunks=1,
                                       **EXTRACT)
    progress = json.loads((out / "train" / "progress.json").read_text())
    assert progress["done_chunks"] == [0] and progress["num_chunks"] == 3
    with pytest.raises(DatasetError, match="incomplete"):
        MSCOCOFeatures(out, "train")
    encoded = []  # images the restart encodes: only those of unfinished chunks

    def counting_encode(vae, images):
        encoded.append(len(images))
        return autoencoder.encode_moments(vae, images)

    monkeypatch.setattr(extraction, "encode_moments", counting_encode)
    assert extraction.extract_features(coco.coco, out, vae, coco.encoder, **EXTRACT)
    assert sum(encoded) == (5 - 2) + (3 - 2)
    for split in ("train", "val"):
        resumed, reference = read_split(out / split), read_split(coco.features / split)
        for key, value in reference.items():
            assert np.array_equal(resumed[key], value) if key != "captions" else (
                resumed[key] == value), key


def test_crash_inside_a_chunk_is_redone_on_restart(coco, vae, tmp_path: Path) -> None:
    out = tmp_path / "features"
    encoder = ClipTextEncoder(model=tiny_clip(seed=0))
    real_encode, calls = encoder.encode, []

    def crashing_encode(texts, batch_size=256):
        calls.append(len(texts))
        if len(calls) == 4:  # "" and the sample prompts, chunk 0, then chunk 1 of train
            raise KeyboardInterrupt
        return real_encode(texts, batch_size)

    encoder.encode = crashing_encode
    with pytest.raises(KeyboardInterrupt):  # chunk 1's moments are written, not committed
        extraction.extract_features(coco.coco, out, vae, encoder, **EXTRACT)
    assert json.loads((out / "train" / "progress.json").read_text())["done_chunks"] == [0]
    with pytest.raises(DatasetError, match="chunk_size"):  # settings must not change
        extraction.extract_features(coco.coco, out, vae, coco.encoder, **(EXTRACT | {
            "chunk_size": 3}))
    assert extraction.extract_features(coco.coco, out, vae, coco.encoder, **EXTRACT)
    for split in ("train", "val"):
        resumed, reference = read_split(out / split), read_split(coco.features / split)
        assert np.array_equal(resumed["moments"], reference["moments"])
        assert np.array_equal(resumed["contexts"], reference["contexts"])


def test_corrupt_image_is_named_or_skipped(vae, clip_model, tmp_path: Path) -> None:
    records = make_coco(tmp_path / "coco", {"train": 4}, seed=1)
    bad, truncated = records["train"][1]["file"], records["train"][3]["file"]
    bad.write_bytes(b"this is not a jpeg")
    truncated.write_bytes(truncated.read_bytes()[:200])
    encoder = ClipTextEncoder(model=clip_model)
    kwargs = EXTRACT | {"splits": ("train",)}
    with pytest.raises(extraction.CorruptImageError, match="--skip-corrupt") as err:
        extraction.extract_features(tmp_path / "coco", tmp_path / "a", vae, encoder, **kwargs)
    assert str(bad) in str(err.value)
    assert extraction.extract_features(tmp_path / "coco", tmp_path / "b", vae, encoder,
                                   skip_corrupt=True, **kwargs)
    dataset = MSCOCOFeatures(tmp_path / "b", "train")
    skipped = json.loads((tmp_path / "b" / "train" / "progress.json").read_text())["skipped"]
    assert sorted(s["file"] for s in skipped) == sorted([str(bad), str(truncated)])
    assert len(dataset) == 2
    assert [dataset.captions(i) for i in range(2)] == [records["train"][k]["captions"]
                                                       for k in (0, 2)]


def test_missing_captions_file_is_named(tmp_path: Path, capsys) -> None:
    make_coco(tmp_path / "coco", {"val": 1})
    expected = tmp_path / "coco" / "annotations" / "captions_train2014.json"
    with pytest.raises(DatasetError) as err:
        extraction.read_coco_split(tmp_path / "coco", "train")
    assert str(expected) in str(err.value)
    status = extract_cli.main(["--coco", str(tmp_path / "coco"), "--out", str(tmp_path / "out"),
                          "--splits", "train"])
    assert status == 1 and str(expected) in capsys.readouterr().err


def test_cli_with_local_model_folders(coco, tmp_path: Path) -> None:
    vae_dir = tiny_vae_folder(tmp_path / "vae", seed=0)
    clip_name = tiny_clip_folder(tmp_path / "clip", seed=0)
    out = tmp_path / "features"
    status = extract_cli.main([
        "--coco", str(coco.coco), "--out", str(out), "--splits", "val", "--vae", str(vae_dir),
        "--clip-model", clip_name, "--resolution", "64", "--batch-size", "2",
        "--chunk-size", "2", "--workers", "2", "--device", "cpu", "--no-progress",
    ])
    assert status == 0
    resumed, reference = read_split(out / "val"), read_split(coco.features / "val")
    assert np.array_equal(resumed["moments"], reference["moments"])
    assert np.array_equal(resumed["contexts"], reference["contexts"])
    meta = json.loads((out / "meta.json").read_text())
    assert meta["settings"]["vae"] == str(vae_dir) and "torch" in meta["versions"]
