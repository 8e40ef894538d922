"""Statistics over seeds: each variant's mean with a 95% Student-t interval, and paired
differences between variants (`uvic-compare`; the seeded rows of `uvic-table3` and
`uvic-release-table`).

Seed s of every variant starts from the same initial weights (where the variants share
parameters) and sees the same batches and noise, so the numbers of two variants are pairs:
their difference per seed removes what the seed alone moves. For a pair (a, b) the
difference is d_s = b_s - a_s over the seeds both have, and we report:

* the mean difference with its Student-t interval, mean(d) +- t(0.975, n-1) sd(d) / sqrt(n)
  (`t interval`);
* the two-sided paired t-test p-value for "mean difference 0" (`paired t p`); a constant
  difference (sd 0) gives p = 0, or 1 when it is 0 everywhere;
* a percentile bootstrap interval of the mean difference (`bootstrap interval`) and a
  bootstrap p-value (the share of resampled means of the centred differences d - mean(d)
  at least as far from 0 as mean(d)). For n <= `EXACT_BOOTSTRAP_MAX` seeds every one of
  the n**n resamples is enumerated (exact, no randomness); beyond, `BOOTSTRAP_DRAWS`
  seeded draws. With 3 seeds there are only 27 resamples: the bootstrap interval is the
  range of few resampled means and its p-value cannot go below 1/27 unless it is 0, so
  read the t figures first.

One number per seed is required; one seed gives no interval and is refused
(`OneSeedError`) rather than reported as if it had one. No torch here.
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


@dataclass(frozen=True)
class PairedDifference:
    """b - a over the seeds both have: its mean with the t interval, the paired t-test
    p-value, the percentile bootstrap interval and the bootstrap p-value."""

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

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "t_low": self.mean - self.t_half_width,
                "t_high": self.mean + self.t_half_width}


def paired_difference(a: Mapping[int, float], b: Mapping[int, float], names: tuple[str, str],
                      confidence: float = CONFIDENCE, seed: int = 0) -> PairedDifference:
    """b - a, seed by seed (dicts seed -> value; seeds that only one has are left out)."""
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
    return PairedDifference(names[0], names[1], len(d), iv.mean, iv.half_width, t_test_p(d),
                            float(low), float(high), float(far.mean()), len(means),
                            len(d) <= EXACT_BOOTSTRAP_MAX)


def pairs_of(values: Mapping[str, Mapping[int, float]], confidence: float = CONFIDENCE
             ) -> list[PairedDifference]:
    """Every pair (a, b) of variants, a before b in the order given: b - a."""
    names = list(values)
    return [paired_difference(values[a], values[b], (a, b), confidence)
            for i, a in enumerate(names) for b in names[i + 1:]]


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
