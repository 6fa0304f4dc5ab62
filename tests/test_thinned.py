"""The whole run in a bounded number of points (core/thinned.py), and the charts that
draw it (dashboard/series.py): the whole run by default, the newest steps a key away."""

from __future__ import annotations

import asyncio
import time

import pytest
from test_state import fold, hello, step

from ddtop.core.thinned import Thinned, mean
from ddtop.dashboard import series
from ddtop.dashboard.app import DashboardApp
from ddtop.dashboard.charts import Chart
from ddtop.dashboard.feed import StateFeed
from ddtop.dashboard.mainpanels import CHART_POINTS


def add(a: tuple[int, float], wa: int, b: tuple[int, float], wb: int) -> tuple[int, float]:
    """A reading (step, value) merged as the fold merges its points."""
    value = mean(a[1], wa, b[1], wb)
    assert value is not None
    return b[0], value


def test_a_thinned_series_is_bounded_even_and_whole() -> None:
    kept: Thinned[tuple[int, float]] = Thinned()
    for n in range(1, 1001):
        kept.add((n, float(n)), 10, add)
        assert len(kept.points) <= 10
    # Each point stands for `every` readings in a row: the mean of their values, at the
    # last one's step; the newest, fewer, pending.
    every = kept.every
    assert every == 128 and len(kept.points) == 1000 // every
    for i, (at, value) in enumerate(kept.points):
        first, last = i * every + 1, (i + 1) * every
        assert at == last and value == pytest.approx((first + last) / 2)
    assert kept.pending is not None and kept.pending_n == 1000 % every
    assert kept.pending[0] == 1000
    whole = kept.whole()
    assert whole[0][0] == every and whole[-1][0] == 1000
    assert mean(None, 1, 2.0, 3) == 2.0 and mean(1.0, 1, None, 1) == 1.0


def test_charts_cover_the_whole_run_and_the_newest_steps_a_key_away() -> None:
    # 2,000 step messages of one step each: far more than a rank's newest readings.
    state = fold(hello(0), *(step(0, i, i, steps=1) for i in range(1, 2001)))
    assert len(state.ranks[0].history) < 2000
    whole = series.throughput(state, None).lines[0].xs
    latest = series.throughput(state, CHART_POINTS).lines[0].xs
    assert whole[0] < 50 and whole[-1] == 2000 and len(whole) <= 2 * 120
    assert latest == tuple(range(2001 - CHART_POINTS, 2001))
    loss = series.rank_loss(state, 0, whole=True)
    assert loss.lines[0].xs[0] < 50 and loss.step == 2000
    assert series.rank_loss(state, 0).lines[0].xs[0] > 1000  # the newest readings only


def test_the_w_key_switches_the_charts_between_the_whole_run_and_the_newest_steps() -> None:
    state = fold(hello(0), *(step(0, i, i, steps=1) for i in range(1, 2001)))
    first_whole = series.throughput(state, None).lines[0].xs[0]
    first_latest = series.throughput(state, CHART_POINTS).lines[0].xs[0]
    app = DashboardApp(StateFeed(state), fps=10)
    spans: list[tuple[int, int]] = []

    async def main() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            deadline = time.monotonic() + 30

            async def drawn(first: int) -> None:
                while (data := app.query_one("#rate", Chart).data).empty or (
                        data.lines[0].xs[0] != first):
                    assert time.monotonic() < deadline, "the charts did not change"
                    await pilot.pause(0.05)
                spans.append((data.lines[0].xs[0], data.lines[0].xs[-1]))

            await drawn(first_whole)  # the whole run, from its first readings
            await pilot.press("w")
            await drawn(first_latest)  # the newest steps
            await pilot.press("w")
            await drawn(first_whole)

    try:
        asyncio.run(main())
    finally:
        app.feed.close()
    assert spans == [(first_whole, 2000), (2001 - CHART_POINTS, 2000), (first_whole, 2000)]
