"""The dashboard's charts: the series built from a RunState (pure), the chart's
axes, ticks and title drawn from known values, and the main screen with 8 and 64
ranks at 120x40 and 200x60 compared with tests/snapshots/charts-*.txt.

A run of N ranks is folded by hand: each rank reports 10 steps (320 samples) a
message, from step 10 to step 200, one message a second (320 samples/s a rank)
but every fifth 1.25 s (256 samples/s: the last one too), loss 2 - step/200
(+0.01 per rank), comm 20% of the step (+1% per rank); the global loss at steps
50, 100, 150 and 200 is 2 - step/200 (1.0 at the end). A finished run ends as a real
one does: each rank's goodbye, then the daemon's `succeeded` (every rank `finished`).

Snapshots are rewritten with DDTOP_UPDATE_SNAPSHOTS=1 (review the diff); with
DDTOP_SCREENSHOTS=1 the same screens are saved as SVG under docs/images/ (the
screenshots docs/dashboard.md shows)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_app import screen_text

from ddtop.core import wire
from ddtop.core.rundir import RunPaths
from ddtop.core.state import RunState
from ddtop.dashboard import series
from ddtop.dashboard.app import DashboardApp
from ddtop.dashboard.charts import (
    LEGEND_MIN_HEIGHT,
    Chart,
    finite,
    nice_ticks,
    sparkline,
    thin,
)
from ddtop.dashboard.feed import Feed, StateFeed
from ddtop.dashboard.live import open_feed

RUN = "charts"
SNAPSHOTS = Path(__file__).parent / "snapshots"
FIXTURES = Path(__file__).parent / "fixtures" / "runs"
SCREENSHOTS = Path(__file__).parent.parent / "docs" / "images"
UPDATE = os.environ.get("DDTOP_UPDATE_SNAPSHOTS") == "1"
SAVE_SCREENSHOTS = os.environ.get("DDTOP_SCREENSHOTS") == "1"
LAST_STEP = 200


@pytest.fixture(autouse=True)
def utc() -> Iterator[None]:
    """Event times print in local time: pin it, so snapshots match anywhere."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    yield
    if before is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = before
    time.tzset()


def run_of(ranks: int, finished: bool = True) -> RunState:
    state = RunState(run=RUN)
    for rank in range(ranks):
        state.apply(wire.Hello(run=RUN, rank=rank, seq=0, t=100.0, local_rank=rank % 8,
                               host=f"node{rank // 8}", pid=1000 + rank, device="cpu",
                               backend="gloo", world_size=ranks, config_digest="d",
                               model="mlp", dataset="synthetic", epochs=1,
                               global_batch=32 * ranks), 100.0)
    seqs = [0] * ranks  # each rank's messages numbered 1, 2, ...: none lost
    t = 100.0
    for k, step in enumerate(range(10, LAST_STEP + 1, 10), start=1):
        took = 1.25 if k % 5 == 0 else 1.0
        t += took
        for rank in range(ranks):
            seqs[rank] += 1
            state.apply(wire.Step(
                run=RUN, rank=rank, seq=seqs[rank], t=t, epoch=0, step=step,
                steps_per_epoch=LAST_STEP, global_step=step, steps=10, samples=320,
                loss_sum=(2.0 - step / 200 + 0.01 * rank) * 320, lr=0.1, step_s=took,
                data_s=0.1, forward_s=0.2, backward_s=0.3, optimizer_s=took - 0.6,
                comm_s=(0.2 + 0.01 * rank) * took, comm_bytes=10_000_000, comm_ops=10,
                algbw_gbps=1.0, busbw_gbps=1.0, sync_wait_s=0.0, rss=10**8), t)
        if step % 50 == 0:
            seqs[0] += 1
            state.apply(wire.Aggregate(run=RUN, rank=0, seq=seqs[0], t=t, scope="sync",
                                       epoch=0, global_step=step, train_loss=2.0 - step / 200,
                                       train_accuracy=0.5, train_samples=32 * step), t)
    if finished:  # as a run ends: every rank says goodbye, then the daemon the status
        t += 1.0
        for rank in range(ranks):
            seqs[rank] += 1
            state.apply(wire.Bye(run=RUN, rank=rank, seq=seqs[rank], t=t, exit_code=0), t)
        state.apply(wire.RunStatus(run=RUN, rank=wire.DAEMON_RANK, t=t, status="succeeded",
                                   world_size=ranks), t)
    return state


# -- the series, pure ---------------------------------------------------------------------
def test_the_series_say_the_latest_values_at_the_newest_step() -> None:
    state = run_of(2)
    loss = series.global_loss(state)
    assert loss.title == "loss: global 1.0000 at step 200"
    assert loss.lines[0].xs == (50, 100, 150, 200)
    assert loss.lines[0].ys == (1.75, 1.5, 1.25, 1.0)
    mine = series.rank_loss(state, 1)
    assert mine.title == "loss: rank 1 1.0100 at step 200" and len(mine.lines[0].xs) == 20
    rate = series.throughput(state, 120)
    assert rate.title == "samples/s 512 at step 200" and rate.unit == "samples/s"
    assert rate.lines[0].ys[:5] == (640, 640, 640, 640, 512) and set(rate.lines[0].ys) == {
        640, 512}
    comm = series.comm_share(state, 120)
    assert comm.title == "comm % r0 20 r1 21 at step 200" and comm.unit == "% of step"
    assert [line.label for line in comm.lines] == ["rank 0", "rank 1"]
    assert series.rank_loss(state, None).empty and series.rank_loss(state, 7).empty


def test_many_ranks_make_the_comm_chart_a_spread() -> None:
    comm = series.comm_share(run_of(8), 10)
    assert [line.label for line in comm.lines] == ["max", "median", "min"]
    assert comm.lines[0].xs == tuple(range(110, 201, 10))  # the newest 10 steps
    high, mid, low = (line.ys[-1] for line in comm.lines)
    assert (round(low, 6), round(mid, 6), round(high, 6)) == (20.0, 23.5, 27.0)
    assert comm.title == "comm % min 20 med 24 max 27 at step 200"


def test_a_run_with_no_step_yet_has_empty_charts() -> None:
    state = RunState(run=RUN)
    for data in (series.global_loss(state), series.throughput(state, 120),
                 series.comm_share(state, 120), series.rank_loss(state, 0)):
        assert data.empty and data.title == data.name


def test_ticks_thinning_and_sparklines() -> None:
    assert nice_ticks(9, 1024, 3) == [500, 1000]
    assert nice_ticks(0.6, 1.89, 5) == [0.75, 1.0, 1.25, 1.5, 1.75]
    assert nice_ticks(2534, 22373, 4) == [5000, 10000, 15000, 20000]
    assert nice_ticks(5, 5) == [5]
    line = series.Line("x", tuple(range(100)), tuple(float(i) for i in range(100)))
    thinned = thin(line, 10)
    assert len(thinned.xs) == 10 and thinned.xs[0] == 0 and thinned.xs[-1] == 99
    assert sparkline((1.0, 2.0, 3.0, float("nan"), 8.0), 10) == "▁▂▃█"
    assert sparkline(tuple(float(i) for i in range(100)), 8) == "▁▂▃▄▅▆▇█"
    assert sparkline((), 8) == ""
    nan, inf = float("nan"), float("inf")
    diverged = series.Line("loss", (10, 20, 30, 40), (2.0, nan, inf, 1.0))
    assert finite(diverged) == series.Line("loss", (10, 40), (2.0, 1.0))  # plotted: the rest


# -- drawn in the app -----------------------------------------------------------------------
@dataclass(frozen=True)
class Shown:
    chart: str  # its text
    plot: bool  # drawn with axes (else a sparkline)
    height: int


def shown(ranks: int, size: tuple[int, int], feed: Feed | None = None,
          screenshot: str | None = None) -> tuple[str, dict[str, Shown]]:
    """The main screen of a finished run of `ranks` ranks (or of `feed`), and each
    chart as shown."""
    app = DashboardApp(feed or StateFeed(run_of(ranks)), fps=10)
    charts: dict[str, Shown] = {}
    screens: list[str] = []

    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            deadline = time.monotonic() + 30
            while (not app.feed.finished or app.frames < 3
                   or app.query_one("#rate", Chart).data.empty):
                assert time.monotonic() < deadline, "no frame drew the charts"
                await pilot.pause(0.05)
            await pilot.pause(0.2)
            charts.update({c.id or "": Shown(c.text, c.is_plot, c.size.height)
                           for c in app.query(Chart)})
            screens.append(screen_text(app))
            if screenshot is not None and SAVE_SCREENSHOTS:
                SCREENSHOTS.mkdir(parents=True, exist_ok=True)
                app.save_screenshot(f"{screenshot}.svg", str(SCREENSHOTS))

    try:
        asyncio.run(main())
    finally:
        app.feed.close()
    assert len(charts) == 4
    return screens[0], charts


def axes(text: str) -> tuple[list[float], list[int]]:
    """The y tick labels (left of ┤) and the x tick labels (the line under └) of a plot."""
    lines = text.splitlines()
    ys = [float(m.group(1).replace("k", "e3"))
          for line in lines if (m := re.match(r"\s*([-\d.k]+)┤", line))]
    bottom = next(i for i, line in enumerate(lines) if "└" in line)
    xs = [int(x) for x in lines[bottom + 1].split()]
    return ys, xs


def test_the_charts_show_axes_ticks_and_the_latest_value_of_the_data_fed() -> None:
    _, shown_charts = shown(2, (120, 40))
    assert all(c.plot for c in shown_charts.values())
    charts = {name: c.chart for name, c in shown_charts.items()}
    loss = charts["loss-global"]
    assert loss.splitlines()[0] == "loss: global 1.0000 at step 200"
    ys, xs = axes(loss)
    assert len(ys) >= 2 and min(ys) >= 1.0 and max(ys) <= 1.75  # within the data: 1 to 1.75
    assert len(xs) >= 2 and min(xs) >= 50 and max(xs) == 200  # steps 50 to 200
    assert "loss" in loss.splitlines()[-1] and "step" in loss.splitlines()[-1]  # the units
    rate = charts["rate"]
    assert rate.splitlines()[0] == "samples/s 512 at step 200"
    ys, xs = axes(rate)
    assert min(ys) >= 512 and max(ys) <= 640 and max(xs) <= 200
    assert "samples/s" in rate.splitlines()[-1]
    comm = charts["comm-share"]
    assert comm.splitlines()[0] == "comm % r0 20 r1 21 at step 200"
    ys, _ = axes(comm)
    assert min(ys) >= 20 and max(ys) <= 21 and "% of step" in comm.splitlines()[-1]
    assert "rank 0" in comm and "rank 1" in comm  # the legend: a line per rank
    assert charts["loss-rank"].splitlines()[0] == "loss: rank 0 1.0000 at step 200"


def test_the_charts_of_a_recorded_run_say_what_its_table_and_header_say(
        tmp_path: Path) -> None:
    shutil.copytree(FIXTURES, tmp_path / "runs")
    screen, charts = shown(2, (120, 40), open_feed(RunPaths(tmp_path / "runs" / "recorded-ok")),
                           screenshot="charts-recorded-2-ranks-120x40")
    assert "global: loss 0.5989" in screen and "(step 1024)" in screen  # the header
    assert charts["loss-global"].chart.startswith("loss: global 0.5989 at step 1024\n")
    assert charts["loss-rank"].chart.startswith("loss: rank 0 0.5505 at step 1024\n")
    rows = [line.split() for line in screen.splitlines() if line.split()[:2] in (["0", "vm"],
                                                                               ["1", "vm"])]
    shares = [row[10] for row in rows]  # COMM%: 50 and 56
    assert charts["comm-share"].chart.startswith(
        f"comm % r0 {shares[0]} r1 {shares[1]} at step 1024\n")
    ys, xs = axes(charts["loss-global"].chart)  # two metric syncs: steps 512 and 1024
    assert min(xs) >= 512 and max(xs) <= 1024 and min(ys) >= 0.5989 and max(ys) <= 1.8886


def test_a_narrow_screen_keeps_sparklines() -> None:
    _, shown_charts = shown(2, (80, 24))
    assert not any(c.plot for c in shown_charts.values())
    charts = {name: c.chart for name, c in shown_charts.items()}
    falling = "".join(sorted(sparkline(tuple(float(i) for i in range(20)), 24), reverse=True))
    assert charts["loss-rank"].splitlines() == ["loss: rank 0 1.0000", falling]  # 20 steps
    assert charts["rate"].splitlines()[0] == "samples/s 512"


def test_charts_draw_only_when_their_data_change() -> None:
    """plotext takes tens of ms a plot: frames that bring nothing new draw none."""
    state = run_of(2, finished=False)
    app = DashboardApp(StateFeed(state), fps=20)
    builds: list[int] = []

    async def main() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            while app.query_one("#rate", Chart).builds == 0:
                await pilot.pause(0.05)
            await pilot.pause(0.3)
            before, frames = app.query_one("#rate", Chart).builds, app.frames
            while app.frames < frames + 10:
                app.dirty = True
                await pilot.pause(0.05)
            builds.extend([before, app.query_one("#rate", Chart).builds])

    asyncio.run(main())
    assert builds[0] >= 1 and builds[1] == builds[0]


@pytest.mark.parametrize("ranks", [8, 64])
@pytest.mark.parametrize("size", [(120, 40), (200, 60)])
def test_snapshot_of_the_charts(ranks: int, size: tuple[int, int]) -> None:
    name = f"charts-{ranks}-ranks-{size[0]}x{size[1]}"
    screen, charts = shown(ranks, size, screenshot=name)
    comm = charts["comm-share"].chart
    assert comm.splitlines()[0].startswith("comm % min 20 med ")
    # Axes wherever two rows of plots, or one of four, have the room: not with 64 ranks
    # at 120x40, where the table leaves ten lines: there the sparklines.
    assert all(c.plot == (ranks == 8 or size == (200, 60)) for c in charts.values()), name
    if charts["comm-share"].height >= LEGEND_MIN_HEIGHT:
        assert all(line in comm.split("\n", 1)[1] for line in ("max", "median", "min"))
    expected = SNAPSHOTS / f"{name}.txt"
    if UPDATE or not expected.exists():
        expected.write_text(screen + "\n")
        if not UPDATE:
            pytest.fail(f"wrote the missing snapshot {expected.name}; check it and rerun")
    assert screen + "\n" == expected.read_text()
