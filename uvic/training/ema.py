"""Exponential moving average (EMA) of a model's weights, used for sampling and evaluation.

As in the U-ViT release, the average starts as an exact copy of the initialised network
and moves after every optimizer step, ema <- decay * ema + (1 - decay) * weights; here it
is a float32 copy of the module updated with a drift-free lerp (docs/fidelity.md), and
`state_dict()` is what checkpoints save and `uvic.run.weights.save_safetensors` exports.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from uvic.run.weights import unwrap_model


class EMA:
    """A float32 moving-average copy of `model` (`.model`), updated with `update(model)`."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"train.ema_decay must be in [0, 1], got {decay}")
        self.decay = decay
        self.model = copy.deepcopy(unwrap_model(model)).float().eval().requires_grad_(False)

    def to(self, device: torch.device | str) -> EMA:
        """Move the averaged copy to `device` (in place); returns self."""
        self.model.to(device)
        return self

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """One step of the average towards the current weights of `model` (same class).

        Parameters are averaged (one fused `_foreach_lerp_`, no host sync); buffers, if
        any, are copied as they are.
        """
        source = unwrap_model(model)
        ema_params = list(self.model.parameters())
        params = [p.detach() for p in source.parameters()]
        if len(params) != len(ema_params):
            raise ValueError(f"EMA.update: model has {len(params)} parameters, the average "
                             f"{len(ema_params)}")
        params = [p if p.dtype == torch.float32 else p.float() for p in params]
        torch._foreach_lerp_(ema_params, params, 1.0 - self.decay)
        for ema_buf, buf in zip(self.model.buffers(), source.buffers()):
            ema_buf.copy_(buf)

    def state_dict(self) -> dict[str, Tensor]:
        """The averaged weights (keys as the plain model's state dict)."""
        return self.model.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Restore averaged weights saved by `state_dict()` (strict)."""
        self.model.load_state_dict(state_dict)
