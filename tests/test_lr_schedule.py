"""optim.lr_schedule: the release's constant LR after warm-up, or a cosine decay to 0."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from accelerate.state import AcceleratorState, GradientState

from uvic.config import ConfigError, load_config
from uvic.training.trainer import train

REPO = Path(__file__).resolve().parents[1]
TINY = ["model.embed_dim=32", "model.depth=2", "model.num_heads=2",
        "model.attention_backend=torch", "data.num_images=16", "data.num_workers=0",
        "train.batch_size=4", "train.sample_every=0", "train.ckpt_every=100",
        "optim.lr=1e-3", "optim.warmup_steps=2", "train.max_steps=6", "train.log_every=1",
        "sample.autoguidance_scale=0"]


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each train() builds its own Accelerator; reset Accelerate's process-wide singletons."""
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def logged_lrs(tmp_path: Path, schedule: str) -> list[float]:
    cfg = load_config(REPO / "configs" / "quickstart.py",
                      [*TINY, f"optim.lr_schedule={schedule}", f"train.output_dir={tmp_path}"])
    run = train(cfg)
    return [json.loads(line)["lr"] for line in (run / "log.jsonl").read_text().splitlines()]


def test_cosine_warms_up_then_decays_to_zero_at_the_last_step(tmp_path: Path) -> None:
    def factor(s: int) -> float:  # after s optimizer steps; warm-up 2, 6 steps in all
        return s / 2 if s < 2 else 0.5 * (1 + math.cos(math.pi * (s - 2) / 4))

    assert logged_lrs(tmp_path, "cosine") == pytest.approx([1e-3 * factor(s)
                                                             for s in range(1, 7)])


def test_constant_is_the_release_schedule(tmp_path: Path) -> None:
    assert logged_lrs(tmp_path, "constant") == pytest.approx([5e-4] + [1e-3] * 5)


def test_unknown_schedule_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"optim\.lr_schedule"):
        logged_lrs(tmp_path, "linear")
