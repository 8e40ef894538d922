"""A short try of any shipped config: one `--set train.max_steps=N` passes every check made
before training. The quickstart's autoguidance guide (its own EMA at step 1000) is one a
short run never writes: such a run samples unguided, said in one note, and the quickstart
at its own length keeps its guide. A refusal under `accelerate launch` is the last line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState

from uvic.cli import compare, errors
from uvic.cli import train as train_cli
from uvic.config import load_config
from uvic.config.sampling import own_guide_step
from uvic.config.validation import start_config, startup_config
from uvic.evaluation.protocols import protocol_of
from uvic.models.uvit import build_model
from uvic.sampling.generate import sample_checkpoint
from uvic.training.optim import make_optimizer

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted((REPO / "configs").glob("*.py"))
QUICKSTART = REPO / "configs" / "quickstart.py"
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
GUIDE = "checkpoints/step_001000/ema.safetensors"


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each run builds its own Accelerator; reset Accelerate's process-wide singletons."""
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_the_shipped_configs_are_all_here() -> None:
    assert len(SHIPPED) >= 25 and QUICKSTART in SHIPPED


@pytest.mark.parametrize("steps", [1, 2, 30])
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_config_accepts_a_short_try(path: Path, steps: int) -> None:
    """Validation, the trainer's start-up checks (guide included), the model (on the meta
    device: no memory) and its optimizer and LR schedule over the whole short run."""
    cfg, note = start_config(startup_config(str(path), [f"train.max_steps={steps}"]))
    assert cfg.train.max_steps == steps
    guide = own_guide_step(cfg)
    assert guide is None or guide < steps
    assert (note is not None) == (path == QUICKSTART)  # the only config with autoguidance
    with torch.device("meta"):
        model = build_model(cfg.model)
    _, schedule = make_optimizer(model, cfg.optim, steps)
    factors = [schedule.lr_lambdas[0](step) for step in range(steps + 1)]
    assert all(0.0 <= f <= 1.0 for f in factors)


def test_a_short_quickstart_drops_its_guide_with_a_note_that_says_how_to_keep_it() -> None:
    cfg, note = start_config(load_config(QUICKSTART, ["train.max_steps=30"]))
    assert cfg.sample.autoguidance_scale == 0 and protocol_of(cfg).guide == ""
    assert note == (
        "train.max_steps=30 ends before step 1000, whose EMA is the autoguidance guide "
        "(sample.autoguidance_ckpt): sampling unguided (sample.autoguidance_scale=0); to keep "
        "autoguidance, guide with an earlier step, e.g. --set 'train.keep_steps=[10]' --set "
        "sample.autoguidance_ckpt=checkpoints/step_000010/ema.safetensors")
    # the way it names keeps the guide: a short run guided by its own step 10
    kept, none = start_config(load_config(QUICKSTART, [
        "train.max_steps=30", "train.keep_steps=[10]",
        "sample.autoguidance_ckpt=checkpoints/step_000010/ema.safetensors"]))
    assert none is None and kept.sample.autoguidance_scale == 1.0 and own_guide_step(kept) == 10
    # a run ending at the guide's step would be guided by itself: dropped too
    at, said = start_config(load_config(QUICKSTART, ["train.max_steps=1000"]))
    assert at.sample.autoguidance_scale == 0 and "ends at step 1000" in said
    # a guidance interval with nothing left to guide goes with it, and the note says so
    free, why = start_config(load_config(QUICKSTART, ["train.max_steps=1",
                                                      "sample.guidance_interval=0.3,2"]))
    assert free.sample.guidance_interval == () and "no guidance interval" in why
    assert why.endswith("train at least 2 steps and guide with an earlier one")


def test_the_quickstart_at_its_own_length_keeps_its_guide() -> None:
    """The quickstart's results (tests and docs numbers) depend on the step-1000 guide."""
    cfg = load_config(QUICKSTART)
    kept, note = start_config(cfg)
    assert note is None and kept == cfg and cfg.train.max_steps == 2700
    assert own_guide_step(kept) == 1000 and kept.sample.autoguidance_scale == 1.0
    assert protocol_of(kept).guide == GUIDE


@pytest.mark.parametrize("name", ["quickstart", "table3_smoke"])
def test_a_short_try_of_a_cpu_config_trains_and_samples(tmp_path: Path, capsys,
                                                        name: str) -> None:
    """The shipped configs that need no data or GPU, tried for real: `uvic-train --config
    configs/<name>.py --set train.max_steps=2` trains, says what it dropped (the
    quickstart's guide), and the run's config.json samples it (unguided: no guide)."""
    out = tmp_path / "try"
    assert train_cli.main(["--config", str(REPO / "configs" / f"{name}.py"),
                           "--set", "train.max_steps=2", "--set", "train.log_with=",
                           # PyTorch attention: the tests interpret Triton kernels on a CPU
                           "--set", "model.attention_backend=torch",
                           "--output-dir", str(out)]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")
             and "autoguidance" in line]
    assert len(notes) == (name == "quickstart")
    assert all(n.startswith("note: train.max_steps=2 ends before step 1000") for n in notes)
    saved = json.loads((out / "config.json").read_text())
    assert saved["sample"]["autoguidance_scale"] == 0 and saved["train"]["max_steps"] == 2
    cfg = load_config(out / "config.json", ["sample.steps=2"])
    images = torch.cat([b for _, b in sample_checkpoint(cfg, out / "ema.safetensors",
                                                        range(2), seed=0)])
    size = cfg.model.img_size
    assert images.shape == (2, 3, size, size) and torch.isfinite(images).all()


def test_a_short_comparison_of_the_quickstart_is_planned(tmp_path: Path, capsys) -> None:
    """uvic-compare's default config at 30 steps: planned, every run unguided, said once."""
    assert compare.main(["--dry-run", "--set", "train.max_steps=30", "--seeds", "2",
                         "--variants", "uvit,uvic", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("note: train.max_steps=30 ends before step 1000") == 1


@pytest.mark.slow
def test_a_refusal_under_accelerate_launch_is_the_last_line(tmp_path: Path) -> None:
    """accelerate launch ends a failed process with a traceback of its own: the one-line
    error is printed after it, once."""
    cmd = [ACCELERATE, "launch", "--num_processes", "1", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "scripts/train.py",
           "--config", str(QUICKSTART), "--set", "train.max_steps=30",
           "--set", "sample.autoguidance_ckpt=nowhere.safetensors",
           "--output-dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: sample.autoguidance_ckpt='nowhere.safetensors' is "
                                "neither a checkpoint this run keeps"), proc.stderr[-2000:]
    assert "CalledProcessError" in proc.stderr  # the launcher's report, before it
    assert sum(line.startswith("error: ") for line in lines) == 1
    assert not (tmp_path / "run").exists()


def test_no_launcher_no_repeat() -> None:
    """Run directly (here: by pytest), nothing is repeated."""
    assert errors.reporting_launcher() is None


@pytest.mark.slow
@pytest.mark.parametrize("script", ["scripts/sample.py", "eval/fid.py"])
def test_sample_and_fid_refusals_under_accelerate_launch_are_the_last_line(
        tmp_path: Path, script: str) -> None:
    """The same one error path in every program: after the launcher's report, once."""
    missing = tmp_path / "nowhere.safetensors"
    cmd = [ACCELERATE, "launch", "--num_processes", "1", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", script,
           "--config", str(QUICKSTART), "--ckpt", str(missing), "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1] == f"error: --ckpt {missing}: no such file", proc.stderr[-2000:]
    assert sum(line.startswith("error: ") for line in lines) == 1
