"""The budgeted GPU check (`uvic-gpu-check`) and what it needs of the GPU
machine's older stack, on the CPU: the smoke under a small budget, a failing row recorded
while the run goes on, the record file valid after a kill, the interpreter under Triton
3.6's interfaces, and the wheels' pins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import torch

from uvic.cli import gpu_check
from uvic.cli.gpu_check import Check
from uvic.cli.gpu_check_plan import SMOKE_COSTS, CostModel, Row
from uvic.cli.gpu_check_report import evaluate_targets

ROOT = Path(__file__).resolve().parents[1]
ENV = {"python": "3", "torch": "t", "triton": "tr", "cuda": "c", "device": "d"}


def rows_of(*specs: tuple) -> list[Row]:
    return [Row(rid, group, "train", run, estimate, families)
            for rid, group, run, estimate, families in specs]


def fail() -> dict:
    raise RuntimeError("kernel exploded\nsecond line of the message")


@pytest.mark.slow
def test_smoke_under_a_small_budget(tmp_path: Path) -> None:
    """The command with the real plan at smoke size: every row recorded once, in order;
    what does not fit the budget skipped (or cut off) and said so; the run ends near its
    budget. (A subprocess: a row cut off by the budget may leave its process half-way
    through an import, which is why the check stops running rows then.)"""
    out = tmp_path / "check.json"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "uvic.cli.gpu_check", "--smoke",
                           "--budget-s", "8", "--out", str(out)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert time.monotonic() - start < 8 + 5
    payload = json.loads(out.read_text())
    assert payload["finished"] and payload["smoke"] and payload["kind"] == "gpu-check"
    records = payload["records"]
    assert [r["group"] for r in records] == sorted(r["group"] for r in records)
    assert len({r["id"] for r in records}) == len(records) > 30
    assert {r["status"] for r in records} <= {"ok", "skipped", "timeout"}
    budget = [r for r in records if r["status"] == "skipped" and r["reason"].startswith("budget")]
    assert budget, [(r["id"], r["status"], r["reason"]) for r in records]
    assert all(r["reason"].startswith("needs CUDA") for r in records
               if "reduce-overhead" in r["id"] and r["status"] == "skipped"
               and not r["reason"].startswith("budget"))
    assert all(set(r["stack"]) == {"python", "torch", "triton", "cuda", "device"}
               for r in records)
    assert {t["status"] for t in payload["targets"]} == {"not measured"}
    assert "Targets:" in proc.stdout and payload["summary"] in proc.stdout


@pytest.mark.slow
def test_each_kind_of_row_runs_on_the_cpu(tmp_path: Path) -> None:
    """The plan's own rows at smoke size: a training step, the attention alone, the
    sampling call, each with its figures and its stack."""
    from uvic.cli.gpu_check_plan import plan

    wanted = ["train cifar10 uvit sdpa off", "attention N=257 cog (ours)",
              "sampling cifar10 uvic eager"]
    rows = {r.id: r for r in plan(torch.device("cpu"), None, SMOKE_COSTS)}
    payload = Check(tmp_path / "c.json", 300.0, SMOKE_COSTS, ENV, {"smoke": True}).run(
        [rows[rid] for rid in wanted], cuda=False)
    train, attention, sampling = payload["records"]
    assert [r["status"] for r in payload["records"]] == ["ok"] * 3, [
        r["reason"] for r in payload["records"]]
    assert train["ms_per_step"] > 0 and train["impl"] == "sdpa" and train["batch"] == 2
    assert attention["fwd_bwd_ms"] > 0 and attention["method"] == "cog (ours, torch)"
    assert sampling["images_per_s_per_eval"] > 0 and sampling["compile"] == "off"
    assert all(r["stack"] == ENV for r in payload["records"])


def test_failing_row_is_recorded_and_the_run_goes_on(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    costs = CostModel(triton_config_s=1.0)
    rows = rows_of(("first", 1, lambda: {"ms_per_step": 1.0}, 0.0, {"bf16 cog bwd": 14}),
                   ("fails", 1, fail, 0.0, {}),
                   ("too dear", 2, lambda: {}, 1e6, {}),
                   ("oom", 2, lambda: {"status": "OOM"}, 0.0, {}),
                   ("again", 3, lambda: {"ms_per_step": 2.0}, 0.5, {"bf16 cog bwd": 14}))
    payload = Check(out, 60.0, costs, ENV, {"smoke": True}).run(rows, cuda=False)
    records = {r["id"]: r for r in payload["records"]}
    assert [r["status"] for r in payload["records"]] == ["ok", "error", "skipped", "OOM", "ok"]
    assert records["fails"]["reason"] == "RuntimeError: kernel exploded"
    assert records["too dear"]["reason"].startswith("budget: estimated 1000000 s")
    # the kernels' family is compiled (and its cost counted) once
    assert records["first"]["estimate_s"] == 14 and records["again"]["estimate_s"] == 0.5
    assert records["again"]["ms_per_step"] == 2.0
    assert json.loads(out.read_text()) == payload


def test_budget_cuts_off_a_running_row(tmp_path: Path) -> None:
    rows = rows_of(("slow", 1, lambda: time.sleep(5), 0.0, {}),
                   ("later", 2, lambda: {}, 0.0, {}))
    start = time.monotonic()
    payload = Check(tmp_path / "c.json", gpu_check.SUMMARY_RESERVE_S + 0.5, SMOKE_COSTS, ENV,
                    {"smoke": True}).run(rows, cuda=False)
    assert time.monotonic() - start < 3
    slow, later = payload["records"]
    assert slow["status"] == "timeout" and slow["reason"].startswith("budget: the budget ran out")
    assert later["status"] == "skipped" and later["reason"] == "budget: spent before this row"


def test_resume_keeps_finished_rows(tmp_path: Path) -> None:
    """--resume: rows that finished on the same stack are kept, not run again; the rows
    the budget skipped run now."""
    out, runs = tmp_path / "check.json", []

    def rows() -> list[Row]:
        return rows_of(("a", 1, lambda: runs.append("a") or {"ms_per_step": 1.0}, 0.0, {}),
                       ("b", 2, lambda: runs.append("b") or {"ms_per_step": 2.0}, 100.0, {}))

    first = Check(out, 60.0, SMOKE_COSTS, ENV, {"smoke": True}).run(rows(), cuda=False)
    assert [r["status"] for r in first["records"]] == ["ok", "skipped"] and runs == ["a"]
    again = Check(out, 200.0, SMOKE_COSTS, ENV, {"smoke": True})
    again.resume(out)
    on_disk = []
    later = rows()
    later[1].run = lambda: on_disk.append(json.loads(out.read_text())) or runs.append("b") or {}
    second = again.run(later, cuda=False)
    assert [r["id"] for r in on_disk[0]["records"]] == ["a"]  # kept rows: on disk at once
    assert runs == ["a", "b"]
    assert [(r["id"], r["status"], r.get("resumed", False)) for r in second["records"]] == [
        ("a", "ok", True), ("b", "ok", False)]


def test_dry_run_plans_the_default_budget(capsys: pytest.CaptureFixture) -> None:
    """The GPU plan under the cost model: every row listed, the run expected to end
    within the default budget."""
    assert gpu_check.main(["--dry-run"]) == 0
    shown = capsys.readouterr().out
    rows = [line for line in shown.splitlines() if line.startswith("| ") and "row |" not in line]
    assert len(rows) == 38 and rows[0].startswith("| train cifar10 uvit ours off |")
    expected = float(shown.split("expected wall time ")[1].split(" s")[0])
    assert expected <= gpu_check.DEFAULT_BUDGET_S


KILLED = """
import sys, time
from pathlib import Path
from uvic.cli.gpu_check import Check
from uvic.cli.gpu_check_plan import SMOKE_COSTS, Row
rows = [Row("first", 1, "train", lambda: {"ms_per_step": 1.0}, 0.0),
        Row("hangs", 1, "train", lambda: time.sleep(120), 0.0)]
env = dict.fromkeys(("python", "torch", "triton", "cuda", "device"), "x")
Check(Path(sys.argv[1]), 600.0, SMOKE_COSTS, env, {"smoke": True}).run(rows, cuda=False)
"""


def test_record_file_is_valid_after_a_kill(tmp_path: Path) -> None:
    """Killed (SIGKILL) while the second row runs: the file holds the first row."""
    out = tmp_path / "check.json"
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(out)], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if out.exists() and json.loads(out.read_text())["records"]:
                break
            assert proc.poll() is None, "the check ended before it was killed"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    payload = json.loads(out.read_text())
    assert not payload["finished"]
    assert [(r["id"], r["status"], r["ms_per_step"]) for r in payload["records"]] == [
        ("first", "ok", 1.0)]


def train(dataset: str, model: str, impl: str, mode: str, ms: float, mfu: float = 0.4,
          status: str = "ok") -> dict:
    return {"kind": "train", "dataset": dataset, "model": model, "impl": impl,
            "compile": mode, "grad_checkpointing": False, "status": status,
            "ms_per_step": ms, "mfu": mfu}


def test_summary_row_figures() -> None:
    from uvic.cli.gpu_check_report import result_text

    row = {**train("cifar10", "uvit", "ours", "off", 40.0), "images_per_s": 3200.0,
           "profile": {"gpu_busy": 0.42}}
    assert result_text(row) == "40.00 ms/step, 3200 images/s, GPU busy 42%"
    assert result_text({**row, "status": "error", "reason": "ValueError: x"}) == "ValueError: x"
    assert result_text({"kind": "attention", "status": "ok", "fwd_ms": 0.1, "fwd_bwd_ms": 0.4,
                        "fwd_bwd_ms_cuda_graph": 0.3}) == (
        "fwd 0.100 ms, fwd+bwd 0.400 ms (graph 0.300)")


def test_targets_met_missed_and_not_measured() -> None:
    records = [train("cifar10", "uvit", "ours", "off", 40.0),
               train("cifar10", "uvit", "sdpa", "off", 45.0),
               train("cifar10", "uvic", "ours", "off", 41.0),
               train("cifar10", "uvit", "ours", "reduce-overhead", 28.0, mfu=0.36),
               train("cifar10", "uvit", "sdpa", "reduce-overhead", 27.0),
               train("cifar10", "uvic", "ours", "reduce-overhead", 28.0),
               train("mscoco", "uvit", "ours", "off", 30.0),
               train("mscoco", "uvit", "sdpa", "off", 31.0),
               train("mscoco", "uvit", "ours", "reduce-overhead", 0.0, status="skipped"),
               {"kind": "sampling", "dataset": "cifar10", "model": "uvic", "compile": "off",
                "status": "ok", "images_per_s_per_eval": 9000.0},
               {"kind": "sampling", "dataset": "cifar10", "model": "uvic",
                "compile": "reduce-overhead", "status": "ok", "images_per_s_per_eval": 19000.0}]
    got = {t["target"]: t["status"] for t in evaluate_targets(records, smoke=False)}
    assert got == {
        "CIFAR-10: U-ViT ours <= SDPA, eager": "met",
        "CIFAR-10: U-ViT ours <= SDPA, best mode": "missed",  # 28 vs 27
        "CIFAR-10: U-ViC best <= 1.05x U-ViT-SDPA best": "met",  # 28 / 27 = 1.037
        "MS-COCO: U-ViT ours <= SDPA, eager": "met",
        "MS-COCO: U-ViT ours <= SDPA, best mode": "not measured",  # a mode was skipped
        "MS-COCO: U-ViC best <= 1.05x U-ViT-SDPA best": "not measured",
        "CIFAR-10 b128 <= 30 ms/step, >= 35% MFU": "met",
        "MS-COCO b64 <= 25 ms/step": "not measured",
        "CIFAR-10: sampling graphed >= 2x eager images/s/NFE": "met",
        "MS-COCO: sampling graphed >= 2x eager images/s/NFE": "not measured"}


# ---------------------------------------------------------- Triton 3.6's interfaces


def test_interpreter_scalar_index_fix(monkeypatch) -> None:
    """An interpreter whose `__index__` is `int(array)` (Triton 3.6) fails under numpy >=
    2.4 and gets the one-element `__index__`; the installed one is left alone."""
    from triton.runtime import interpreter

    from uvic_kernels import compat

    def old_patch_lang_tensor(tensor, scope):  # Triton 3.6's, as far as __index__ goes
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    try:
        int(np.array([3]))
        numpy_refuses = False
    except TypeError:
        numpy_refuses = True
    assert compat.interpreter_index_fails(old_patch_lang_tensor) == numpy_refuses
    installed = getattr(interpreter._patch_lang_tensor, compat._PATCHED, False)
    assert compat.interpreter_index_fails(interpreter._patch_lang_tensor) is False or installed

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", old_patch_lang_tensor)
    assert compat.fix_interpreter_scalar_index() == numpy_refuses
    if numpy_refuses:
        index = compat._index_of(interpreter._patch_lang_tensor)
        scalar = type("T", (), {"handle": type("H", (), {"data": np.array([7], np.int32)})})
        assert index(scalar) == 7 and range(index(scalar))[-1] == 6


# ---------------------------------------------------------- the wheels the GPU machine lacks


def test_gpu_wheels_are_pinned_to_what_we_install() -> None:
    """gpu-wheels.txt pins each wheel to the version this environment runs (`make install`)."""
    pins = [line.split("#")[0].strip() for line in (ROOT / "gpu-wheels.txt").read_text()
            .splitlines()]
    pins = [p for p in pins if p]
    assert {p.split("==")[0].lower().replace("_", "-") for p in pins} >= {
        "diffusers", "open-clip-torch", "clean-fid", "ftfy"}
    for pin in pins:
        name, version = pin.split("==")
        assert metadata.version(name) == version, f"{pin}: installed {metadata.version(name)}"


def test_help_names_the_budget() -> None:
    proc = subprocess.run([sys.executable, "-m", "uvic.cli.gpu_check", "--help"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and "--budget-s" in proc.stdout
