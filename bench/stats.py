"""The statistics the benchmarks share: a median with the sign test's interval, a
mean with Student's t interval, percentiles, the median of paired ratios.

    from stats import median_interval, mean_interval, percentile  # bench/stats.py

Standard library only (scipy is not a dependency): the t quantile inverts the
t distribution's CDF, computed from the regularized incomplete beta function.
tests/test_bench_stats.py checks it against the tables.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

TARGET = 0.99  # the speed a watched run must keep, as a ratio to an unwatched one


# -- the median and the sign test ------------------------------------------------------------
@dataclass
class Estimate:
    """A median and its 95% interval (unbounded under six values)."""

    median: float
    low: float
    high: float
    n: int

    def verdict(self, target: float = TARGET) -> str:
        if self.low >= target:
            return f"meets {target}"
        if self.high < target:
            return f"below {target}"
        return f"cannot tell (the interval spans {target})"

    def cell(self) -> str:
        return f"{self.median:.3f} [{self.low:.3f}, {self.high:.3f}]"


def median_interval(values: Iterable[float]) -> Estimate:
    """The median and a 95% interval for it that assumes nothing about how the
    values are distributed (the sign test's: between the k-th smallest and the
    k-th largest, k the largest with P(Binomial(n, 1/2) < k) <= 2.5%). Under six
    values there is none: the interval is unbounded."""
    ordered = sorted(values)
    n = len(ordered)
    k, below = 0, 0  # below: the ways to have fewer than k successes in n
    while (below + math.comb(n, k)) * 40 <= 2 ** n:  # P(X <= k) <= 1/40
        below += math.comb(n, k)
        k += 1
    if k == 0:
        return Estimate(statistics.median(ordered), -math.inf, math.inf, n)
    return Estimate(statistics.median(ordered), ordered[k - 1], ordered[n - k], n)


def median_ratio(values: Iterable[float], baselines: Iterable[float]) -> float:
    """The median of the ratios of measurements taken side by side (the same round),
    each value over its own baseline."""
    return statistics.median(v / b for v, b in zip(values, baselines, strict=True))


# -- the mean and Student's t ----------------------------------------------------------------
def mean_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """The mean and the half-width of its interval (Student's t with n - 1 degrees of
    freedom: right for a few pairs as for many, where 1.96 is too narrow under 30)."""
    if len(values) < 2:
        raise statistics.StatisticsError("a mean's interval needs at least two values")
    t = t_quantile((1 + confidence) / 2, len(values) - 1)
    return statistics.fmean(values), t * statistics.stdev(values) / math.sqrt(len(values))


def t_quantile(p: float, df: float) -> float:
    """The x with P(T <= x) = p, T Student's t with df degrees of freedom
    (t_quantile(0.975, 9) = 2.262). Bisection on t_cdf, to about 1e-12."""
    if not 0 < p < 1 or not df > 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, not p={p}, df={df}")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_quantile(1 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        low, high = high, 2 * high
    while high - low > 1e-12 * high:
        middle = (low + high) / 2
        if t_cdf(middle, df) < p:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def t_cdf(x: float, df: float) -> float:
    """P(T <= x) for Student's t with df degrees of freedom."""
    tail = 0.5 * _incomplete_beta(df / 2, 0.5, df / (df + x * x))  # P(T > |x|)
    return 1 - tail if x > 0 else tail


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x))
    # The continued fraction converges fast below the mean (a+1)/(a+b+2); above
    # it, use I_x(a, b) = 1 - I_(1-x)(b, a).
    if x < (a + 1) / (a + b + 2):
        return front * _beta_fraction(a, b, x) / a
    return 1 - front * _beta_fraction(b, a, 1 - x) / b


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The incomplete beta function's continued fraction, by Lentz's method."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1 + numerator * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1) < eps:
            break
    return h


# -- percentiles -----------------------------------------------------------------------------
def percentile(values: Iterable[float], p: int) -> float:
    """The p-th percentile (1 to 99): statistics.quantiles' inclusive method, linear
    between the order statistics (numpy's default); one value is its own percentile."""
    if not 1 <= p <= 99:
        raise ValueError(f"a percentile from 1 to 99, not {p}")
    data = list(values)
    if not data:
        raise statistics.StatisticsError("a percentile of no values")
    if len(data) == 1:
        return float(data[0])
    return statistics.quantiles(data, n=100, method="inclusive")[p - 1]
