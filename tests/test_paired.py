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
    Interval,
    OneSeedError,
    best_step,
    format_interval,
    paired_difference,
    pairs_of,
    proportion_interval,
    resample_means,
    t_interval,
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
