"""Cog, expressive, sigmoid and softmax attention for diffusers models, on uvic's fused kernel.

The processors do what diffusers' ``AttnProcessor2_0`` does, with ``uvic_kernels.attention``
in place of ``scaled_dot_product_attention`` (differentiable; PyTorch on a CPU).
``set_cog_attention(model)`` puts one on every ``Attention`` module of any model, or on
chosen transformer blocks (``keep_softmax="first_last"``, as U-ViC); uvic's own ``UViT``
takes its attention from its config instead (docs/diffusers.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from diffusers.models.attention_processor import Attention
from torch import nn

import uvic_kernels
from uvic.models.uvit import DifferentialHeads, OutputGate
from uvic_kernels.fused_attention import BACKENDS, MODES

KEEP_SOFTMAX = ("first_last",)
# diffusers processors that compute what AttnProcessor2_0 does (so ours can replace them)
PLAIN_PROCESSORS = ("AttnProcessor2_0", "AttnProcessor", "XFormersAttnProcessor",
                    "SlicedAttnProcessor", "AttnProcessorNPU")


class KernelAttnProcessor:
    """diffusers attention processor running ``uvic_kernels.attention(mode=mode)``.

    Equal to diffusers' ``AttnProcessor2_0`` apart from the attention op; like it, the
    scores are scaled by ``head_dim ** -0.5`` (``attn.scale`` is not read).  ``backend``
    is passed to the kernel: None picks Triton on CUDA and PyTorch on a CPU.  Attention
    masks are refused: the fused kernel has none.  ``bias`` is sigmoid attention's (a
    number; None: ``-log N``, N the number of keys of each call).
    """

    def __init__(self, mode: str = "cog", backend: str | None = None,
                 bias: float | None = None) -> None:
        name = type(self).__name__
        if mode not in MODES:
            raise ValueError(f"{name}: mode must be one of {MODES}, got {mode!r}")
        if bias is not None and (mode != "sigmoid" or isinstance(bias, bool)
                                 or not isinstance(bias, int | float) or not math.isfinite(bias)):
            raise ValueError(f"{name}: bias must be a finite number and is sigmoid mode's only, "
                             f"got bias={bias!r} with mode={mode!r}")
        self.bias = bias
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"{name}: backend must be one of {BACKENDS} or None, got {backend!r}")
        if backend == "sdpa" and mode != "softmax":
            raise ValueError(f"{name}: backend='sdpa' runs softmax only, not mode={mode!r}")
        self.mode = mode
        self.backend = backend

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mode={self.mode!r}, backend={self.backend!r})"

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float | None = None, bias: object = None) -> torch.Tensor:
        """The attention op on (B, H, N, D) heads: the kernel in this mode and backend. In
        sigmoid mode the bias is this processor's, else `bias` (the attention module's;
        None for both: -log N)."""
        bias = self.bias if self.bias is not None else bias
        extra = {"bias": bias} if self.mode == "sigmoid" and bias is not None else {}
        return uvic_kernels.attention(q, k, v, mode=self.mode, scale=scale, backend=self.backend,
                                      **extra)

    def attend_module(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> torch.Tensor:
        """The attention op of module ``attn`` on its (B, H, N, D) heads."""
        return self.attend(q, k, v)

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``attn`` over ``hidden_states`` (self-attention) or, given
        ``encoder_hidden_states``, from them (cross-attention; any key length)."""
        if not isinstance(attn, Attention):
            raise ValueError(
                f"{type(self).__name__} runs diffusers' Attention modules, not "
                f"{type(attn).__name__}; a UViT takes its attention from model.attention "
                "(UViT.set_attention)")
        if attention_mask is not None:
            raise ValueError(
                f"{type(self).__name__}: attention masks are not supported (the fused kernel "
                f"has none); got attention_mask of shape {tuple(attention_mask.shape)}"
            )
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)

        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)
        batch_size = hidden_states.shape[0]

        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)

        gate_input = hidden_states  # what makes the queries also makes an output gate's gates
        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)

        head_dim = key.shape[-1] // attn.heads
        # (B, N, H * D) -> (B, H, N, D) views; the kernel takes strided inputs.
        query, key, value = (
            x.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
            for x in (query, key, value)
        )
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        hidden_states = self.attend_module(attn, query, key, value)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = hidden_states.to(query.dtype)
        gate = getattr(attn, "output_gate", None)
        if gate is not None:
            hidden_states = gate(gate_input, hidden_states)

        hidden_states = attn.to_out[0](hidden_states)  # linear projection
        hidden_states = attn.to_out[1](hidden_states)  # dropout
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(
                batch_size, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


class CogAttnProcessor(KernelAttnProcessor):
    """Cog attention, ``sign(S) * softmax(|S|)``: weights of either sign."""

    def __init__(self, backend: str | None = None) -> None:
        super().__init__("cog", backend)


class ExpressiveAttnProcessor(KernelAttnProcessor):
    """Expressive attention, ``E / rowsum(E)`` with ``E = S^2 / (1 + S^2)``."""

    def __init__(self, backend: str | None = None) -> None:
        super().__init__("expressive", backend)


class SigmoidAttnProcessor(KernelAttnProcessor):
    """Sigmoid attention without normalisation, ``sigmoid(S + bias)`` (Gu et al. 2024); ``bias``
    defaults to ``-log N`` for N keys."""

    def __init__(self, backend: str | None = None, bias: float | None = None) -> None:
        super().__init__("sigmoid", backend, bias)


class SoftmaxAttnProcessor(KernelAttnProcessor):
    """Softmax attention through the same kernel (a baseline for the others)."""

    def __init__(self, backend: str | None = None) -> None:
        super().__init__("softmax", backend)


class DifferentialAttnProcessor(KernelAttnProcessor):
    """Differential attention in a module that `set_cog_attention(model, "differential")`
    prepared: its heads pair up (2i, 2i + 1) into h/2 heads of value width 2d, weighed by
    softmax(S1) - lambda softmax(S2) (`uvic.models.uvit.DifferentialHeads`)."""

    def __init__(self, backend: str | None = None) -> None:
        super().__init__("softmax", backend)
        self.mode = "differential"

    def attend_module(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> torch.Tensor:
        heads = getattr(attn, "differential", None)
        if heads is None:
            raise ValueError("DifferentialAttnProcessor: the module has no differential weights; "
                             "use set_cog_attention(model, 'differential')")
        d = q.shape[-1]
        pairs = torch.cat([v[:, 0::2], v[:, 1::2]], dim=-1)  # head i's value: heads 2i, 2i+1
        out = heads(q[:, 0::2], k[:, 0::2], q[:, 1::2], k[:, 1::2], pairs, scale=d ** -0.5,
                    backend=self.backend)  # (B, H/2, N, 2d)
        return torch.stack([out[..., :d], out[..., d:]], dim=2).flatten(1, 2)


PROCESSORS: dict[str, type[KernelAttnProcessor]] = {
    "cog": CogAttnProcessor,
    "expressive": ExpressiveAttnProcessor,
    "sigmoid": SigmoidAttnProcessor,
    "softmax": SoftmaxAttnProcessor,
    "differential": DifferentialAttnProcessor,
}


def kernel_processor(mode: str, backend: str | None = None) -> KernelAttnProcessor:
    """The processor of a kernel mode: its class in ``PROCESSORS``, else a
    ``KernelAttnProcessor(mode)`` (any mode the kernel runs has one)."""
    named = PROCESSORS.get(mode)
    return named(backend) if named is not None else KernelAttnProcessor(mode, backend)


def transformer_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's transformer blocks, in order, as ``(name, block)``.

    A block is an entry of an ``nn.ModuleList`` that holds diffusers ``Attention``
    modules and is not inside another such list: DiT's and PixArt's
    ``transformer_blocks``, for example.
    """
    blocks: list[tuple[str, nn.Module]] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or any(
            name.startswith(f"{outer}.") for outer in inside
        ):
            continue
        entries = [
            (f"{name}.{i}" if name else str(i), entry) for i, entry in enumerate(module)
            if any(isinstance(m, Attention) for m in entry.modules())
        ]
        if entries:
            inside.append(name)
            blocks.extend(entries)
    return blocks


def _chosen_blocks(
    model: nn.Module, blocks: Iterable[int] | None, keep_softmax: str | None
) -> list[str] | None:
    """Names of the chosen blocks, or None for the whole model."""
    if blocks is None and keep_softmax is None:
        return None
    if blocks is not None and keep_softmax is not None:
        raise ValueError("set_cog_attention: give blocks or keep_softmax, not both")
    if keep_softmax is not None and keep_softmax not in KEEP_SOFTMAX:
        raise ValueError(
            f"set_cog_attention: keep_softmax must be one of {KEEP_SOFTMAX} or None, "
            f"got {keep_softmax!r}"
        )
    found = transformer_blocks(model)
    count = len(found)
    if keep_softmax is not None:
        if count < 3:
            raise ValueError(
                f"set_cog_attention: keep_softmax={keep_softmax!r} needs at least 3 transformer "
                f"blocks; {type(model).__name__} has {count}"
            )
        indices = list(range(1, count - 1))
    else:
        indices = list(blocks)
        bad = [i for i in indices if isinstance(i, bool) or not isinstance(i, int)
               or not -count <= i < count]
        if bad or not indices:
            raise ValueError(
                f"set_cog_attention: blocks={indices!r}: need block indices in "
                f"[-{count}, {count}) ({type(model).__name__} has {count} transformer blocks)"
            )
    return [found[i][0] for i in indices]


def set_cog_attention(
    model: nn.Module,
    mode: str = "cog",
    *,
    blocks: Iterable[int] | None = None,
    keep_softmax: str | None = None,
    backend: str | None = None,
    gate: str | None = None,
) -> dict[str, KernelAttnProcessor]:
    """Run the ``Attention`` modules of ``model`` through uvic's kernel in ``mode``.

    By default every diffusers ``Attention`` module gets the processor; ``blocks`` (indices
    into :func:`transformer_blocks`, negative ones count from the end) or
    ``keep_softmax="first_last"`` (every block but the first and the last, U-ViC's
    pattern) restrict it to some transformer blocks, and the others keep the processor
    they have.  Only modules running diffusers' plain attention (``AttnProcessor2_0`` and
    its equivalents) or one of these processors are switched: a module whose processor
    does more (rotary embeddings, joint text-image attention, adapters) is refused and
    nothing is changed.  Returns ``{module name: processor}`` for the modules changed.

    ``mode="differential"`` adds differential attention's weights to each module (lambda
    vectors, a norm; heads paired): a starting point for fine-tuning, not the function the
    model computed. ``gate="elementwise"`` or ``"headwise"`` adds an output gate that starts
    as the identity (`OutputGate(identity=True)`), so the model's outputs start unchanged.
    """
    if mode not in PROCESSORS:
        raise ValueError(
            f"set_cog_attention: mode must be one of {tuple(PROCESSORS)}, got {mode!r}")
    if gate not in (None, "elementwise", "headwise"):
        raise ValueError(f"set_cog_attention: gate must be 'elementwise', 'headwise' or None, "
                         f"got {gate!r}")
    processor = kernel_processor(mode, backend)
    chosen = _chosen_blocks(model, blocks, keep_softmax)
    targets = {
        name: module for name, module in model.named_modules()
        if isinstance(module, Attention)
        and (chosen is None or any(name == block or name.startswith(f"{block}.")
                                   for block in chosen))
    }
    if not targets:
        raise ValueError(
            f"set_cog_attention: {type(model).__name__} has no diffusers Attention modules")
    for name, module in targets.items():
        current = type(module.processor)
        if not (issubclass(current, KernelAttnProcessor) or current.__name__ in PLAIN_PROCESSORS):
            raise ValueError(
                f"set_cog_attention: {name} runs {current.__name__}, not plain attention "
                f"({', '.join(PLAIN_PROCESSORS)}); nothing was changed"
            )
    if mode == "differential":
        odd = [name for name, m in targets.items()
               if m.heads % 2 or 2 * (m.inner_dim // m.heads) > 128]
        if odd:
            raise ValueError(f"set_cog_attention: {odd[0]} has {targets[odd[0]].heads} heads of "
                             "width d: differential attention pairs them (an even count, 2d <= "
                             "128); nothing was changed")
    order = [name for name, _ in transformer_blocks(model)]
    for name, module in targets.items():
        if mode == "differential":
            layer = next((i + 1 for i, b in enumerate(order) if name.startswith(f"{b}.")), 1)
            module.differential = DifferentialHeads(module.inner_dim // module.heads, layer).to(
                module.to_q.weight.device, module.to_q.weight.dtype)
        if gate is not None:
            heads = module.heads // 2 if mode == "differential" else module.heads
            module.output_gate = OutputGate(module.to_q.in_features, heads, gate, identity=True,
                                            out_dim=module.inner_dim).to(
                module.to_q.weight.device, module.to_q.weight.dtype)
        module.set_processor(processor)
    return dict.fromkeys(targets, processor)
