"""`uvic-compare` at reduced size: 2 variants x 2 seeds of a tiny model through the real
training loop, evaluated at matched steps; the report's statistics recomputed by hand from
the per-run evaluation files; resumption; pairing; and the one-line refusals."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from readme_commands import argv

from uvic.cli import compare
from uvic.experiments import compare_plan, compare_report

T1 = math.tan(math.pi * 0.475)  # t(0.975) with 1 degree of freedom (2 seeds)
T2 = 0.95 / math.sqrt(2 * 0.975 * 0.025)  # t(0.975) with 2 degrees of freedom (3 seeds)
TINY = ["train.max_steps=6", "train.batch_size=4", "model.embed_dim=16", "model.depth=2",
        "model.num_heads=2", "eval.n_samples=4", "sample.steps=2", "train.keep_steps=[]",
        "sample.autoguidance_scale=0", "data.num_images=32", "train.log_every=3",
        "train.log_with=", "optim.warmup_steps=2", "model.attention_backend=torch"]
# The README's commands, shrunk by ARGS (later options win)
README_RUN = "python scripts/compare.py --steps 1500,2100 --best --set eval.n_samples=128"
README_PLAN = "python scripts/compare.py --dry-run --steps 1500,2100 --set eval.n_samples=128"
# docs/recipes.md's comparison under flow matching
README_FLOW = ("python scripts/compare.py --variants uvit,uvic --set eval.n_samples=128 "
               "--set diffusion.objective=velocity --set diffusion.min_snr_gamma=0 "
               "--set sample.scheduler=flow_heun --set sample.steps=25 "
               "--set train.max_steps=1200 --set 'train.keep_steps=[500]' "
               "--set sample.autoguidance_ckpt=checkpoints/step_000500/ema.safetensors "
               "--threads 1 --out runs/flowcmp")
VELOCITY = "v:diffusion.objective=velocity;diffusion.min_snr_gamma=0;sample.scheduler=flow_heun"
ARGS = ["--variants", "uvit,uvic", "--seeds", "2", "--steps", "3", "--heldout", "8",
        "--threads", "1", "--best", *[w for o in TINY for w in ("--set", o)]]


def run(tmp_path: Path, *extra: str, readme: str | None = None) -> int:
    words = argv(readme)[2:] if readme else []
    return compare.main([*words, *ARGS, "--out", str(tmp_path / "cmp"), *extra])


@pytest.mark.slow
def test_readme_plan_states_the_compute(tmp_path: Path, capsys) -> None:
    """The README's dry run, as written: every attention preset (6) x 3 seeds, 3
    evaluation steps."""
    assert compare.main([*argv(README_PLAN)[2:], "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert ("6 variants (uvit, uvic, uvie, uvis, uvid, uvid2) x 3 seeds (1234, 1235, 1236) "
            "= 18 runs") in out
    assert "18 runs x 2,700 steps x 32 images = 48,600 steps" in out
    assert "18 runs x 3 steps (1500, 2100, 2700) = 54" in out
    assert "128 x 100 network calls = 12,800 image forwards per evaluation" in out


@pytest.mark.slow
def test_compare_end_to_end(tmp_path: Path, capsys) -> None:
    assert run(tmp_path, readme=README_RUN) == 0
    out = tmp_path / "cmp"
    report = json.loads((out / "compare.json").read_text())
    assert report["seeds"] == [1234, 1235] and report["grid"] == [3, 6]
    assert report["pairing"]["share_of_initial_weights_equal_to_first"] == {"uvit": 1.0,
                                                                           "uvic": 1.0}
    for metric in ("heldout_mse", "standin_fid", "hf_ratio", "palette_share", "shape_share"):
        for step in (3, 6):
            runs = {(v, s): json.loads((out / "evals" / f"{v}_seed{s}" /
                                        f"step_{step:06d}.json").read_text())
                    for v in ("uvit", "uvic") for s in (1234, 1235)}
            x = {k: r["metrics"][metric] for k, r in runs.items()}
            got = report["summary"][metric]["steps"][str(step)]
            for v in ("uvit", "uvic"):  # 2 seeds: mean, half-width t1 * |x1 - x2| / 2
                a, b = x[v, 1234], x[v, 1235]
                assert got["variants"][v]["mean"] == pytest.approx((a + b) / 2, abs=1e-12)
                assert got["variants"][v]["half_width"] == pytest.approx(
                    T1 * abs(a - b) / 2, rel=1e-9, abs=1e-12)
            (pair,) = got["pairs"]  # uvic - uvit, seed by seed
            d = [x["uvic", s] - x["uvit", s] for s in (1234, 1235)]
            assert (pair["a"], pair["b"]) == ("uvit", "uvic")
            assert pair["mean"] == pytest.approx(sum(d) / 2, abs=1e-12)
            assert pair["t_half_width"] == pytest.approx(T1 * abs(d[0] - d[1]) / 2,
                                                         rel=1e-9, abs=1e-12)
            # 2 seeds: the MDE by the closed forms of t with 1 degree of freedom; the
            # bootstrap (4 resamples) is not read: nulled, and said so
            assert pair["mde"] == pytest.approx((T1 + math.tan(math.pi * 0.3)) *
                                                abs(d[0] - d[1]) / 2, rel=1e-9, abs=1e-12)
            assert pair["verdict"] in ("B higher", "B lower") or \
                pair["verdict"].startswith("inconclusive: MDE ")
            assert pair["bootstrap_valid"] is False and pair["bootstrap_p"] is None
            assert pair["bootstrap_low"] is None and pair["bootstrap_high"] is None
            assert pair["bootstrap_note"] == "needs >= 6 seeds"
        best = report["summary"][metric]["best"]["variants"]["uvit"]
        assert set(best["steps"].values()) <= {3, 6}
    assert report["protocols"]["standin_fid"].endswith("NOT comparable with Inception FID)")
    assert report["git_commit"] and report["configs"]["uvic_seed1235"]["train"]["seed"] == 1235
    # the pairs' samples start from the same noise: after 6 steps from the same weights the
    # held-out MSEs of the two variants agree closely but are not equal
    h = report["summary"]["heldout_mse"]["steps"]["6"]["variants"]
    assert h["uvit"]["mean"] != h["uvic"]["mean"]
    text = (out / "compare.md").read_text()
    assert "| uvic − uvit | 6 |" in text and "best step (selected on this metric itself)" in text
    assert "| needs >= 6 seeds | needs >= 6 seeds |" in text
    assert r"\pm" in (out / "compare.tex").read_text() and (out / "compare.png").stat().st_size

    # resumes: nothing is redone; a lost evaluation is redone, bit for bit
    lost = out / "evals" / "uvic_seed1235" / "step_000003.json"
    before = json.loads(lost.read_text())
    lost.unlink()
    capsys.readouterr()
    assert run(tmp_path, readme=README_RUN) == 0
    printed = capsys.readouterr().out
    assert printed.count("trained (skipped)") == 4 and printed.count("(skipped)") == 11
    assert json.loads(lost.read_text())["metrics"] == before["metrics"]


@pytest.mark.parametrize("extra, message", [
    (["--variants", "uvit,nope"], "unknown variant 'nope'"),
    (["--seeds", "1"], "--seeds 1: one seed gives no interval"),
    (["--table-steps", "4"], "--table-steps 4: not on the evaluation grid (3, 6)"),
    (["--steps", "9"], "evaluation step 9 is outside the run"),
    (["--variant", "x:train.seed=3", "--variants", "uvit,x"], "variant 'x' sets train.seed"),
    (["--metrics", "fidd"], "--metrics 'fidd'"),
    (["--variant", VELOCITY, "--variants", "uvit,v"],  # a noise MSE beside a velocity MSE
     "--metrics heldout_mse: variant 'v' has diffusion.objective='velocity', not 'eps'"),
    (["--metrics", "fid", "--set", "eval.inception_path=/nowhere/inception.pt"],
     "FID Inception weights not found at /nowhere/inception.pt"),
    (["--margin", "heldout_mse=-0.1"],
     "--margin 'heldout_mse=-0.1': expected METRIC=VALUE with a number > 0"),
    (["--margin", "heldout_mse=abc"], "--margin 'heldout_mse=abc': expected METRIC=VALUE"),
    (["--margin", "heldout_mse"], "--margin 'heldout_mse': expected METRIC=VALUE"),
    (["--margin", "fid=1"], "--margin 'fid=1': 'fid' is not a compared metric (heldout_mse, "),
    (["--margin", "nope=1"], "--margin 'nope=1': 'nope' is not a compared metric"),
])
def test_bad_input_is_one_line(tmp_path: Path, capsys, extra: list[str], message: str) -> None:
    assert run(tmp_path, "--dry-run", *extra) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_runs_trained_with_other_settings_are_refused(tmp_path: Path, capsys) -> None:
    """A run folder that trained under other settings than the plan's (another learning
    rate here) is refused in one line before anything runs, the dry run too: it would be
    skipped or continued and reported under settings it was not trained with."""
    from uvic.config import apply_overrides
    from uvic.experiments.compare_run import jobs_of
    from uvic.files import save_config

    plan = compare_plan.make_plan(compare.parse_args([*ARGS, "--out", str(tmp_path / "cmp")]))
    job = jobs_of(plan)[0]
    save_config(apply_overrides(job.cfg, ["optim.lr=0.5"]), job.run_dir / "config.json")
    assert run(tmp_path, "--dry-run") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {job.run_dir} was trained with other settings "
                              "(optim.lr: 0.5 -> ")
    save_config(apply_overrides(job.cfg, ["eval.n_samples=7", "train.max_steps=2"]),
                job.run_dir / "config.json")  # what it makes of a run, and its length: free
    assert run(tmp_path, "--dry-run") == 0


@pytest.mark.slow
def test_flow_matching_plan_and_report(tmp_path: Path, capsys) -> None:
    """docs/recipes.md's comparison under flow matching: its plan counts flow_heun's 2 steps
    - 1 network calls, twice with autoguidance; at tiny size, its samples come from the flow
    sampler (the protocol says so) and its held-out MSE is labelled the velocity MSE."""
    assert compare.main([*argv(README_FLOW)[2:], "--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 variants (uvit, uvic) x 3 seeds (1234, 1235, 1236) = 6 runs" in out
    assert "6 runs x 1,200 steps x 32 images" in out
    assert "128 x 98 network calls = 12,544 image forwards per evaluation" in out
    assert run(tmp_path, "--seeds", "2", readme=README_FLOW) == 0
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert report["protocols"]["standin_fid"].startswith(
        "flow_heun (velocity, linear interpolant) 2 steps")
    what = report["metrics"]["heldout_mse"]["what"]
    assert what.startswith("held-out velocity MSE") and "noise" not in what.split(";")[0]
    text = (tmp_path / "cmp" / "compare.md").read_text()
    assert "## held-out velocity MSE of the EMA weights (linear interpolant, uniform times" in text
    assert "noise MSE" not in text.replace("NOT comparable with a noise MSE", "")
    # and the eps comparison keeps its label
    plan = compare_plan.make_plan(compare.parse_args([*ARGS, "--out", str(tmp_path)]))
    assert plan.what("heldout_mse") == "held-out noise MSE of the EMA weights"


def test_guided_steps_before_the_guide_are_refused(tmp_path: Path, capsys) -> None:
    assert compare.main(["--dry-run", "--steps", "900", "--out", str(tmp_path)]) == 2
    assert "step 900: its samples would be guided by the run's own step-1000" in (
        capsys.readouterr().err)


def test_the_runs_keep_their_guide_though_the_base_config_does_not(tmp_path: Path) -> None:
    """The comparison's runs keep the evaluated steps (the guide's among them) in folders of
    their own: the guide is checked on each run's config, not on the base's."""
    plan = compare_plan.make_plan(compare.parse_args([
        "--set", "train.keep_steps=[]", "--steps", "1000,2700", "--metrics", "heldout_mse",
        "--out", str(tmp_path)]))
    assert all(1000 in cfg.train.keep_steps and cfg.sample.autoguidance_scale > 0
               for cfg in plan.configs.values())


def test_attention_variants_must_keep_the_parameters(tmp_path: Path, capsys,
                                                     monkeypatch) -> None:
    """Presets start from the same weights (the end-to-end test); a variant whose model
    changed a shared weight's shape where only attention was asked for is refused."""
    import uvic.models.uvit as uvit

    real = uvit.build_model

    def build(model):
        net = real(model)
        if model.attention == "uvic":
            net.pos_embed = torch.nn.Parameter(torch.zeros(1, 1, net.embed_dim))
        return net

    monkeypatch.setattr(uvit, "build_model", build)
    assert run(tmp_path, "--dry-run") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: variant 'uvic' has ") and "attention only" in err
    # a variant that asks for another model is compared as asked
    assert run(tmp_path, "--dry-run", "--variant", "wide:model.attention=uvic;model.qkv_bias=true",
               "--variants", "uvit,wide") == 0


def hand_report(tmp_path: Path, diffs: list[float], *extra: str) -> tuple[dict, str]:
    """The summary and markdown of a comparison whose evaluation files are written by hand:
    held-out MSE uvit 1 + seed index / 10 and uvic that plus `diffs`, at steps 3 and 6."""
    plan = compare_plan.make_plan(compare.parse_args(
        [*ARGS, "--seeds", str(len(diffs)), "--out", str(tmp_path), *extra]))
    records = {}
    for k, seed in enumerate(plan.seeds):
        base = 1 + k / 10
        for v, value in (("uvit", base), ("uvic", base + diffs[k])):
            records[f"{v}_seed{seed}"] = {t: {"metrics": {"heldout_mse": value}}
                                          for t in plan.grid}
    summary = compare_report.summarize(plan, records)
    return summary, compare_report.markdown(plan, summary, [])


def test_report_states_mde_verdict_and_bootstrap_validity(tmp_path: Path) -> None:
    """2 seeds: MDE (T1 + t(0.8, 1)) |d1 - d2| / 2, an inconclusive verdict, and "needs >= 6
    seeds" where the bootstrap would say p 0; 6 seeds: the exact bootstrap and its p; a
    margin: the TOST p column and the equivalence verdict."""
    summary, text = hand_report(tmp_path, [0.02, -0.01])
    (pair,) = summary["heldout_mse"]["steps"][6]["pairs"]
    mde = (T1 + math.tan(math.pi * 0.3)) * 0.03 / 2
    assert pair["mde"] == pytest.approx(mde, rel=1e-9)
    line = next(x for x in text.splitlines() if x.startswith("| uvic − uvit | 6 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[4:] == [f"{mde:.3g}", f"inconclusive: MDE {mde:.3g} at 80% power",
                         "needs >= 6 seeds", "needs >= 6 seeds"]
    assert "| MDE (80% power) | verdict | bootstrap interval | bootstrap p |" in text
    assert pair["bootstrap_p"] is None and "TOST" not in line

    diffs = [0.02, -0.01, 0.015, 0.0, 0.005, -0.005]
    summary, text = hand_report(tmp_path, diffs, "--margin", "heldout_mse=0.05")
    (pair,) = summary["heldout_mse"]["steps"][6]["pairs"]
    assert pair["bootstrap_valid"] and pair["bootstrap_resamples"] == 6 ** 6
    assert summary["heldout_mse"]["margin"] == 0.05 and pair["tost_p"] < 0.05
    line = next(x for x in text.splitlines() if x.startswith("| uvic − uvit | 6 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[5] == f"equivalent within ±0.05 (TOST p {pair['tost_p']:.2g})"
    assert cells[6] == f"{pair['tost_p']:.3g}" and cells[8] == f"{pair['bootstrap_p']:.3g}"
    assert cells[7].endswith("(exact, 46656)") and "needs" not in line
    assert "| TOST p (±0.05) |" in text


def pilot(tmp_path: Path, pairs: list[dict], **extra) -> Path:
    path = tmp_path / "pilot" / "compare.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"seeds": [1, 2, 3], "grid": [5, 10], "table_steps": [10],
                                "summary": {"heldout_mse": {
                                    "what": "held-out noise MSE", "better": "lower",
                                    "steps": {"10": {"pairs": pairs}}}}, **extra}))
    return path


def seeds_needed(sd: float, target: float) -> int:
    """The fewest seeds whose MDE, by scipy's t quantiles, is at most `target`."""
    from scipy import stats

    n = 2
    while (stats.t.ppf(0.975, n - 1) + stats.t.ppf(0.8, n - 1)) * sd / math.sqrt(n) > target:
        n += 1
    return n


def test_plan_from_a_pilot(tmp_path: Path, capsys) -> None:
    """--plan on a hand-written compare.json: per pair the sd, the MDE at the pilot's 3 seeds
    ((T2 + t(0.8, 2)) sd / sqrt 3) and the seeds for the observed difference or --target; a
    report without sd gives it from the t half-width."""
    t80 = 0.6 / math.sqrt(2 * 0.8 * 0.2)
    half = T2 * 0.004 / math.sqrt(3)
    path = pilot(tmp_path, [{"a": "uvit", "b": "uvic", "n": 3, "mean": 0.002, "sd": 0.004,
                             "t_half_width": half},
                            {"a": "uvit", "b": "uvie", "n": 3, "mean": -0.01,
                             "t_half_width": half}])
    assert compare.main(["--plan", str(path.parent)]) == 0
    out = capsys.readouterr().out
    mde = (T2 + t80) * 0.004 / math.sqrt(3)
    assert f"| uvic − uvit | 3 | +0.002 | 0.004 | {mde:.3g} | 0.002 (observed) | " \
           f"{seeds_needed(0.004, 0.002)} |" in out
    assert f"| uvie − uvit | 3 | -0.01 | 0.004 | {mde:.3g} | 0.01 (observed) | " \
           f"{seeds_needed(0.004, 0.01)} |" in out
    assert "## held-out noise MSE (lower is better), step 10" in out
    assert compare.main(["--plan", "--out", str(path.parent), "--target",
                         "heldout_mse=0.0005"]) == 0
    out = capsys.readouterr().out
    assert f"| 0.0005 | {seeds_needed(0.004, 0.0005)} |" in out and "observed" not in out
    assert seeds_needed(0.004, 0.0005) > 100


@pytest.mark.parametrize("content, extra, message", [
    (None, [], "No such file"),
    ("{not json", [], "Expecting property name"),
    ('{"seeds": [1, 2]}', [], "not the compare.json of a finished uvic-compare run"),
    ('{"grid": [10], "summary": {"heldout_mse": {"steps": {"10": {"pairs": '
     '[{"n": 3, "mean": "x", "sd": 1}]}}}}}', [], "not the compare.json of a finished"),
    ('{"grid": [10], "summary": {"heldout_mse": {"steps": {"10": {"pairs": []}}}}}', [],
     "no paired differences in it"),
    ("pilot", ["--target", "fid=1"], "--target 'fid=1': 'fid' is not a compared metric "
                                     "(heldout_mse)"),
    ("pilot", ["--target", "heldout_mse=0"], "--target 'heldout_mse=0': expected METRIC="),
])
def test_plan_refuses_in_one_line(tmp_path: Path, capsys, content: str | None,
                                  extra: list[str], message: str) -> None:
    path = tmp_path / "compare.json"
    if content == "pilot":
        path = pilot(tmp_path, [{"a": "x", "b": "y", "n": 3, "mean": 0.1, "sd": 0.1,
                                 "t_half_width": 0.2}])
    elif content is not None:
        path.write_text(content)
    assert compare.main(["--plan", str(path), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --") and message in err and err.count("\n") == 1, err


@pytest.mark.slow
def test_plan_and_margin_check_before_torch(tmp_path: Path) -> None:
    """--plan and a bad --margin are answered without importing torch."""
    path = pilot(tmp_path, [{"a": "x", "b": "y", "n": 3, "mean": 0.1, "sd": 0.1,
                             "t_half_width": 0.2}])
    code = ("import sys; from uvic.cli import compare; rc = compare.main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'torch loaded'; sys.exit(rc)")
    for words, rc in ((["--plan", str(path)], 0), (["--margin", "heldout_mse=0"], 2)):
        done = subprocess.run([sys.executable, "-c", code, *words, "--out", str(tmp_path)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == rc, done.stderr
        assert "torch loaded" not in done.stderr
    assert done.stderr.startswith("error: --margin 'heldout_mse=0'")


DESIGNS_RESULT = Path(__file__).resolve().parents[1] / "docs/compare_designs.json"


@pytest.mark.parametrize("variant", ["uvit", "uvic", "uvie", "uvis", "uvid", "uvid2",
                                     "uvit_gate", "uvic_gate"])
def test_documented_design_comparison_is_the_recorded_run(variant: str) -> None:
    """docs/comparisons.md's table of every design is the recorded comparison: each row's
    five cells are its summary at the last step, and the summary is its runs' mean."""
    import math

    from uvic.evaluation.paired import Interval, format_interval

    record = json.loads(DESIGNS_RESULT.read_text())
    step = str(record["grid"][-1])
    cells = []
    for metric in ("heldout_mse", "standin_fid", "hf_ratio", "palette_share", "shape_share"):
        d = record["summary"][metric]["steps"][step]["variants"][variant]
        runs = [r["metrics"][step][metric] for r in record["runs"].values()
                if r["variant"] == variant]
        assert len(runs) == d["n"] == 3 and math.isclose(sum(runs) / 3, d["mean"], rel_tol=1e-9)
        cells.append(format_interval(Interval(d["mean"], d["half_width"], d["n"], d["sd"])))
    page = (DESIGNS_RESULT.parent / "comparisons.md").read_text()
    assert " | " + " | ".join(cells) + " |" in page


# docs/comparisons.md: every design and the two controls
README_DESIGNS = 'python scripts/compare.py --steps 1500,2100 --best --set eval.n_samples=128 --variants uvit,uvic,uvie,uvis,uvid,uvid2,uvit_gate,uvic_gate --variant "uvit_gate:model.attention=uvit;model.output_gate=elementwise" --variant "uvic_gate:model.attention=uvic;model.output_gate=elementwise" --out runs/compare_designs'  # noqa: E501


@pytest.mark.slow
def test_design_comparison_as_documented_plans_paired_runs(tmp_path: Path, capsys) -> None:
    """The documented command, as a dry run: 8 variants x 3 seeds, and the pairing check
    passes (a design's own weights are drawn after the shared ones)."""
    assert compare.main([*argv(README_DESIGNS)[2:], "--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert ("8 variants (uvit, uvic, uvie, uvis, uvid, uvid2, uvit_gate, uvic_gate) x 3 seeds "
            "(1234, 1235, 1236) = 24 runs") in out
