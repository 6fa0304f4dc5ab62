"""bench/stats.py, the benchmarks' statistics, against published tables and
closed forms.

bench/ is a folder of scripts, not a package: the module is loaded from its
file under a name of its own, leaving sys.path alone.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import random
import statistics
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "bench_stats", Path(__file__).resolve().parents[1] / "bench" / "stats.py")
assert _SPEC is not None and _SPEC.loader is not None
stats = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = stats  # dataclasses look their module up there
_SPEC.loader.exec_module(stats)


# -- Student's t ----------------------------------------------------------------------
# Two-sided 95%, 90% and 99% critical values as printed in the usual tables (3 decimals).
@pytest.mark.parametrize(("p", "df", "table"), [
    (0.975, 1, 12.706), (0.975, 2, 4.303), (0.975, 5, 2.571), (0.975, 9, 2.262),
    (0.975, 10, 2.228), (0.975, 19, 2.093), (0.975, 29, 2.045), (0.975, 30, 2.042),
    (0.975, 39, 2.023), (0.975, 59, 2.001), (0.975, 120, 1.980),
    (0.95, 9, 1.833), (0.95, 29, 1.699), (0.995, 1, 63.657), (0.995, 9, 3.250),
    (0.995, 29, 2.756),
])
def test_t_quantile_matches_the_tables(p: float, df: int, table: float) -> None:
    assert stats.t_quantile(p, df) == pytest.approx(table, abs=0.0005)


def test_t_quantile_is_symmetric_and_tends_to_the_normal() -> None:
    assert stats.t_quantile(0.5, 7) == 0.0
    assert stats.t_quantile(0.025, 9) == pytest.approx(-stats.t_quantile(0.975, 9), abs=1e-12)
    normal = statistics.NormalDist().inv_cdf(0.975)
    assert stats.t_quantile(0.975, 1e8) == pytest.approx(normal, abs=1e-6)
    # Fewer degrees of freedom, heavier tails: the quantile falls as df grows.
    quantiles = [stats.t_quantile(0.975, df) for df in range(1, 61)]
    assert all(a > b for a, b in itertools.pairwise(quantiles))
    assert quantiles[-1] > normal


def test_t_cdf_matches_the_closed_forms_of_one_and_two_degrees() -> None:
    for i in range(-200, 201):
        x = i / 10
        assert stats.t_cdf(x, 1) == pytest.approx(0.5 + math.atan(x) / math.pi, abs=1e-12)
        assert stats.t_cdf(x, 2) == pytest.approx(0.5 + x / (2 * math.sqrt(2 + x * x)),
                                                  abs=1e-12)


def test_t_quantile_inverts_t_cdf() -> None:
    for df in (1, 3, 9, 29, 45.5, 200):
        for p in (0.001, 0.1, 0.4, 0.6, 0.9, 0.975, 0.999):
            assert stats.t_cdf(stats.t_quantile(p, df), df) == pytest.approx(p, abs=1e-10)


@pytest.mark.parametrize(("p", "df"), [(0.0, 5), (1.0, 5), (-0.1, 5), (0.975, 0), (0.975, -2)])
def test_t_quantile_refuses_what_has_none(p: float, df: float) -> None:
    with pytest.raises(ValueError, match="t_quantile needs"):
        stats.t_quantile(p, df)


# -- the mean's interval ---------------------------------------------------------------
def test_mean_interval_is_students_t_by_hand() -> None:
    values = [float(v) for v in range(1, 11)]  # mean 5.5, standard deviation sqrt(55/6)
    mean, half = stats.mean_interval(values)
    assert mean == 5.5
    assert half == pytest.approx(2.262 * math.sqrt(55 / 6) / math.sqrt(10), rel=2e-4)
    _, half_90 = stats.mean_interval(values, confidence=0.90)
    assert half_90 == pytest.approx(1.833 * math.sqrt(55 / 6) / math.sqrt(10), rel=3e-4)


def test_mean_interval_on_thirty_pairs_is_wider_than_the_normal_one() -> None:
    rng = random.Random(5)
    ratios = [rng.gauss(1.0, 0.03) for _ in range(30)]
    _, half = stats.mean_interval(ratios)
    normal = 1.96 * statistics.stdev(ratios) / math.sqrt(30)
    assert half == pytest.approx(normal * 2.045 / 1.96, rel=3e-4)
    assert half > normal


def test_mean_interval_needs_two_values() -> None:
    with pytest.raises(statistics.StatisticsError):
        stats.mean_interval([1.0])
    with pytest.raises(statistics.StatisticsError):
        stats.mean_interval([])


# -- the median's interval (sign test) ---------------------------------------------------
def test_median_interval_under_six_values_is_unbounded() -> None:
    found = stats.median_interval([1.0, 3.0, 2.0, 5.0, 4.0])
    assert (found.median, found.low, found.high, found.n) == (3.0, -math.inf, math.inf, 5)
    assert found.verdict() == "cannot tell (the interval spans 0.99)"


@pytest.mark.parametrize(("n", "k"), [(6, 1), (10, 2), (20, 6), (30, 10), (100, 40)])
def test_median_interval_is_the_sign_tests_order_statistics(n: int, k: int) -> None:
    # Published 95% sign-test intervals: from the k-th smallest to the k-th largest.
    values = [float(v) for v in range(1, n + 1)]
    random.Random(n).shuffle(values)
    found = stats.median_interval(values)
    assert (found.low, found.high) == (k, n + 1 - k)
    assert found.median == (n + 1) / 2
    assert found.n == n


def test_verdict_reads_the_interval_against_the_target() -> None:
    meets = stats.Estimate(1.0, 0.995, 1.01, 10)
    below = stats.Estimate(0.97, 0.96, 0.985, 10)
    spans = stats.Estimate(0.99, 0.98, 1.0, 10)
    assert meets.verdict() == "meets 0.99"
    assert below.verdict() == "below 0.99"
    assert spans.verdict() == "cannot tell (the interval spans 0.99)"
    assert spans.verdict(0.95) == "meets 0.95"
    assert meets.cell() == "1.000 [0.995, 1.010]"


def test_median_ratio_pairs_each_value_with_its_own_baseline() -> None:
    assert stats.median_ratio([2.0, 4.0, 9.0], [1.0, 2.0, 3.0]) == 2.0
    with pytest.raises(ValueError):
        stats.median_ratio([1.0, 2.0], [1.0])


# -- percentiles -------------------------------------------------------------------------
def test_percentile_is_linear_between_order_statistics() -> None:
    assert stats.percentile([float(v) for v in range(101)], 95) == 95.0
    assert stats.percentile([20.0, 10.0], 95) == pytest.approx(19.5)
    assert stats.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert stats.percentile([3.0], 99) == 3.0
    rng = random.Random(1)
    data = [rng.expovariate(1.0) for _ in range(37)]
    assert stats.percentile(data, 99) <= max(data)
    assert stats.percentile(data, 1) >= min(data)


def test_percentile_refuses_what_has_none() -> None:
    with pytest.raises(statistics.StatisticsError):
        stats.percentile([], 50)
    for p in (0, 100):
        with pytest.raises(ValueError, match="a percentile from 1 to 99"):
            stats.percentile([1.0, 2.0], p)
