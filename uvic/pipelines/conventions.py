"""diffusers' pipeline conventions that `UViTPipeline` needs code of its own for.

Loading: a saved pipeline holds `pipeline_uvit.py`, a two-line module that imports the
installed uvic's `UViTPipeline`, and names it in `model_index.json`'s `_class_name`, so
`DiffusionPipeline.from_pretrained(folder or repo, trust_remote_code=True)` loads it
(`write_entry`). `callback_on_step_end`: `StepCallback` wraps the scheduler that uvic's
sampling loop steps, so that each `step` calls the callback.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from diffusers.schedulers.scheduling_utils import SchedulerMixin

from uvic.config.diffusion import FLOW_NAMED, RELEASE_FAST, check_sampler_objective
from uvic.diffusion.samplers import scheduler_for

ENTRY_MODULE = "pipeline_uvit"  # the module file a saved pipeline holds (without .py)
ENTRY_SOURCE = '''"""diffusers' custom-pipeline entry of a saved uvic UViTPipeline:
model_index.json's _class_name ["pipeline_uvit", "UViTPipeline"] makes
DiffusionPipeline.from_pretrained import this file. The pipeline is the installed uvic's
(uvic.pipelines.pipeline_uvit)."""

from uvic.pipelines.pipeline_uvit import UViTPipeline

__all__ = ["UViTPipeline"]
'''
CALLBACK_TENSOR_INPUTS = ["latents"]


def write_entry(folder: str | Path, class_name: str) -> None:
    """Make a saved pipeline folder loadable by `DiffusionPipeline.from_pretrained`: the
    entry module beside `model_index.json`, and `_class_name` the pair naming it."""
    folder = Path(folder)
    (folder / f"{ENTRY_MODULE}.py").write_text(ENTRY_SOURCE)
    index = folder / "model_index.json"
    config = json.loads(index.read_text())
    config["_class_name"] = [ENTRY_MODULE, class_name]
    index.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def class_named(config: dict[str, Any], class_name: str) -> dict[str, Any]:
    """`config` with a [module, class] `_class_name` replaced by `class_name`: loaded by
    `UViTPipeline.from_pretrained`, the class is known and no module of the folder runs
    (no `trust_remote_code` needed)."""
    if isinstance(config.get("_class_name"), list):
        config["_class_name"] = class_name
    return config


HUB_ARGUMENTS = ("revision", "cache_dir", "force_download", "local_files_only", "token")


def hub_folder(repo_id: str, kwargs: dict[str, Any]) -> str:
    """The local snapshot of a Hub repository (`huggingface_hub.snapshot_download`, with the
    download arguments `from_pretrained` was given), for `UViTPipeline.from_pretrained` to
    load as a folder: diffusers' own download would treat the folder's [module, class]
    `_class_name` as a custom pipeline to import."""
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, **{k: kwargs[k] for k in HUB_ARGUMENTS if k in kwargs})


def push_folder(pipe: Any, folder: str | Path, repo_id: str | None = None,
                private: bool | None = None, token: str | None = None,
                commit_message: str | None = None, create_pr: bool = False,
                **_: Any) -> None:
    """Upload a saved pipeline folder (`save_pretrained(..., push_to_hub=True)`), as
    diffusers does, the entry module included."""
    from huggingface_hub import create_repo

    repo = create_repo(repo_id or Path(folder).name, exist_ok=True, private=private,
                       token=token).repo_id
    pipe._upload_folder(folder, repo, token=token, commit_message=commit_message,
                        create_pr=create_pr)


def with_callback(pipe: Any, scheduler: str | SchedulerMixin, order: int, steps: int,
                  callback: Callable | None, tensor_inputs: list[str] | None
                  ) -> str | SchedulerMixin:
    """What the pipeline samples with: `scheduler` (a sampler's name or a scheduler) as
    it is without a callback, else the diffusers scheduler (built from a name as uvic
    builds it) whose steps call `callback` (`StepCallback`)."""
    if callback is None:
        return scheduler
    if isinstance(scheduler, str):  # flow samplers for velocity models only, and vice versa
        check_sampler_objective(pipe.diffusion.cfg, scheduler)
    if isinstance(scheduler, str) and scheduler not in (*RELEASE_FAST, *FLOW_NAMED):
        scheduler = scheduler_for(pipe.diffusion, scheduler, order, steps)
    return StepCallback(scheduler, pipe, callback,
                        check_callback(callback, tensor_inputs, scheduler))


def check_callback(callback: Callable, tensor_inputs: list[str] | None,
                   scheduler: str | SchedulerMixin) -> list[str]:
    """The tensor names to hand `callback` (a PipelineCallback's own, else
    `tensor_inputs`, else ["latents"]); refuses names the pipeline has not, and samplers
    without a scheduler step (uvic's release protocols and Euler-Maruyama step by
    themselves)."""
    tensor_inputs = list(getattr(callback, "tensor_inputs", None) or tensor_inputs
                         or ["latents"])
    unknown = [k for k in tensor_inputs if k not in CALLBACK_TENSOR_INPUTS]
    if unknown:
        raise ValueError(f"callback_on_step_end_tensor_inputs: {unknown} are not among "
                         f"the pipeline's {CALLBACK_TENSOR_INPUTS}")
    if isinstance(scheduler, str) or hasattr(scheduler, "step_pred"):
        name = scheduler if isinstance(scheduler, str) else type(scheduler).__name__
        raise ValueError(f"callback_on_step_end needs a diffusers scheduler's step; the "
                         f"sampler {name!r} steps by itself")
    return tensor_inputs


class StepCallback:
    """`scheduler`, whose `step` then calls `callback(pipe, i, t, {"latents": ...})` and
    continues from the latents it returns (any other attribute is the scheduler's)."""

    def __init__(self, scheduler: SchedulerMixin, pipe: Any, callback: Callable,
                 tensor_inputs: list[str]) -> None:
        self._scheduler, self._pipe, self._callback = scheduler, pipe, callback
        self._inputs, self._index = tensor_inputs, 0
        # same signature as the scheduler's (the loop looks for its `generator`)
        @functools.wraps(scheduler.step)
        def step(*args: Any, **kwargs: Any) -> Any:
            return self._step(*args, **kwargs)

        self.step = step

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)

    def _step(self, model_output: Any, timestep: Any, sample: Any, *args: Any,
              **kwargs: Any) -> Any:
        out = self._scheduler.step(model_output, timestep, sample, *args, **kwargs)
        given = {"latents": out.prev_sample}
        returned = self._callback(self._pipe, self._index, timestep,
                                  {k: given[k] for k in self._inputs}) or {}
        self._index += 1
        if "latents" in returned:
            out.prev_sample = returned["latents"]
        return out
