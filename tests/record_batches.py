"""What a training run trains on, recorded by the tests from outside the library.

`recording_loss(folder)` wraps the training loop's loss (`uvic.training.trainer.
diffusion_loss`): every call appends one line to `folder/data_rank{r}.jsonl` (r: the
process's rank) with the micro-batch's per-sample sums and the seed of its noise
generator, which the loop sets to `uvic.seeds.noise_seed(seed, r, step, micro)`, so a test
can tell which step and micro-batch each batch was. In a test process:
`monkeypatch.setattr(uvic.training.trainer, "diffusion_loss", recording_loss(folder))`.

Run as a program, it records into $RECORD_BATCHES_DIR and runs scripts/train.py with its
own arguments, so `accelerate launch ... tests/record_batches.py ARGS` is the README's
`accelerate launch ... scripts/train.py ARGS` with a record of each process's batches.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import uvic.training.trainer as trainer

FOLDER_ENV = "RECORD_BATCHES_DIR"
TRAIN_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train.py"


def recording_loss(folder: str | Path) -> Callable[..., torch.Tensor]:
    """`uvic.training.trainer.diffusion_loss`, recording each batch it is given."""
    real_loss = trainer.diffusion_loss

    def loss(model, diffusion, batch, generator, **kwargs) -> torch.Tensor:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        record = {"seed": generator.initial_seed(),
                  "sums": batch["x"].double().flatten(1).sum(1).tolist()}
        with open(Path(folder) / f"data_rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        return real_loss(model, diffusion, batch, generator, **kwargs)

    return loss


def read_records(folder: str | Path, rank: int) -> list[dict]:
    """The records of process `rank`, in the order it trained on them."""
    path = Path(folder) / f"data_rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


if __name__ == "__main__":
    trainer.diffusion_loss = recording_loss(os.environ[FOLDER_ENV])
    sys.argv[0] = str(TRAIN_SCRIPT)
    runpy.run_path(str(TRAIN_SCRIPT), run_name="__main__")
