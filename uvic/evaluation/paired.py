"""Statistics over seeds (`uvic-compare`, the seeded rows of `uvic-table3` and
`uvic-release-table`): each variant's mean with a 95% Student-t interval, and paired
differences between variants (docs/comparisons.md).

Seed s of every variant starts from the same weights and sees the same batches and noise,
so d_s = b_s - a_s removes what the seed alone moves; one seed gives no interval and is
refused (`OneSeedError`). No torch here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

CONFIDENCE = 0.95
EXACT_BOOTSTRAP_MAX = 7  # 7**7 = 823,543 resamples: enumerated; above, drawn
BOOTSTRAP_DRAWS = 20_000
POWER = 0.8  # the power at which the minimum detectable difference is stated
# How a metric's better value is found: "lower", "higher", or "one" (closest to 1).
BETTER = ("lower", "higher", "one")


class OneSeedError(ValueError):
    """An interval was asked of a single seed."""


def _values(values: Sequence[float], what: str) -> np.ndarray:
    x = np.asarray([float(v) for v in values], dtype=np.float64)
    if len(x) < 2:
        raise OneSeedError(f"{what}: {len(x)} seed(s) give no interval; use 2 or more seeds")
    if not np.isfinite(x).all():
        raise ValueError(f"{what}: non-finite value in {x.tolist()}")
    return x


def t_quantile(n: int, confidence: float = CONFIDENCE) -> float:
    """t(1 - alpha/2, n - 1): the half-width of a mean's interval in standard errors."""
    from scipy import stats

    return float(stats.t.ppf(0.5 + confidence / 2, n - 1))


@dataclass(frozen=True)
class Interval:
    """A mean over seeds with its Student-t interval (mean +- half_width)."""

    mean: float
    half_width: float
    n: int
    sd: float

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "low": self.low, "high": self.high}


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE,
               what: str = "values") -> Interval:
    """The mean of `values` (one per seed) and its Student-t interval."""
    x = _values(values, what)
    sd = float(x.std(ddof=1))
    return Interval(float(x.mean()), t_quantile(len(x), confidence) * sd / math.sqrt(len(x)),
                    len(x), sd)


def proportion_interval(successes: int, trials: int,
                        confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The exact (Clopper-Pearson) interval of a share, ``successes`` of ``trials``: e.g.
    how many trained models show an effect. Never narrower than its confidence promises."""
    from scipy import stats

    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"need 0 <= successes <= trials and trials >= 1, got {successes} "
                         f"of {trials}")
    alpha = 1 - confidence
    low = float(stats.beta.ppf(alpha / 2, successes, trials - successes + 1)) if successes else 0.0
    high = (float(stats.beta.ppf(1 - alpha / 2, successes + 1, trials - successes))
            if successes < trials else 1.0)
    return low, high


def t_test_p(d: np.ndarray) -> float:
    """Two-sided p-value of the one-sample t-test of mean(d) = 0 (a paired t-test on
    differences); sd 0: 1 if every difference is 0, else 0."""
    from scipy import stats

    mean, sd = float(d.mean()), float(d.std(ddof=1))
    if sd == 0.0:
        return 1.0 if mean == 0.0 else 0.0
    t = mean / (sd / math.sqrt(len(d)))
    return float(2 * stats.t.sf(abs(t), len(d) - 1))


def resample_means(d: np.ndarray, seed: int = 0) -> np.ndarray:
    """Means of bootstrap resamples of `d`: all len(d)**len(d) of them (equally likely)
    for len(d) <= EXACT_BOOTSTRAP_MAX, else BOOTSTRAP_DRAWS draws seeded by `seed`."""
    n = len(d)
    if n <= EXACT_BOOTSTRAP_MAX:
        sums = np.zeros(1)
        for _ in range(n):  # every ordered choice of n values
            sums = (sums[:, None] + d[None, :]).ravel()
        return sums / n
    rng = np.random.default_rng(seed)
    return d[rng.integers(0, n, size=(BOOTSTRAP_DRAWS, n))].mean(1)


def bootstrap_min_seeds(confidence: float = CONFIDENCE) -> int:
    """The fewest seeds from which the percentile bootstrap can hold its level: the
    smallest n with 2 / 2**n <= 1 - confidence (6 at 95%, 8 at 99%)."""
    # Every resampled mean lies within [min d, max d], which misses the true mean whenever
    # all n differences fall on one side of it: with probability 2 / 2**n for differences
    # symmetric about it, so below that n the interval covers less than it states. The
    # exact sign-flip test (the distribution-free paired test) is bound alike: its smallest
    # two-sided p is 2 / 2**n. The paired t, assuming normal differences, reaches any level
    # from 2 seeds. From this n on the bootstrap can hold its level, not that it does: at
    # few seeds it still runs narrower than the t interval.
    alpha = 1 - confidence
    if not 0 < alpha < 1:
        raise ValueError(f"confidence={confidence}: must be between 0 and 1")
    n = 2
    while 2.0 / 2**n > alpha * (1 + 1e-12):
        n += 1
    return n


BOOTSTRAP_MIN_SEEDS = bootstrap_min_seeds(CONFIDENCE)  # 6


def _mde(sd: float, n: np.ndarray, confidence: float, power: float) -> np.ndarray:
    from scipy import stats

    if not (math.isfinite(sd) and sd >= 0):
        raise ValueError(f"sd={sd}: must be finite and >= 0")
    if not 0 < confidence < 1 or not 0 < power < 1:
        raise ValueError(f"confidence={confidence}, power={power}: each between 0 and 1")
    df = n - 1
    return ((stats.t.ppf(0.5 + confidence / 2, df) + stats.t.ppf(power, df))
            * sd / np.sqrt(n))


def minimum_detectable_difference(sd: float, n: int, confidence: float = CONFIDENCE,
                                  power: float = POWER) -> float:
    """The true mean difference a two-sided paired t-test on `n` seeds with differences'
    sd `sd` detects with probability `power`: (t(1 - alpha/2) + t(power)) sd / sqrt(n),
    the usual central-t approximation (exact power at it: 0.79 at 5 seeds, 0.73 at 2)."""
    if n < 2:
        raise OneSeedError(f"n={n}: a paired t-test needs 2 or more seeds")
    return float(_mde(sd, np.array([n]), confidence, power)[0])


def seeds_for_difference(sd: float, difference: float, confidence: float = CONFIDENCE,
                         power: float = POWER, max_seeds: int = 10_000) -> int:
    """The fewest seeds (>= 2) whose minimum detectable difference is at most
    |difference|: how many seeds a comparison needs to find that difference."""
    if difference == 0 or not math.isfinite(difference):
        raise ValueError(f"difference={difference}: a difference to detect must be finite "
                         "and not 0")
    n = np.arange(2, max(2, max_seeds) + 1)
    found = np.flatnonzero(_mde(sd, n, confidence, power) <= abs(difference))
    if not len(found):
        raise ValueError(f"difference {difference:g} at sd {sd:g}: more than {max_seeds:,} "
                         "seeds needed")
    return int(n[found[0]])


def equivalence_p(d: Sequence[float], margin: float) -> float:
    """Two one-sided t-tests (TOST) of mean(d) against -margin and +margin: the larger
    one-sided p. Below alpha, the mean difference lies within +-margin ("equivalent")."""
    from scipy import stats

    if not (math.isfinite(margin) and margin > 0):
        raise ValueError(f"margin={margin}: an equivalence margin must be > 0")
    x = _values(d, "differences")
    mean, sd = float(x.mean()), float(x.std(ddof=1))
    if sd == 0.0:  # no spread: the mean is known exactly
        return 0.0 if abs(mean) < margin else 1.0
    se = sd / math.sqrt(len(x))
    above = stats.t.sf((mean + margin) / se, len(x) - 1)  # H0: mean <= -margin
    below = stats.t.cdf((mean - margin) / se, len(x) - 1)  # H0: mean >= +margin
    return float(max(above, below))


@dataclass(frozen=True)
class PairedDifference:
    """b - a over the seeds both have: its mean with the t interval, the paired t-test
    p-value, the percentile bootstrap interval and p-value (to be read where
    `bootstrap_valid`), the differences' sd, the MDE at 80% power and, given a margin, the
    TOST p-value of equivalence."""

    a: str
    b: str
    n: int
    mean: float
    t_half_width: float
    t_p: float
    bootstrap_low: float
    bootstrap_high: float
    bootstrap_p: float
    bootstrap_resamples: int
    bootstrap_exact: bool
    sd: float
    mde: float
    bootstrap_valid: bool
    margin: float | None = None
    tost_p: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "t_low": self.mean - self.t_half_width,
                "t_high": self.mean + self.t_half_width}


def paired_difference(a: Mapping[int, float], b: Mapping[int, float], names: tuple[str, str],
                      confidence: float = CONFIDENCE, seed: int = 0,
                      margin: float | None = None) -> PairedDifference:
    """b - a, seed by seed (dicts seed -> value; seeds that only one has are left out);
    with `margin`, the TOST p-value of |b - a| < margin too."""
    seeds = sorted(set(a) & set(b))
    what = f"{names[1]} - {names[0]}"
    d = _values([b[s] - a[s] for s in seeds], what)
    iv = t_interval(d, confidence, what)
    means = resample_means(d, seed)
    alpha = 1 - confidence
    low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2], method="inverted_cdf")
    centred = resample_means(d - d.mean(), seed)
    # a tolerance of float rounding: a resample equal to the observed mean counts
    far = np.abs(centred) >= abs(iv.mean) - 1e-12 * max(1.0, abs(iv.mean))
    return PairedDifference(
        names[0], names[1], len(d), iv.mean, iv.half_width, t_test_p(d), float(low),
        float(high), float(far.mean()), len(means), len(d) <= EXACT_BOOTSTRAP_MAX, iv.sd,
        minimum_detectable_difference(iv.sd, len(d), confidence),
        len(d) >= bootstrap_min_seeds(confidence), margin,
        None if margin is None else equivalence_p(d, margin))


def pairs_of(values: Mapping[str, Mapping[int, float]], confidence: float = CONFIDENCE,
             margin: float | None = None) -> list[PairedDifference]:
    """Every pair (a, b) of variants, a before b in the order given: b - a (with
    `margin`, each pair's TOST p-value of equivalence within it)."""
    names = list(values)
    return [paired_difference(values[a], values[b], (a, b), confidence, margin=margin)
            for i, a in enumerate(names) for b in names[i + 1:]]


def verdict(d: PairedDifference, confidence: float = CONFIDENCE) -> str:
    """What the pair supports, in one phrase: "B higher"/"B lower" (t interval without 0),
    "equivalent within ±m" (TOST, given a margin), else "inconclusive" with the MDE."""
    half = t_quantile(d.n, confidence) * d.sd / math.sqrt(d.n)
    if d.mean - half > 0:
        return "B higher"
    if d.mean + half < 0:
        return "B lower"
    if d.margin is not None and d.tost_p is not None and d.tost_p < 1 - confidence:
        return f"equivalent within ±{d.margin:.3g} (TOST p {d.tost_p:.2g})"
    mde = minimum_detectable_difference(d.sd, d.n, confidence)
    return f"inconclusive: MDE {mde:.3g} at {POWER:.0%} power"


def better_key(better: str):
    """Sort key under which the best value is the smallest."""
    if better == "lower":
        return lambda v: v
    if better == "higher":
        return lambda v: -v
    if better == "one":
        return lambda v: abs(math.log(v)) if v > 0 else math.inf
    raise ValueError(f"better={better!r}: choose one of {BETTER}")


def best_step(by_step: Mapping[int, float], better: str) -> tuple[int, float]:
    """The step whose value is best (ties: the earliest step) and that value: a checkpoint
    selected on the metric itself, an optimistic figure."""
    key = better_key(better)
    step = min(sorted(by_step), key=lambda s: key(by_step[s]))
    return step, by_step[step]


def digits_for(half_width: float, digits: int | None = None) -> int:
    """Decimals that show the interval's half-width to two significant figures (2..6)."""
    if digits is not None:
        return digits
    if half_width <= 0 or not math.isfinite(half_width):
        return 4
    return int(min(6, max(2, 1 - math.floor(math.log10(half_width)))))


def format_interval(iv: Interval, digits: int | None = None, latex: bool = False) -> str:
    """"mean ± half-width" (LaTeX: `$mean \\pm half$`), decimals from the half-width."""
    k = digits_for(iv.half_width, digits)
    if latex:
        return f"${iv.mean:.{k}f} \\pm {iv.half_width:.{k}f}$"
    return f"{iv.mean:.{k}f} ± {iv.half_width:.{k}f}"
