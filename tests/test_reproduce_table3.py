"""scripts/reproduce_table3.py: the plan, and the whole chain at --smoke size, resumed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate.utils import set_seed
from PIL import Image

from uvic.cli import tables
from uvic.experiments import runner
from uvic.experiments.tables import TABLE3
from uvic.models.uvit import build_model

REPO = Path(__file__).resolve().parents[1]


def jobs_of(argv: list[str]) -> list[runner.Job]:
    """The runs `uvic-table3` (scripts/reproduce_table3.py) makes of `argv`."""
    return runner.make_jobs(TABLE3, tables.parse_args(TABLE3, argv))


@pytest.mark.slow
def test_plan_of_the_paper_runs(capsys) -> None:
    assert tables.table3(["--dry-run", "--out", "unused"]) == 0
    out = capsys.readouterr().out
    assert "cifar10 / uvit: train 500,000 of 500,000 steps x 128 images" in out
    assert "mscoco / uvic: train 1,000,000 of 1,000,000 steps x 256 images" in out
    # CIFAR-10: 50,000 samples x 1000 Euler-Maruyama calls; MS-COCO: 30,000 x 50 x 2 (guided)
    assert "50,000 samples x 1000 network calls = 50,000,000 image forwards" in out
    assert "30,000 samples x 100 network calls = 3,000,000 image forwards" in out
    assert "protocol: euler_maruyama 1000 steps, 50000 samples, legacy_pytorch" in out
    assert ("protocol: dpm_solver++_fast_time_uniform 50 steps, guidance 1, 30000 samples, "
            "legacy_pytorch") in out


@pytest.mark.slow
def test_smoke_chain_and_resume(tmp_path: Path, capsys) -> None:
    out = tmp_path / "t3"
    assert tables.table3(["--smoke", "--out", str(out), "--quiet"]) == 0
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
        assert result["protocol"]["features"] == "projection"  # eval.features, no Inception
        assert result["protocol"]["comparable_with_inception_fid"] is False
        assert result["protocol"]["sampler"] == "euler_maruyama"
        assert f"{result['fid']:.2f}" in rows[result["model"]]
    assert ("euler_maruyama 20 steps, 32 samples, clean, ref shapes/train/16, features "
            "projection (stand-in: NOT comparable with Inception FID)") in table
    assert "| Shapes (P1, stand-in: not FID) |" in table.splitlines()[0]
    assert "shapes / uvit: stand-in FID " in first

    # the two rows agree, and the table says why, measured
    samples = {m: np.stack([np.asarray(Image.open(p)) for p in sorted(
        (out / "fid" / f"shapes_{m}_samples").glob("*.png"))]) for m in ("uvit", "uvic")}
    same = np.mean(samples["uvit"] == samples["uvic"])
    clipped = np.mean([(x == 0) | (x == 255) for x in samples.values()])
    fids = [json.loads((out / "fid" / f"shapes_{m}.json").read_text())["fid"]
            for m in ("uvit", "uvic")]
    assert same > 0.9 and abs(fids[0] - fids[1]) < 0.01  # what the note explains
    note = [line for line in table.splitlines() if line.startswith("Smoke note: ")]
    assert note == [
        f"Smoke note: U-ViT and U-ViC score alike (stand-in FID {fids[0]:.4f} vs "
        f"{fids[1]:.4f}) because their samples are {same:.1%} identical pixels ({clipped:.1%} "
        "clipped to 0 or 255): both models start from the same weights (same seed; softmax "
        "and Cog blocks have the same parameters), see the same batches and sampling noise, "
        "and train only 40 steps. The smoke checks the chain (train, FID, table, resume), not "
        "the models."]
    assert note[0] in first  # printed too
    # the note's "same weights": the seed alone decides the initial weights of both
    initial = []
    for job in jobs_of(["--smoke", "--out", str(out)]):
        set_seed(job.cfg.train.seed)
        initial.append(build_model(job.cfg.model).state_dict())
    assert initial[0].keys() == initial[1].keys()
    assert all(torch.equal(initial[0][k], initial[1][k]) for k in initial[0])

    # again: every stage is found done and skipped; the table is the same
    assert tables.table3(["--smoke", "--out", str(out), "--quiet"]) == 0
    second = capsys.readouterr().out
    assert second.count("trained (skipped)") == 2
    assert second.count("(skipped: result exists)") == 2
    assert (out / "table3.md").read_text() == table
    # other training settings for the same runs: refused before anything runs
    assert tables.table3(["--smoke", "--out", str(out), "--quiet", "--set", "optim.lr=0.5"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {out / 'runs' / 'shapes_uvit'} was "
                                                "trained with other settings (optim.lr: ")
    assert "use another --out" in err[0] and (out / "table3.md").read_text() == table
    # a measured step time now states the remaining training time
    assert "measured" in runner.plan(jobs_of(["--smoke", "--out", str(out)]))
