"""The real Textual app, driven with App.run_test(): attached to a live 2-rank run
(rows advance, sort, detail, quit while the run goes on, stop it with `x`), to a
daemon that never answers a stop (the dashboard does not freeze), to a real relay
fed a script's messages (its ddtop.log scalars as columns and in the detail), and
on recorded journals (keys, filters, screens, and snapshots of the main screen).

Snapshots are the screen's text; after a deliberate change of the layout,
rewrite them with DDTOP_UPDATE_SNAPSHOTS=1 and review the diff."""

from __future__ import annotations

import asyncio
import io
import json
import os
import queue
import re
import shutil
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from helpers import detached
from rich.console import Console
from test_scalars import scalars, script_hello
from test_state import step
from textual.pilot import Pilot

from ddtop.core import wire
from ddtop.core.control import STOP_REQUEST_TIMEOUT_S as STOP_REQUEST_S
from ddtop.core.rundir import RunPaths
from ddtop.core.runinfo import RunInfo
from ddtop.core.state import RunState, encode_snapshot
from ddtop.daemon.relay import Relay
from ddtop.dashboard.app import DashboardApp
from ddtop.dashboard.feed import LIVE, Feed, Pacer
from ddtop.dashboard.live import LiveFeed, open_feed
from ddtop.dashboard.screens import HelpScreen, RankDetail
from ddtop.dashboard.widgets import RankTable, TextPanel

FIXTURES = Path(__file__).parent / "fixtures" / "runs"
SNAPSHOTS = Path(__file__).parent / "snapshots"
UPDATE = os.environ.get("DDTOP_UPDATE_SNAPSHOTS") == "1"


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


@pytest.fixture
def recorded(tmp_path: Path) -> Path:
    shutil.copytree(FIXTURES, tmp_path / "runs")
    return tmp_path / "runs"


def screen_text(app: DashboardApp) -> str:
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), record=True,
                      color_system=None, legacy_windows=False)
    console.print(app.screen._compositor.render_update(full=True))
    return "\n".join(line.rstrip() for line in console.export_text().splitlines())


def drive(feed: Feed, size: tuple[int, int],
          script: Callable[[DashboardApp, Pilot[None]], Awaitable[None]],
          notifications: bool = False) -> DashboardApp:
    app = DashboardApp(feed, fps=10)

    async def main() -> None:
        async with app.run_test(size=size, notifications=notifications) as pilot:
            await script(app, pilot)

    try:
        asyncio.run(main())
    finally:
        feed.close()
    return app


async def until(pilot: Pilot[None], predicate: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s")
        await pilot.pause(0.05)


async def settled(app: DashboardApp, pilot: Pilot[None]) -> None:
    """The journal is folded and a frame drawn from the end of it."""
    await until(pilot, lambda: app.feed.finished)
    frames = app.frames
    await until(pilot, lambda: app.frames > frames + 1)


def table(app: DashboardApp) -> list[str]:
    return [line for line in app.query_one(RankTable).visible_text() if line]


@pytest.mark.parametrize("size", [(120, 40), (80, 24)])
def test_snapshot_of_a_finished_run(recorded: Path, size: tuple[int, int]) -> None:
    shots: list[str] = []

    async def script(app: DashboardApp, pilot: Pilot[None]) -> None:
        await settled(app, pilot)
        shots.append(screen_text(app))

    drive(open_feed(RunPaths(recorded / "recorded-ok")), size, script)
    expected = SNAPSHOTS / f"finished-{size[0]}x{size[1]}.txt"
    if UPDATE or not expected.exists():
        expected.parent.mkdir(exist_ok=True)
        expected.write_text(shots[0] + "\n")
        if not UPDATE:
            pytest.fail(f"wrote the missing snapshot {expected.name}; check it and rerun")
    assert shots[0] + "\n" == expected.read_text()


def test_every_view_is_whole_at_80x24(recorded: Path) -> None:
    """The header keeps the elapsed time (its bar goes first), the help fits its width
    and scrolls to its last line, and the rank detail keeps its comm row."""
    import re

    from ddtop.dashboard.screens import HELP

    help_lines = [line.rstrip() for line in re.sub(r"\[/?[a-z ]+\]", "", HELP).splitlines()]
    seen: dict[str, str] = {}

    async def script(app: DashboardApp, pilot: Pilot[None]) -> None:
        await settled(app, pilot)
        seen["main"] = screen_text(app)
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen))
        await pilot.pause(0.2)
        seen["help"] = screen_text(app)
        for _ in range(4):
            await pilot.press("pagedown")
            await pilot.pause(0.2)
            seen["help"] += screen_text(app)
        seen["help end"] = screen_text(app)
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, HelpScreen))
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, RankDetail))
        await until(pilot, lambda: "per step (ms)" in screen_text(app))
        seen["detail"] = screen_text(app)

    drive(open_feed(RunPaths(recorded / "recorded-ok")), (80, 24), script)
    progress = seen["main"].splitlines()[2]
    assert "elapsed 7.2 s" in progress and "…" not in progress, progress
    for line in help_lines:  # every line whole, at the top or once scrolled down
        assert line.strip() in seen["help"], line
    assert "Press Escape or ? to close." in seen["help end"]
    comm = next(line for line in seen["detail"].splitlines() if "all-reduce" in line
                and "%" in line)
    assert comm.rstrip().endswith("(in backward)"), comm
    # The four charts fit beside the numbers at 80x24, the memory one titled with what
    # it charts and its newest reading.
    for title in ("loss", "samples/s", "comm share of step", "memory: RSS 471.6 MB"):
        assert title in seen["detail"], (title, seen["detail"])


def test_rank_and_view_open_where_they_say(recorded: Path) -> None:
    """ddtop --rank 1 opens rank 1's detail at once (a page's #rank=1), and Escape goes
    back to the main view, which --view map makes the rank map (a page's #view=map);
    --view table, the table."""
    paths = RunPaths(recorded / "recorded-ok")
    seen: list[str] = []

    async def script(app: DashboardApp, pilot: Pilot[None]) -> None:
        await until(pilot, lambda: isinstance(app.screen, RankDetail))
        await until(pilot, lambda: "per step (ms)" in screen_text(app))
        seen.append(screen_text(app))
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, RankDetail))
        await settled(app, pilot)
        assert app.map_shown and app.query_one("#mapview").display
        assert not app.query_one(RankTable).display
        seen.append(screen_text(app))

    app = DashboardApp(open_feed(paths), fps=10, rank=1, view="map")

    async def main() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            await script(app, pilot)

    try:
        asyncio.run(main())
    finally:
        app.feed.close()
    assert seen[0].lstrip().startswith("rank 1") and "RANK" not in seen[0]
    assert "cursor r0" in seen[1] and "RANK" not in seen[1]  # the map, not the table
    for view, shown in (("table", False), (None, None)):  # None: by the ranks' count
        feed = open_feed(paths)
        try:
            assert DashboardApp(feed, view=view).map_shown is shown
        finally:
            feed.close()


def test_keys_on_a_recorded_failed_run(recorded: Path) -> None:
    async def script(app: DashboardApp, pilot: Pilot[None]) -> None:
        await settled(app, pilot)
        text = screen_text(app)
        assert "✖ rank 1 killed by SIGKILL" in text and " failed " in text
        rows = table(app)[1:]
        assert " SIGTERM " in rows[0] and " SIGKILL " in rows[1]
        await pilot.press("s")  # by state: problems first, then by rank
        await pilot.pause(0.1)
        assert "STATE▼" in table(app)[0]
        await pilot.press("s", "s", "s")  # step, loss, samples/s
        assert "SAMPLES/S▼" in table(app)[0]
        await pilot.press("slash", "1", "enter")
        await until(pilot, lambda: len(table(app)) == 2)
        assert table(app)[1].split()[0] == "1" and "filter: '1'" in screen_text(app)
        await pilot.press("slash", "backspace", "enter")
        await until(pilot, lambda: len(table(app)) == 3)
        await pilot.press("f")  # problems only: both ranks are dead
        await until(pilot, lambda: "problems only" in screen_text(app))
        assert len(table(app)) == 3
        await pilot.press("f", "question_mark")
        assert isinstance(app.screen, HelpScreen) and "straggler" in screen_text(app)
        await pilot.press("escape")
        await pilot.press("x")  # nothing to stop: the run is over
        await pilot.pause(0.1)
        assert not isinstance(app.screen, HelpScreen)
        rank_table = app.query_one(RankTable)
        loss_x = next(x for x in range(120) if rank_table.column_at(x) == "loss")
        await pilot.click(RankTable, offset=(loss_x, 0))  # a click on a title sorts by it
        await until(pilot, lambda: "LOSS▼" in table(app)[0])
        await pilot.click(RankTable, offset=(loss_x, 0))  # ... a second reverses
        await until(pilot, lambda: "LOSS▲" in table(app)[0])
        rank_x = next(x for x in range(120) if rank_table.column_at(x) == "rank")
        await pilot.click(RankTable, offset=(rank_x, 0))
        await until(pilot, lambda: "RANK▼" in table(app)[0])
        await pilot.press("home", "enter")
        await until(pilot, lambda: isinstance(app.screen, RankDetail))
        await until(pilot, lambda: "training done" in screen_text(app)
                    or "step" in screen_text(app))
        detail = screen_text(app)
        assert "rank 0" in detail and "stopped by the daemon" in detail
        assert "rank-0.log" in detail and "per step (ms)" in detail
        assert "esc back" in detail and "s sort" not in detail  # only this screen's keys
        await pilot.press("escape")
        assert isinstance(app.screen.query_one(RankTable), RankTable)
        await pilot.press("q")

    drive(open_feed(RunPaths(recorded / "recorded-failed")), (120, 40), script)


def test_replay_plays_the_journal_in_its_own_time(recorded: Path) -> None:
    feed = open_feed(RunPaths(recorded / "recorded-ok"), replay=True, speed=4.0)

    async def script(app: DashboardApp, pilot: Pilot[None]) -> None:
        await until(pilot, lambda: "replay 4x" in screen_text(app))
        # What acts on a live run is not offered in a replay.
        assert not any(app.check_action(a, ()) for a in ("stop_run", "evidence", "profile"))
        await pilot.press("plus")
        await until(pilot, lambda: "replay 8x" in screen_text(app))
        await until(pilot, lambda: app.feed.finished, timeout=20)
        await until(pilot, lambda: " succeeded " in screen_text(app))
        await pilot.press("f")  # problems only, in a run without one: said so
        await until(pilot, lambda: any("no rank has a problem" in str(n.message)
                                       for n in app._notifications))

    drive(feed, (120, 40), script)


@pytest.mark.timeout(180)
@pytest.mark.processes
def test_live_run_rows_advance_quit_leaves_it_running_and_x_stops_it(tmp_path: Path) -> None:
    with detached("-n", "2", "--epochs", "40",
                  "--step-delay", "0.05", "--run-id", "tui", cwd=tmp_path) as run:
        assert run.started.returncode == 0, run.started.stderr
        paths = RunPaths(tmp_path / "runs" / "tui")

        def steps(app: DashboardApp) -> list[int]:
            return [int(line.split()[4].split("/")[0]) for line in table(app)[1:]]

        async def watch_then_quit(app: DashboardApp, pilot: Pilot[None]) -> None:
            await until(pilot, lambda: len(table(app)) == 3 and min(steps(app)) > 0)
            first = steps(app)
            await until(pilot, lambda: all(b > a for a, b in zip(first, steps(app), strict=True)))
            assert " running " in screen_text(app) and "2 ranks on 1 node" in screen_text(app)
            await pilot.press("s")
            assert "STATE▼" in table(app)[0]
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, RankDetail))
            await until(pilot, lambda: "samples/s" in screen_text(app))
            hidden = app.frames  # the main view is not drawn behind the detail ...
            await pilot.pause(1.0)
            assert app.frames == hidden
            await pilot.press("t")  # the rank's Python stacks, from the live rank
            await until(pilot, lambda: "Thread 0x" in screen_text(app))
            assert "stacks of rank" in screen_text(app)
            await pilot.press("l")
            await until(pilot, lambda: ".log" in screen_text(app))
            detail = app.screen
            assert isinstance(detail, RankDetail) and detail.log_path is not None
            with detail.log_path.open("a") as log:  # the tail follows the log as it grows
                log.write("a line the test appended\n")
            await until(pilot, lambda: "a line the test appended" in screen_text(app))
            await pilot.press("escape")
            await until(pilot, lambda: app.frames > hidden)  # ... and is again once shown
            await pilot.press("e")  # the evidence, gathered now: its folder in the events
            await until(pilot, lambda: "evidence asked for in" in screen_text(app))
            told = [e.message for e in app.feed.state.events if "evidence" in e.message]
            assert told and told[-1].startswith("evidence asked for in runs/tui/evidence/"), told
            (bundle,) = paths.evidence.iterdir()
            assert {"index.json", "rank-0.stacks", "rank-1.stacks"} <= {
                f.name for f in bundle.iterdir()}
            # P: the selected rank profiled for 5 steps, a second of steps from now.
            await pilot.press("P")
            await until(pilot, lambda: bool(list(paths.root.glob("profiles/*/rank-*.top.json"))),
                        timeout=30)
            (taken,) = (paths.root / "profiles").iterdir()
            (top,) = taken.glob("rank-*.top.json")
            record = json.loads(top.read_text())
            assert record["steps"] == 5 and record["top"], record
            assert (taken / top.name.replace("top.json", "trace.json.gz")).stat().st_size > 0
            await pilot.press("q")

        drive(LiveFeed(paths=paths), (120, 40), watch_then_quit)
        assert RunInfo.load(paths).live  # quitting the dashboard left the run alone

        async def stop_it(app: DashboardApp, pilot: Pilot[None]) -> None:
            await until(pilot, lambda: app.feed.connection == "live")
            await pilot.press("x")
            await until(pilot, lambda: "Stop run" in screen_text(app))
            await pilot.press("y")
            await until(pilot, lambda: app.feed.finished, timeout=60)
            await until(pilot, lambda: " stopped " in screen_text(app))
            await pilot.press("q")

        drive(LiveFeed(paths=paths), (120, 40), stop_it)
        status = run.status("tui")
        assert status["status"] == "stopped"
        assert run.leftovers() == []


def test_a_daemon_that_does_not_answer_gets_a_banner_and_retries() -> None:
    feed = LiveFeed(connect="tcp://127.0.0.1:9")  # nothing listens there

    async def script(app: DashboardApp, pilot: Pilot[None]) -> None:
        await until(pilot, lambda: "the daemon does not answer" in screen_text(app))
        tries = feed.next_try
        await until(pilot, lambda: feed.next_try > tries)  # still trying, still drawing
        frames = app.frames
        await until(pilot, lambda: app.frames > frames)
        await pilot.press("q")

    drive(feed, (100, 30), script)


@pytest.mark.timeout(120)
@pytest.mark.processes
def test_killed_daemon_shows_the_run_lost(tmp_path: Path) -> None:
    with detached("-n", "2", "--epochs", "40",
                  "--step-delay", "0.05", "--run-id", "gone", cwd=tmp_path) as run:
        assert run.started.returncode == 0, run.started.stderr
        paths = RunPaths(tmp_path / "runs" / "gone")
        pid = RunInfo.load(paths).daemon_pid
        assert pid is not None

        async def script(app: DashboardApp, pilot: Pilot[None]) -> None:
            await until(pilot, lambda: app.feed.connection == "live" and " running " in
                        screen_text(app))
            os.kill(pid, signal.SIGKILL)
            await until(pilot, lambda: "run lost" in screen_text(app), timeout=30)
            text = screen_text(app)
            assert " lost " in text and f"daemon (pid {pid}) is gone" in text
            await pilot.press("q")

        drive(LiveFeed(paths=paths), (120, 40), script)
        assert run.leftovers() == []  # the ranks died with their daemon


@contextmanager
def daemon_mute_on_stop() -> Iterator[tuple[str, list[str]]]:
    """A stand-in daemon on 127.0.0.1, real sockets: its control ROUTER answers
    `ping` and `snapshot` (so a LiveFeed attaches: a running run), and reads `stop`
    without ever answering, like a daemon wedged mid-request. Yields the control
    endpoint and the ops received, in order."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    pub = context.socket(zmq.PUB)  # where the feed subscribes; nothing is published
    pub.setsockopt(zmq.LINGER, 0)
    endpoints = {"control": endpoint,
                 "publish": f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"}
    snapshot = encode_snapshot(RunState(run="mute", status="running"))
    ops: list[str] = []
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            if not router.poll(50):
                continue
            *envelope, body = router.recv_multipart()
            op = str(msgspec.msgpack.decode(body)["op"])
            ops.append(op)
            if op == "ping":
                reply = {"ok": True, "run": "mute", "seq": 0, "endpoints": endpoints}
            elif op == "snapshot":
                reply = {"ok": True, "seq": 0, "state": snapshot}
            else:
                continue  # stop: read, never answered
            router.send_multipart([*envelope, msgspec.msgpack.encode(reply)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield endpoint, ops
    finally:
        done.set()
        thread.join()
        router.close()
        pub.close()
        context.term()


@pytest.mark.timeout(60)
def test_a_stop_the_daemon_never_answers_does_not_freeze_the_dashboard() -> None:
    with daemon_mute_on_stop() as (endpoint, ops):
        feed = LiveFeed(connect=endpoint)

        async def script(app: DashboardApp, pilot: Pilot[None]) -> None:
            await until(pilot, lambda: feed.connection == "live")
            assert feed.stop_endpoint == endpoint
            await pilot.press("x")
            await until(pilot, lambda: "Stop run" in screen_text(app))
            confirmed = time.monotonic()
            await pilot.press("y")
            await until(pilot, lambda: "stop" in ops)  # the request is out: no answer comes
            await pilot.press("question_mark")  # ... and the keys still work meanwhile
            await until(pilot, lambda: isinstance(app.screen, HelpScreen))
            assert "straggler" in screen_text(app)
            # The keys worked while the request was still out (not after its timeout).
            assert time.monotonic() - confirmed < STOP_REQUEST_S
            assert "did not" not in screen_text(app)  # still waiting for the daemon
            await pilot.press("escape")
            await until(pilot, lambda: not isinstance(app.screen, HelpScreen))
            await until(pilot, lambda: "the daemon did not answer" in screen_text(app),
                        timeout=STOP_REQUEST_S + 10)  # the toast, once the request timed out
            assert time.monotonic() - confirmed >= STOP_REQUEST_S - 0.5
            assert ops.count("stop") == 1
            await pilot.press("q")

        drive(feed, (120, 40), script, notifications=True)


@pytest.mark.timeout(60)
def test_an_open_rank_detail_asks_the_daemon_for_the_ranks_every_step() -> None:
    """protocol.Focus: what a hub passes on to the rank's node (tests/test_nodesummary.py
    has the rest of the way); unanswered here, and nothing said of it."""
    with daemon_mute_on_stop() as (endpoint, ops):
        feed = LiveFeed(connect=endpoint)

        async def script(app: DashboardApp, pilot: Pilot[None]) -> None:
            await until(pilot, lambda: feed.connection == "live")
            assert "focus" not in ops
            app.push_screen(RankDetail(feed, 1, None, 5.0))
            await until(pilot, lambda: "focus" in ops)
            await pilot.press("escape")
            await until(pilot, lambda: not isinstance(app.screen, RankDetail))
            await pilot.press("q")

        drive(feed, (120, 40), script, notifications=True)


@pytest.mark.parametrize(("ranks", "table_lines"), [(2, 3), (64, 40 - 4 - 1 - 10)])
def test_the_ranks_table_takes_the_lines_it_needs_and_the_panels_the_rest(
        ranks: int, table_lines: int) -> None:
    from ddtop.dashboard.feed import StateFeed

    state = RunState(run="big")
    for rank in range(ranks):
        state.apply(wire.Hello(run="big", rank=rank, seq=0, t=100.0, local_rank=rank, host="n",
                               pid=1000 + rank, device="cpu", backend="gloo",
                               world_size=ranks, config_digest="d", model="mlp",
                               dataset="synthetic", epochs=1, global_batch=64), 100.0)

    async def script(app: DashboardApp, pilot: Pilot[None]) -> None:
        await pilot.pause(0.3)
        assert app.query_one(RankTable).size.height == table_lines
        assert app.query_one("#lower").outer_size.height >= 10  # its border included
        assert app.query_one("#lower").outer_size.height + table_lines == 40 - 4 - 1

    drive(StateFeed(state), (120, 40), script)


class RelayThread:
    """The daemon's real Relay (PULL, PUB, ROUTER, journal) served in a thread of
    its own, with a PUSH socket there that sends what `send` queues, as ranks do;
    `emit` has the relay say something as the daemon, after all that was sent."""

    def __init__(self, run: str, journal: Path) -> None:
        self.run, self.journal = run, journal
        self.queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.ready, self.done = threading.Event(), threading.Event()
        self.control = ""
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def send(self, *messages: wire.Message) -> None:
        for m in messages:
            self.queue.put(("push", m))

    def emit(self, kind: type[wire.RunStatus], **fields: Any) -> None:
        self.queue.put(("emit", (kind, fields)))

    def _serve(self) -> None:
        relay = Relay(self.run, self.journal)
        push = relay.context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(relay.endpoints["telemetry"])
        self.control = relay.endpoints["control"]
        self.ready.set()
        pushed = 0
        try:
            while not self.done.is_set():
                relay.serve(0.02)
                try:
                    what, item = self.queue.get_nowait()
                except queue.Empty:
                    continue
                if what == "push":
                    push.send_multipart(wire.encode(item))
                    pushed += 1
                    continue
                deadline = time.monotonic() + 10
                while relay.seq < pushed + relay.daemon_seq and time.monotonic() < deadline:
                    relay.serve(0.02)  # everything sent before is folded first
                kind, fields = item
                relay.emit(kind, **fields)
        finally:
            push.close()
            relay.close()


@contextmanager
def relay_thread(run: str, journal: Path) -> Iterator[RelayThread]:
    relay = RelayThread(run, journal)
    relay.thread.start()
    assert relay.ready.wait(10), "the relay did not start"
    try:
        yield relay
    finally:
        relay.done.set()
        relay.thread.join()


def a_script_with_scalars() -> list[wire.Message]:
    """Three ranks of a user's script, each a step in: rank 0 logs grad_norm and
    lr, rank 1 grad_norm, rank 2 tokens_per_s alone."""
    messages: list[wire.Message] = [script_hello(r) for r in range(3)]
    messages += [step(r, 1, 10) for r in range(3)]
    return messages


def cell(app: DashboardApp, rank: int, title: str) -> str:
    """What the ranks table shows for `rank` under the column titled `title`,
    read from the drawn text at the cells that column takes."""
    lines = app.query_one(RankTable).visible_text()
    header = lines[0]
    start = header.index(title)
    rank_table = app.query_one(RankTable)
    key = rank_table.column_at(start)
    span = [x for x in range(len(header) + 1) if rank_table.column_at(x) == key]
    row = next(line for line in lines[1:] if line[2:].split()[:1] == [str(rank)])
    return row.ljust(span[-1] + 1)[span[0]:span[-1] + 1].strip()


@pytest.mark.timeout(120)
def test_a_scripts_scalars_get_columns_that_stay_put_and_the_detail_lists_them(
        tmp_path: Path) -> None:
    with relay_thread("r1", tmp_path / "telemetry.journal") as relay:
        relay.send(*a_script_with_scalars())

        async def script(app: DashboardApp, pilot: Pilot[None]) -> None:
            await until(pilot, lambda: len(table(app)) == 4)
            assert "grad_norm" not in table(app)[0]  # no scalars yet: no columns
            relay.send(scalars(0, 2, grad_norm=1.5, lr=3e-4), scalars(1, 2, grad_norm=2.25),
                       scalars(2, 2, tokens_per_s=12345.0))
            await until(pilot, lambda: "tokens_per_s" in table(app)[0]
                        and cell(app, 2, "tokens_per_s") == "12.35k")
            header = table(app)[0]
            # After the fixed columns, by name; each rank's newest value, "-" where
            # the rank has not logged that key.
            assert header.index("SEEN") < header.index("grad_norm") < header.index(
                " lr") < header.index("tokens_per_s")
            assert [cell(app, r, "grad_norm") for r in range(3)] == ["1.5", "2.25", "-"]
            assert [cell(app, r, " lr") for r in range(3)] == ["0.0003", "-", "-"]
            assert [cell(app, r, "tokens_per_s") for r in range(3)] == ["-", "-", "12.35k"]
            assert "scalars: grad_norm 1.875 (1.5..2.25) · lr 0.0003 · tokens_per_s 12.35k" \
                in screen_text(app)

            relay.send(scalars(0, 3, grad_norm=1.75))  # a new value: the columns stay put
            await until(pilot, lambda: cell(app, 0, "grad_norm") == "1.75")
            assert table(app)[0] == header

            rank_table = app.query_one(RankTable)
            x = next(x for x in range(120) if rank_table.column_at(x) == "scalar:grad_norm")
            await pilot.click(RankTable, offset=(x, 0))  # a scalar's title sorts by it
            await until(pilot, lambda: "grad_norm▼" in table(app)[0])
            assert [line[2:].split()[0] for line in table(app)[1:]] == ["1", "0", "2"]

            await pilot.press("slash", "0", "enter")  # rank 0's detail: all it logged
            await until(pilot, lambda: len(table(app)) == 2)
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, RankDetail))
            await until(pilot, lambda: "scalars (ddtop.log)" in screen_text(app))
            detail = screen_text(app)
            assert re.search(r"grad_norm +1\.75 ▼", detail)  # the run's lowest (1.75 < 2.25)
            assert re.search(r"lr +0\.0003(?! [▲▼])", detail)  # logged by rank 0 alone
            assert "tokens_per_s" not in detail  # rank 2's, not rank 0's
            await pilot.press("escape", "q")

        drive(LiveFeed(connect=relay.control), (120, 40), script)


@pytest.mark.timeout(120)
def test_scalar_columns_fit_the_width_and_count_those_left_out(tmp_path: Path) -> None:
    with relay_thread("r1", tmp_path / "telemetry.journal") as relay:
        relay.send(*a_script_with_scalars(), scalars(0, 2, grad_norm=1.5, lr=3e-4),
                   scalars(2, 2, tokens_per_s=12345.0))

        async def script(app: DashboardApp, pilot: Pilot[None]) -> None:
            await until(pilot, lambda: "tokens_per_s" in table(app)[0])
            assert "more" not in table(app)[0]
            await pilot.resize_terminal(100, 30)
            await until(pilot, lambda: table(app)[0].endswith("+1 more"))
            assert "grad_norm" in table(app)[0] and " lr" in table(app)[0]
            assert "tokens_per_s" not in table(app)[0]
            assert cell(app, 0, " lr") == "0.0003"
            await pilot.resize_terminal(80, 24)  # the fixed columns come first
            await until(pilot, lambda: table(app)[0].endswith("SEEN +3 more"))
            await pilot.resize_terminal(120, 40)  # and back: the cells follow at once
            await until(pilot, lambda: "tokens_per_s" in table(app)[0])
            await until(pilot, lambda: cell(app, 2, "tokens_per_s") == "12.35k")
            assert cell(app, 0, "grad_norm") == "1.5" and cell(app, 1, "grad_norm") == "-"
            await pilot.press("q")

        drive(LiveFeed(connect=relay.control), (120, 40), script)


@pytest.mark.timeout(120)
def test_an_event_is_drawn_at_once_not_at_the_next_frame(tmp_path: Path) -> None:
    """With no frame due for 100 s, a rank's death still shows within a second
    or two: the worker has the app draw an event (or a new status) as soon as it
    is folded, where progress waits for the frame."""
    with relay_thread("r1", tmp_path / "telemetry.journal") as relay:
        relay.send(*a_script_with_scalars())
        app = DashboardApp(LiveFeed(connect=relay.control), fps=0.01)

        async def main() -> None:
            async with app.run_test(size=(120, 40)) as pilot:
                await until(pilot, lambda: len(table(app)) == 4)  # the first data: at once
                await pilot.pause(0.3)
                frames = app.frames
                relay.emit(wire.RankExit, exited=1, pid=1001, exit_code=None, signal="SIGKILL")
                events = app.query_one("#events", TextPanel)
                await until(pilot, lambda: "SIGKILL" in events.text, timeout=2.5)
                assert app.frames == frames + 1  # that one, drawn for the event
                await pilot.press("q")

        try:
            asyncio.run(main())
        finally:
            app.feed.close()


@pytest.mark.timeout(60)
def test_a_live_feed_of_a_few_ranks_is_folded_a_period_at_a_time_and_nothing_is_lost(
        tmp_path: Path) -> None:
    """feed.Pacer, the loop of `ddtop --headless` and of the TUI's worker: messages
    that trickle in (the relay thread sends them one by one, as a few ranks do)
    are folded a period's worth at a time, one wakeup per period rather than one
    per message, and every one is folded."""
    period_s, sent = 0.25, 80
    with relay_thread("r1", tmp_path / "telemetry.journal") as relay:
        feed = LiveFeed(connect=relay.control)
        try:
            pacer = Pacer(feed, period_s)
            deadline = time.monotonic() + 10
            while feed.connection != LIVE and time.monotonic() < deadline:
                pacer.pump()
            assert feed.connection == LIVE, feed.detail
            messages = [script_hello(0), *(step(0, seq, seq, steps=1) for seq in range(1, sent))]

            def trickle() -> None:  # 10 messages every 0.1 s
                for i in range(0, sent, 10):
                    relay.send(*messages[i:i + 10])
                    time.sleep(0.1)

            sender = threading.Thread(target=trickle, daemon=True)
            sender.start()
            folds: list[int] = []
            first = last = 0.0
            deadline = time.monotonic() + 30
            while sum(folds) < sent and time.monotonic() < deadline:
                folded = pacer.pump()
                if folded:
                    last = time.monotonic()
                    first = first or last
                    folds.append(folded)
                pacer.rest()
            sender.join()
        finally:
            feed.close()
    assert sum(folds) == sent and feed.state.ranks[0].global_step == sent - 1
    # As many wakeups with news as periods it took (and the first), not one per message.
    assert len(folds) <= (last - first) / period_s + 2, (folds, last - first)
    assert max(folds) > 1, folds


def test_ddtop_help_lists_every_key_the_app_binds() -> None:
    from textual.binding import Binding

    from ddtop.dashboard import cli

    def bound(*owners: type) -> set[str]:
        return {key.strip() for owner in owners for b in owner.BINDINGS  # type: ignore[attr-defined]
                if isinstance(b, Binding) for key in b.key.split(",")}

    def listed(keys: tuple[tuple[str, str], ...]) -> set[str]:
        return {key for names, _ in keys for key in names.split(",")}

    assert listed(cli.KEYS) == bound(DashboardApp, RankTable)
    assert listed(cli.DETAIL_KEYS) == bound(RankDetail)
    help_text = " ".join(cli.build_parser().format_help().split())
    for key in ("q quit", "? help", "f problems only", "t its Python stacks", "l its log",
                "Enter the rank's detail", "x stop the run"):
        assert key in help_text
