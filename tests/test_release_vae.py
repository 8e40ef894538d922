"""Which autoencoder each latent row uses, and the release's own autoencoder files.

The U-ViT release (baofff/U-ViT) encodes every row's features with
``assets/stable-diffusion/autoencoder_kl.pth`` (scripts/extract_imagenet_feature.py,
scripts/extract_mscoco_feature.py), stores the posterior moments (``encode_moments``) and
draws ``scale_factor * (mean + std * noise)`` from them at every training step
(``FrozenAutoencoderKL.sample``); it decodes samples with ``autoencoder_kl.pth`` (MS-COCO and
the ImageNet L rows) or ``autoencoder_kl_ema.pth`` (the ImageNet H rows), scale factor 0.23010
for MS-COCO (its config passes it) and the default 0.18215 for ImageNet. The expected values
below are written out independently of the configs and of uvic's constants.

Its ``.pth`` files are plain state dicts in the LDM (CompVis) layout; `load_vae` reads them.
The LDM key names here are written by this test's own renaming of a diffusers state dict,
independently of diffusers' converter that uvic uses.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from datagen import tiny_vae
from diffusers import AutoencoderKL

from uvic.config import DataConfig, load_config
from uvic.models import autoencoder
from uvic.models.autoencoder import VAELoadError, encode_moments, load_vae

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SD = "CompVis/stable-diffusion-v1-4/vae"  # Stable Diffusion's own KL-f8: autoencoder_kl.pth
FT_EMA = "stabilityai/sd-vae-ft-ema"  # its decoder fine-tune: autoencoder_kl_ema.pth
ROWS = {  # config -> (decoding VAE, latent scale factor)
    "mscoco_uvit": (SD, 0.23010), "mscoco_uvic": (SD, 0.23010), "mscoco_uvid": (SD, 0.23010),
    "imagenet256_uvit_large": (SD, 0.18215), "imagenet256_uvic_large": (SD, 0.18215),
    # the modern-recipe twins train on the same latents (plus REPA features)
    "imagenet256_uvit_large_flow": (SD, 0.18215), "imagenet256_uvic_large_flow": (SD, 0.18215),
    "imagenet512_uvit_large": (SD, 0.18215), "imagenet512_uvic_large": (SD, 0.18215),
    "imagenet256_uvit_huge": (FT_EMA, 0.18215), "imagenet256_uvic_huge": (FT_EMA, 0.18215),
    "imagenet512_uvit_huge": (FT_EMA, 0.18215), "imagenet512_uvic_huge": (FT_EMA, 0.18215),
}


@pytest.mark.parametrize("name", sorted(ROWS))
def test_each_latent_row_uses_the_releases_autoencoder(name: str) -> None:
    cfg = load_config(CONFIGS / f"{name}.py")
    assert (cfg.data.vae, cfg.data.scale_factor) == ROWS[name]


def test_every_latent_config_is_pinned() -> None:
    latent = {p.stem for p in CONFIGS.glob("*.py")
              if load_config(p).data.name in ("mscoco", "imagenet_features")}
    assert latent == set(ROWS)


def test_features_are_encoded_with_the_releases_extraction_autoencoder() -> None:
    """Both extractors default to autoencoder_kl.pth's autoencoder (uvic-extract-mscoco reads
    DataConfig's default, uvic-extract-imagenet DEFAULT_VAE)."""
    assert DataConfig().vae == autoencoder.DEFAULT_VAE == SD
    assert autoencoder.RELEASE_FILES == {"autoencoder_kl.pth": SD, "autoencoder_kl_ema.pth": FT_EMA}


def test_features_are_moments_not_samples() -> None:
    """encode_moments is deterministic: [mean, logvar] of the posterior, 2 x 4 channels."""
    vae = tiny_vae(0)
    x = torch.rand(2, 3, 64, 64) * 2 - 1
    moments = encode_moments(vae, x)
    assert moments.shape == (2, 8, 8, 8) and torch.equal(moments, encode_moments(vae, x))
    dist = vae.encode(x).latent_dist
    assert torch.equal(moments[:, :4], dist.mean) and torch.equal(moments[:, 4:], dist.logvar)


# --------------------------------------------------------------------------- the LDM layout

def ldm_key(key: str, levels: int) -> str:
    """diffusers AutoencoderKL key -> the LDM / release FrozenAutoencoderKL key."""
    key = re.sub(r"down_blocks\.(\d+)\.resnets\.", r"down.\1.block.", key)
    key = re.sub(r"down_blocks\.(\d+)\.downsamplers\.0\.", r"down.\1.downsample.", key)
    key = re.sub(r"up_blocks\.(\d+)\.(resnets|upsamplers\.0)\.",
                 lambda m: f"up.{levels - 1 - int(m[1])}."
                 f"{'block' if m[2] == 'resnets' else 'upsample'}.", key)
    key = re.sub(r"mid_block\.resnets\.(\d)\.", lambda m: f"mid.block_{int(m[1]) + 1}.", key)
    for new, old in (("norm", "group_norm"), ("q", "to_q"), ("k", "to_k"), ("v", "to_v"),
                     ("proj_out", "to_out.0")):
        key = key.replace(f"mid_block.attentions.0.{old}.", f"mid.attn_1.{new}.")
    return (key.replace("conv_shortcut", "nin_shortcut").replace("conv_norm_out", "norm_out"))


def ldm_state_dict(vae: AutoencoderKL) -> dict[str, torch.Tensor]:
    """The state dict the release's FrozenAutoencoderKL would hold (1x1 conv attention)."""
    levels = len(vae.config.block_out_channels)
    out = {}
    for key, value in vae.state_dict().items():
        new = ldm_key(key, levels)
        if ".attn_1." in new and new.endswith("weight") and ".norm." not in new:
            value = value[:, :, None, None]  # LDM's q, k, v, proj_out are 1x1 convolutions
        out[new] = value.clone()
    return out


def tiny_release_vae(seed: int = 0) -> AutoencoderKL:
    """A random AutoencoderKL with the LDM autoencoder's 32 GroupNorm groups: 3 levels (one
    width change, so shortcut convolutions), random norms and biases."""
    torch.manual_seed(seed)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(32, 32, 64), layers_per_block=1, norm_num_groups=32,
    )
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.2)
    return vae.eval()


def test_ldm_key_names_are_the_releases() -> None:
    keys = ldm_state_dict(tiny_release_vae())
    for key in ("encoder.conv_in.weight", "encoder.down.0.block.0.conv1.weight",
                "encoder.down.0.downsample.conv.weight", "encoder.mid.block_2.norm2.bias",
                "encoder.mid.attn_1.q.weight", "encoder.norm_out.weight", "quant_conv.weight",
                "post_quant_conv.weight", "encoder.down.2.block.0.nin_shortcut.weight",
                "decoder.up.1.block.0.nin_shortcut.weight", "decoder.up.2.upsample.conv.weight",
                "decoder.up.1.upsample.conv.weight", "decoder.mid.attn_1.proj_out.weight"):
        assert key in keys, key
    assert keys["encoder.mid.attn_1.q.weight"].shape == (64, 64, 1, 1)
    assert not [k for k in keys if "_blocks" in k or "to_" in k or "group_norm" in k]


def assert_same_vae(loaded: AutoencoderKL, vae: AutoencoderKL) -> None:
    assert isinstance(loaded, AutoencoderKL) and not loaded.training
    assert not any(p.requires_grad for p in loaded.parameters())
    theirs = vae.state_dict()
    assert loaded.state_dict().keys() == theirs.keys()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, theirs[key]), key
    x = torch.rand(2, 3, 16, 16) * 2 - 1
    z = torch.randn(2, 4, 4, 4)
    with torch.no_grad():
        assert torch.equal(encode_moments(loaded, x), encode_moments(vae, x))
        assert torch.equal(loaded.decode(z).sample, vae.decode(z).sample)


def test_release_pth_loads_as_the_same_autoencoder(tmp_path: Path, monkeypatch) -> None:
    """assets/stable-diffusion/autoencoder_kl.pth (a plain LDM state dict) loads locally:
    the same weights in diffusers' layout, the same moments and decoded images; the Hub is
    never asked."""
    def no_hub(*args, **kwargs):
        raise AssertionError("a weights file must not go to the Hub")

    monkeypatch.setattr(AutoencoderKL, "from_pretrained", no_hub)
    vae = tiny_release_vae(1)
    path = tmp_path / "assets" / "stable-diffusion" / "autoencoder_kl.pth"
    path.parent.mkdir(parents=True)
    torch.save(ldm_state_dict(vae), path)
    assert_same_vae(load_vae(str(path)), vae)
    half = load_vae(str(path), dtype=torch.float16)
    assert all(p.dtype == torch.float16 for p in half.parameters())


def test_stable_diffusion_checkpoint_and_safetensors_load(tmp_path: Path) -> None:
    """A Stable Diffusion checkpoint ({"state_dict": {"first_stage_model.*": ...}}, with other
    models' weights beside it) and a safetensors file of the release's keys."""
    from safetensors.torch import save_file

    vae = tiny_release_vae(2)
    state = {f"first_stage_model.{k}": v for k, v in ldm_state_dict(vae).items()}
    state["model.diffusion_model.out.0.weight"] = torch.ones(3)
    torch.save({"state_dict": state, "global_step": 1}, tmp_path / "sd.ckpt")
    assert_same_vae(load_vae(str(tmp_path / "sd.ckpt")), vae)
    save_file(ldm_state_dict(vae), tmp_path / "vae.safetensors")
    assert_same_vae(load_vae(str(tmp_path / "vae.safetensors")), vae)


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_missing_release_file_names_it_and_where_it_goes(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(AutoencoderKL, "from_pretrained", lambda *a, **k: pytest.fail("Hub"))
    for file, twin in (("autoencoder_kl.pth", SD), ("autoencoder_kl_ema.pth", FT_EMA)):
        with pytest.raises(VAELoadError) as err:
            load_vae(f"assets/stable-diffusion/{file}")  # two slashes: not a Hub name
        message = one_line(err)
        assert f"assets/stable-diffusion/{file}" in message and "not found" in message
        assert f"data.vae={twin}" in message


def test_not_a_vae_file_is_one_line(tmp_path: Path) -> None:
    nnet = tmp_path / "nnet_ema.pth"  # e.g. a U-ViT checkpoint passed by mistake
    torch.save({"pos_embed": torch.zeros(1, 2, 3)}, nnet)
    with pytest.raises(VAELoadError, match="not a Stable Diffusion") as err:
        load_vae(str(nnet))
    assert str(nnet) in one_line(err)
    diffusers_bin = tmp_path / "diffusion_pytorch_model.bin"  # diffusers' names: its folder
    torch.save(tiny_release_vae().state_dict(), diffusers_bin)
    with pytest.raises(VAELoadError, match="diffusers folder") as err:
        load_vae(str(diffusers_bin))
    assert str(diffusers_bin) in one_line(err)
    broken = tmp_path / "autoencoder_kl.pth"
    broken.write_bytes(b"not a checkpoint")
    with pytest.raises(VAELoadError, match="unreadable") as err:
        load_vae(str(broken))
    assert str(broken) in one_line(err)
    partial = ldm_state_dict(tiny_release_vae())
    del partial["decoder.mid.attn_1.k.weight"]
    torch.save(partial, broken)
    with pytest.raises(VAELoadError, match="to_k") as err:
        load_vae(str(broken))
    assert str(broken) in one_line(err)


def test_hub_hint_names_the_repository_to_download(monkeypatch) -> None:
    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(AutoencoderKL, "from_pretrained", offline)
    with pytest.raises(VAELoadError) as err:
        load_vae(SD)
    message = one_line(err)
    assert "huggingface-cli download CompVis/stable-diffusion-v1-4 --include 'vae/*'" in message
    assert "data.vae=models/stable-diffusion-v1-4" in message
