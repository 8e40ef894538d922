"""Post-hoc EMA (EDM2): the power-function profiles in closed form against direct float64
recursions and quadrature, the least-squares reconstruction recovering a known EMA from
synthetic snapshots, the snapshot bound, the profiles in a tiny training run (resume,
unchanged default runs) and `uvic-posthoc-ema` writing a checkpoint that samples."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import readme_commands
import torch
from accelerate.state import AcceleratorState, GradientState
from conftest import load_script
from readme_commands import argv
from safetensors.torch import load_file, save_file
from test_train import same_tensors, shapes_config, shapes_overrides

from uvic.cli.posthoc_ema import main as posthoc_main
from uvic.config import ConfigError, load_config
from uvic.config.validation import validate
from uvic.models.uvit import build_model
from uvic.run.folder import RunFolder
from uvic.run.prepare import save_run_config
from uvic.sampling.load import load_model
from uvic.training.posthoc_ema import (
    POSTHOC_METADATA_KEY,
    PosthocEMA,
    beta,
    describe_plan,
    gamma_to_sigma,
    kept_steps,
    profile_products,
    sigma_to_gamma,
    snapshot_bytes,
    snapshot_name,
    snapshot_steps,
    solve_coefficients,
)
from uvic.training.posthoc_reconstruct import PosthocError, read_snapshots, reconstruct
from uvic.training.trainer import train

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each train() builds its own Accelerator; reset Accelerate's process-wide singletons."""
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def power_ema(trajectory: np.ndarray, gamma: float) -> np.ndarray:
    """The power-function EMA after each step of `trajectory` (steps x ...), by the
    training recursion in float64: ema_t = beta_t ema_(t-1) + (1 - beta_t) theta_t."""
    out = np.empty_like(trajectory)
    ema = np.zeros_like(trajectory[0])
    for t in range(1, len(trajectory) + 1):
        b = (1.0 - 1.0 / t) ** (gamma + 1.0)
        ema = b * ema + (1.0 - b) * trajectory[t - 1]
        out[t - 1] = ema
    return out


# --------------------------------------------------------------------------- closed forms


def test_sigma_rel_and_gamma_are_the_closed_form():
    """EDM2's pair: sigma_rel 0.05 and 0.10 are gamma 16.97 and 6.94 (their section 3);
    gamma = 0 (the plain average) is sqrt(1/12); the inverse solves the cubic."""
    assert sigma_to_gamma(0.05) == pytest.approx(16.97, abs=0.005)
    assert sigma_to_gamma(0.10) == pytest.approx(6.94, abs=0.005)
    assert gamma_to_sigma(0.0) == pytest.approx(math.sqrt(1 / 12), rel=1e-15)
    for sigma in (0.003, 0.05, 0.1, 0.2, 0.28):
        gamma = sigma_to_gamma(sigma)
        assert gamma > 0 and gamma_to_sigma(gamma) == pytest.approx(sigma, rel=1e-12)
    # the profile (g+1) tau^g / t^(g+1) on [0, t] has that relative standard deviation
    gamma, tau = 6.94, (np.arange(200_000) + 0.5) / 200_000  # midpoint rule, t = 1
    p = (gamma + 1) * tau ** gamma / 200_000
    mean = (p * tau).sum()
    assert math.sqrt((p * (tau - mean) ** 2).sum()) == pytest.approx(gamma_to_sigma(gamma),
                                                                      rel=1e-6)
    for bad in (0.0, -0.1, 0.29, math.nan):
        with pytest.raises(ConfigError, match="is not in"):
            sigma_to_gamma(bad)


def test_recursion_weights_are_the_profile_integrated_over_each_step():
    """The recursion weights step tau by the integral of p_t over [tau - 1, tau]: the
    closed forms of continuous profiles hold exactly for what training computes."""
    gamma, t = sigma_to_gamma(0.1), 50
    weights = power_ema(np.eye(t), gamma)[-1]  # the EMA of unit impulses: each step's weight
    tau = np.arange(1, t + 1, dtype=np.float64)
    integral = (tau ** (gamma + 1) - (tau - 1) ** (gamma + 1)) / t ** (gamma + 1)
    np.testing.assert_allclose(weights, integral, rtol=1e-12, atol=1e-300)
    assert beta(gamma, 1) == 0.0  # the first update copies the weights


def test_profile_products_match_quadrature():
    """<p_a, p_b> in closed form against the midpoint rule on a fine grid."""
    n = 400_000
    tau = (np.arange(n) + 0.5) * (1000 / n)

    def profile(t: float, g: float) -> np.ndarray:
        return np.where(tau <= t, (g + 1) * tau ** g / t ** (g + 1), 0.0)

    for (ta, ga), (tb, gb) in [((1000, 6.94), (1000, 16.97)), ((400, 16.97), (1000, 6.94)),
                               ((1000, 2.0), (250, 9.0)), ((600, 6.94), (600, 6.94))]:
        numeric = (profile(ta, ga) * profile(tb, gb)).sum() * (1000 / n)
        assert profile_products(ta, ga, tb, gb) == pytest.approx(numeric, rel=1e-5)
        assert profile_products(ta, ga, tb, gb) == profile_products(tb, gb, ta, ga)


# --------------------------------------------------------------------------- reconstruction


def synthetic_run(root: Path, trajectory: np.ndarray, stds: tuple[float, ...], every: int,
                  dtype: torch.dtype = torch.float64) -> dict[float, np.ndarray]:
    """A run folder whose posthoc_ema/ holds the exact profiles of `trajectory` (steps x
    n) every `every` steps, as training writes them (file names, metadata), and a
    config.json; returns the exact EMA of every step per sigma_rel."""
    folder = RunFolder(root).posthoc_ema
    folder.mkdir(parents=True)
    save_run_config(load_config(REPO / "configs" / "quickstart.py"), root / "config.json", [])
    emas = {}
    for sigma in stds:
        gamma = sigma_to_gamma(sigma)
        emas[sigma] = power_ema(trajectory, gamma)
        for step in range(every, len(trajectory) + 1, every):
            record = {"step": step, "sigma_rel": sigma, "gamma": gamma}
            save_file({"w": torch.from_numpy(emas[sigma][step - 1]).to(dtype)},
                      str(folder / snapshot_name(step, sigma)),
                      metadata={POSTHOC_METADATA_KEY: json.dumps(record)})
    return emas


def test_recovers_a_known_ema_from_synthetic_snapshots(tmp_path):
    """A weight trajectory of 1000 steps (drift, oscillation and a random walk), profiles
    0.05 and 0.10 saved every 50 steps: the reconstruction of sigma_rel 0.08 at the last
    step matches the EMA computed by direct recursion. Tolerance, derived: the error of
    each weight is int (sum_i x_i p_i - p) (theta - c) for any constant c (the coefficients
    sum to 1), so |error| <= fit * ||p|| * ||theta - mean(theta)||_2 (Cauchy-Schwarz, the
    recursion being the profile integrated over steps); the snapshots are float64."""
    rng = np.random.default_rng(0)
    steps, n = 1000, 6
    s = np.arange(1, steps + 1)[:, None]
    trajectory = (np.exp(-s / 300.0) * rng.normal(size=n) + 0.2 * np.sin(s / 40.0 + np.arange(n))
                  + 0.05 * np.cumsum(rng.normal(size=(steps, n)), axis=0) / math.sqrt(steps))
    emas = synthetic_run(tmp_path / "run", trajectory, (0.05, 0.10), every=50)
    exact = power_ema(trajectory, sigma_to_gamma(0.08))[-1]

    result = reconstruct(tmp_path / "run", 0.08, tmp_path / "out")
    got = load_file(tmp_path / "out" / "ema.safetensors")["w"].numpy()
    assert result.step == steps and len(result.snapshots) == 40
    assert sum(result.coefficients) == pytest.approx(1.0, abs=1e-12)
    gamma = sigma_to_gamma(0.08)
    norm_p = math.sqrt(profile_products(steps, gamma, steps, gamma))
    spread = np.sqrt(((trajectory - trajectory.mean(axis=0)) ** 2).sum(axis=0))
    bound = result.fit * norm_p * spread
    error = np.abs(got - exact)
    assert np.all(error <= bound * (1 + 1e-6) + 1e-12), (error, bound)
    assert 0 < result.fit < 0.01  # two profiles every 50 steps span sigma_rel 0.08 well
    # and it is a reconstruction, not the nearest saved profile: far closer than either
    nearest = np.minimum(np.abs(emas[0.05][-1] - exact), np.abs(emas[0.10][-1] - exact))
    assert np.all(error < 0.05 * nearest), (error, nearest)
    report = json.loads((tmp_path / "out" / "posthoc_ema.json").read_text())
    assert report["fit"] == result.fit and len(report["coefficients"]) == 40


def test_reconstructing_a_saved_profile_returns_that_snapshot(tmp_path):
    """sigma_rel 0.10 at a snapshot step: coefficient 1 on that snapshot, 0 elsewhere, fit
    0, and the weights written are the snapshot's (float32 files: to float32 rounding)."""
    rng = np.random.default_rng(1)
    trajectory = np.cumsum(rng.normal(size=(300, 5)), axis=0)
    synthetic_run(tmp_path / "run", trajectory, (0.05, 0.10), every=30, dtype=torch.float32)
    result = reconstruct(tmp_path / "run", 0.10, tmp_path / "out", step=240)
    used = [(s.step, s.sigma_rel) for s in result.snapshots]
    assert len(used) == 16 and max(step for step, _ in used) == 240
    expected = np.array([1.0 if u == (240, 0.10) else 0.0 for u in used])
    np.testing.assert_allclose(result.coefficients, expected, atol=1e-9)
    assert result.fit < 1e-6
    snapshot = load_file(RunFolder(tmp_path / "run").posthoc_ema
                         / snapshot_name(240, 0.10))["w"]
    got = load_file(tmp_path / "out" / "ema.safetensors")["w"]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, snapshot, rtol=1e-6, atol=1e-6)


def test_bad_requests_are_one_line(tmp_path, capsys):
    """Missing run folder, run without snapshots, sigma_rel out of range, a step without
    snapshots, an output folder in use: one line naming it, exit status 2."""
    synthetic_run(tmp_path / "run", np.ones((20, 2)), (0.05,), every=10)
    (tmp_path / "empty").mkdir()
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    cases = [
        ([str(tmp_path / "nope"), "--sigma-rel", "0.1"], "run folder not found"),
        ([str(tmp_path / "empty"), "--sigma-rel", "0.1"], "no post-hoc EMA snapshots in"),
        ([str(tmp_path / "run"), "--sigma-rel", "0.3"], "--sigma-rel 0.3: sigma_rel 0.3 is not"),
        ([str(tmp_path / "run"), "--sigma-rel", "0.1", "--step", "15"],
         "--step 15: no snapshots at that step"),
        ([str(tmp_path / "run"), "--sigma-rel", "0.1", "--out", str(tmp_path / "used")],
         "exists and is not an empty folder"),
    ]
    for args, needle in cases:
        if "--out" not in args:
            args = [*args, "--out", str(tmp_path / "out")]
        assert posthoc_main(args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and needle in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()
    (RunFolder(tmp_path / "run").posthoc_ema / "junk.safetensors").write_bytes(b"x" * 16)
    with pytest.raises(PosthocError, match=re.escape("junk.safetensors: not a post-hoc EMA")):
        read_snapshots(tmp_path / "run")
    synthetic_run(tmp_path / "nan", np.full((20, 2), np.nan), (0.05,), every=10)
    with pytest.raises(PosthocError, match="'w' holds NaN or inf"):
        reconstruct(tmp_path / "nan", 0.05, tmp_path / "out")


# --------------------------------------------------------------------------- training side


def test_profiles_follow_the_float64_recursion():
    """PosthocEMA on a small module whose weights follow a known trajectory: each profile
    is the float64 recursion's EMA (to float32 rounding); its state round-trips."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    tracker = PosthocEMA(model, (0.05, 0.2))
    trajectory = np.random.default_rng(2).normal(size=(40, 8))
    for theta in trajectory:
        with torch.no_grad():
            model.weight.copy_(torch.from_numpy(theta[:6].reshape(2, 3)))
            model.bias.copy_(torch.from_numpy(theta[6:]))
        tracker.update(model)
    for sigma, profile in zip((0.05, 0.2), tracker.profiles):
        exact = power_ema(trajectory, sigma_to_gamma(sigma))[-1]
        got = torch.cat([profile.weight.flatten(), profile.bias]).double().numpy()
        np.testing.assert_allclose(got, exact, rtol=0, atol=2e-6)
    copy = PosthocEMA(torch.nn.Linear(3, 2), (0.05, 0.2))
    copy.load_state_dict(tracker.state_dict())
    assert copy.step == 40 and same_tensors(copy.state_dict(), tracker.state_dict())


def test_bounded_snapshots_thin_out_the_same_way_after_any_history(tmp_path):
    """keep = 5, a snapshot every 10 steps: after each save at most 5 per profile remain,
    always the newest and the multiples of a doubling interval, whatever was on disk."""
    on_disk: set[int] = set()
    for step in range(10, 1001, 10):
        on_disk.add(step)
        keep = kept_steps(step, 10, 5)
        on_disk = {s for s in on_disk if keep(s)}
        direct = {s for s in range(10, step + 1, 10) if keep(s)}
        assert on_disk == direct and step in on_disk and len(on_disk) <= 5
    # 100 saves: the interval doubles 10, 20, ..., 320 (3 multiples and step 1000)
    assert on_disk == {320, 640, 960, 1000}
    # the files PosthocEMA leaves: a snapshot every step, at most 3 per profile
    tracker = PosthocEMA(torch.nn.Linear(2, 2), (0.05, 0.1))
    tracker.folder, tracker.every, tracker.keep, tracker.max_steps = tmp_path, 1, 3, 100
    for _ in range(13):
        tracker.update(torch.nn.Linear(2, 2))
    # interval 8 at step 13: its one multiple and the newest
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        snapshot_name(s, x) for s in (8, 13) for x in (0.05, 0.1))
    keep_all = kept_steps(1005, 10, 0)  # 0: every multiple of the interval, and the last
    assert all(keep_all(s) for s in [*range(10, 1001, 10), 1005]) and not keep_all(995)


def test_posthoc_ema_settings_are_validated(tmp_path):
    for override, needle in [("train.posthoc_ema_stds=[0.05,0.3]", "sigma_rel 0.3 is not in"),
                             ("train.posthoc_ema_stds=[0.1,0.1]", "repeats a profile"),
                             ("train.posthoc_ema_every=0", "train.posthoc_ema_every=0 must"),
                             ("train.posthoc_ema_keep=-1", "train.posthoc_ema_keep=-1 must")]:
        with pytest.raises(ConfigError, match=needle.replace("[", r"\[")):
            validate(shapes_config(tmp_path / "run", override))


# The commands of docs/training.md's "Post-hoc EMA", run here at tiny scale (later options win)
DOC_TRAIN = ("python scripts/train.py --config configs/quickstart.py "
             "--set train.posthoc_ema_stds=0.05,0.1 --set train.posthoc_ema_every=100 "
             "--output-dir runs/quickstart_phema")
DOC_RECONSTRUCT = ("python scripts/posthoc_ema.py runs/quickstart_phema --sigma-rel 0.08 "
                   "--out runs/quickstart_phema/phema_0.080")
DOC_SAMPLE = ("python scripts/sample.py --config runs/quickstart_phema/phema_0.080/config.json "
              "--ckpt runs/quickstart_phema/phema_0.080/ema.safetensors "
              "--out samples/quickstart_phema")


@pytest.mark.slow
def test_training_keeps_profiles_resumes_them_exactly_and_reconstructs(tmp_path, capsys,
                                                                        monkeypatch):
    """The documented commands at tiny scale (profiles 0.05 and 0.10 saved every 2 steps,
    6 steps): the snapshots appear and checkpoints carry the profiles; a run stopped at
    step 3 and resumed to 6 writes bitwise the same snapshots; the model and EMA are those
    of the same run without post-hoc EMA, which writes nothing of it; a resume that
    changes the profiles or the interval is refused; the reconstruction samples."""
    commands = readme_commands.readme_commands(readme_commands.page("docs/training.md"))
    assert {DOC_TRAIN, DOC_RECONSTRUCT, DOC_SAMPLE} <= set(commands)
    monkeypatch.chdir(tmp_path)
    tiny = [w for o in shapes_overrides(tmp_path)[1:] for w in ("--set", o)]
    tiny += ["--set", "train.max_steps=6", "--set", "train.posthoc_ema_every=2"]
    assert load_script("scripts/train.py").main([*argv(DOC_TRAIN)[2:], *tiny]) == 0
    whole = tmp_path / "runs" / "quickstart_phema"
    on = ("train.posthoc_ema_stds=[0.05,0.1]", "train.posthoc_ema_every=2")
    off, split = tmp_path / "off", tmp_path / "split"
    train(shapes_config(off, "train.max_steps=6"))
    train(shapes_config(split, "train.max_steps=3", *on))
    assert sorted(snapshot_steps(RunFolder(split).posthoc_ema)) == [2, 3]  # 3: the last step
    for changed, needle in [(("train.posthoc_ema_stds=[0.05]",), "cannot start or change"),
                            ((*on, "train.posthoc_ema_every=3"), "keeps the snapshot interval")]:
        with pytest.raises(ConfigError, match=needle):
            train(shapes_config(split, "train.max_steps=6", *changed), resume="latest")
    train(shapes_config(split, "train.max_steps=6", *on), resume="latest")

    folder = RunFolder(whole).posthoc_ema
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted(snapshot_name(s, x) for s in (2, 4, 6) for x in (0.05, 0.1))
    assert sorted(p.name for p in RunFolder(split).posthoc_ema.iterdir()) == names
    for name in names:
        assert same_tensors(load_file(folder / name),
                            load_file(RunFolder(split).posthoc_ema / name)), name
    snaps = read_snapshots(whole)
    assert [(s.step, s.sigma_rel) for s in snaps][-2:] == [(6, 0.05), (6, 0.1)]
    assert snaps[-1].gamma == sigma_to_gamma(0.1)
    last = RunFolder(whole).checkpoint(6)
    assert (last / "custom_checkpoint_1.pkl").is_file()
    assert not RunFolder(off).posthoc_ema.exists()
    assert not (RunFolder(off).checkpoint(6) / "custom_checkpoint_1.pkl").exists()
    for file in ("model.safetensors", "ema.safetensors"):
        assert same_tensors(load_file(last / file),
                            load_file(RunFolder(off).checkpoint(6) / file)), file

    capsys.readouterr()
    assert load_script("scripts/posthoc_ema.py").main(argv(DOC_RECONSTRUCT)[2:]) == 0
    assert "at step 6 from 6 snapshots" in capsys.readouterr().out
    out = whole / "phema_0.080"
    weights = out / "ema.safetensors"
    net = load_model(load_config(out / "config.json"), weights)  # what uvic-sample loads
    assert same_tensors(dict(net.state_dict()), load_file(weights))
    assert not same_tensors(load_file(weights), load_file(folder / snapshot_name(6, 0.1)))
    sample = ["--n", "2", "--steps", "2", "--quiet", "--set", "sample.autoguidance_scale=0"]
    assert load_script("scripts/sample.py").main([*argv(DOC_SAMPLE)[2:], *sample]) == 0
    assert (tmp_path / "samples" / "quickstart_phema" / "grid.png").is_file()


@pytest.mark.slow
def test_docs_state_the_disk_use_and_the_fit_of_bounded_snapshots():
    """docs/training.md's disk lines are what a run of the CIFAR-10 U-ViC says at its
    start, and its table of fits is what `solve_coefficients` gives."""
    text = readme_commands.section("docs/training.md", "## Post-hoc EMA")
    on = ["train.posthoc_ema_stds=0.05,0.1", "train.posthoc_ema_every=4096"]
    for keep in (0, 32):
        cfg = load_config(REPO / "configs" / "cifar10_uvic.py",
                          [*on, f"train.posthoc_ema_keep={keep}"])
        line = describe_plan(cfg.train, snapshot_bytes(build_model(cfg.model)))
        assert f"    {line}\n" in text, line
    steps, every = 500_000, 4096
    gammas = [sigma_to_gamma(0.05), sigma_to_gamma(0.1)]
    for keep, count in ((0, 123), (32, 31), (8, 8)):
        kept = [s for s in [*range(every, steps + 1, every), steps]
                if kept_steps(steps, every, keep)(s)]
        row = re.search(rf"^\| {count} \(.*\) \| (.*) \|$", text, flags=re.M)
        assert len(kept) == count and row, (keep, len(kept))
        fits = []
        for sigma in (0.02, 0.05, 0.08, 0.15, 0.2, 0.25):
            fit = solve_coefficients(np.array(kept * 2), np.repeat(gammas, len(kept)),
                                     steps, sigma_to_gamma(sigma))[1]
            fits.append(f"{100 * fit:.3g}%" if fit > 1e-6 else "0%")
        assert row.group(1).split(" | ") == fits


def test_a_diverging_run_writes_no_nan_snapshot(tmp_path, monkeypatch):
    """NaN from step 6 on, between checkpoints (every 8) and logs (every 10): the snapshot
    due at step 6 is refused like a checkpoint; those on disk are finite (steps 2, 4)."""
    import uvic.training.trainer as trainer_module
    from uvic.training.launch import TrainError

    real_loss, calls = trainer_module.diffusion_loss, []

    def poisoned(*args, **kwargs):
        calls.append(1)
        return real_loss(*args, **kwargs) * (float("nan") if len(calls) >= 6 else 1.0)

    monkeypatch.setattr(trainer_module, "diffusion_loss", poisoned)
    out = tmp_path / "run"
    cfg = shapes_config(out, "train.max_steps=12", "train.ckpt_every=8", "train.log_every=10",
                        "train.posthoc_ema_stds=[0.1]", "train.posthoc_ema_every=2")
    with pytest.raises(TrainError, match=r"loss is nan \(mean of steps 1-6\); stopping \(no "):
        train(cfg)
    folder = RunFolder(out).posthoc_ema
    assert sorted(snapshot_steps(folder)) == [2, 4]
    assert all(v.isfinite().all() for p in folder.iterdir() for v in load_file(p).values())


def test_finite_check_covers_the_profiles(tmp_path):
    """A non-finite post-hoc EMA profile (model and EMA finite) stops the run before a
    checkpoint or snapshot holds it."""
    from uvic.training.launch import TrainError
    from uvic.training.trainer import Trainer

    trainer = Trainer(shapes_config(tmp_path / "run", "train.posthoc_ema_stds=[0.05,0.1]"))
    trainer.unlogged_steps = 0  # (the loop's: no loss to check here)
    try:
        trainer._check_finite()  # all finite
        next(trainer.phema.profiles[1].parameters()).data.view(-1)[0] = float("inf")
        with pytest.raises(TrainError, match="non-finite weights at step 0"):
            trainer._check_finite()
    finally:
        trainer.lock.release()
