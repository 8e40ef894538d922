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


def test_a_warm_up_as_long_as_the_run_is_warned_at_start(tmp_path: Path, capsys) -> None:
    """A warm-up that outlasts the run (the LR never reaches optim.lr, the cosine decay
    never starts) is one warning line at start: not refused, a short check run of a longer
    config means it."""
    cfg = load_config(REPO / "configs" / "quickstart.py",
                      [*TINY, "optim.warmup_steps=8", "optim.lr_schedule=cosine",
                       f"train.output_dir={tmp_path}"])
    train(cfg)
    warnings = [line for line in capsys.readouterr().out.splitlines()
                if line.startswith("warning: optim.warmup_steps")]
    assert warnings == [
        "warning: optim.warmup_steps=8 is not shorter than the run (train.max_steps=6): the LR "
        "warms up for the whole run, reaching 0.00075 at its last step (optim.lr=0.001 at "
        "step 8), and the cosine decay never starts (fine for a short check run; for a real "
        "one set optim.warmup_steps below train.max_steps)"]


def test_warmup_warning_only_when_the_warm_up_outlasts_the_run() -> None:
    from uvic.config import OptimConfig
    from uvic.config.training import warmup_warning

    assert warmup_warning(OptimConfig(warmup_steps=39), 40) is None
    assert warmup_warning(OptimConfig(warmup_steps=0), 0) is None
    assert warmup_warning(OptimConfig(warmup_steps=50), 0) is None  # nothing to train
    line = warmup_warning(OptimConfig(lr=2e-3, warmup_steps=50, lr_schedule="cosine"), 40)
    assert line is not None and "reaching 0.0016 at its last step" in line
    assert "cosine decay never starts" in line
    assert "cosine" not in warmup_warning(OptimConfig(warmup_steps=40), 40)


def test_a_resume_describes_a_warm_up_cut_off_by_the_run() -> None:
    """The resume note says what runs: not "warm-up to 0.002 at step 50, then cosine decay
    to 0 at step 40"."""
    from uvic.config import OptimConfig
    from uvic.training.optim import describe_lr

    optim = OptimConfig(lr=2e-3, warmup_steps=50, lr_schedule="cosine")
    assert describe_lr(optim, 40, 20) == ("0.0008 at step 20, warm-up toward 0.002 (at step "
                                          "50) until the run ends: 0.0016 at step 40, no "
                                          "cosine decay")
    assert describe_lr(optim, 100, 20) == ("0.0008 at step 20, warm-up to 0.002 at step 50, "
                                           "then cosine decay to 0 at step 100")
