"""How a run ends: at train.max_steps with several processes, and on SIGINT or
SIGTERM, where every process stops after the same step, saves a checkpoint and the run
resumes bit-exactly. Real processes through the README's launch command, on the CPU."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import readme_commands
from safetensors.torch import load_file
from test_train import README_CPU_COMMAND, free_port, same_tensors, shapes_overrides

from uvic.run.folder import RunFolder

REPO = Path(__file__).resolve().parents[1]
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))


def launch_two(out: Path, *extra: str, resume: bool = False) -> subprocess.Popen:
    """The README's two-process CPU command on the tiny Shapes run `out`, in its own session
    (a process group, as a terminal's job is); output in out.parent / f"{out.name}.txt"."""
    assert README_CPU_COMMAND in readme_commands.readme_commands()
    env_vars, words = readme_commands.split_env(shlex.split(README_CPU_COMMAND))
    cmd = [ACCELERATE, "launch", "--main_process_port", str(free_port()), *words[2:],
           *[f"--set={o}" for o in shapes_overrides(out, *extra)], "--output-dir", str(out),
           *(["--resume", "latest"] if resume else [])]
    env = {**os.environ, **env_vars, "OMP_NUM_THREADS": "1"}
    log = open(out.parent / f"{out.name}.txt", "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                            start_new_session=True)


def finish(proc: subprocess.Popen, out: Path, timeout: float = 300) -> str:
    proc.wait(timeout=timeout)
    return (out.parent / f"{out.name}.txt").read_text()


def logged_steps(out: Path) -> int:
    path = out / "log.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def interrupt(out: Path, how: str) -> tuple[int, str]:
    """Start an endless two-process run, signal it after a few logged steps (Ctrl-C: SIGINT
    to the whole process group; a scheduler: SIGTERM to the launcher, which forwards it);
    returns the step of its last checkpoint and what it printed."""
    proc = launch_two(out, "train.max_steps=100000", "train.ckpt_every=1000",
                      "data.num_workers=2")
    deadline = time.monotonic() + 240
    while logged_steps(out) < 3:
        assert proc.poll() is None, finish(proc, out)[-3000:]
        assert time.monotonic() < deadline, "no logged steps within 240 s"
        time.sleep(0.02)
    if how == "SIGINT":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    said = finish(proc, out)
    checkpoints = RunFolder(out).checkpoints()
    assert len(checkpoints) == 1, said[-3000:]
    return int(checkpoints[0].name.split("_")[1]), said


def stop_two(out, how: str) -> int:
    """Stop a two-process run with `how`; both processes saved the same step's checkpoint
    (no periodic one yet) and the run says so. Returns that step."""
    step, said = interrupt(out, how)
    assert step >= 6  # past the 3rd log, at log_every=2; no periodic checkpoint yet
    line = f"stopped by {how} at step {step}; saved {out / 'checkpoints'}"
    assert line in said, said[-3000:]
    state = json.loads((out / "checkpoints" / f"step_{step:06d}" /
                        "trainer_state.json").read_text())
    assert state["step"] == step and state["num_processes"] == 2
    assert not (out / "summary.json").exists()  # the run has not ended
    return step


@pytest.mark.slow
def test_sigterm_stops_two_processes_at_one_saved_step(tmp_path):
    """SIGTERM (a scheduler) stops a two-process run: both processes save the checkpoint
    of the same step, so nothing of the steps since the last periodic checkpoint is lost."""
    stop_two(tmp_path / "SIGTERM", "SIGTERM")


@pytest.mark.slow
def test_two_processes_stopped_by_ctrl_c_resume_bit_exactly(tmp_path):
    """SIGINT (Ctrl-C) stops a two-process run as SIGTERM does; resumed, it reaches the
    weights of an uninterrupted run, which itself ends cleanly although its
    train.max_steps is not a multiple of train.sample_every (the final grid was sampled by
    one process while the other waited at a barrier it never reached: the launch failed)."""
    out = tmp_path / "SIGINT"
    target = stop_two(out, "SIGINT") + 3
    proc = launch_two(out, f"train.max_steps={target}", "train.ckpt_every=1000",
                      "data.num_workers=2", resume=True)
    said = finish(proc, out)
    assert proc.returncode == 0, said[-3000:]

    reference = tmp_path / "reference"
    proc = launch_two(reference, f"train.max_steps={target}", "train.ckpt_every=1000",
                      f"train.keep_steps=({target},)", f"train.sample_every={target - 1}")
    said = finish(proc, reference)
    assert proc.returncode == 0, said[-3000:]
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["steps"] == target and summary["num_processes"] == 2
    grids = sorted(p.name for p in (reference / "samples").iterdir())
    assert grids == [f"step_{target - 1:06d}.png", f"step_{target:06d}.png"]

    name = f"step_{target:06d}"
    for file in ("model.safetensors", "ema.safetensors"):
        mine, theirs = (out / "checkpoints" / name / file,
                        reference / "checkpoints" / name / file)
        assert same_tensors(load_file(mine), load_file(theirs)), file
    log = (out / "log.jsonl").read_text().splitlines()
    assert json.loads(log[-1])["step"] == target


@pytest.mark.slow
def test_sigterm_stops_a_single_process_run_with_a_checkpoint(tmp_path):
    """Without a launcher: SIGTERM ends `scripts/train.py` with a checkpoint of the current
    step and exit status 143 (128 + SIGTERM), as a process killed by it would report."""
    out = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "scripts" / "train.py"), "--config",
           str(REPO / "configs" / "quickstart.py"),
           *[f"--set={o}" for o in shapes_overrides(out, "train.max_steps=100000",
                                                      "train.ckpt_every=1000")]]
    with open(tmp_path / "out.txt", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 240
    while logged_steps(out) < 2:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    said = (tmp_path / "out.txt").read_text()
    [checkpoint] = RunFolder(out).checkpoints()
    step = int(checkpoint.name.split("_")[1])
    assert step >= 4 and f"stopped by SIGTERM at step {step}; saved {checkpoint}" in said
    assert "Traceback" not in said
