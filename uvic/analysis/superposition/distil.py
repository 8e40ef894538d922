"""Distil an attention module of a real model (U-ViT / U-ViC, diffusers) into a gated block:
`capture` records the module's inputs and outputs with a forward hook while the whole model
runs on real inputs, and `distil_module` fits a `GatedAttentionBlock` with `expansion` x its
heads, in the module's own attention mode. Supported: uvic's `Attention` and diffusers'
`Attention` in self-attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from uvic.analysis.superposition.gated import (
    GatedAttentionBlock,
    expanded_heads,
    fit,
    gate_report,
    start_at_mean,
)


def module_attention(module: nn.Module) -> tuple[str, int]:
    """(mode, heads) of an attention module: uvic's Attention (its input is the block's
    normalised tokens) or diffusers' Attention (its processor's mode, softmax by default);
    a differential module's are its softmax maps, two per head."""
    if getattr(module, "mode", None) == "differential":  # its maps are 2 per head, softmax
        return "softmax", 2 * module.num_heads
    if hasattr(module, "qkv") and hasattr(module, "num_heads"):  # uvic.models.uvit.Attention
        return module.mode, module.num_heads
    if hasattr(module, "heads") and hasattr(module, "processor"):  # diffusers Attention
        return getattr(module.processor, "mode", "softmax"), module.heads
    raise ValueError(f"{type(module).__name__} is not an attention module this can distil "
                     "(uvic's Attention or diffusers' Attention)")


def capture(module: nn.Module, run: Callable[[], object]) -> tuple[Tensor, Tensor]:
    """Inputs (B, N, D) and outputs (B, N, D') of ``module`` while ``run()`` runs the model
    (concatenated over calls); self-attention on 3-D token inputs only."""
    ins, outs = [], []

    def hook(mod: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        x = args[0] if args else kwargs.get("hidden_states")
        cross = args[1] if len(args) > 1 else kwargs.get("encoder_hidden_states")
        if cross is not None:
            raise ValueError("the module attends to other tokens (cross-attention); only "
                             "self-attention can be distilled")
        out = output[0] if isinstance(output, tuple) else output
        if x is None or x.ndim != 3 or out.ndim != 3:
            raise ValueError("the module's input and output must be (batch, tokens, width)")
        ins.append(x.detach().float().cpu())
        outs.append(out.detach().float().cpu())

    handle = module.register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            run()
    finally:
        handle.remove()
    if not ins:
        raise ValueError("the module did not run (is it part of the model that ran?)")
    return torch.cat(ins), torch.cat(outs)


def distil_module(module: nn.Module, inputs: Tensor, outputs: Tensor, *, expansion: int = 2,
                  coef: float = 3e-1, lr: float = 1e-3, epochs: int = 100, batch: int = 8,
                  warmup: float = 0.0, seed: int = 0,
                  say: Callable[[str], None] | None = None) -> tuple[GatedAttentionBlock, dict]:
    """Fit a gated block to (inputs, outputs) of ``module``; returns it and its report
    (reconstruction error, L0.6 value, open heads per (query, key) pair, mean gates)."""
    mode, heads = module_attention(module)
    d_in, d_out = inputs.shape[-1], outputs.shape[-1]
    if d_in % heads:
        raise ValueError(f"width {d_in} is not divisible by the module's {heads} heads")
    torch.manual_seed(seed)
    block = GatedAttentionBlock(d_in, d_out, expanded_heads(heads, expansion), d_in // heads,
                                mode=mode)

    def batches():
        order = torch.randperm(len(inputs))
        for start in range(0, len(inputs), batch):
            idx = order[start:start + batch]
            yield inputs[idx], outputs[idx]

    def progress(epoch: int, rec: float, l0: float) -> None:
        if say is not None and (epoch % max(1, epochs // 10) == 0 or epoch == epochs - 1):
            say(f"epoch {epoch}: reconstruction {rec:.4g}, L0.6 {l0:.4g}")

    fit(block, batches, epochs, lr, coef, warmup, progress, start_at_mean(block, outputs))
    report = gate_report(block, inputs, outputs)
    report.update({"mode": mode, "teacher_heads": heads, "gated_heads": block.num_heads,
                   "samples": len(inputs), "tokens": inputs.shape[1], "epochs": epochs,
                   "coef": coef, "lr": lr, "expansion": expansion})
    return block, report


def uvit_block(model: nn.Module, name: str) -> nn.Module:
    """The attention module of a U-ViT block by name: in_blocks.i, mid_block, out_blocks.i."""
    from uvic.analysis.core import block_names

    names = block_names(model)
    if name not in names:
        raise ValueError(f"--block {name!r}: the model's blocks are {', '.join(names)}")
    return model.blocks()[names.index(name)].attn
