"""U-ViT and U-ViC: the diffusion backbone.

U-ViT (Bao et al., "All are Worth Words", CVPR 2023) treats everything as tokens: the
noisy image cut into patches, the diffusion time, and optionally a class label or 77
CLIP text tokens. A plain pre-LN transformer with long skip connections (U-Net style)
predicts the noise. U-ViC is the same network with Cog attention (weights may be
negative, docs/cog_attention.md) in every block except the first in-block and the
last out-block.

Parameter names and shapes are identical to the released U-ViT (`libs/uvit.py` and
`libs/uvit_t2i.py`), so a released `nnet_ema.pth` loads with strict=True, and U-ViT
and U-ViC weights are interchangeable (only each block's `attn.mode` differs).

Differences from the release, on purpose:
* Attention goes through `uvic_kernels.attention` (fused Triton kernel or PyTorch),
  with the per-block mode "softmax", "cog", "expressive" or "sigmoid" (seed 002).
* Under autocast, q/k/v stay in the autocast dtype (fp16/bf16); the release casts them
  to float32 before its softmax attention. The kernels accumulate in float32 anyway.
* Gradient checkpointing uses `torch.utils.checkpoint` with use_reentrant=False.

Shapes below: B batch, C channels, H/W image size, p patch, L = (H/p)(W/p) patches,
E extra tokens (time, label or context), N = E + L tokens, D width, h heads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import einops
import torch
import torch.utils.checkpoint
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from timm.layers import Mlp
from torch import Tensor, nn

import uvic_kernels
from uvic.config import Config, ModelConfig
from uvic.models.checks import (
    ATTENTION_MODES,
    check_arch,
    check_backend_fits,
    kernel_backend,
    resolve_attention,
)
from uvic.models.embeddings import PatchEmbed, sincos_pos_embed_2d, timestep_embedding

# Model sizes of the U-ViT paper (Table 1), as in the release configs:
# small  = configs/cifar10_uvit.py, configs/mscoco_uvit.py        (13 blocks)
# mid    = configs/imagenet64_uvit_mid.py                         (17 blocks)
# large  = configs/imagenet64_uvit_large.py, imagenet512_uvit_large.py (21 blocks)
# huge   = configs/imagenet256_uvit_huge.py, imagenet512_uvit_huge.py  (29 blocks)
# `depth` counts in- plus out-blocks; the network has depth + 1 blocks with the mid-block.
UVIT_SIZES: dict[str, dict[str, int]] = {
    "small": {"embed_dim": 512, "depth": 12, "num_heads": 8},
    "mid": {"embed_dim": 768, "depth": 16, "num_heads": 12},
    "large": {"embed_dim": 1024, "depth": 20, "num_heads": 16},
    "huge": {"embed_dim": 1152, "depth": 28, "num_heads": 16},
}
_SIZE_ALIASES = {"s": "small", "m": "mid", "l": "large", "h": "huge", "medium": "mid"}


def uvit_size(name: str) -> dict[str, int]:
    """(embed_dim, depth, num_heads) of U-ViT-S/M/L/H; accepts "small" or "S" etc."""
    key = _SIZE_ALIASES.get(name.lower(), name.lower())
    if key not in UVIT_SIZES:
        raise ValueError(f"unknown U-ViT size {name!r}; choose one of {sorted(UVIT_SIZES)}")
    return dict(UVIT_SIZES[key])


class Attention(nn.Module):
    """Multi-head self-attention whose weights are softmax, Cog, expressive or sigmoid (`mode`).

    (B, N, D) -> qkv (B, N, 3D) -> q, k, v (B, h, N, D/h) -> kernel -> (B, N, D) -> proj.
    Sigmoid mode's bias is `sigmoid_bias`: None (-log N), a number, or a parameter (h,).
    """

    def __init__(
        self, dim: int, num_heads: int, qkv_bias: bool = False, mode: str = "softmax",
        backend: str | None = None,
    ) -> None:
        super().__init__()
        if mode not in ATTENTION_MODES:
            raise ValueError(f"attention mode {mode!r} is not one of {ATTENTION_MODES}")
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.mode = mode
        self.backend = backend  # None: the kernel picks (Triton on CUDA, else PyTorch)
        self.sigmoid_bias: float | nn.Parameter | None = None  # set by UViT
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        qkv = self.qkv(x)
        # Non-contiguous (B, h, N, D/h) views; the kernel accepts strided inputs.
        q, k, v = einops.rearrange(qkv, "B N (K h d) -> K B h N d", K=3, h=self.num_heads)
        extra = {"bias": self.sigmoid_bias} if self.mode == "sigmoid" else {}
        out = uvic_kernels.attention(q, k, v, mode=self.mode, scale=self.scale,
                                     backend=self.backend, **extra)
        out = einops.rearrange(out, "B h N d -> B N (h d)")
        return self.proj(out)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, num_heads={self.num_heads}, backend={self.backend!r}"


class Block(nn.Module):
    """Pre-LN transformer block; out-blocks first merge the long skip with Linear(2D, D)."""

    def __init__(
        self, dim: int, num_heads: int, mlp_ratio: float, qkv_bias: bool, skip: bool = False,
        mode: str = "softmax", backend: str | None = None,
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads, qkv_bias, mode=mode, backend=backend)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))  # timm's: fc1 -> GELU -> fc2, as the release
        self.skip_linear = nn.Linear(2 * dim, dim) if skip else None  # last, as the release

    def forward(self, x: Tensor, skip: Tensor | None = None) -> Tensor:
        if self.skip_linear is not None:
            if skip is None:
                raise ValueError("an out-block with skip_linear needs its long-skip input")
            x = self.skip_linear(torch.cat([x, skip], dim=-1))
        x = x + self.attn(self.norm1(x))
        x = x + self.mlp(self.norm2(x))
        return x


class UViT(ModelMixin, ConfigMixin):
    """U-ViT / U-ViC noise predictor: forward(x, t, context=None, y=None) -> eps like x.

    Token layout: unconditional [time, patches]; class-conditional [label, time, patches];
    text-conditional [time, 77 context tokens, patches]. `attention` is a preset
    ("uvit", "uvic", "uvie", "uvis") or a list of depth + 1 modes (see `resolve_attention`).

    A diffusers model (`ModelMixin`, `ConfigMixin`): the constructor's arguments, which are
    `uvic.config.ModelConfig`'s fields, are its config, so `save_pretrained(folder)` writes
    config.json (the per-block attention included) and safetensors weights, and
    `UViT.from_pretrained(folder)` rebuilds it (`uvic.pipelines` has the pipeline).
    """

    _supports_gradient_checkpointing = True  # diffusers' enable_gradient_checkpointing()

    @register_to_config
    def __init__(
        self,
        img_size: int = 32,
        patch_size: int = 2,
        in_chans: int = 3,
        embed_dim: int = 512,
        depth: int = 12,
        num_heads: int = 8,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        mlp_time_embed: bool = False,
        num_classes: int = -1,
        clip_dim: int = 0,
        num_clip_token: int = 77,
        conv: bool = True,
        skip: bool = True,
        attention: str | Sequence[str] = "uvit",
        attention_backend: str = "auto",
        grad_checkpointing: bool = False,
        pos_embed_init: str = "normal",
        sigmoid_bias: float | None = None,
        sigmoid_bias_learnable: bool = False,
    ) -> None:
        super().__init__()
        check_arch(img_size, patch_size, embed_dim, depth, num_heads, num_classes, clip_dim,
                   num_clip_token, pos_embed_init, sigmoid_bias)
        backend = kernel_backend(attention_backend)
        modes = resolve_attention(attention, depth)
        check_backend_fits(backend, modes)

        self.img_size, self.patch_size, self.in_chans = img_size, patch_size, in_chans
        self.embed_dim, self.depth = embed_dim, depth
        self.num_classes, self.clip_dim, self.num_clip_token = num_classes, clip_dim, num_clip_token
        self.grad_checkpointing = grad_checkpointing
        num_patches = (img_size // patch_size) ** 2

        self.patch_embed = PatchEmbed(patch_size, in_chans, embed_dim)
        self.time_embed = nn.Sequential(
            nn.Linear(embed_dim, 4 * embed_dim), nn.SiLU(), nn.Linear(4 * embed_dim, embed_dim),
        ) if mlp_time_embed else nn.Identity()
        if num_classes > 0:
            self.label_emb = nn.Embedding(num_classes, embed_dim)
        if clip_dim > 0:
            self.context_embed = nn.Linear(clip_dim, embed_dim)
        self.extras = 1 + (1 if num_classes > 0 else 0) + (num_clip_token if clip_dim > 0 else 0)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.extras + num_patches, embed_dim))

        def block(i: int, skip_in: bool) -> Block:
            return Block(embed_dim, num_heads, mlp_ratio, qkv_bias, skip=skip_in,
                         mode=modes[i], backend=backend)

        half = depth // 2
        self.in_blocks = nn.ModuleList([block(i, False) for i in range(half)])
        self.mid_block = block(half, False)
        self.out_blocks = nn.ModuleList([block(half + 1 + i, skip) for i in range(half)])

        self.norm = nn.LayerNorm(embed_dim)
        self.decoder_pred = nn.Linear(embed_dim, patch_size**2 * in_chans)
        self.final_layer = nn.Conv2d(in_chans, in_chans, 3, padding=1) if conv else nn.Identity()
        self.sigmoid_bias, self.sigmoid_bias_learnable = sigmoid_bias, sigmoid_bias_learnable
        self._set_sigmoid_biases()

        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if pos_embed_init == "sincos":  # same draws as "normal" elsewhere, patch rows replaced
            with torch.no_grad():
                self.pos_embed[0, self.extras:] = sincos_pos_embed_2d(img_size // patch_size,
                                                                      embed_dim)
        self.apply(_init_weights)

    # ------------------------------------------------------------------ attention pattern

    def blocks(self) -> list[Block]:
        """All blocks in order: in_blocks..., mid_block, out_blocks...."""
        return [*self.in_blocks, self.mid_block, *self.out_blocks]

    @property
    def attention_modes(self) -> list[str]:
        """Current per-block attention modes (depth + 1 entries)."""
        return [blk.attn.mode for blk in self.blocks()]

    def set_attention(self, spec: str | Sequence[str], backend: str | None = None) -> None:
        """Switch the per-block pattern in place (e.g. load U-ViT weights, run as U-ViC).

        `backend`, if given, is "auto", "triton" or "torch" and is set on every block.
        """
        modes = resolve_attention(spec, self.depth)
        kernel = (self.blocks()[0].attn.backend if backend is None
                  else kernel_backend(backend, label="attention backend "))
        check_backend_fits(kernel, modes)
        for blk, mode in zip(self.blocks(), modes):
            blk.attn.mode = mode
            if backend is not None:
                blk.attn.backend = kernel
        self._set_sigmoid_biases()
        # the diffusers config (save_pretrained) records the pattern the model now runs
        self.register_to_config(attention=spec if isinstance(spec, str) else modes)
        if backend is not None:
            self.register_to_config(attention_backend=backend)

    def _set_sigmoid_biases(self) -> None:
        """The bias of every sigmoid block: `sigmoid_bias` (None: -log N at run time), or with
        `sigmoid_bias_learnable` a parameter per head (key `...attn.sigmoid_bias`) that
        starts there (-log N: N the model's tokens) and is kept when the pattern changes."""
        tokens = self.pos_embed.shape[1]
        start = -math.log(tokens) if self.sigmoid_bias is None else self.sigmoid_bias
        for attn in (blk.attn for blk in self.blocks() if blk.attn.mode == "sigmoid"):
            if not self.sigmoid_bias_learnable:
                attn.sigmoid_bias = self.sigmoid_bias
            elif not isinstance(attn.sigmoid_bias, nn.Parameter):
                attn.sigmoid_bias = nn.Parameter(torch.full((attn.num_heads,), float(start)))

    @property
    def gradient_checkpointing(self) -> bool:
        """diffusers' name for `grad_checkpointing` (its enable_gradient_checkpointing())."""
        return self.grad_checkpointing

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, enable: bool) -> None:
        self.grad_checkpointing = enable

    def no_weight_decay(self) -> set[str]:
        """Parameter names one may exempt from weight decay. The release defines this too but
        its optimizer decays every parameter, and so does `uvic.training.trainer` (to match it)."""
        return {"pos_embed"}

    # ------------------------------------------------------------------ forward

    def forward(
        self, x: Tensor, t: Tensor | float, context: Tensor | None = None,
        y: Tensor | None = None,
    ) -> Tensor:
        """x (B, C, H, W), t (B,) or scalar network time, context (B, 77, clip_dim),
        y (B,) class ids -> predicted noise (B, C, H, W)."""
        B = self._check_inputs(x, context, y)
        t = torch.as_tensor(t, device=x.device)
        if t.dim() == 0:
            t = t.expand(B)
        if t.shape != (B,):
            raise ValueError(f"t must be a scalar or shape ({B},), got {tuple(t.shape)}")

        patches = self.patch_embed(x)  # (B, L, D)
        time_token = self.time_embed(
            timestep_embedding(t, self.embed_dim).to(self.pos_embed.dtype)
        )[:, None]  # (B, 1, D)
        tokens = [time_token]
        if y is not None:
            tokens.insert(0, self.label_emb(y)[:, None])  # [label, time]
        if context is not None:
            tokens.append(self.context_embed(context))  # [time, context]
        h = torch.cat([*tokens, patches], dim=1) + self.pos_embed  # (B, N, D)

        skips = []
        for blk in self.in_blocks:
            h = self._run(blk, h)
            skips.append(h)
        h = self._run(self.mid_block, h)
        for blk in self.out_blocks:
            h = self._run(blk, h, skips.pop())

        h = self.decoder_pred(self.norm(h))  # (B, N, p*p*C)
        h = h[:, self.extras:]  # drop time/label/context tokens -> (B, L, p*p*C)
        img = einops.rearrange(
            h, "B (hh ww) (p1 p2 C) -> B C (hh p1) (ww p2)",
            hh=self.img_size // self.patch_size, p1=self.patch_size, p2=self.patch_size,
        )
        return self.final_layer(img)

    def _run(self, blk: Block, h: Tensor, skip: Tensor | None = None) -> Tensor:
        if self.grad_checkpointing and self.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(blk, h, skip, use_reentrant=False)
        return blk(h, skip)

    def _check_inputs(self, x: Tensor, context: Tensor | None, y: Tensor | None) -> int:
        expected = (self.in_chans, self.img_size, self.img_size)
        if x.dim() != 4 or tuple(x.shape[1:]) != expected:
            raise ValueError(f"x must have shape (B, {', '.join(map(str, expected))}), "
                             f"got {tuple(x.shape)}")
        B = x.shape[0]
        if self.clip_dim > 0:
            if context is None:
                raise ValueError("this text-conditional model needs context "
                                 f"(B, {self.num_clip_token}, {self.clip_dim})")
            if tuple(context.shape) != (B, self.num_clip_token, self.clip_dim):
                raise ValueError(f"context must have shape ({B}, {self.num_clip_token}, "
                                 f"{self.clip_dim}), got {tuple(context.shape)}")
        elif context is not None:
            raise ValueError("context given but the model is not text-conditional "
                             "(model.clip_dim=0)")
        if self.num_classes > 0:
            if y is None:
                raise ValueError(f"this class-conditional model needs y (B,) with ids in "
                                 f"[0, {self.num_classes})")
            if tuple(y.shape) != (B,) or y.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"y must be an integer tensor of shape ({B},), got "
                                 f"{y.dtype} {tuple(y.shape)}")
        elif y is not None:
            raise ValueError("y given but the model is not class-conditional "
                             "(model.num_classes=-1)")
        return B


def _init_weights(m: nn.Module) -> None:
    """Release init: Linear trunc-normal(0.02) with zero bias, LayerNorm 1/0, rest default.

    torch's `trunc_normal_`, not timm's: the same distribution (the release's), but a
    different draw from the same seed, and runs seeded before keep their initial weights.
    """
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


def build_model(cfg: ModelConfig | Config) -> UViT:
    """Build the U-ViT/U-ViC described by `cfg.model` (or a ModelConfig): every ModelConfig
    field is a `UViT` argument of the same name."""
    m = cfg.model if isinstance(cfg, Config) else cfg
    return UViT(**dataclasses.asdict(m))
