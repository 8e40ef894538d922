"""Stable Diffusion KL-f8 autoencoder helpers (latent space of the MS-COCO models).

The MS-COCO U-ViT / U-ViC works on 4 x 32 x 32 latents of 256 x 256 images. As in the
release, feature extraction stores the encoder's Gaussian *moments* (mean and log-variance,
8 channels); training samples ``z = mean + exp(logvar / 2) * noise`` afresh every time and
multiplies by the scale factor 0.23010 (the release's value, not diffusers' 0.18215).
Sampling divides by the same factor before decoding.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKL

DEFAULT_VAE = "stabilityai/sd-vae-ft-ema"
SCALE_FACTOR = 0.23010  # latent scale of the U-ViT release (docs/conventions.md)


class VAELoadError(FileNotFoundError):
    """The autoencoder weights were not found locally nor on the Hub."""


def _hint(name: str) -> str:
    return (
        f"download it with `huggingface-cli download {DEFAULT_VAE} --local-dir "
        "models/sd-vae-ft-ema` and pass the folder via --set data.vae=models/sd-vae-ft-ema "
        f"(or --vae for the extraction script); got {name!r}"
    )


def load_vae(
    name_or_path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> AutoencoderKL:
    """Load a diffusers `AutoencoderKL` from a local folder or a Hub name, frozen, in eval mode.

    A local folder holds ``config.json`` and the weights (or is a Stable Diffusion pipeline
    folder with a ``vae/`` subfolder). Hub names use the local cache first, then the network;
    ``owner/name/subfolder`` names a pipeline's VAE (e.g. ``CompVis/stable-diffusion-v1-4/vae``,
    Stable Diffusion's own autoencoder).
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        subfolder = "vae" if (path / "vae" / "config.json").is_file() else None
        if subfolder is None and not (path / "config.json").is_file():
            raise VAELoadError(f"VAE folder {path} has no config.json; {_hint(name_or_path)}")
        vae = AutoencoderKL.from_pretrained(path, subfolder=subfolder, torch_dtype=dtype)
    elif name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") not in (1, 2):
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
