"""Long experiments (`uvic-compare`, `uvic-table3`, `uvic-release-table`, `uvic-recipes-table`)
keep their work and know their time: each finished cell (a trained run, an evaluation) is
saved at once and a rerun after an interruption redoes none of it; each cell done prints
its progress with an ETA from the cells measured so far; a dry run states every cell's
time, calibrated on one cell's model timed here, before any run exists. Tiny configs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import uvic.training.trainer as trainer_module
from uvic.cli import compare, tables
from uvic.experiments import compare_eval, runner
from uvic.experiments.progress import EVAL, TRAIN, Cell, Clock, duration

# uvic-compare at the size of tests/test_compare.py: 2 variants x 2 seeds, 6 steps
TINY = ["train.max_steps=6", "train.batch_size=4", "model.embed_dim=16", "model.depth=2",
        "model.num_heads=2", "eval.n_samples=4", "sample.steps=2", "train.keep_steps=[]",
        "sample.autoguidance_scale=0", "data.num_images=32", "train.log_every=3",
        "train.log_with=", "optim.warmup_steps=2", "model.attention_backend=torch"]
COMPARE = ["--variants", "uvit,uvic", "--seeds", "2", "--steps", "3", "--heldout", "8",
           "--threads", "1", "--jobs", "1", *[w for o in TINY for w in ("--set", o)]]
TIME = re.compile(r"~[0-9.]+ (s|min|h|days|years)\b")


class FakeTime:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_eta_comes_from_the_cells_measured_so_far() -> None:
    now = FakeTime()
    cells = [Cell("a: train", TRAIN, 100.0), Cell("a: FID", EVAL, 10.0),
             Cell("b: train", TRAIN, 200.0), Cell("b: FID", EVAL, 10.0)]
    clock = Clock(cells, now=now)
    assert clock.eta() is None  # nothing measured, no calibration
    now.t += 50
    line = clock.finished(cells[0], 50.0)
    # 0.5 s per FLOP of training, used for the evaluations too until one is measured
    assert clock.eta() == pytest.approx((10 + 200 + 10) * 0.5)
    assert line == ("progress: 1 of 4 cells done (last: a: train, 50 s), 50 s so far; "
                    "ETA ~1.8 min (from 1 measured cell)")
    now.t += 30
    clock.finished(cells[1], 30.0)  # 3 s per FLOP of evaluation
    assert clock.eta() == pytest.approx(200 * 0.5 + 10 * 3)
    # a cell found done and skipped measures nothing
    clock.finished(cells[2], 0.01, worked=False)
    assert clock.eta() == pytest.approx(10 * 3)
    now.t += 31
    assert clock.finished(cells[3], 31.0).endswith("1.9 min so far; all done")
    # a calibration gives the first ETA; several workers share the work
    calibrated = Clock(cells, workers=2, rates={TRAIN: 0.1, EVAL: 1.0}, now=now)
    assert calibrated.eta() == pytest.approx((300 * 0.1 + 20 * 1.0) / 2)
    assert calibrated.finished(cells[0], 5.0, worked=False).endswith("ETA ~20 s (calibrated)")


def test_durations_read_at_a_useful_precision() -> None:
    assert [duration(s) for s in (4.24, 45, 750, 3.2 * 3600, 5 * 86400, 1096 * 86400)] == [
        "4.2 s", "45 s", "12.5 min", "3.2 h", "5.0 days", "3.0 years"]


@pytest.mark.parametrize("program", [tables.table3, tables.release_table, tables.recipes_table],
                         ids=["table3", "release_table", "recipes_table"])
def test_a_table_dry_run_states_a_calibrated_time_before_any_run(program, tmp_path: Path,
                                                                   capsys) -> None:
    out = tmp_path / "out"
    assert program(["--smoke", "--dry-run", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("- ")]
    assert rows and all(TIME.search(r) and "(calibrated)" in r for r in rows), text
    assert "time not measured yet" not in text
    (total,) = [line for line in text.splitlines() if line.startswith("Time: ~")]
    assert " in all, one row after another (training ~" in total
    assert "calibrated on cpu (" in total and "(network only: " in total
    assert not out.exists()  # a dry run writes nothing


def test_a_comparison_dry_run_states_a_calibrated_time_before_any_run(tmp_path: Path,
                                                                       capsys) -> None:
    out = tmp_path / "cmp"
    assert compare.main([*COMPARE, "--dry-run", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    (line,) = [x for x in text.splitlines() if x.startswith("- time: ~")]
    assert TIME.search(line) and " on 1 worker (training ~" in line
    assert "calibrated on cpu (1 thread): a training step of uvit_seed1234 (4 images" in line
    assert not out.exists()


class Counter:
    """Counts the work done: training runs started (by run name) and evaluations made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.trained: list[str] = []
        self.evaluated = 0
        train, evaluate = trainer_module.train, compare_eval.evaluate

        def counted_train(cfg, *args, **kwargs):
            self.trained.append(cfg.name)
            return train(cfg, *args, **kwargs)

        def counted_evaluate(*args, **kwargs):
            self.evaluated += 1
            return evaluate(*args, **kwargs)

        import uvic.evaluation.fid as fid_module

        monkeypatch.setattr(trainer_module, "train", counted_train)
        monkeypatch.setattr(fid_module, "evaluate", counted_evaluate)  # the table runner's
        monkeypatch.setattr(compare_eval, "evaluate", counted_evaluate)  # the comparison's

    def take(self) -> tuple[list[str], int]:
        done = (self.trained, self.evaluated)
        self.trained, self.evaluated = [], 0
        return done


@pytest.mark.slow
def test_a_table_interrupted_after_one_cell_redoes_none_of_it(tmp_path: Path, capsys,
                                                              monkeypatch) -> None:
    """Table 3's smoke stopped (Ctrl-C) right after its first cell, the U-ViT's training:
    the rerun trains only the U-ViC and scores both; a third run does nothing."""
    out = tmp_path / "t3"
    args = ["--smoke", "--out", str(out), "--quiet"]
    count = Counter(monkeypatch)
    real = runner.run_train

    def stop_after_one(job):
        real(job)
        raise KeyboardInterrupt  # as Ctrl-C between two cells

    monkeypatch.setattr(runner, "run_train", stop_after_one)
    assert tables.table3(args) == 130
    assert "stopped by SIGINT: every finished cell is kept" in capsys.readouterr().err
    assert count.take() == (["shapes_uvit"], 0)

    monkeypatch.setattr(runner, "run_train", real)
    assert tables.table3(args) == 0
    printed = capsys.readouterr().out
    assert count.take() == (["shapes_uvic"], 2)  # the U-ViT's training is not redone
    assert "progress: 1 of 4 cells done (last: shapes / uvit: train, found done)" in printed
    assert "ETA after the first measured cell" in printed
    progress = [line for line in printed.splitlines() if line.startswith("progress: ")]
    assert len(progress) == 4 and progress[-1].endswith("all done")
    assert all(TIME.search(line) for line in progress[1:-1])  # then from measured cells

    assert tables.table3(args) == 0
    assert count.take() == ([], 0)


@pytest.mark.slow
def test_a_comparison_interrupted_after_two_cells_redoes_neither(tmp_path: Path, capsys,
                                                                 monkeypatch) -> None:
    """uvic-compare stopped after its first run's training and first evaluation: the rerun
    trains the three other runs and makes the seven other evaluations."""
    out = tmp_path / "cmp"
    count = Counter(monkeypatch)
    real = compare_eval.evaluate_step
    calls = []

    def stop_at_the_second(*args, **kwargs):
        calls.append(args[2])
        if len(calls) == 2:
            raise KeyboardInterrupt  # as Ctrl-C between two cells
        return real(*args, **kwargs)

    monkeypatch.setattr(compare_eval, "evaluate_step", stop_at_the_second)
    assert compare.main([*COMPARE, "--out", str(out)]) == 130
    assert count.take() == (["uvit_seed1234"], 1)

    monkeypatch.setattr(compare_eval, "evaluate_step", real)
    capsys.readouterr()
    assert compare.main([*COMPARE, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert count.take() == (["uvit_seed1235", "uvic_seed1234", "uvic_seed1235"], 7)
    assert ("progress: 2 of 12 cells done (last: uvit_seed1234: step 3, found done), "
            in printed)
    assert printed.count("progress: ") == 12 and "12 of 12 cells done" in printed
    assert compare.main([*COMPARE, "--out", str(out)]) == 0
    assert count.take() == ([], 0)
