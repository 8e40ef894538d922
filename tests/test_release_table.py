"""uvic-release-table (scripts/reproduce_release_table.py): the plan of every release row,
--only, the table's rendering, and the whole chain at --smoke size on generated data in the
real on-disk formats (CelebA, ImageNet class folders, extracted ImageNet latents), resumed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from uvic.cli import tables
from uvic.evaluation.protocols import RELEASE_ROWS, Protocol
from uvic.evaluation.release_table import release_table as render
from uvic.experiments import runner
from uvic.experiments.tables import RELEASE_TABLE


def jobs_of(*argv: str) -> list[runner.Job]:
    table = RELEASE_TABLE
    return runner.make_jobs(table, tables.parse_args(table, argv))


@pytest.mark.slow
def test_plan_of_every_release_row(capsys) -> None:
    assert tables.release_table(["--dry-run", "--out", "unused"]) == 0
    out = capsys.readouterr().out
    for key in RELEASE_ROWS:
        for model in ("uvit", "uvic"):
            assert f"- {key} / {model}: train " in out
    assert "imagenet256_huge / uvic: train 500,000 of 500,000 steps x 1024 images" in out
    # guided rows: two network calls per step (conditional and null class)
    assert ("50,000 samples x 100 network calls = 5,000,000 image forwards; protocol: "
            "dpm_solver++_fast_time_uniform 50 steps, guidance 0.4, labels uniform over 1000 "
            "classes, 50000 samples, legacy_pytorch, ref "
            "fid_stats_imagenet256_guided_diffusion/train/256") in out
    assert ("50,000 samples x 50 network calls = 2,500,000 image forwards; protocol: "
            "dpm_solver_fast_logsnr 50 steps, labels 1000 classes in training-set frequencies, "
            "50000 samples, legacy_pytorch, ref fid_stats_imagenet64_guided_diffusion/train/64"
            ) in out
    assert "celeba64_small / uvit: train 500,000 of 500,000 steps x 128 images" in out


def test_only_picks_rows_and_models(capsys) -> None:
    assert [(j.row, j.model) for j in jobs_of("--only", "imagenet256")] == [
        ("imagenet256_large", "uvit"), ("imagenet256_large", "uvic"),
        ("imagenet256_huge", "uvit"), ("imagenet256_huge", "uvic")]
    jobs = jobs_of("--only", "imagenet512_huge")
    assert [j.cfg.name for j in jobs] == ["imagenet512_huge_uvit", "imagenet512_huge_uvic"]
    assert [j.cfg.model.attention for j in jobs] == ["uvit", "uvic"]
    assert {j.row for j in jobs_of("--only", "uvic")} == set(RELEASE_ROWS)
    assert tables.release_table(["--dry-run", "--only", "imagenet1024"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --only ['imagenet1024']: matches no row of release_table")
    assert len(err.strip().splitlines()) == 1


def result(name: str, model: str, protocol: Protocol, fid: float) -> dict:
    return {"name": name, "model": model, "fid": fid, "checkpoint": f"{name}.safetensors",
            "step": 7, "protocol": protocol.as_dict()}


def test_table_lines_keep_protocols_apart() -> None:
    row = RELEASE_ROWS["imagenet256_large"]
    other = Protocol("dpm_solver++ order 2", 25, 0.4, 10_000, "clean", row.protocol.reference)
    text = render([result("imagenet256_uvit_large", "U-ViT", row.protocol, 3.5),
                   result("imagenet256_large_uvic", "U-ViC", row.protocol, 3.3),
                   result("imagenet256_large_uvic", "U-ViC", row.protocol, 3.9),  # not best
                   result("imagenet256_uvic_large", "U-ViC", other, 9.0)])
    lines = [line for line in text.splitlines() if line.startswith("| ImageNet 256, U-ViT-L/2")]
    # P1 CIFAR-10, P2 CelebA, P3 both ImageNet 64 rows (one protocol), P4 the release's here
    assert lines == ["| ImageNet 256, U-ViT-L/2 (`imagenet256_uvit_large`) | P4 | 3.50 | 3.30 "
                     "| 3.40 |",
                     "| ImageNet 256, U-ViT-L/2 (`imagenet256_uvit_large`) | P5 | — | 9.00 "
                     "| 3.40 |"]
    assert ("- P4: dpm_solver_fast_logsnr 50 steps, guidance 0.4, labels uniform over 1000 "
            "classes, 50000 samples, legacy_pytorch, ref "
            "fid_stats_imagenet256_guided_diffusion/train/256 — *release protocol*: "
            "dpm_solver_fast_logsnr, 50 steps, guidance s=0.4 (diffusers guidance_scale=1.4)"
            ) in text
    assert "P5: dpm_solver++ order 2 25 steps, guidance 0.4, 10000 samples, clean, ref " \
           "fid_stats_imagenet256_guided_diffusion/train/256\n" in text  # not the release's
    with pytest.raises(ValueError, match="config name 'shapes_uvit' is no release row's"):
        render([result("shapes_uvit", "U-ViT", row.protocol, 1.0)])


def test_table_lines_keep_references_apart() -> None:
    """One protocol, results scored against two references and an unknown one: a line each,
    marked, the best picked within each only, and a note naming every file."""
    row = RELEASE_ROWS["imagenet256_large"]
    results = [{**result("imagenet256_large_uvit", "U-ViT", row.protocol, fid), "_path": path,
                **({"reference_digest": digest} if digest else {})}
               for fid, path, digest in [(3.5, "a.json", "aaaaaaaa11112222"),
                                         (3.2, "b.json", "bbbbbbbb11112222"),
                                         (3.1, "c.json", None)]]
    text = render([*results, {**result("imagenet256_large_uvic", "U-ViC", row.protocol, 3.3),
                              "_path": "d.json", "reference_digest": "aaaaaaaa11112222"}])
    lines = [line for line in text.splitlines() if line.startswith("| ImageNet 256, U-ViT-L/2")]
    title = "| ImageNet 256, U-ViT-L/2 (`imagenet256_uvit_large`)"
    assert lines == [f"{title} | P4, ref aaaaaaaa | 3.50 | 3.30 | 3.40 |",
                     f"{title} | P4, ref bbbbbbbb | 3.20 | — | 3.40 |",
                     f"{title} | P4, ref unknown | 3.10 | — | 3.40 |"]
    assert ("- ImageNet 256, U-ViT-L/2, P4: ref aaaaaaaa: a.json, d.json; ref bbbbbbbb: "
            "b.json; ref unknown: c.json") in text.splitlines()
    assert "scored against different reference statistics" in text
    # one reference for all: the table is the one without digests
    same = [{**r, "reference_digest": "aaaaaaaa11112222"} for r in results]
    assert render(same) == render([{**r, "reference_digest": None} for r in results])
    assert "ref " not in render(same).split("Protocols:")[0]


@pytest.mark.slow
def test_smoke_chain_on_every_kind_of_data_and_resume(tmp_path: Path, capsys) -> None:
    out = tmp_path / "rt"
    assert tables.release_table(["--smoke", "--out", str(out), "--quiet"]) == 0
    first = capsys.readouterr().out
    data = out / "data"
    # the real on-disk formats, read by the real loaders
    assert len(list((data / "imagenet" / "train").glob("n*/n*_*.JPEG"))) == 24
    assert (data / "celeba" / "list_eval_partition.txt").is_file()
    assert len(list((data / "celeba" / "img_align_celeba").glob("*.jpg"))) == 24
    assert json.loads((data / "imagenet_features" / "train" / "progress.json").read_text())[
        "complete"] is True
    expected = {"celeba64_small": ("euler_maruyama", 0.0), "imagenet64_mid":
                ("dpm_solver_fast_logsnr", 0.0), "imagenet256_huge":
                ("dpm_solver++_fast_time_uniform", 0.4)}
    table = (out / "release_table.md").read_text()
    for key, (sampler, guidance) in expected.items():
        assert f"{key} / uvit: trained to step 30" in first
        fids = []
        for model in ("uvit", "uvic"):
            r = json.loads((out / "fid" / f"{key}_{model}.json").read_text())
            assert r["attention"] == model and r["n"] == 16
            assert r["protocol"]["sampler"] == sampler
            assert r["protocol"]["guidance"] == guidance
            assert r["protocol"]["features"] == "projection"
            fids.append(f"{r['fid']:.2f}")
        title = RELEASE_ROWS[key].title
        line = next(x for x in table.splitlines() if x.startswith(f"| {title} "))
        assert line.endswith(f"stand-in: not FID | {fids[0]} | {fids[1]} | "
                             f"{RELEASE_ROWS[key].release_fid:.2f} |")
    cfg = json.loads((out / "runs" / "imagenet256_huge_uvic" / "config.json").read_text())
    assert cfg["data"]["name"] == "imagenet_features" and cfg["model"]["num_classes"] == 4
    assert cfg["diffusion"]["schedule"] == "scaled_linear"
    assert cfg["model"]["attention"] == "uvic"
    assert table.count("Smoke note (") == 3  # why U-ViT and U-ViC agree, per row
    # rows without results show the release's protocol and "—"
    assert "| ImageNet 512, U-ViT-H/4 (`imagenet512_uvit_huge`) | P8 | — | — | 4.05 |" in table
    assert "| ImageNet 64, U-ViT-L/4 (`imagenet64_uvit_large`) | P4 | — | — | 4.26 |" in table

    assert tables.release_table(["--smoke", "--out", str(out), "--quiet"]) == 0
    second = capsys.readouterr().out
    assert second.count("trained (skipped)") == 6
    assert second.count("(skipped: result exists)") == 6
    assert (out / "release_table.md").read_text() == table


@pytest.mark.slow
def test_seeded_runs_plan_and_cells(capsys) -> None:
    """--seeds 2: every row twice, the second run with the next seed in its own folder; the
    cell of two seeds is their mean ± t(0.975, 1) |a - b| / 2."""
    assert tables.release_table(["--dry-run", "--out", "unused", "--only", "celeba64_small",
                               "--seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert "- celeba64_small / uvit / seed 1234: train" in out
    assert "- celeba64_small / uvic / seed 1235: train" in out
    row = RELEASE_ROWS["celeba64_small"]
    seeded = [{**result("celeba64_small_uvit", "U-ViT", row.protocol, fid),
               "config": {"train": {"seed": seed}}} for seed, fid in ((1, 2.0), (2, 2.5))]
    line = next(x for x in render(seeded).splitlines() if x.startswith("| CelebA"))
    half = math.tan(math.pi * 0.475) * 0.25
    assert f"| {2.25:.2f} ± {half:.2f} (2 seeds) | — |" in line
