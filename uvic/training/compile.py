"""torch.compile of the training model through Accelerate (`train.compile`, docs/training.md).

The mode becomes Accelerate's `TorchDynamoPlugin`: inductor, `fullgraph=True` (U-ViT's
forward has no graph break). Accelerate compiles the model last in `prepare`, around DDP,
and saves the plain module, so checkpoints keep plain weight names and a run resumes
compiled or not; the EMA, the sample grids and the seeded noise are as without compile.
"""

from __future__ import annotations

from typing import Any

from accelerate import Accelerator
from accelerate.utils import TorchDynamoPlugin

from uvic.config.training import compile_mode

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile adds CUDA graphs


def dynamo_kwargs(value: bool | str) -> dict[str, Any]:
    """Accelerator's keyword for `train.compile=value`: `dynamo_backend="no"` (off: also
    over a launcher's `--dynamo_backend`), or the TorchDynamoPlugin of the mode."""
    mode = compile_mode(value)
    if mode == "off":
        return {"dynamo_backend": "no"}
    return {"dynamo_plugin": TorchDynamoPlugin(backend="inductor", mode=mode, fullgraph=True)}


def compile_settings(acc: Accelerator) -> str:
    """What Accelerate will do to the model: "off" or torch.compile's mode."""
    plugin = acc.state.dynamo_plugin
    return "off" if plugin.backend.value.lower() == "no" else plugin.mode


def compile_note(value: bool | str, device_type: str) -> str | None:
    """The one line said at start when the mode's CUDA graphs cannot run on the device."""
    mode = compile_mode(value)
    if mode in CUDA_GRAPH_MODES and device_type != "cuda":
        return (f"note: train.compile={mode}: CUDA graphs need a CUDA device; on "
                f"{device_type} torch compiles the model without them")
    return None
