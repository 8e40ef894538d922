"""scripts/reproduce_table3.py: the plan, and the whole chain at --smoke size, resumed."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("reproduce_table3",
                                                  REPO / "scripts" / "reproduce_table3.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_plan_of_the_paper_runs(capsys) -> None:
    assert load_script().main(["--dry-run", "--out", "unused"]) == 0
    out = capsys.readouterr().out
    assert "cifar10 / uvit: train 500,000 of 500,000 steps x 128 images" in out
    assert "mscoco / uvic: train 1,000,000 of 1,000,000 steps x 256 images" in out
    # CIFAR-10: 50,000 samples x 1000 Euler-Maruyama calls; MS-COCO: 30,000 x 50 x 2 (guided)
    assert "50,000 samples x 1000 network calls = 50,000,000 image forwards" in out
    assert "30,000 samples x 100 network calls = 3,000,000 image forwards" in out
    assert "protocol: euler_maruyama 1000 steps, 50000 samples, legacy_pytorch" in out
    assert "protocol: dpm_solver_fast 50 steps, guidance 1, 30000 samples, legacy_pytorch" in out


def test_smoke_chain_and_resume(tmp_path: Path, capsys) -> None:
    script = load_script()
    out = tmp_path / "t3"
    assert script.main(["--smoke", "--out", str(out), "--quiet"]) == 0
    first = capsys.readouterr().out
    assert "shapes / uvit: trained to step 40" in first
    assert "shapes / uvic: trained to step 40" in first
    table = (out / "table3.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()
            if line.startswith("| U-Vi")}
    assert set(rows) == {"U-ViT", "U-ViC"}
    for model in ("uvit", "uvic"):
        result = json.loads((out / "fid" / f"shapes_{model}.json").read_text())
        assert result["model"] == {"uvit": "U-ViT", "uvic": "U-ViC"}[model]
        assert result["attention"] == model
        assert result["protocol"]["features"] == "smoke16"
        assert result["protocol"]["sampler"] == "euler_maruyama"
        assert f"{result['fid']:.2f}" in rows[result["model"]]
    assert "euler_maruyama 20 steps, 32 samples, clean, ref shapes/train/16, features smoke16" \
        in table

    # again: every stage is found done and skipped; the table is the same
    assert script.main(["--smoke", "--out", str(out), "--quiet"]) == 0
    second = capsys.readouterr().out
    assert second.count("trained (skipped)") == 2
    assert second.count("(skipped: result exists)") == 2
    assert (out / "table3.md").read_text() == table
    # a measured step time now states the remaining training time
    assert "measured" in script.plan(script.make_jobs(script.parse_args(["--smoke", "--out",
                                                                          str(out)])))
