"""The README's main job (`make quickstart` -> scripts/quickstart.py) at a reduced size.

The commands are the README's (`readme_commands.argv`), with settings that shrink them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from readme_commands import argv, page

ROOT = Path(__file__).resolve().parents[1]


def readme_outputs() -> list[str]:
    """The names docs/quickstart.md lists as written to runs/quickstart/."""
    listing = page("docs/quickstart.md").split("and writes to `runs/quickstart/`:\n\n")[1].split(
        "\n\n")[0]
    return [name for item in re.findall(r"^- (.+?):", listing, flags=re.M)
            for name in re.findall(r"`([^`]+)`", item)]


def run_quickstart(tmp_path: Path, out: Path, *extra: str, check: bool = True,
                   command: str = "make quickstart") -> subprocess.CompletedProcess:
    """README `command` at a reduced size, in a clean environment, writing to `out`."""
    cmd = [
        *argv(command), "--preset", "cpu", "--out", str(out),
        "--n-grid", "4", "--n-quality", "8", "--heldout", "32",
        "--set", "train.max_steps=20", "--set", "train.batch_size=8",
        "--set", "train.log_every=4", "--set", "train.sample_every=0",
        "--set", "train.ckpt_every=6", "--set", "data.num_images=64",
        "--set", "sample.steps=4", "--set", "eval.n_samples=8",
        # autoguidance as in the default run, by the run's own EMA at step 8
        "--set", "train.keep_steps=[8]",
        "--set", "sample.autoguidance_ckpt=checkpoints/step_000008/ema.safetensors",
        "--set", "model.embed_dim=32", "--set", "model.depth=2",
        # No Inception weights: FID must be reported as skipped, never made up.
        "--set", f"eval.inception_path={tmp_path / 'absent' / 'inception-2015-12-05.pt'}",
        *extra,
    ]
    # A clean environment: in particular no TRITON_INTERPRET (set by conftest for the
    # kernel tests), so the CPU run takes the PyTorch attention path as a user's would.
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    if "PYTHONPATH" in os.environ:  # import the same uvic as this test process does
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp_path = tmp_path_factory.mktemp("quickstart")
    run_quickstart(tmp_path, tmp_path / "qs")
    return tmp_path / "qs"


@pytest.mark.slow
def test_quickstart_end_to_end(first_run: Path) -> None:
    out = first_run

    names = readme_outputs()
    assert {"grid.png", "loss.png", "results.md", "uvit/", "uvic/"} <= set(names)
    for name in [*names, "config.json"]:
        assert (out / name).is_dir() if name.endswith("/") else (out / name).is_file(), name
    results = json.loads((out / "results.json").read_text())
    rows = {r["model"]: r for r in results["rows"]}
    assert set(rows) == {"U-ViT", "U-ViC"}
    assert rows["U-ViT"]["pattern"] == "SSS"
    assert rows["U-ViC"]["pattern"] == "SCS"  # depth 2: first and last softmax, mid Cog
    for r in rows.values():
        assert np.isfinite(r["final_loss"]) and np.isfinite(r["heldout_loss"])
        assert np.isfinite(r["hf_ratio"]) and 0.0 <= r["palette_share"] <= 1.0
        assert r["fid"] is None
        timing = results["timing"][r["model"]]
        assert timing["ms_per_step"] > 0 and timing["images_per_s"] > 0
    # Held-out real images against training images: the scale the samples are judged on.
    assert 0.8 < results["real_heldout"]["hf_ratio"] < 1.25
    assert results["real_heldout"]["palette_share"] > 0.8  # noise: < 0.05
    assert results["real_heldout"]["shape_share"] > 0.9  # a plain background: 0
    assert any("inception" in note.lower() for note in results["notes"])
    # the training objective is the config's weighted loss, the held-out figure plain MSE
    assert any("Min-SNR-5 weighted" in note for note in results["notes"])
    # what guided the samples: the guide's file, its step and the scale
    assert ("Samples: DDPMScheduler, 4 steps, from the EMA weights at step 20, autoguided by "
            "the same run's EMA weights at step 8 (uvit/checkpoints/step_000008/ema.safetensors"
            ", uvic/checkpoints/step_000008/ema.safetensors): eps = g + 1 (g - b)."
            in results["notes"])
    assert "autoguided by the same run's EMA weights at step 8" in (out / "results.md").read_text()
    for r in rows.values():
        assert r["final_step"] == 20
        assert r["guide"] == {"ckpt": f"{r['run_dir']}/checkpoints/step_000008/ema.safetensors",
                              "step": 8, "scale": 1.0}
    report = (out / "results.md").read_text()
    assert "skipped" in report and "| U-ViC | 1 |" in report and "massive ratio" in report
    # the attention analysis of both models: Cog blocks carry negative mass, softmax none
    attention = results["attention"]
    assert set(attention) == {"U-ViT", "U-ViC"}
    assert attention["U-ViT"]["negative_mass"] == [0.0, 0.0, 0.0]
    uvic = attention["U-ViC"]["negative_mass"]
    assert uvic[0] == uvic[2] == 0.0 and uvic[1] > 0.0
    for model in attention.values():  # a largest token's norm is at least the others' mean
        assert len(model["massive_ratio"]) == 3 and min(model["massive_ratio"]) >= 1.0
        assert all(0.0 <= share <= 1.0 for share in model["sink_share"])
    assert (out / "attention.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "attention" / "attention.json").is_file()

    # The grid: two labelled panels side by side, 2x2 images each enlarged to 64 px.
    grid = np.asarray(Image.open(out / "grid.png").convert("RGB")).astype(np.int16)
    height, width, _ = grid.shape
    panel = (width - 8) // 2
    assert panel >= 2 * 64 and height >= 2 * 64
    left, right = grid[:, :panel], grid[:, panel + 8: panel + 8 + panel]
    assert left.shape == right.shape
    # Same init, noise and data, different attention: the images differ (the header
    # labels differ too, so compare the image area below the header only). After a few
    # steps the two models are still close, so ask for differing pixels, not a margin.
    body = slice(height - 2 * 64, height)
    assert np.count_nonzero(left[body] != right[body]) > 0

    for preset in ("uvit", "uvic"):
        run = out / preset
        assert (run / "ema.safetensors").is_file()
        saved = json.loads((run / "config.json").read_text())
        assert saved["model"]["attention"] == preset
        # the autoguidance model: step 8 is kept beside the last two checkpoints
        assert saved["sample"]["autoguidance_scale"] == 1.0
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
            "step_000008", "step_000018", "step_000020"]

    # last, as it replaces the run: a second run (one test, so the first run is made once)
    second_run_on_one_thread_replaces_the_first_with_the_same_numbers(out)


def second_run_on_one_thread_replaces_the_first_with_the_same_numbers(first_run: Path) -> None:
    """Everything but the timings is bit for bit the same on a second run (the README
    promises it), also when the models train one after the other on one thread (`--threads
    1`) rather than at once in two one-thread processes (the default, --jobs 2 --threads
    2): the same weights; and a second `make quickstart` into the same folder replaces the
    first run's."""
    results = [json.loads((first_run / "results.json").read_text())]
    weights = [{preset: (first_run / preset / "ema.safetensors").read_bytes()
                for preset in ("uvit", "uvic")}]
    (first_run / "results.json").unlink()
    # same folder, so the same absent Inception path in the notes
    run_quickstart(first_run.parent, first_run, command='make quickstart ARGS="--threads 1"')
    results.append(json.loads((first_run / "results.json").read_text()))
    weights.append({preset: (first_run / preset / "ema.safetensors").read_bytes()
                    for preset in ("uvit", "uvic")})
    assert [(r["timing"]["jobs"], r["timing"]["threads"]) for r in results] == [(2, 2), (1, 1)]
    assert weights[0] == weights[1]
    for r in results:
        assert set(r["timing"]) >= {"U-ViT", "U-ViC", "total_s"}
        del r["timing"]
        timed = [n for n in r["notes"] if "models trained at once" in n]  # the timings' note
        assert len(timed) == 1
        r["notes"].remove(timed[0])
    texts = [json.dumps(r, sort_keys=True) for r in results]  # floats as exact reprs
    assert texts[0] == texts[1]
    rows = results[0]["rows"]
    # Not vacuous: the two models' numbers differ from each other.
    assert rows[0]["final_loss"] != rows[1]["final_loss"]


@pytest.mark.slow
def test_a_failing_worker_stops_the_run_with_one_line_naming_model_and_log(
        tmp_path: Path) -> None:
    """A model that diverges in its worker process: exit 1, one error line that names the
    model, the cause and the worker's full output; no results are written."""
    proc = run_quickstart(tmp_path, tmp_path / "qs", "--set", "optim.lr=1e12",
                          "--set", "optim.warmup_steps=1", check=False)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert errors[0].startswith("error: U-ViT: loss is nan")  # the first model's result
    assert "optim.lr" in errors[0]  # what to try
    log = tmp_path / "qs" / "uvit.log"
    assert errors[0].endswith(f"(full output: {log})")
    assert "TrainError: loss is nan" in log.read_text()  # the worker's traceback
    assert not (tmp_path / "qs" / "results.json").exists()


@pytest.mark.slow
def test_an_autoguidance_model_the_run_does_not_keep_is_refused_before_training(
        tmp_path: Path) -> None:
    proc = run_quickstart(tmp_path, tmp_path / "qs", "--set", "train.keep_steps=[]",
                          check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: sample.autoguidance_ckpt=")
    assert proc.stderr.count("\n") == 1 and "train.keep_steps=[]" in proc.stderr
    assert not (tmp_path / "qs").exists()  # nothing trained, nothing written


@pytest.mark.parametrize("steps, when", [(8, "ends at step 8"), (5, "ends before step 8")])
def test_a_run_that_ends_at_or_before_its_guide_samples_unguided_with_a_note(
        capsys, steps: int, when: str) -> None:
    """Step 8 of an 8-step run is the final model (guided by itself it would sample as
    unguided, at twice the cost); a 5-step run never writes it. Either run samples unguided,
    and one note says so before any training, and how to keep autoguidance."""
    from uvic.cli.quickstart import parse_args
    from uvic.experiments.quickstart_steps import build_config

    cfg = build_config(parse_args([
        "--preset", "cpu", "--set", f"train.max_steps={steps}", "--set", "train.keep_steps=[8]",
        "--set", "sample.autoguidance_ckpt=checkpoints/step_000008/ema.safetensors"]))
    assert cfg.sample.autoguidance_scale == 0
    (note,) = capsys.readouterr().out.splitlines()
    assert note.startswith(f"note: train.max_steps={steps} {when}, whose EMA is the "
                           "autoguidance guide (sample.autoguidance_ckpt): sampling unguided")
    assert "to keep autoguidance, guide with an earlier step" in note


def test_loss_plot_names_the_training_objective(tmp_path: Path) -> None:
    """loss.png's axis says what the curves are: Min-SNR weighted when the config is."""
    from uvic.cli.quickstart import parse_args
    from uvic.experiments.quickstart_report import objective_name, plot_losses
    from uvic.experiments.quickstart_steps import build_config

    cfg = build_config(parse_args([]))
    logs = {"U-ViT": [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}]}
    figure = plot_losses(logs, tmp_path / "loss.png", objective_name(cfg.diffusion))
    assert figure.axes[0].get_ylabel() == "training loss (Min-SNR-5 weighted noise MSE)"
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    plain = dataclasses.replace(cfg.diffusion, min_snr_gamma=0.0)
    assert objective_name(plain) == "noise MSE"


def test_fid_says_it_is_skipped_before_anything_else(tmp_path: Path, capsys) -> None:
    """Without Inception weights the quickstart's line says FID is skipped (not "FID (256
    samples)" and then no FID), and no sample is made for it."""
    from uvic.cli.quickstart import parse_args
    from uvic.config import apply_overrides
    from uvic.experiments.quickstart_steps import build_config, try_fid

    absent = tmp_path / "absent" / "inception-2015-12-05.pt"
    cfg = apply_overrides(build_config(parse_args(["--preset", "cpu"])),
                          [f"eval.inception_path={absent}"])
    value, why = try_fid(cfg, tmp_path / "no.safetensors", tmp_path / "run", "U-ViT")
    assert value is None and str(absent) in why
    assert capsys.readouterr().out.splitlines() == [
        "=== U-ViT: FID skipped (no Inception weights: results.md says how to get them) ==="]
    assert not (tmp_path / "run").exists()
