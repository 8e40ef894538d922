"""Stable Diffusion KL-f8 autoencoder helpers (the latent space of the MS-COCO and ImageNet
models): load one (`load_vae`: a diffusers folder, a Hub name, or the release's LDM
`.pth` files), encode images to its posterior moments, draw scaled latents from them, and
decode. Which autoencoder and scale factor each row uses: docs/conventions.md,
"Autoencoders".
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # loaded where a VAE is built: most runs (pixels) never need diffusers' VAE
    from diffusers import AutoencoderKL

SD_VAE = "CompVis/stable-diffusion-v1-4/vae"  # the release's autoencoder_kl.pth
SD_VAE_FT_EMA = "stabilityai/sd-vae-ft-ema"  # the release's autoencoder_kl_ema.pth
RELEASE_FILES = {"autoencoder_kl.pth": SD_VAE, "autoencoder_kl_ema.pth": SD_VAE_FT_EMA}
DEFAULT_VAE = SD_VAE  # the release encodes every row's features with it
SCALE_FACTOR = 0.23010  # latent scale of the U-ViT release (docs/conventions.md)
# weights files in the LDM (CompVis) layout, as the release's assets/stable-diffusion/*.pth
CHECKPOINT_SUFFIXES = (".pth", ".pt", ".ckpt", ".bin", ".safetensors")
LDM_NORM_GROUPS = 32  # GroupNorm groups of the LDM autoencoder (not stored in its weights)


class VAELoadError(FileNotFoundError):
    """The autoencoder weights were not found locally nor on the Hub, or are not a VAE's."""


def _hint(name: str) -> str:
    """Where to get the weights, for a one-line error about `name`."""
    hub_twin = next((hub for file, hub in RELEASE_FILES.items() if name.endswith(file)), None)
    if hub_twin is not None:  # one of the release's files
        return ("put the U-ViT release's file there (the `stable-diffusion` folder its README "
                "links, which it keeps as assets/stable-diffusion/), or pass the same "
                f"autoencoder from the Hub via --set data.vae={hub_twin} (or --vae for the "
                "extraction scripts)")
    hub = name if _is_hub_name(name) else DEFAULT_VAE
    owner, repo, *sub = hub.split("/")
    include = f" --include '{sub[0]}/*'" if sub else ""
    return (f"download it with `huggingface-cli download {owner}/{repo}{include} --local-dir "
            f"models/{repo}` and pass the folder via --set data.vae=models/{repo} (or --vae for "
            "the extraction scripts), or pass the release's file "
            f"assets/stable-diffusion/autoencoder_kl.pth; got {name!r}")


def _is_hub_name(name: str) -> bool:
    """``owner/name`` or ``owner/name/subfolder``, not a path or a weights file."""
    return (not name.startswith((".", "/", "~")) and name.count("/") in (1, 2)
            and not name.endswith(CHECKPOINT_SUFFIXES))


def _one_line(err: BaseException, limit: int = 300) -> str:
    """An exception's message on one line, at most `limit` characters."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _ldm_config(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """diffusers `AutoencoderKL` arguments of an LDM autoencoder state dict, from its shapes
    (levels, widths, blocks per level, channels); GroupNorm has 32 groups, as in LDM."""
    levels = sorted({int(k.split(".")[2]) for k in state if k.startswith("encoder.down.")})
    blocks = {int(k.split(".")[4]) for k in state if k.startswith("encoder.down.0.block.")}
    return {
        "in_channels": state["encoder.conv_in.weight"].shape[1],
        "out_channels": state["decoder.conv_out.weight"].shape[0],
        "down_block_types": ["DownEncoderBlock2D"] * len(levels),
        "up_block_types": ["UpDecoderBlock2D"] * len(levels),
        "block_out_channels": [state[f"encoder.down.{i}.block.0.conv1.weight"].shape[0]
                               for i in levels],
        "layers_per_block": len(blocks),
        "latent_channels": state["post_quant_conv.weight"].shape[1],
        "norm_num_groups": LDM_NORM_GROUPS,
        "sample_size": 256,
        "scaling_factor": 0.18215,  # unused by uvic: cfg.data.scale_factor scales the latents
    }


def vae_from_ldm_state_dict(state: dict[str, torch.Tensor]) -> AutoencoderKL:
    """A diffusers `AutoencoderKL` holding an LDM (CompVis) autoencoder state dict.

    The keys are those of the release's ``FrozenAutoencoderKL`` (``encoder.*``,
    ``decoder.*``, ``quant_conv.*``, ``post_quant_conv.*``), optionally under Stable
    Diffusion's ``first_stage_model.`` prefix; diffusers' `convert_ldm_vae_checkpoint` (its
    single-file loader's converter) renames them, and every converted weight must load
    (strict). Raises TypeError, ValueError, KeyError or RuntimeError for anything else.
    """
    from diffusers.loaders.single_file_utils import LDM_VAE_KEYS, convert_ldm_vae_checkpoint

    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise TypeError(f"it holds a {type(state).__name__}, not a state dict")
    prefix = next((p for p in LDM_VAE_KEYS if any(k.startswith(p) for k in state)), "")
    own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    for key in ("encoder.conv_in.weight", "encoder.down.0.block.0.conv1.weight",
                "decoder.conv_out.weight", "post_quant_conv.weight"):
        if key not in own:
            diffusers = any(".down_blocks." in k for k in own)
            raise ValueError(f"no {key!r}" + (" (diffusers key names: pass the diffusers folder "
                                            "holding it and its config.json)" if diffusers else ""))
    config = _ldm_config(own)
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(**config)
    vae.load_state_dict(convert_ldm_vae_checkpoint(own, config), strict=True)
    return vae


def load_ldm_vae(path: str | Path, dtype: torch.dtype = torch.float32) -> AutoencoderKL:
    """A weights file in the LDM layout (the release's ``autoencoder_kl.pth``,
    ``autoencoder_kl_ema.pth``; a Stable Diffusion ``.ckpt``; ``.safetensors``) as a diffusers
    `AutoencoderKL`. Errors are one `VAELoadError` line naming the file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise VAELoadError(f"VAE file not found: {path}; {_hint(str(path))}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state: Any = load_file(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle, zip and safetensors errors have no common base
        raise VAELoadError(f"VAE file {path} is unreadable as a state dict: "
                           f"{_one_line(err)}") from err
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]  # a Lightning / Stable Diffusion checkpoint
    try:
        vae = vae_from_ldm_state_dict(state)
    except (KeyError, RuntimeError, AttributeError, IndexError, TypeError, ValueError) as err:
        raise VAELoadError(
            f"VAE file {path} is not a Stable Diffusion (LDM) autoencoder state dict "
            f"(encoder.*, decoder.*, quant_conv.*, post_quant_conv.*): {_one_line(err)}"
        ) from err
    return vae if dtype == torch.float32 else vae.to(dtype)


def load_vae(
    name_or_path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> AutoencoderKL:
    """Load a diffusers `AutoencoderKL` from a local folder or file or a Hub name, frozen, in
    eval mode.

    A local folder holds ``config.json`` and the weights (or is a Stable Diffusion pipeline
    folder with a ``vae/`` subfolder). A path ending in ``.pth``, ``.pt``, ``.ckpt``, ``.bin``
    or ``.safetensors`` is a weights file in the LDM layout (`load_ldm_vae`: the release's
    ``assets/stable-diffusion/autoencoder_kl.pth`` or ``autoencoder_kl_ema.pth``). Hub names
    use the local cache first, then the network; ``owner/name/subfolder`` names a pipeline's
    VAE (e.g. ``CompVis/stable-diffusion-v1-4/vae``, Stable Diffusion's own autoencoder).
    """
    from diffusers import AutoencoderKL

    path = Path(name_or_path).expanduser()
    if name_or_path.endswith(CHECKPOINT_SUFFIXES):
        vae = load_ldm_vae(path, dtype)
    elif path.exists():
        subfolder = "vae" if (path / "vae" / "config.json").is_file() else None
        if subfolder is None and not (path / "config.json").is_file():
            raise VAELoadError(f"VAE folder {path} has no config.json; {_hint(name_or_path)}")
        vae = AutoencoderKL.from_pretrained(path, subfolder=subfolder, torch_dtype=dtype)
    elif not _is_hub_name(name_or_path):
        raise VAELoadError(f"VAE folder not found: {path}; {_hint(name_or_path)}")
    else:
        owner, name, *sub = name_or_path.split("/")
        repo, subfolder = f"{owner}/{name}", (sub[0] if sub else None)
        try:  # the Hub cache first: no network round trips when it is already there
            vae = AutoencoderKL.from_pretrained(
                repo, subfolder=subfolder, torch_dtype=dtype, local_files_only=True
            )
        except (OSError, ValueError):
            try:
                vae = AutoencoderKL.from_pretrained(repo, subfolder=subfolder, torch_dtype=dtype)
            except (OSError, ValueError) as err:
                raise VAELoadError(
                    f"VAE {name_or_path!r} is neither a local folder nor loadable from the "
                    f"Hugging Face Hub; {_hint(name_or_path)}"
                ) from err
    return vae.to(device).eval().requires_grad_(False)


@torch.no_grad()
def encode_moments(vae: AutoencoderKL, images: torch.Tensor) -> torch.Tensor:
    """Images (B, 3, H, W) in [-1, 1] -> posterior moments (B, 8, H/8, W/8): [mean, logvar]."""
    images = images.to(device=vae.device, dtype=vae.dtype)
    return vae.encode(images).latent_dist.parameters


def sample_from_moments(
    moments: torch.Tensor, scale_factor: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Draw scaled latents from moments (..., 2C, h, w) -> (..., C, h, w), float32.

    z = (mean + exp(logvar / 2) * noise) * scale_factor, logvar clamped to [-30, 20] as in
    the release and diffusers' DiagonalGaussianDistribution.
    """
    moments = moments.float()
    mean, logvar = moments.chunk(2, dim=-3)
    std = torch.exp(0.5 * logvar.clamp(-30.0, 20.0))
    noise = torch.randn(mean.shape, generator=generator, device=mean.device)
    return (mean + std * noise) * scale_factor


@torch.no_grad()
def decode_latents(
    vae: AutoencoderKL, z: torch.Tensor, scale_factor: float, batch_size: int = 50
) -> torch.Tensor:
    """Scaled latents (B, 4, h, w) -> images (B, 3, 8h, 8w) in [-1, 1], float32, on z's device.

    Divides by `scale_factor`, decodes `batch_size` latents at a time, clamps to [-1, 1].
    """
    if batch_size < 1:
        raise ValueError(f"decode batch_size must be >= 1, got {batch_size}")
    images = []
    for chunk in torch.split(z, batch_size):
        chunk = (chunk / scale_factor).to(device=vae.device, dtype=vae.dtype)
        images.append(vae.decode(chunk).sample.float().clamp(-1.0, 1.0).to(z.device))
    return torch.cat(images)
