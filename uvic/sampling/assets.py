"""What sampling a config needs besides the network: the VAE that decodes latents, the
empty-prompt context of guidance, prompts and their text contexts; and the conversion of
model outputs (pixels in [-1, 1] or VAE latents) to images in [0, 1].
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from uvic.config import Config, DataConfig
from uvic.config.data import LATENT_DATASETS
from uvic.data.datasets import EMPTY_CONTEXT_FILE, load_empty_context, load_sample_prompts
from uvic.models.autoencoder import decode_latents, load_vae


def is_latent(data: DataConfig) -> bool:
    """Whether the model works on VAE latents (decoded before viewing)."""
    return data.name in LATENT_DATASETS


def to_pixels(cfg: Config, x0: torch.Tensor, vae: nn.Module | None = None) -> torch.Tensor:
    """Model-space samples -> images in [0, 1] (N, 3, H, W), float32.

    Pixel data (cifar10, shapes) is in [-1, 1]; MS-COCO latents are decoded with the
    Stable Diffusion VAE (scale factor cfg.data.scale_factor) in chunks of
    cfg.sample.decode_batch_size.
    """
    if is_latent(cfg.data):
        if vae is None:
            raise ValueError(
                f"data.name={cfg.data.name!r} samples are VAE latents: pass the VAE "
                f"(uvic.models.autoencoder.load_vae({cfg.data.vae!r}, device))"
            )
        return model_to_pixels(x0, vae, cfg.data.scale_factor, cfg.sample.decode_batch_size)
    return model_to_pixels(x0)


def model_to_pixels(x0: torch.Tensor, vae: nn.Module | None = None, scale_factor: float = 1.0,
                    decode_batch_size: int = 50) -> torch.Tensor:
    """Model-space samples -> images in [0, 1], float32: pixels in [-1, 1] as they are,
    latents (with their `vae`) decoded `decode_batch_size` at a time (`to_pixels`, and the
    pipelines of `uvic.pipelines`, which have no Config)."""
    if vae is not None:
        x0 = decode_latents(vae, x0, scale_factor, decode_batch_size)
    return ((x0.float() + 1.0) / 2.0).clamp(0.0, 1.0)


def read_prompts(path: str | Path) -> list[str]:
    """Prompts file: one prompt per line; blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file not found: {path}")
    prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompts file {path} has no prompts")
    return prompts


def text_encoder(data: DataConfig, device: torch.device | str):
    """The CLIP text encoder the data was encoded with (open_clip, the release's padding)."""
    from uvic.models.text_encoder import ClipTextEncoder

    return ClipTextEncoder(data.clip_model, data.clip_pretrained, device)


def empty_context(data: DataConfig, device: torch.device | str = "cpu",
                  encoder=None) -> torch.Tensor:
    """The empty-prompt context (L, D) used for guidance: the feature folder's
    `empty_context.npy` when present (exactly what training dropped captions to),
    otherwise the text encoder's encoding of ""."""
    if (Path(data.root) / EMPTY_CONTEXT_FILE).is_file() or encoder is None:
        return load_empty_context(data).to(device)
    return encoder.encode([""])[0].to(device)


def prompt_contexts(data: DataConfig, prompts_file: str | Path | None,
                    encoder=None) -> tuple[list[str], torch.Tensor]:
    """Prompts and their contexts (n, L, D) on the CPU for a text-to-image config: from a
    prompts file (encoded with `encoder`, by default `text_encoder(data)`) or, without one,
    the feature folder's sample prompts (`uvic.data.datasets.load_sample_prompts`)."""
    if prompts_file is None:
        prompts, contexts = load_sample_prompts(data)
        return list(prompts), contexts.cpu()
    prompts = read_prompts(prompts_file)
    encoder = encoder or text_encoder(data, "cpu")
    return prompts, encoder.encode(prompts).cpu()


@dataclass
class SamplingAssets:
    """What sampling a config needs besides the network, loaded once from the config: the
    VAE that decodes latents (latent data) and the empty-prompt context for guidance
    (text-to-image). The training grids, `scripts/sample.py` and the FID evaluator all
    build it with `from_config`."""

    cfg: Config
    vae: nn.Module | None = None
    uncond: torch.Tensor | None = None  # (L, D)

    @classmethod
    def from_config(cls, cfg: Config, device: torch.device | str = "cpu",
                    encoder=None) -> SamplingAssets:
        """Load what `cfg` needs; `encoder` encodes "" when the feature folder has no
        empty context."""
        vae = load_vae(cfg.data.vae, device) if is_latent(cfg.data) else None
        uncond = empty_context(cfg.data, device, encoder) if cfg.model.clip_dim > 0 else None
        return cls(cfg, vae, uncond)

    def to_pixels(self, x0: torch.Tensor) -> torch.Tensor:
        """Model-space samples -> images in [0, 1] (`to_pixels` with this VAE)."""
        return to_pixels(self.cfg, x0, self.vae)
