"""REPA: representation alignment as an extra training loss (Yu et al. 2024; docs/training.md,
"REPA").

A forward hook keeps the output of block `train.repa_block` (0-based in `UViT.blocks()`
order); its patch tokens go through the projector, and the loss is their negative cosine
similarity to the frozen encoder's patch features of the clean images, computed from the
batch's pixels or stored with latent datasets (batch key "repa"). With
`train.repa_encoder` unset nothing here is built.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import Tensor, nn

from uvic.config import Config, ConfigError, TrainConfig
from uvic.models.repa_encoder import RepaEncoder, encoder_id, load_encoder
from uvic.run.weights import unwrap_model

FEATURES_KEY = "repa"  # batch key of precomputed encoder patch features (B, L, D)


def projector(width: int, hidden: int, out: int) -> nn.Sequential:
    """REPA's projector: Linear(width, hidden), SiLU, Linear(hidden, hidden), SiLU,
    Linear(hidden, out), applied to each token."""
    return nn.Sequential(nn.Linear(width, hidden), nn.SiLU(), nn.Linear(hidden, hidden),
                         nn.SiLU(), nn.Linear(hidden, out))


def alignment_loss(projected: Tensor, target: Tensor) -> Tensor:
    """Mean over images and tokens of -cos(projected, target), both (B, L, D)."""
    return -F.cosine_similarity(projected.float(), target.float(), dim=-1).mean()


class NoRepa:
    """A run without REPA: what the trainer asks of the REPA loss, doing nothing (the
    plain run, bit for bit)."""

    modules: tuple[nn.Module, ...] = ()  # trained modules besides the model

    def trained(self, model: nn.Module) -> nn.Module:
        """What the optimizer trains: the model, and with REPA the projector after it."""
        return model

    def parameters(self, model: nn.Module) -> Iterator[nn.Parameter]:
        """The parameters the optimizer steps (gradient clipping covers them all)."""
        return itertools.chain(model.parameters(), *(m.parameters() for m in self.modules))

    def prepare(self, acc: Accelerator) -> None:
        """Prepare the projector with Accelerate, after the model (checkpoints hold it as
        model_1.safetensors, `load_state` restores it)."""

    def add(self, loss: Tensor, batch: dict[str, Tensor]) -> Tensor:
        """The training loss: the diffusion `loss`, plus REPA's of `batch`."""
        return loss

    def log(self, acc: Accelerator) -> dict[str, float]:
        """What a log record adds: {"repa_loss": mean since the last log} with REPA."""
        return {}


class Repa(NoRepa):
    """The REPA loss of one training run: the hook on the model's block, the projector,
    the encoder (pixel datasets) and the logged loss since the last log."""

    def __init__(self, cfg: Config, model: nn.Module, encoder: RepaEncoder | None,
                 dim: int) -> None:
        t = cfg.train
        blocks = unwrap_model(model).blocks()
        if t.repa_block >= len(blocks):
            raise ConfigError(f"train.repa_block={t.repa_block} but the model has "
                              f"{len(blocks)} blocks (0..{len(blocks) - 1}: in_blocks, "
                              "mid_block, out_blocks)")
        self.weight, self.encoder = t.repa_weight, encoder
        self.extras = unwrap_model(model).extras
        self.projector = projector(cfg.model.embed_dim, t.repa_projector_dim, dim)
        self.modules = (self.projector,)
        self.hidden: Tensor | None = None
        self.handle = blocks[t.repa_block].register_forward_hook(self._keep)
        self.unlogged = torch.zeros(())
        self.calls = 0
        self.autocast: Callable[[], AbstractContextManager] = contextlib.nullcontext

    def _keep(self, _module: nn.Module, _inputs: object, output: Tensor) -> None:
        self.hidden = output

    def to(self, device: torch.device) -> Repa:
        self.projector.to(device)
        if self.encoder is not None:
            self.encoder.to(device)
        self.unlogged = self.unlogged.to(device)
        return self

    def targets(self, batch: dict[str, Tensor]) -> Tensor:
        """The encoder's patch features of the batch's images: stored ones (latent
        datasets) or computed from the pixels."""
        if FEATURES_KEY in batch:
            return batch[FEATURES_KEY]
        if self.encoder is None:  # build_repa checks the dataset first
            raise ValueError("REPA: the batch has no encoder features and no encoder runs")
        with self.autocast():  # the run's mixed precision; features come back in float32
            return self.encoder(batch["x"])

    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        """repa_weight x the alignment loss of the block output the last forward of the
        model kept (call right after the model's forward on `batch`)."""
        if self.hidden is None:
            raise RuntimeError("REPA: the model's forward did not reach the hooked block")
        tokens, self.hidden = self.hidden[:, self.extras:], None
        target = self.targets(batch)
        if target.shape[:2] != tokens.shape[:2]:
            raise ValueError(f"REPA: {tuple(target.shape)} encoder features for "
                             f"{tuple(tokens.shape)} block tokens")
        value = alignment_loss(self.projector(tokens), target)
        self.unlogged = self.unlogged + value.detach()
        self.calls += 1
        return self.weight * value

    def trained(self, model: nn.Module) -> nn.Module:
        return nn.ModuleList([model, self.projector])

    def prepare(self, acc: Accelerator) -> None:
        self.projector = acc.prepare(self.projector)
        self.autocast = acc.autocast
        self.modules = (self.projector,)

    def add(self, loss: Tensor, batch: dict[str, Tensor]) -> Tensor:
        return loss + self.loss(batch)

    def log(self, acc: Accelerator) -> dict[str, float]:
        mean = acc.reduce(self.unlogged, reduction="mean").item() / max(self.calls, 1)
        self.unlogged, self.calls = torch.zeros_like(self.unlogged), 0
        return {"repa_loss": mean}


LATENT_DATASETS = ("imagenet_features", "mscoco")


def build_repa(cfg: Config, model: nn.Module, device: torch.device) -> NoRepa:
    """The REPA loss of `cfg` for `model` (`NoRepa` when train.repa_encoder is unset), on
    `device`. Build it after the EMA copy (the hook is the trained model's only). Latent
    datasets need the encoder features stored beside the latents (`stored_features`)."""
    t, m = cfg.train, cfg.model
    if not t.repa_encoder:
        return NoRepa()
    grid = m.img_size // m.patch_size
    if cfg.data.name in LATENT_DATASETS:
        return Repa(cfg, model, None, stored_features(cfg, grid)).to(device)
    if m.in_chans != 3:
        raise ConfigError(f"train.repa_encoder needs RGB images but model.in_chans={m.in_chans}")
    encoder = load_encoder(t.repa_encoder, t.repa_encoder_weights, grid)
    return Repa(cfg, model, encoder, encoder.dim).to(device)


def stored_features(cfg: Config, grid: int) -> int:
    """The width of the encoder features stored in the latent folder data.root (its
    meta.json "repa" settings), checked: the same encoder as train.repa_encoder, a `grid`
    x `grid` patch grid (one feature per model token). Missing: one line naming the
    folder and the command that writes them."""
    root = Path(cfg.data.root)
    command = ("uvic-extract-imagenet" if cfg.data.name == "imagenet_features"
               else "uvic-extract-mscoco")
    how = (f"extract them with {command} --out {root} --repa-encoder "
           f"{cfg.train.repa_encoder} --repa-grid {grid}")
    meta = root / "meta.json"
    settings = json.loads(meta.read_text()).get("settings", {}) if meta.is_file() else {}
    repa = settings.get("repa")
    if not repa:
        raise ConfigError(f"train.repa_encoder: data.root={root} holds latents without "
                          f"REPA encoder features; {how}")
    if repa["encoder"] != encoder_id(cfg.train.repa_encoder) or repa["grid"] != grid:
        raise ConfigError(f"train.repa_encoder={cfg.train.repa_encoder} with {grid}x{grid} "
                          f"tokens but {meta} stores features of {repa['encoder']} on a "
                          f"{repa['grid']}x{repa['grid']} grid; {how}")
    return int(repa["dim"])


def check_resume(checkpoint: Path, old: TrainConfig, new: TrainConfig) -> None:
    """A resume keeps REPA on or off, and the projector's width: the checkpoint holds the
    projector's weights and optimizer state of its own shape (or none). Another encoder
    of the same width, block or weight are changes the resume applies and records."""
    key = None
    if bool(old.repa_encoder) != bool(new.repa_encoder):
        key = "repa_encoder"
    elif new.repa_encoder and old.repa_projector_dim != new.repa_projector_dim:
        key = "repa_projector_dim"
    if key is not None:
        raise ConfigError(f"refusing to resume from {checkpoint}: REPA's projector differs "
                          f"from the checkpoint's (train.{key}: {getattr(old, key)!r} in the "
                          f"checkpoint vs {getattr(new, key)!r} now)")
