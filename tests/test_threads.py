"""CPU threads per process (`--threads`, config key `train.threads`, `uvic.cli.threads`):
the auto rule on given inputs, the setting reaching torch in real tiny command runs, bad
values refused in one line before torch loads, and the hint when steps slow down
(`uvic.experiments.progress`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from uvic.cli.threads import auto_threads, choose_threads, free_cores, local_processes
from uvic.config import ConfigError, from_dict
from uvic.config.validation import validate
from uvic.experiments.progress import LogWatcher, StepClock

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- the auto rule


@pytest.mark.parametrize("usable, processes, load, machine, threads", [
    (2, 1, 0.0, 2, 2),  # an idle 2-core machine: both cores
    (2, 1, 0.4, 2, 2),  # a little load rounds away
    (2, 1, 0.6, 2, 1),  # one core busy
    (2, 1, 1.7, 2, 1),
    (2, 1, 5.0, 2, 1),  # a machine busier than its cores: still one thread
    (2, 2, 0.0, 2, 1),  # two processes of one launch share the two cores
    (16, 3, 0.0, 16, 5),
    (8, 2, 4.0, 8, 2),  # 4 of 8 cores free, two processes
    (4, 1, 32.0, 64, 2),  # 4 cores of a 64-core host at load 32: half of them busy
    (4, 1, 1.0, 64, 4),  # load elsewhere on the host
    (1, 2, 0.0, 1, 1),  # more processes than cores: one thread each
])
def test_auto_threads_from_cores_load_and_processes(usable: int, processes: int, load: float,
                                                    machine: int, threads: int) -> None:
    assert auto_threads(usable, processes, load, machine) == threads
    if processes <= usable:  # never oversubscribed by the command itself
        assert processes * threads <= free_cores(usable, load, machine) <= usable


def test_choose_threads_numbers_environment_and_launchers() -> None:
    """A number is taken as it is; auto takes OMP_NUM_THREADS when set, else the rule on
    this machine's inputs, with the launcher's processes on this machine."""
    assert choose_threads(3, env={}).line() == "threads: 3 per process (train.threads=3)"
    assert choose_threads("4", env={"OMP_NUM_THREADS": "1"}).threads == 4  # a number wins
    assert choose_threads("auto", env={"OMP_NUM_THREADS": "3"}, usable=2, load=0.0).line() == (
        "threads: 3 per process (auto: OMP_NUM_THREADS=3)")
    launched = choose_threads("auto", env={"LOCAL_WORLD_SIZE": "2"}, usable=8, load=0.0,
                              machine=8)
    assert launched.line() == ("threads: 4 per process (auto: 8 of 8 cores free at start, "
                               "2 processes)")
    busy = choose_threads("auto", env={"OMP_NUM_THREADS": ""}, usable=2, load=1.2, machine=2)
    assert busy.line() == "threads: 1 per process (auto: 1 of 2 cores free at start, 1 process)"
    assert choose_threads("auto", env={}, usable=2, load=0.0, machine=2).threads == 2
    assert local_processes({"LOCAL_WORLD_SIZE": "x", "MPI_LOCALNRANKS": "3"}) == 3
    assert local_processes({}) == 1
    with pytest.raises(ConfigError, match=r"^train.threads=0 must be 'auto' or a whole number"):
        choose_threads(0)


@pytest.mark.parametrize("value", [0, -2, True, "many", "2.5", ""])
def test_config_values_refused(value: object) -> None:
    """A config's (or a saved config.json's) train.threads is checked with the other rules."""
    with pytest.raises(ConfigError, match=r"^train.threads=.* must be 'auto' or a whole number"):
        validate(from_dict({"train": {"threads": value}}))
    for good in ("auto", 1, 8):
        assert validate(from_dict({"train": {"threads": good}})).train.threads == good
    with pytest.raises(ConfigError, match=re.escape("threads must be int | str, got float 1.5")):
        from_dict({"train": {"threads": 1.5}})


# --------------------------------------------------------------------------- bad values, early

# Each command with a bad value and the line it must give, run in one fresh interpreter that
# reports, per case, the exit status, stderr and whether torch was loaded.
BAD = [
    ("uvic.cli.train", ["--config", "quickstart", "--threads", "0"],
     "error: --threads 0: must be 'auto' or a whole number >= 1"),
    ("uvic.cli.train", ["--config", "quickstart", "--set", "train.threads=many"],
     "error: train.threads='many' must be 'auto' or a whole number >= 1"),
    ("uvic.cli.sample", ["--config", "quickstart", "--ckpt", "x", "--out", "o",
                         "--threads", "two"],
     "error: --threads two: must be 'auto' or a whole number >= 1"),
    ("uvic.cli.fid", ["--config", "quickstart", "--ckpt", "x", "--threads", "1.5"],
     "error: --threads 1.5: must be 'auto' or a whole number >= 1"),
    ("uvic.cli.fid", ["--config", "quickstart", "--ckpt", "x", "--set", "train.threads=0"],
     "error: train.threads=0 must be 'auto' or a whole number >= 1"),
    ("uvic.cli.quickstart", ["--threads", "-2"],
     "error: --threads -2: must be 'auto' or a whole number >= 1"),
]
PROBE = """
import contextlib, importlib, io, json, sys
report = []
for module, args in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = importlib.import_module(module).main(args)
        except SystemExit as exit:
            code = exit.code
    report.append({"code": code, "stderr": err.getvalue(), "torch": "torch" in sys.modules})
print(json.dumps(report))
"""


def test_bad_values_are_one_line_before_torch(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE,
                           json.dumps([[m, a] for m, a, _ in BAD])],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for (module, args, line), got in zip(BAD, json.loads(proc.stdout), strict=True):
        assert got == {"code": 2, "stderr": line + "\n", "torch": False}, (module, args, got)


# --------------------------------------------------------------------------- real tiny runs

TINY = ["model.embed_dim=32", "model.depth=2", "model.num_heads=2", "model.img_size=16",
        "model.attention_backend=torch", "data.num_images=8", "data.num_workers=0",
        "train.batch_size=4", "train.max_steps=2", "train.sample_every=0",
        "train.mixed_precision=no", "train.keep_steps=[]", "sample.autoguidance_scale=0",
        "sample.steps=2", "sample.batch_size=2", "optim.warmup_steps=1"]


def recording(monkeypatch: pytest.MonkeyPatch, module: object, name: str,
              seen: list[int], result: object = None) -> None:
    """Replace `module.name` by a wrapper that records torch's thread count when called,
    then calls the original (or returns `result`, when given)."""
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return original(*args, **kwargs) if result is None else result

    monkeypatch.setattr(module, name, wrapper)


def test_flag_and_config_key_reach_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture) -> None:
    """uvic-train trains, uvic-sample samples and uvic-fid evaluates under the thread count
    of `--threads` (over the config's), of `train.threads`, or auto's (OMP_NUM_THREADS when
    set)."""
    import uvic.evaluation.fid
    import uvic.sampling.folder
    import uvic.training.trainer
    from uvic.cli import fid, sample, train

    seen: list[int] = []
    recording(monkeypatch, uvic.training.trainer.Trainer, "fit", seen)
    recording(monkeypatch, uvic.sampling.folder, "sample_to_folder", seen)
    recording(monkeypatch, uvic.evaluation.fid, "evaluate", seen, result={})
    base = ["--config", "quickstart", *[w for o in TINY for w in ("--set", o)]]
    run = tmp_path / "run"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert train.main([*base, "--output-dir", str(run), "--set", "train.threads=1",
                       "--threads", "2"]) == 0
    assert "threads: 2 per process (train.threads=2)" in capsys.readouterr().out
    assert train.main([*base, "--output-dir", str(run), "--set", "train.max_steps=4",
                       "--set", "train.threads=1", "--resume", "latest"]) == 0
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # auto takes it
    ema = str(run / "ema.safetensors")
    assert sample.main([*base, "--ckpt", ema, "--n", "2", "--out", str(tmp_path / "s")]) == 0
    assert "threads: 3 per process (auto: OMP_NUM_THREADS=3)" in capsys.readouterr().out
    assert fid.main([*base, "--ckpt", ema, "--n", "2", "--threads", "2", "--quiet"]) == 0
    assert seen == [2, 1, 3, 2]
    assert [r["step"] for r in map(json.loads, (run / "log.jsonl").read_text().splitlines())
            ][-1] == 4


# --------------------------------------------------------------------------- slow steps


def test_hint_once_when_steps_turn_slow() -> None:
    """The clock shows the recent seconds per step, and says once, naming the threads and
    the setting, when recent steps run over 3x slower than the first ones."""
    clock = StepClock(2, change="--threads N, config key train.threads")
    assert clock.text() == ""
    assert clock.add(20, 2.0) is None  # the first 20 steps: 0.1 s each
    assert clock.first == pytest.approx(0.1) and clock.text() == "0.1 s/step"
    assert clock.add(20, 5.0) is None and clock.add(20, 5.0) is None  # 2.5x: no hint
    assert clock.text() == "0.25 s/step"
    assert clock.add(20, 30.0) == (
        "hint: steps now take 1.5 s, 15x the 0.1 s of the first ones, on 2 threads per "
        "process: other work may share the cores; fewer threads may then run faster "
        "(--threads N, config key train.threads)")
    assert clock.add(20, 40.0) is None and clock.text() == "2 s/step"  # said once


def test_log_watcher_reads_this_runs_windows(tmp_path: Path) -> None:
    """The trainer's log records (a window's images/s every train.log_every steps) feed the
    clock from the second on; records of an earlier run are skipped, a half-written line
    waits."""
    log, said = tmp_path / "log.jsonl", []
    now = time.time()
    old = {"step": 50, "loss": 1.0, "images_per_s": 1.0, "time": now - 100}
    log.write_text(json.dumps(old) + "\n")
    watcher = LogWatcher(log, StepClock(1, steps=10), batch=32, say=said.append, since=now)

    def record(step: int, seconds_per_step: float) -> str:
        return json.dumps({"step": step, "loss": 0.5, "images_per_s": 32 / seconds_per_step,
                           "time": now + step}) + "\n"

    with open(log, "a") as f:
        f.write(record(10, 0.9) + record(20, 0.1) + record(30, 0.1)[:20])
    assert [r["step"] for r in watcher.poll()] == [10, 20]  # the first: warm-up, not timed
    assert watcher.clock.first == pytest.approx(0.1) and not said
    with open(log, "a") as f:
        f.write(record(30, 0.1)[20:] + record(40, 0.5) + record(50, 0.5))
    assert [r["step"] for r in watcher.poll()] == [30, 40, 50]
    assert len(said) == 1 and said[0].startswith("hint: steps now take 0.5 s, 5x the 0.1 s")
    assert said[0].endswith("on 1 thread per process: other work may share the cores")
    assert watcher.clock.text() == "0.5 s/step"
