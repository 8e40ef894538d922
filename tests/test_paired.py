"""The statistics over seeds (`uvic.evaluation.paired`) against values computed by hand.

Closed forms used as the independent reference: Student t with 2 degrees of freedom has
CDF 1/2 + t / (2 sqrt(2 + t^2)), so its quantile q is (2q - 1) / sqrt(2 q (1 - q)) and the
two-sided p-value of t is 1 - |t| / sqrt(2 + t^2); with 1 degree of freedom (Cauchy) the
quantile is tan(pi (q - 1/2)) and the p-value 1 - (2 / pi) atan |t|. The bootstrap
distributions of 3 seeds are counted by hand over the 27 ordered resamples.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from uvic.evaluation.paired import (
    BOOTSTRAP_MIN_SEEDS,
    Interval,
    OneSeedError,
    best_step,
    bootstrap_min_seeds,
    equivalence_p,
    format_interval,
    minimum_detectable_difference,
    paired_difference,
    pairs_of,
    proportion_interval,
    resample_means,
    seeds_for_difference,
    t_interval,
    verdict,
)

T2 = 0.95 / math.sqrt(2 * 0.975 * 0.025)  # t(0.975, df 2) = 4.3027
T1 = math.tan(math.pi * 0.475)  # t(0.975, df 1) = 12.706


def p_df2(t: float) -> float:
    return 1 - abs(t) / math.sqrt(2 + t * t)


def test_known_paired_differences() -> None:
    """d = b - a = (1, 2, 3): mean 2, sd 1; t = 2 sqrt(3); the 27 resampled means run from
    1 to 3 (each extreme has probability 1/27 > 2.5%, so the 95% percentile interval is
    [1, 3]); the centred differences (-1, 0, 1) never reach |2|: bootstrap p = 0."""
    a = {7: 10.0, 8: 20.0, 9: 30.0}
    b = {7: 11.0, 8: 22.0, 9: 33.0}
    d = paired_difference(a, b, ("A", "B"))
    assert (d.a, d.b, d.n) == ("A", "B", 3)
    assert d.mean == pytest.approx(2.0)
    assert d.t_half_width == pytest.approx(T2 * 1.0 / math.sqrt(3), rel=1e-9)
    assert d.t_p == pytest.approx(p_df2(2 * math.sqrt(3)), rel=1e-9)  # 0.0742
    assert (d.bootstrap_low, d.bootstrap_high) == pytest.approx((1.0, 3.0))
    assert d.bootstrap_p == 0.0
    assert d.bootstrap_resamples == 27 and d.bootstrap_exact


def test_bootstrap_p_counted_by_hand() -> None:
    """d = (-1, 0, 4): mean 1, sd sqrt(7). Centred: (-2, -1, 3); of the 27 ordered resamples
    15 have |sum| >= 3 (multisets -2-2-2, -1-1-1, 333, -2-2-1 (x3), -2-1-1 (x3), -2 3 3
    (x3), -1 3 3 (x3)), so the bootstrap p-value is 15/27."""
    d = paired_difference({0: 0.0, 1: 0.0, 2: 0.0}, {0: -1.0, 1: 0.0, 2: 4.0}, ("a", "b"))
    t = 1.0 / (math.sqrt(7) / math.sqrt(3))
    assert d.mean == pytest.approx(1.0)
    assert d.t_half_width == pytest.approx(T2 * math.sqrt(7) / math.sqrt(3), rel=1e-9)
    assert d.t_p == pytest.approx(p_df2(t), rel=1e-9)  # 0.580
    assert d.bootstrap_p == pytest.approx(15 / 27)
    assert (d.bootstrap_low, d.bootstrap_high) == pytest.approx((-1.0, 4.0))


def test_zero_and_constant_differences() -> None:
    """Equal numbers: difference 0, interval [0, 0], both p-values 1. A constant shift:
    interval [0.5, 0.5], t p-value 0, bootstrap p-value 0."""
    a = {1: 0.3, 2: 0.1, 3: 0.7}
    zero = paired_difference(a, dict(a), ("x", "y"))
    assert (zero.mean, zero.t_half_width, zero.t_p) == (0.0, 0.0, 1.0)
    assert (zero.bootstrap_low, zero.bootstrap_high, zero.bootstrap_p) == (0.0, 0.0, 1.0)
    shift = paired_difference(a, {k: v + 0.5 for k, v in a.items()}, ("x", "y"))
    assert shift.mean == pytest.approx(0.5)
    assert shift.t_half_width == pytest.approx(0.0, abs=1e-12)
    assert shift.t_p == 0.0 and shift.bootstrap_p == 0.0
    assert (shift.bootstrap_low, shift.bootstrap_high) == pytest.approx((0.5, 0.5))


def test_two_seeds_and_unshared_seeds() -> None:
    """Only the seeds both variants have are paired: here seeds 2 and 3, d = (1, 3), mean
    2, sd sqrt 2, t = 2 with 1 degree of freedom."""
    d = paired_difference({1: 9.0, 2: 1.0, 3: 2.0}, {2: 2.0, 3: 5.0, 4: 0.0}, ("a", "b"))
    assert d.n == 2 and d.mean == pytest.approx(2.0)
    assert d.t_half_width == pytest.approx(T1, rel=1e-9)
    assert d.t_p == pytest.approx(1 - 2 / math.pi * math.atan(2.0), rel=1e-9)


def test_variant_interval_and_one_seed() -> None:
    """Mean (2, 4, 9): 5, sd sqrt(13), half-width t(0.975, 2) sqrt(13 / 3). One seed is
    refused, naming what was asked."""
    iv = t_interval([2.0, 4.0, 9.0])
    assert (iv.mean, iv.n) == (pytest.approx(5.0), 3)
    assert iv.sd == pytest.approx(math.sqrt(13))
    assert iv.half_width == pytest.approx(T2 * math.sqrt(13 / 3), rel=1e-9)
    assert (iv.low, iv.high) == pytest.approx((5 - iv.half_width, 5 + iv.half_width))
    with pytest.raises(OneSeedError, match="uvic at step 10: 1 seed"):
        t_interval([1.0], what="uvic at step 10")


def test_exact_bootstrap_is_every_resample() -> None:
    """The enumerated resample means are those of itertools.product (4 seeds: 256)."""
    d = np.array([0.5, -1.0, 2.0, 3.5])
    mine = np.sort(resample_means(d))
    reference = np.sort([np.mean(c) for c in itertools.product(d, repeat=4)])
    np.testing.assert_allclose(mine, reference, rtol=0, atol=1e-12)


def test_drawn_bootstrap_is_seeded() -> None:
    """Beyond 7 seeds the resamples are drawn, the same for the same seed."""
    a = {s: 0.0 for s in range(9)}
    b = {s: float(s % 3) for s in range(9)}
    one, two = paired_difference(a, b, ("a", "b")), paired_difference(a, b, ("a", "b"))
    assert one == two and not one.bootstrap_exact
    assert 0.0 <= one.bootstrap_low <= 1.0 <= one.bootstrap_high <= 2.0


def test_pairs_best_step_and_format() -> None:
    values = {"uvit": {0: 1.0, 1: 2.0}, "uvic": {0: 1.5, 1: 2.5}, "uvie": {0: 0.0, 1: 1.0}}
    assert [(p.a, p.b) for p in pairs_of(values)] == [
        ("uvit", "uvic"), ("uvit", "uvie"), ("uvic", "uvie")]
    assert pairs_of(values)[2].mean == pytest.approx(-1.5)
    by_step = {100: 0.5, 200: 0.3, 300: 0.3, 400: 1.1}
    assert best_step(by_step, "lower") == (200, 0.3)  # ties: the earliest
    assert best_step(by_step, "higher") == (400, 1.1)
    assert best_step(by_step, "one") == (400, 1.1)  # |log 1.1| < |log 0.5|
    assert format_interval(Interval(3.2712, 0.0456, 3, 0.1)) == "3.271 ± 0.046"
    assert format_interval(Interval(3.2712, 0.456, 3, 0.1), latex=True) == r"$3.27 \pm 0.46$"


def test_proportion_interval_closed_forms():
    """Clopper-Pearson's closed forms: 0 of n -> [0, 1 - (alpha/2)^(1/n)], n of n ->
    [(alpha/2)^(1/n), 1]; k of n holds k/n and, by the binomial sums that define it, the
    ends give tail probabilities of exactly alpha/2."""
    from scipy import stats

    assert proportion_interval(0, 8) == (0.0, pytest.approx(1 - 0.025 ** (1 / 8)))
    assert proportion_interval(8, 8) == (pytest.approx(0.025 ** (1 / 8)), 1.0)
    low, high = proportion_interval(4, 8)
    assert low < 0.5 < high
    assert stats.binom.sf(3, 8, low) == pytest.approx(0.025)  # P(X >= 4 | low)
    assert stats.binom.cdf(4, 8, high) == pytest.approx(0.025)  # P(X <= 4 | high)
    with pytest.raises(ValueError, match="3 of 2"):
        proportion_interval(3, 2)


def test_minimum_detectable_difference_closed_form_and_scipy() -> None:
    """3 seeds (df 2): t(0.8, 2) = 0.6 / sqrt(0.32) by the closed form above, so the MDE of
    sd 1 is (4.3027 + 1.0607) / sqrt 3; other n against scipy's t quantiles."""
    from scipy import stats

    t80 = 0.6 / math.sqrt(2 * 0.8 * 0.2)
    assert minimum_detectable_difference(1.0, 3) == pytest.approx((T2 + t80) / math.sqrt(3),
                                                                  rel=1e-9)
    assert minimum_detectable_difference(2.0, 2) == pytest.approx(
        2 * (T1 + math.tan(math.pi * 0.3)) / math.sqrt(2), rel=1e-9)
    for sd, n, conf, power in ((0.3, 5, 0.95, 0.8), (1.7, 12, 0.99, 0.9), (0.01, 40, 0.9, 0.5)):
        df = n - 1
        want = (stats.t.ppf(1 - (1 - conf) / 2, df) + stats.t.ppf(power, df)) * sd / math.sqrt(n)
        assert minimum_detectable_difference(sd, n, conf, power) == pytest.approx(want, rel=1e-9)
    assert minimum_detectable_difference(0.0, 4) == 0.0
    with pytest.raises(OneSeedError, match="n=1"):
        minimum_detectable_difference(1.0, 1)
    with pytest.raises(ValueError, match="sd=-1"):
        minimum_detectable_difference(-1.0, 4)


def test_minimum_detectable_difference_has_its_power() -> None:
    """A true difference of one MDE is found by the two-sided paired t-test about 80% of the
    time: exactly (noncentral t) 0.79 at 5 seeds, 0.80 at 30; and in a simulation at 5."""
    from scipy import stats

    for n, low, high in ((5, 0.785, 0.795), (30, 0.798, 0.801)):
        mde, crit = minimum_detectable_difference(1.0, n), stats.t.ppf(0.975, n - 1)
        ncp = mde * math.sqrt(n)
        power = stats.nct.sf(crit, n - 1, ncp) + stats.nct.cdf(-crit, n - 1, ncp)
        assert low < power < high, (n, power)
    rng = np.random.default_rng(0)
    d = rng.normal(minimum_detectable_difference(1.0, 5), 1.0, size=(20_000, 5))
    t = d.mean(1) / (d.std(1, ddof=1) / math.sqrt(5))
    found = np.mean(np.abs(t) > stats.t.ppf(0.975, 4))  # binomial sd 0.003
    assert 0.775 < found < 0.805, found


def test_seeds_for_difference_boundary_and_monotone() -> None:
    """The smallest n whose MDE is at most |difference|: exact at the boundary, more seeds
    for a smaller difference or a larger sd; 0 and the unreachable are refused."""
    for sd, diff in ((1.0, 0.5), (0.004, 0.0008), (2.0, -3.0)):
        n = seeds_for_difference(sd, diff)
        assert minimum_detectable_difference(sd, n) <= abs(diff)
        assert n == 2 or minimum_detectable_difference(sd, n - 1) > abs(diff)
    assert seeds_for_difference(1.0, 0.5) == 34
    edge = minimum_detectable_difference(1.0, 20)
    assert seeds_for_difference(1.0, edge) == 20  # an MDE equal to the target suffices
    assert seeds_for_difference(1.0, edge * (1 - 1e-9)) == 21
    assert seeds_for_difference(0.0, 1e-9) == 2
    ns = [seeds_for_difference(1.0, x) for x in (2.0, 1.0, 0.5, 0.25, 0.1)]
    assert ns == sorted(ns) and len(set(ns)) == len(ns)
    ns = [seeds_for_difference(sd, 0.3) for sd in (0.1, 0.3, 0.6, 1.2)]
    assert ns == sorted(ns) and len(set(ns)) == len(ns)
    with pytest.raises(ValueError, match="difference=0"):
        seeds_for_difference(1.0, 0.0)
    with pytest.raises(ValueError, match="more than 100 seeds"):
        seeds_for_difference(1.0, 0.01, max_seeds=100)


def test_equivalence_p_is_two_one_sided_t_tests() -> None:
    """TOST against scipy's one-sided one-sample t-tests at -margin and +margin; no spread:
    decided exactly; a margin of 0 and one seed are refused."""
    from scipy import stats

    rng = np.random.default_rng(3)
    for n, shift, margin in ((3, 0.0, 1.0), (5, 0.4, 0.5), (8, -0.2, 0.3), (12, 2.0, 0.5)):
        d = rng.normal(shift, 0.4, size=n)
        lower = stats.ttest_1samp(d, -margin, alternative="greater").pvalue
        upper = stats.ttest_1samp(d, margin, alternative="less").pvalue
        assert equivalence_p(d.tolist(), margin) == pytest.approx(max(lower, upper), rel=1e-9)
    assert equivalence_p([0.25, 0.25, 0.25], 0.5) == 0.0  # sd exactly 0
    assert equivalence_p([0.75, 0.75], 0.5) == 1.0 and equivalence_p([0.5, 0.5], 0.5) == 1.0
    assert equivalence_p([0.2, 0.2, 0.2], 0.5) < 1e-20  # sd 0 but for rounding
    assert equivalence_p([0.1, -0.1, 0.05, 0.0, 0.02], 0.5) < 0.01  # tight, well inside
    with pytest.raises(ValueError, match="margin=0"):
        equivalence_p([0.1, 0.2], 0.0)
    with pytest.raises(OneSeedError):
        equivalence_p([0.1], 1.0)


def test_bootstrap_rule_is_the_sign_flip_tests() -> None:
    """The bootstrap is read from the n at which the exact sign-flip test of n positive
    differences (counted here over all 2**n sign vectors) first reaches p <= alpha; at
    2 seeds it claims p 0 and an interval without 0 beside a paired t p of 0.08."""
    def fewest(alpha: float) -> int:
        for n in itertools.count(2):
            d = np.arange(1.0, n + 1)
            sums = [abs(np.dot(s, d)) for s in itertools.product((-1, 1), repeat=n)]
            if np.mean(np.array(sums) >= d.sum() - 1e-9) <= alpha:
                return n
        raise AssertionError

    assert BOOTSTRAP_MIN_SEEDS == fewest(0.05) == bootstrap_min_seeds(0.95) == 6
    assert bootstrap_min_seeds(0.99) == fewest(0.01) == 8
    two = paired_difference({1: 0.0, 2: 0.0}, {1: 1.0, 2: 1.3}, ("a", "b"))
    assert two.bootstrap_p == 0.0 and two.bootstrap_low > 0 and two.t_p > 0.05
    assert not two.bootstrap_valid
    five = {s: 0.0 for s in range(5)}
    assert not paired_difference(five, {s: s + 1.0 for s in five}, ("a", "b")).bootstrap_valid
    six = {s: 0.0 for s in range(6)}
    assert paired_difference(six, {s: s + 1.0 for s in six}, ("a", "b")).bootstrap_valid


def test_pair_mde_tost_and_verdicts() -> None:
    """A pair carries its differences' sd, MDE and, with a margin, TOST p; the verdict says
    higher, lower, equivalent (TOST only) or inconclusive with the MDE, never "no
    difference"."""
    a = {s: 0.0 for s in range(4)}
    up = paired_difference(a, {0: 1.0, 1: 1.2, 2: 0.9, 3: 1.1}, ("a", "b"))
    assert verdict(up) == "B higher" and up.margin is None and up.tost_p is None
    assert up.sd == pytest.approx(np.std([1.0, 1.2, 0.9, 1.1], ddof=1))
    assert up.mde == pytest.approx(minimum_detectable_difference(up.sd, 4))
    down = paired_difference(a, {0: -1.0, 1: -1.2, 2: -0.9, 3: -1.1}, ("a", "b"))
    assert verdict(down) == "B lower"
    noisy = {0: 0.3, 1: -0.2, 2: 0.1, 3: -0.3}
    tight = paired_difference(a, noisy, ("a", "b"), margin=2.0)
    assert tight.tost_p == pytest.approx(equivalence_p(list(noisy.values()), 2.0))
    assert verdict(tight) == f"equivalent within ±2 (TOST p {tight.tost_p:.2g})"
    loose = paired_difference(a, noisy, ("a", "b"), margin=0.05)
    assert loose.tost_p > 0.05
    text = f"inconclusive: MDE {loose.mde:.3g} at 80% power"
    assert verdict(loose) == text == verdict(paired_difference(a, noisy, ("a", "b")))
    # at 99% the interval widens: the same pair is no longer "B higher" at 2 seeds
    two = paired_difference({0: 0.0, 1: 0.0}, {0: 1.0, 1: 1.05}, ("a", "b"))
    assert verdict(two) == "B higher"
    assert verdict(two, confidence=0.99).startswith("inconclusive: MDE ")
    pairs = pairs_of({"x": a, "y": noisy}, margin=2.0)
    assert pairs[0].margin == 2.0 and pairs[0].tost_p == tight.tost_p
    assert "no difference" not in " ".join(verdict(p) for p in (up, down, tight, loose))


def test_twin_table_pairs_the_twins_by_seed() -> None:
    """The release table with 3 seeds of both twins: U-ViC − U-ViT FID paired by training
    seed under it, with its verdict; with 1 seed, no such note."""
    from uvic.evaluation.protocols import RELEASE_ROWS
    from uvic.evaluation.release_table import release_table

    protocol = RELEASE_ROWS["celeba64_small"].protocol.as_dict()

    def result(model: str, seed: int, fid: float) -> dict:
        name = f"celeba64_small_{model.lower().replace('-', '')}"
        return {"name": name, "model": model, "fid": fid, "checkpoint": f"{name}.safetensors",
                "step": 7, "protocol": protocol, "config": {"train": {"seed": seed}}}

    uvit, uvic = {1: 2.0, 2: 2.5, 3: 2.2}, {1: 1.9, 2: 2.3, 3: 2.15}
    text = release_table([*(result("U-ViT", s, f) for s, f in uvit.items()),
                          *(result("U-ViC", s, f) for s, f in uvic.items())])
    d = paired_difference(uvit, uvic, ("U-ViT", "U-ViC"))
    assert d.mean == pytest.approx(-0.35 / 3) and d.n == 3
    assert (f"- CelebA 64, U-ViT-S/4, P2: {d.mean:+.3f} ± {d.t_half_width:.3f} over 3 seeds "
            f"(paired t p {d.t_p:.2g}): inconclusive: MDE {d.mde:.3g} at 80% power") in text
    one = release_table([result("U-ViT", 1, 2.0), result("U-ViC", 1, 1.9)])
    assert "paired by training seed" not in one
