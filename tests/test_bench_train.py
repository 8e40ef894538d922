"""scripts/bench_train.py (a benchmark script, not a timed test): its CPU smoke run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_train.py"


def load_bench():
    return load_script("scripts/bench_train.py")


def test_bench_train_smoke(tmp_path, capsys):
    bench = load_bench()
    out = tmp_path / "train.json"
    assert bench.main(["--smoke", "--steps", "1", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["smoke"] and "timings need a gpu" in capsys.readouterr().out.lower()
    cells = {(r["dataset"], r["model"], r["backend"]): r for r in payload["results"]}
    # sdpa is a softmax-only baseline: U-ViT only; both settings, both models
    assert set(cells) == {(d, m, b) for d in ("cifar10", "mscoco") for m, bs in
                          (("uvit", ("torch", "sdpa")), ("uvic", ("torch",))) for b in bs}
    for r in cells.values():
        assert r["status"] == "ok" and r["train_ms"] > 0 and r["sample_images_per_s"] > 0
    assert cells["cifar10", "uvit", "torch"]["tokens"] == 17  # 8x8 smoke images, patch 2
    assert "| cifar10 (17) | uvic | torch |" in payload["table"]


def test_bench_train_backends_option(tmp_path, capsys):
    bench = load_bench()
    out = tmp_path / "train.json"
    assert bench.main(["--smoke", "--backends", "sdpa", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    cells = [(r["dataset"], r["model"], r["backend"]) for r in rows]
    assert cells == [("cifar10", "uvit", "sdpa"), ("mscoco", "uvit", "sdpa")]
    with pytest.raises(SystemExit) as exc:
        bench.main(["--smoke", "--backends", "sdpa,flash", "--out", str(out)])
    assert exc.value.code == 2 and "unknown backend 'flash'" in capsys.readouterr().err
