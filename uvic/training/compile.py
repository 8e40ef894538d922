"""torch.compile of the training model through Accelerate (`train.compile`).

The mode (`uvic.config.training.TRAIN_COMPILE_MODES`; a bool from an older config: true =
"default", false = "off") becomes Accelerate's `TorchDynamoPlugin`: backend inductor,
torch.compile's mode, `fullgraph=True` (U-ViT's forward has no graph break: a break would
stop the run at its first step). Accelerate compiles the model last in `prepare`, around
DistributedDataParallel where there is one, so that Dynamo's DDP optimizer can split the
graph at the gradient buckets.

What stays as without compile:

* checkpoint keys: Accelerate's `save_state`/`load_state` use the module given to
  `prepare`, not its compiled wrapper (whose weights are named `_orig_mod.<name>`), so
  the checkpoints keep the plain names and a compiled run resumes uncompiled and vice
  versa (tests/test_compile.py);
* the EMA, which averages the plain module's parameters (`uvic.run.weights.unwrap_model`),
  and the sample grids, which run the EMA copy (never compiled);
* the seeded noise and condition dropping, drawn outside the model
  (`uvic.diffusion.schedule.diffusion_loss`).

"reduce-overhead" and "max-autotune" add CUDA graphs on a CUDA device; elsewhere torch
compiles without them (said once, at start).
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
