"""U-ViT and U-ViC, the diffusion backbone: a pre-LN transformer over patch, time and
condition tokens with U-Net style long skips (Bao et al., CVPR 2023), predicting the noise.

Parameter names and shapes are the release's (`libs/uvit.py`, `libs/uvit_t2i.py`), so its
`nnet_ema.pth` loads with strict=True. Each block's attention runs `uvic_kernels.attention`
in the mode `model.attention` gives it; U-ViC is Cog attention in every block but the
first and the last. Shapes: B batch, C channels, H/W size, p patch, L patches, N tokens,
D width, h heads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import einops
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin
from timm.layers import Mlp
from torch import Tensor, nn

import uvic_kernels
from uvic.config import Config, ModelConfig
from uvic.config.models import (
    check_backend_fits,
    check_model,
    kernel_backend,
    resolve_attention,
)
from uvic.models.embeddings import PatchEmbed, sincos_pos_embed_2d, timestep_embedding
from uvic_kernels import reference
from uvic_kernels.modes import DESIGN
from uvic_kernels.reference import lambda_init_at


class OutputGate(nn.Module):
    """Y * sigmoid(X W_g + b) on the heads' outputs Y, before the output projection, from the
    attention's input X (Qiu et al. 2025): one gate per channel ("elementwise") or per head
    ("headwise").

    `identity=True` (for a pretrained model) gates with 2 sigmoid(X W_g + b) from W_g = 0,
    b = 0: the outputs start unchanged, and the factor 2 is one the projection absorbs.
    """

    def __init__(self, dim: int, heads: int, kind: str, identity: bool = False,
                 out_dim: int | None = None) -> None:
        super().__init__()
        self.kind, self.heads, self.identity = kind, heads, identity
        width = (out_dim or dim) if kind == "elementwise" else heads  # out_dim: Y's width
        self.weight, self.bias = nn.Parameter(torch.empty(width, dim)), nn.Parameter(
            torch.empty(width))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The release's Linear init (trunc-normal(0.02) weights, zero bias); 0 if `identity`."""
        if self.identity:
            nn.init.zeros_(self.weight)
        else:
            nn.init.trunc_normal_(self.weight, std=0.02)
        nn.init.zeros_(self.bias)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        gate = torch.sigmoid(F.linear(x, self.weight, self.bias))  # (B, N, D) or (B, N, heads)
        if self.identity:
            gate = 2 * gate
        if self.kind == "headwise":
            gate = gate.repeat_interleave(y.shape[-1] // self.heads, dim=-1)
        return y * gate

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, heads={self.heads}, identity={self.identity}"


def output_gate(dim: int, heads: int, kind: str) -> OutputGate | None:
    """The gate of `model.output_gate` ("none": no gate, no weights), made without advancing
    the random stream: `UViT` draws the designs' own weights after the shared ones."""
    if kind == "none":
        return None
    with torch.random.fork_rng(devices=[]):
        return OutputGate(dim, heads, kind)


class Attention(nn.Module):
    """Multi-head self-attention with the release's weights (fused `qkv`, `proj`), run by the
    fused kernel in this block's `mode` on `backend` (None: the kernel picks per device).

    `sigmoid_bias` (sigmoid mode, set by `UViT`): None (-log N), a number, or a learnt (h,).
    """

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = False, mode: str = "softmax",
                 backend: str | None = None, gate: str = "none") -> None:
        super().__init__()
        self.num_heads, self.mode, self.backend = num_heads, mode, backend
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.gate = output_gate(dim, num_heads, gate)
        self.sigmoid_bias: float | nn.Parameter | None = None

    def reset_design_parameters(self) -> None:
        """Draw the weights of this design's own (the gate's), after the shared ones."""
        if self.gate is not None:
            self.gate.reset_parameters()

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # (B, N, 3D) -> strided (B, h, N, D/h) views, which the kernel accepts as they are
        q, k, v = einops.rearrange(self.qkv(x), "B N (K h d) -> K B h N d", K=3,
                                   h=self.num_heads)
        return q, k, v

    def _bias(self) -> float | Tensor | None:
        return self.sigmoid_bias if self.mode == "sigmoid" else None

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self._qkv(x)
        out = uvic_kernels.attention(q, k, v, mode=self.mode, scale=self.scale,
                                     bias=self._bias(), backend=self.backend)
        out = einops.rearrange(out, "B h N d -> B N (h d)")
        return self.proj(out if self.gate is None else self.gate(x, out))

    @torch.no_grad()
    def weights(self, x: Tensor) -> Tensor:
        """The attention weights A (B, h, N, N) on input x, by the mode's float32 reference."""
        q, k, _ = self._qkv(x)
        bias = self._bias()
        bias = bias.detach().float() if isinstance(bias, Tensor) else bias
        return reference.attention_weights(q.float(), k.float(), self.mode, self.scale, bias)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, num_heads={self.num_heads}, backend={self.backend!r}"


class DifferentialHeads(nn.Module):
    """What differential attention adds to a block (Ye et al., ICLR 2025): lambda =
    exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init, the heads' RMSNorm and 1 - lambda_init.

    Called on head pairs (q1, k1), (q2, k2) of width d and values v of width 2d, (B, h/2, N, .),
    it weighs v by softmax(S1) - lambda softmax(S2): two calls of the softmax kernel that
    share v, q and k zero-padded to v's width (the scores stay as they are).
    """

    def __init__(self, head_dim: int, layer: int = 1, lambda_init: float | None = None) -> None:
        super().__init__()
        self.lambda_init = lambda_init_at(layer) if lambda_init is None else float(lambda_init)
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            nn.Parameter(torch.empty(head_dim)) for _ in range(4))
        with torch.random.fork_rng(devices=[]):  # drawn again by UViT after the shared weights
            self.reset_parameters()
        self.norm = nn.RMSNorm(2 * head_dim, eps=1e-5)

    def reset_parameters(self) -> None:
        """The lambda vectors: normal, std 0.1, as the authors'."""
        for p in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
            nn.init.normal_(p, 0.0, 0.1)

    def lam(self) -> Tensor:
        """lambda, a scalar tensor."""
        return (torch.exp(self.lambda_q1 @ self.lambda_k1)
                - torch.exp(self.lambda_q2 @ self.lambda_k2) + self.lambda_init)

    def forward(self, q1: Tensor, k1: Tensor, q2: Tensor, k2: Tensor, v: Tensor, scale: float,
                backend: str | None = None) -> Tensor:
        """The heads' outputs (B, h/2, N, 2d), normalised and scaled."""
        pad = (0, v.shape[-1] - q1.shape[-1])
        a1, a2 = (uvic_kernels.attention(F.pad(q, pad), F.pad(k, pad), v, mode="softmax",
                                         scale=scale, backend=backend)
                  for q, k in ((q1, k1), (q2, k2)))
        return self.norm(a1 - self.lam().to(a1.dtype) * a2) * (1 - self.lambda_init)

    @torch.no_grad()
    def weights(self, q1: Tensor, k1: Tensor, q2: Tensor, k2: Tensor, scale: float) -> Tensor:
        """The signed weights softmax(S1) - lambda softmax(S2) (B, h/2, N, N), in float32."""
        q1, k1, q2, k2 = (t.float() for t in (q1, k1, q2, k2))
        a1 = reference.attention_weights(q1, k1, "softmax", scale)
        return a1 - self.lam().float() * reference.attention_weights(q2, k2, "softmax", scale)

    def extra_repr(self) -> str:
        return f"lambda_init={self.lambda_init:.4f}"


class DifferentialAttention(nn.Module):
    """Differential attention on the release's `qkv` and `proj` shapes: the h heads of width
    d = D/h pair up into h/2 heads of value width 2d (`DifferentialHeads`)."""

    mode = "differential"

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = False, layer: int = 1,
                 lambda_init: float | None = None, backend: str | None = None,
                 gate: str = "none") -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.backend = num_heads // 2, dim // num_heads, backend
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.diff = DifferentialHeads(self.head_dim, layer, lambda_init)
        self.gate = output_gate(dim, self.num_heads, gate)

    def reset_design_parameters(self) -> None:
        """Draw the lambda vectors and the gate's weights, after the shared ones."""
        self.diff.reset_parameters()
        if self.gate is not None:
            self.gate.reset_parameters()

    def _qkv(self, x: Tensor) -> tuple[Tensor, ...]:
        """q1, k1, q2, k2 (B, h/2, N, d) and v (B, h/2, N, 2d): query and key heads in pairs."""
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q1, q2 = einops.rearrange(q, "B N (h two d) -> two B h N d", two=2, d=self.head_dim)
        k1, k2 = einops.rearrange(k, "B N (h two d) -> two B h N d", two=2, d=self.head_dim)
        return q1, k1, q2, k2, einops.rearrange(v, "B N (h e) -> B h N e", h=self.num_heads)

    def forward(self, x: Tensor) -> Tensor:
        heads = self.diff(*self._qkv(x), scale=self.scale, backend=self.backend)
        out = einops.rearrange(heads, "B h N e -> B N (h e)")
        return self.proj(out if self.gate is None else self.gate(x, out))

    @torch.no_grad()
    def weights(self, x: Tensor) -> Tensor:
        """The signed weights softmax(S1) - lambda softmax(S2) (B, h/2, N, N), in float32."""
        q1, k1, q2, k2, _ = self._qkv(x)
        return self.diff.weights(q1, k1, q2, k2, self.scale)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, backend={self.backend!r}"


class DifferentialV2Attention(Attention):
    """The second version of differential attention (the authors' public code): each of the
    h heads has two queries, the release's q and a second one of its own, sharing k and v,
    and weighs v by softmax(S1) - sigmoid(x . w_head) softmax(S2), the weight per query
    token and head; no norm. Two calls of the softmax kernel."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = False,
                 backend: str | None = None, gate: str = "none") -> None:
        super().__init__(dim, num_heads, qkv_bias, mode="differential_v2", backend=backend,
                         gate=gate)
        self.q2_weight = nn.Parameter(torch.empty(dim, dim))
        self.q2_bias = nn.Parameter(torch.zeros(dim)) if qkv_bias else None
        self.lambda_weight = nn.Parameter(torch.empty(num_heads, dim))
        with torch.random.fork_rng(devices=[]):  # drawn again by UViT after the shared weights
            self.reset_design_parameters()

    def reset_design_parameters(self) -> None:
        """The second query's and the lambda projection's weights (the release's Linear
        init: trunc-normal(0.02), zero bias), then the gate's."""
        for weight in (self.q2_weight, self.lambda_weight):
            nn.init.trunc_normal_(weight, std=0.02)
        if self.q2_bias is not None:
            nn.init.zeros_(self.q2_bias)
        super().reset_design_parameters()

    def _maps(self, x: Tensor) -> tuple[Tensor, ...]:
        """q1, q2, k, v (B, h, N, d) and the second map's weight lambda (B, h, N)."""
        q1, k, v = self._qkv(x)
        q2 = einops.rearrange(F.linear(x, self.q2_weight, self.q2_bias), "B N (h d) -> B h N d",
                              h=self.num_heads)
        lam = torch.sigmoid(F.linear(x, self.lambda_weight)).transpose(1, 2)
        return q1, q2, k, v, lam

    def forward(self, x: Tensor) -> Tensor:
        q1, q2, k, v, lam = self._maps(x)
        o1, o2 = (uvic_kernels.attention(q, k, v, mode="softmax", scale=self.scale,
                                         backend=self.backend) for q in (q1, q2))
        out = einops.rearrange(o1 - lam.unsqueeze(-1).to(o2.dtype) * o2,
                               "B h N d -> B N (h d)")
        return self.proj(out if self.gate is None else self.gate(x, out))

    @torch.no_grad()
    def weights(self, x: Tensor) -> Tensor:
        """The signed weights softmax(S1) - lambda softmax(S2) (B, h, N, N), in float32."""
        q1, q2, k, _, lam = (t.float() for t in self._maps(x))
        a1 = reference.attention_weights(q1, k, "softmax", self.scale)
        return a1 - lam.unsqueeze(-1) * reference.attention_weights(q2, k, "softmax", self.scale)


class Block(nn.Module):
    """Pre-LN transformer block; out-blocks first merge the long skip with Linear(2D, D)."""

    def __init__(
        self, dim: int, num_heads: int, mlp_ratio: float, qkv_bias: bool, skip: bool = False,
        mode: str = "softmax", backend: str | None = None, gate: str = "none", layer: int = 1,
        lambda_init: float | None = None,
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        if mode == "differential":
            self.attn = DifferentialAttention(dim, num_heads, qkv_bias, layer, lambda_init,
                                              backend, gate)
        elif mode == "differential_v2":
            self.attn = DifferentialV2Attention(dim, num_heads, qkv_bias, backend, gate)
        else:
            self.attn = Attention(dim, num_heads, qkv_bias, mode=mode, backend=backend,
                                  gate=gate)
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

    Tokens: unconditional [time, patches]; class-conditional [label, time, patches];
    text-conditional [time, 77 context tokens, patches]. The arguments are
    `uvic.config.ModelConfig`'s fields; diffusers records them as the model's config
    (`save_pretrained` / `from_pretrained`), and `forward` returns `.sample` as its models do.
    """

    _supports_gradient_checkpointing = True  # diffusers' enable_gradient_checkpointing()

    @register_to_config
    def __init__(
        self, *, img_size: int = 32, in_chans: int = 3, patch_size: int = 2,
        embed_dim: int = 512, depth: int = 12, num_heads: int = 8, mlp_ratio: float = 4.0,
        qkv_bias: bool = False, mlp_time_embed: bool = False, num_classes: int = -1,
        clip_dim: int = 0, num_clip_token: int = 77, conv: bool = True, skip: bool = True,
        attention: str | Sequence[str] = "uvit", attention_backend: str = "auto",
        grad_checkpointing: bool = False, pos_embed_init: str = "normal",
        sigmoid_bias: float | None = None, sigmoid_bias_learnable: bool = False,
        output_gate: str = "none", diff_lambda_init: float | None = None,
    ) -> None:
        super().__init__()
        given = dict(locals())  # the arguments, by name
        m = ModelConfig(**{f.name: given[f.name] for f in dataclasses.fields(ModelConfig)})
        check_model(m)
        backend, modes = kernel_backend(m.attention_backend), resolve_attention(m.attention,
                                                                                m.depth)
        self.img_size, self.patch_size, self.in_chans = m.img_size, m.patch_size, m.in_chans
        self.embed_dim, self.depth = m.embed_dim, m.depth
        self.num_classes, self.clip_dim = m.num_classes, m.clip_dim
        self.num_clip_token, self.grad_checkpointing = m.num_clip_token, m.grad_checkpointing
        dim, num_patches = m.embed_dim, (m.img_size // m.patch_size) ** 2

        self.patch_embed = PatchEmbed(m.patch_size, m.in_chans, dim)
        self.time_embed = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.SiLU(), nn.Linear(4 * dim, dim),
        ) if m.mlp_time_embed else nn.Identity()
        if m.num_classes > 0:
            self.label_emb = nn.Embedding(m.num_classes, dim)
        if m.clip_dim > 0:
            self.context_embed = nn.Linear(m.clip_dim, dim)
        self.extras = 1 + (m.num_classes > 0) + (m.num_clip_token if m.clip_dim > 0 else 0)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.extras + num_patches, dim))

        def block(i: int, skip_in: bool) -> Block:
            return Block(dim, m.num_heads, m.mlp_ratio, m.qkv_bias, skip=skip_in,
                         mode=modes[i], backend=backend, gate=m.output_gate, layer=i + 1,
                         lambda_init=m.diff_lambda_init)

        half = m.depth // 2
        self.in_blocks = nn.ModuleList([block(i, False) for i in range(half)])
        self.mid_block = block(half, False)
        self.out_blocks = nn.ModuleList([block(half + 1 + i, m.skip) for i in range(half)])

        self.norm = nn.LayerNorm(dim)
        self.decoder_pred = nn.Linear(dim, m.patch_size**2 * m.in_chans)
        self.final_layer = (nn.Conv2d(m.in_chans, m.in_chans, 3, padding=1) if m.conv
                            else nn.Identity())
        self.sigmoid_bias, self.sigmoid_bias_learnable = m.sigmoid_bias, m.sigmoid_bias_learnable
        self._set_sigmoid_biases()

        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if m.pos_embed_init == "sincos":  # same draws as "normal" elsewhere, patch rows replaced
            with torch.no_grad():
                self.pos_embed[0, self.extras:] = sincos_pos_embed_2d(m.img_size // m.patch_size,
                                                                      dim)
        self.apply(_init_weights)
        for blk in self.blocks():  # a design's own weights last: the shared ones stay paired
            blk.attn.reset_design_parameters()

    # ------------------------------------------------------------------ attention pattern

    def blocks(self) -> list[Block]:
        """All blocks in order: in_blocks..., mid_block, out_blocks...."""
        return [*self.in_blocks, self.mid_block, *self.out_blocks]

    @property
    def attention_modes(self) -> list[str]:
        """The blocks' attention modes, in order (depth + 1 entries)."""
        return [blk.attn.mode for blk in self.blocks()]

    def set_attention(self, spec: str | Sequence[str], backend: str | None = None) -> None:
        """Switch the blocks' modes in place (a preset or one mode per block), and `backend`
        ("auto", "triton", "torch", "sdpa") if given; the config records both, so
        `save_pretrained` keeps them. A bad value changes nothing."""
        modes = resolve_attention(spec, self.depth)
        changed = [i for i, (now, new) in enumerate(zip(self.attention_modes, modes))
                   if now != new and not (DESIGN[now].kernel and DESIGN[new].kernel)]
        if changed:
            raise ValueError(f"set_attention: blocks {changed} would change to or from "
                             "a design with weights of its own (differential attention); "
                             "build the model with the pattern instead")
        kernel = (self.blocks()[0].attn.backend if backend is None
                  else kernel_backend(backend, label="attention backend "))
        check_backend_fits(kernel, modes)
        for blk, mode in zip(self.blocks(), modes):
            blk.attn.mode, blk.attn.backend = mode, kernel
        self._set_sigmoid_biases()
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
        y: Tensor | None = None, return_dict: bool = True,
    ) -> Transformer2DModelOutput | tuple[Tensor]:
        """x (B, C, H, W), t (B,) or scalar network time, context (B, 77, clip_dim),
        y (B,) class ids -> predicted noise (B, C, H, W): `.sample` of the output, or
        `[0]` of the tuple given with `return_dict=False`."""
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
        out = self.final_layer(img)
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)

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
