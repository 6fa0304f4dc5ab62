"""The rank map (dashboard/rankmap.py): a job of 16,384 ranks on 2,048 nodes of 8,
folded in-process, with a failed rank (1000, exit 1), a hung one (5000: 30 s in
its backward) and a slow one (299, on node 37: twice the others' 10 ms step),
shown at 200x60: every rank a cell, the planted ranks first among the outliers,
`m` to the table and back, the cursor to the slow rank and Enter to its detail.
A run of 8 ranks keeps the table. The map's screen is compared with
tests/snapshots/rankmap-16384-ranks-200x60.txt (DDTOP_UPDATE_SNAPSHOTS=1 rewrites it).
What keeps a frame of 16,384 ranks cheap: a large state frozen out of the collector's
full passes (feed.Pacer), the header paced behind the map (pacing.Every)."""

from __future__ import annotations

import asyncio
import gc
import os
import time
from pathlib import Path

import pytest
from test_app import screen_text

from ddtop.core import wire
from ddtop.core.state import RunState
from ddtop.dashboard import rankmap
from ddtop.dashboard.app import DashboardApp
from ddtop.dashboard.feed import Pacer, StateFeed, freeze_due
from ddtop.dashboard.pacing import Every
from ddtop.dashboard.screens import RankDetail
from ddtop.dashboard.widgets import RankTable

RUN = "big"
RANKS, PER_NODE = 16_384, 8
FAILED, HUNG, SLOW = 1000, 5000, 37 * PER_NODE + 3
NOW = 110.0
SNAPSHOT = Path(__file__).parent / "snapshots" / "rankmap-16384-ranks-200x60.txt"
UPDATE = os.environ.get("DDTOP_UPDATE_SNAPSHOTS") == "1"


def big_run(ranks: int = RANKS) -> RunState:
    state = RunState(run=RUN)
    for rank in range(ranks):
        state.apply(wire.Hello(run=RUN, rank=rank, seq=0, t=100.0, local_rank=rank % PER_NODE,
                               host=f"node{rank // PER_NODE}", pid=1000 + rank, device="cpu",
                               backend="gloo", world_size=ranks, config_digest="d",
                               model="mlp", dataset="synthetic", epochs=1,
                               global_batch=32 * ranks), 100.0)
    for rank in range(ranks):
        took = 0.2 if rank == SLOW else 0.1 + (rank % 7) * 0.001
        state.apply(wire.Step(
            run=RUN, rank=rank, seq=1, t=108.0, epoch=0, step=50, steps_per_epoch=1000,
            global_step=50, steps=10, samples=320, loss_sum=320.0, lr=0.1, step_s=took,
            data_s=0.01, forward_s=0.03, backward_s=0.03, optimizer_s=0.01,
            comm_s=0.02, comm_bytes=10_000_000, comm_ops=10, algbw_gbps=1.0,
            busbw_gbps=1.0, sync_wait_s=0.0), 108.0)
    if ranks > HUNG:
        state.apply(wire.Heartbeat(run=RUN, rank=HUNG, seq=2, t=109.0, phase="backward",
                                   epoch=0, global_step=50, phase_s=30.0), 109.0)
    if ranks > FAILED:
        state.apply(wire.RankExit(run=RUN, rank=wire.DAEMON_RANK, t=109.5, exited=FAILED,
                                  pid=1000 + FAILED, exit_code=1, signal=None), 109.5)
    return state


class FixedClockFeed(StateFeed):
    """A live feed whose clock stands still at NOW: the states do not age."""

    def now(self) -> float:
        return NOW


def test_the_map_classes_and_outliers_pure() -> None:
    state = big_run()
    states, data = rankmap.snapshot(state, NOW)
    assert len(data.kinds) == RANKS
    assert data.kinds[FAILED] == "failed" and data.kinds[HUNG] == "hung"
    assert data.kinds[SLOW] == "slower" and data.kinds[0] == "median"
    lines = [line.plain for line in data.outliers]
    assert lines[0].startswith("16,382 running · step ms min 10.0 · p50 10.3")
    assert "max 20.0 · comm ms min 2.0" in lines[0]
    assert "failed  r1000   node125  exit 1" in lines[1]
    assert "hung    r5000   node625  in backward of step 51" in lines[2]
    assert "slowest r299    node37   20.0 ms (1.94x)" in lines[3]
    assert lines[8].startswith("█ fastest r0 ")
    layout = rankmap.pack(rankmap.groups(state, list(states)), 194, 0)
    assert len(layout.lines) == 43 and len(layout.at) == RANKS
    assert layout.at[SLOW] == (0, 37 * 4 + 1, 1) and layout.lines[1][0] == "node48"


def test_a_small_run_keeps_the_table() -> None:
    state = big_run(8)
    assert not rankmap.wanted(state)
    app = DashboardApp(FixedClockFeed(state), fps=10)

    async def main() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            while app.frames < 2:
                await pilot.pause(0.05)
            assert app.map_shown is False
            assert app.query_one("#ranks").display and not app.query_one("#mapview").display

    asyncio.run(main())


@pytest.mark.slow  # 16,384 ranks, a frame per key: 19 s on 2 cores (make test runs it)
def test_the_map_shows_every_rank_and_opens_a_ranks_detail() -> None:
    app = DashboardApp(FixedClockFeed(big_run()), fps=10)

    async def main() -> None:
        async with app.run_test(size=(200, 60)) as pilot:
            deadline = time.monotonic() + 60
            the_map = app.query_one(rankmap.RankMap)
            # Laid out at the screen's size: the map as high as its lines.
            while (app.frames < 2 or the_map.size.height != len(the_map.layout_.lines) + 1
                   or "m map/table" not in screen_text(app)):
                assert time.monotonic() < deadline, "no frame laid the map out"
                await pilot.pause(0.05)
            assert app.map_shown and not app.query_one("#ranks").display
            screen = screen_text(app)
            # Every rank a half of a cell, all on screen: the upper half the glyph's
            # colour, the lower half its background.
            halves = 0
            for y in range(1, the_map.size.height):
                for segment in the_map.render_line(y):
                    if segment.text.strip() == rankmap.GLYPH * len(segment.text.strip()):
                        per = 2 if segment.style and segment.style.bgcolor else 1
                        halves += per * segment.text.count(rankmap.GLYPH)
            assert halves == RANKS
            assert screen.count(rankmap.GLYPH) == RANKS // 2
            outliers = screen[screen.index("16,382 running"):]
            assert outliers.index("r1000") < outliers.index("r5000") < outliers.index("r299")
            if UPDATE or not SNAPSHOT.exists():
                SNAPSHOT.write_text(screen + "\n")
                if not UPDATE:
                    pytest.fail(f"wrote the missing snapshot {SNAPSHOT.name}; check it and rerun")
            assert screen + "\n" == SNAPSHOT.read_text()
            await pilot.press("m")
            await pilot.pause(0.3)
            assert app.map_shown is False and app.query_one("#ranks").display
            assert app.focused is app.query_one(RankTable)
            await pilot.press("m")
            await pilot.pause(0.3)
            assert app.map_shown and app.focused is the_map
            assert the_map.cursor == 0
            # `o`: the outliers in the order listed (failed, hung, slowest, ...), from
            # a rank that is none (rank 0 is among the fastest)
            the_map.cursor = 1
            for outlier in (FAILED, HUNG, SLOW):
                await pilot.press("o")
                assert the_map.cursor == outlier
            the_map.cursor = 0
            # A few keys (each waits for a frame of 16,384 ranks): next to the slow rank,
            # then onto it: from the upper half of its cell to the lower.
            await pilot.press("down")
            assert the_map.cursor == 1
            the_map.cursor = SLOW - 1
            await pilot.press("down")
            assert the_map.cursor == SLOW
            await pilot.press("enter")
            await pilot.pause(0.3)
            assert isinstance(app.screen, RankDetail) and app.screen.rank == SLOW

    asyncio.run(main())


def test_a_large_state_is_frozen_out_of_the_collectors_full_passes() -> None:
    """feed.Pacer (the TUI's worker, ddtop --headless) freezes what is alive (gc.freeze)
    when it first sees a state of 256 ranks or more, and again when it is a new state
    or twice as large: the collector's full passes then skip its millions of objects.
    A small run's dashboard freezes nothing."""
    assert not freeze_due(None, 1, 8) and not freeze_due(None, 1, 255)
    assert freeze_due(None, 1, 256)
    assert not freeze_due((1, 300), 1, 300) and not freeze_due((1, 300), 1, 599)
    assert freeze_due((1, 300), 1, 600) and freeze_due((1, 300), 2, 300)
    gc.unfreeze()
    try:
        state = big_run(300)
        Pacer(StateFeed(state), 0.01).pump()
        assert gc.get_freeze_count() > 300  # the state's ranks among them
    finally:
        gc.unfreeze()


def test_a_panel_is_built_again_when_its_key_changes_or_its_time_has_come() -> None:
    """pacing.Every, which paces the comm panel, the charts and, behind the map, the
    header and the banner (each of those asks every rank's state twice)."""
    every = Every(60.0)
    assert every.due("a")  # never built
    assert not every.due("a")  # the same key, within the minute
    assert every.due("b") and not every.due("b")  # another key: at once
    assert every.due("b", force=True)  # forced (the table's header: every frame)
    soon = Every(0.0)
    assert soon.due("a") and soon.due("a")  # its time has come
