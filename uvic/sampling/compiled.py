"""The network call of sampling compiled (`sample.compile`), and the static batch it needs.

`compile_network` compiles with static shapes and no graph breaks (a break is an error,
not a silent slowdown); `reduce-overhead` replays CUDA graphs on a GPU. Each new batch size
would compile again, so `static_batch` pads a run's last, smaller batch with copies of its
last sample, dropped after the solver: every row's arithmetic is its own, so the real rows
are the images of any other batching, to float tolerance.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from uvic.config import require
from uvic.config.sampling import compile_rule


class CudaGraphSafe(nn.Module):
    """A compiled network whose outputs are copied out of the CUDA-graph pool: a replay
    overwrites the previous call's output, which the solvers keep (multistep history,
    the release's singlestep updates, autoguidance's two predictions)."""

    def __init__(self, compiled: nn.Module) -> None:
        super().__init__()
        self.compiled = compiled

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor | bool | None
                ) -> tuple[torch.Tensor, ...]:
        """The compiled model's `(sample,)` (called with `return_dict=False`), copied."""
        torch.compiler.cudagraph_mark_step_begin()
        return tuple(out.clone() for out in self.compiled(*args, **kwargs))


def compile_network(model: nn.Module, mode: str = "off") -> nn.Module:
    """`model` itself for mode `off`, else `model` compiled with static shapes and no
    graph breaks (the weights stay `model`'s: in-place updates such as EMA show)."""
    require([compile_rule(mode)])
    if mode == "off":
        return model
    compiled = torch.compile(model, mode=mode, dynamic=False, fullgraph=True)
    return CudaGraphSafe(compiled) if mode == "reduce-overhead" else compiled


def static_batch(chunk: Sequence[int], size: int) -> list[int]:
    """`chunk`'s sample indices padded to `size` with copies of the last one (the padded
    rows are dropped after sampling: `chunk`'s images are the first len(chunk) rows)."""
    if not chunk or len(chunk) > size:
        raise ValueError(f"a batch of {len(chunk)} samples cannot be padded to {size}")
    return [*chunk, *[chunk[-1]] * (size - len(chunk))]
