"""What a training session leaves beside its checkpoints: summary.json (steps, loss,
throughput, launch) and the loss of the current step read back from log.jsonl on resume."""

from __future__ import annotations

import contextlib
import json
from typing import Any

from uvic.files import write_json
from uvic.run.folder import RunFolder


def write_summary(run: RunFolder, step: int, start_step: int, train_time: float,
                  final_loss: float | None, facts: dict[str, Any]) -> None:
    """summary.json of the run at `step` (this launch started or resumed at `start_step`;
    `train_time`: seconds in training steps over all launches; `facts`: the other fields,
    global_batch among them). A launch that trained nothing keeps the summary a previous
    one wrote at this step."""
    previous = run.summary
    if step == start_step and previous.is_file():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            if json.loads(previous.read_text())["steps"] == step:
                return
    step_time = train_time / step if step else float("nan")
    write_json(run.summary, {
        "steps": step,
        "steps_this_session": step - start_step,
        "final_loss": final_loss,
        "mean_step_time_s": step_time,
        "images_per_s": facts["global_batch"] / step_time if step else float("nan"),
        **facts,
    })


def logged_loss(run: RunFolder, step: int) -> float | None:
    """The loss log.jsonl holds for `step` (a resume at a logged step), else None."""
    if not run.log.is_file():
        return None
    lines = run.log.read_text().splitlines()
    with contextlib.suppress(ValueError, KeyError, TypeError, IndexError):
        record = json.loads(lines[-1])
        if record["step"] == step:
            return record["loss"]
    return None
