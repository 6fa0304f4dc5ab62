"""The Textual dashboard: the App routes, the widgets display, the feed folds.

A thread worker pumps the feed (sockets or journal) into its RunState (a live
feed of a few ranks once per half frame) and posts `FeedChanged` only when the
connection changes, the first ranks come, or an event or a new status does (drawn
at once). The app redraws on a timer at a fixed frame rate (never once per
message), when the state's fold count moved, else once a second: under the feed's
lock it builds the header, rows and panels from the RunState (the comm panel once
a second, the charts' data, series.py, every other second) and hands them to the
widgets, which draw again only the lines that changed (a chart only when its data
did). Requests to the daemon (`x`: stop the run) go out from a thread worker, so a
daemon that does not answer never freezes the screen (answered by `StopAnswered`).
"""

from __future__ import annotations

import time
from typing import ClassVar

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.message import Message
from textual.notifications import SeverityLevel
from textual.screen import ModalScreen
from textual.widgets import Footer, Input
from textual.worker import get_current_worker

from ddtop.core import control, profilereq, protocol
from ddtop.core.control import STOP_REQUEST_TIMEOUT_S
from ddtop.dashboard import format as fmt
from ddtop.dashboard import panels, rankmap
from ddtop.dashboard.charts import MIN_PLOT_HEIGHT, MIN_PLOT_WIDTH
from ddtop.dashboard.feed import Feed as FeedBase
from ddtop.dashboard.feed import Pacer
from ddtop.dashboard.mainpanels import (
    CHART_POINTS,
    Banner,
    ChartGrid,
    CommPanel,
    EventsPanel,
    RunHeader,
)
from ddtop.dashboard.screens import ConfirmStop, HelpScreen, RankDetail
from ddtop.dashboard.widgets import RankTable

# A live feed of a few ranks is folded once per half frame, within these bounds (see pump).
PUMP_S, PUMP_MAX_S = 0.05, 0.25
STOP_TIMEOUT_S = 30.0  # the graceful stop's deadline, sent to the daemon with the request
PROFILE_STEPS = 5  # the steps `P` profiles the selected rank for
IDLE_REDRAW_S, URGENT_GAP_S = 1.0, 0.1  # an event is drawn at once unless a frame just was
# Lines around the table (ddtop.tcss): header, footer, least for the panels, for the table.
HEADER_LINES, FOOTER_LINES, LOWER_MIN_LINES, TABLE_MIN_LINES = 4, 1, 10, 3
NARROW_WIDTH = 100  # narrower: the charts are one column of sparklines (ddtop.tcss: .narrow)
CHARTS_SHARE, CHARTS_MARGIN = 0.6, 8  # their width: #charts 3fr of 5, padding and gutters


class FeedChanged(Message):
    """The worker folded new messages (or the connection changed). `urgent`: an
    event or a new status among them, drawn at once rather than at the next frame."""

    def __init__(self, folded: int, urgent: bool = False) -> None:
        super().__init__()
        self.folded, self.urgent = folded, urgent

    def can_replace(self, message: Message) -> bool:
        """`message`, a newer one, stands for this one too (urgent if either is)."""
        if not isinstance(message, FeedChanged):
            return False
        message.urgent = message.urgent or self.urgent
        return True


class StopAnswered(Message):
    """The stop (or evidence) request's worker is done: what to tell the user."""

    def __init__(self, text: str, severity: SeverityLevel) -> None:
        super().__init__()
        self.text, self.severity = text, severity


class DashboardApp(App[None]):
    CSS_PATH = "ddtop.tcss"
    TITLE = "ddtop"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "quit"),
        Binding("question_mark", "help", "help"),
        Binding("s", "sort", "sort"),
        Binding("S", "sort(True)", "reverse", show=False),
        Binding("slash", "filter", "filter"),
        Binding("f", "problems", "problems only"),
        Binding("m", "rank_map", "map/table"),
        Binding("p", "pause", "pause"),
        Binding("w", "chart_window", "whole run/latest", show=False),
        Binding("x", "stop_run", "stop run"),
        Binding("e", "evidence", "evidence", show=False),
        Binding("P", "profile", "profile", show=False),
        Binding("plus,equals_sign", "speed(2.0)", "faster", show=False),
        Binding("minus", "speed(0.5)", "slower", show=False),
        Binding("escape", "clear_filter", show=False),
    ]

    def __init__(self, feed: FeedBase, fps: float = 5.0, can_stop: bool = True,
                 rank: int | None = None, view: str | None = None) -> None:
        """`rank`: its detail opened at once; `view`: "map" or "table" first (ddtop --rank,
        --view: a page's #rank=N, #view=map)."""
        super().__init__()
        self.open_rank = rank
        self.feed, self.fps = feed, fps
        self.can_stop = can_stop  # off: --no-stop (a page of ddtop --serve)
        self.pump_s = min(PUMP_MAX_S, max(PUMP_S, 0.5 / fps))
        self.replay = feed.replay_controls
        self.exit_code = 0
        self.paused = False
        self.dirty = True
        self.shown_run = False
        self.last_render = 0.0
        self.sort_index, self.sort_reverse = 0, False  # `s` steps through fmt.SORT_KEYS
        self.sort_key = fmt.SORT_KEYS[0]  # ... and a click on a title may pick a scalar's
        self.filter_text, self.problems_only = "", False
        self.frames = 0
        # The rank map (rankmap.py); None: not decided yet (by the ranks' count).
        self.map_shown: bool | None = None if view is None else view == "map"
        self.shown_folded: tuple[int, int] | None = None  # _folded() at the last frame

    def compose(self) -> ComposeResult:
        yield RunHeader(id="header")
        yield Banner(id="banner")
        yield RankTable(id="ranks")
        yield rankmap.MapView(id="mapview")
        with Horizontal(id="lower"):
            yield ChartGrid(id="charts")
            with Vertical(id="side"):
                yield CommPanel(id="comm")
                yield EventsPanel(id="events")
        yield Input(placeholder="filter: rank, host, state or 'straggler'; Enter applies, "
                    "empty clears", id="filter")
        yield Footer()

    def on_mount(self) -> None:
        # The panels, each owning what it shows (mainpanels.py): found once.
        self.header, self.banner = self.query_one(RunHeader), self.query_one(Banner)
        self.chart_grid, self.comm = self.query_one(ChartGrid), self.query_one(CommPanel)
        self.events = self.query_one(EventsPanel)
        self.query_one(RankTable).focus()
        self.query_one("#filter", Input).display = False
        self.pump()
        if self.map_shown is not None:  # --view
            self.action_rank_map(self.map_shown)
        self.render_view()
        self.set_interval(1 / self.fps, self.tick)
        if self.open_rank is not None:  # --rank
            self.on_rank_table_selected(RankTable.Selected(self.open_rank))

    def tick(self) -> None:
        """A frame when something was folded since the last one, else once a second
        (ages and states move on with the clock alone); none while a screen hides the
        main view (a rank's detail: drawn behind it, the main view had Textual redraw
        the detail screen's regions too), one as soon as it shows again."""
        if self._main_view_hidden():
            return
        if (self.dirty or self._folded() != self.shown_folded
                or time.monotonic() - self.last_render >= IDLE_REDRAW_S):
            self.render_view()

    def _main_view_hidden(self) -> bool:
        """A screen other than a modal one (a rank's detail) covers the main view."""
        return len(self.screen_stack) > 1 and not isinstance(self.screen, ModalScreen)

    # -- the worker: sockets or journal -> RunState -------------------------------------
    @work(thread=True, exclusive=True, exit_on_error=False)
    def pump(self) -> None:
        """Fold, then tell the app only what a frame cannot see for itself: the
        connection changed, the first messages came, or an event or a new status
        (these three drawn at once). The frame timer sees other messages by the
        state's fold count. A live feed of a few ranks is folded at most once per
        `pump_s` (half a frame: feed.Pacer): a few wakeups a second, not one per
        message."""
        worker = get_current_worker()
        seen: tuple[str, str, bool] | None = None
        seen_news: tuple[int, int, str] | None = None
        pacer = Pacer(self.feed, self.pump_s)
        while not worker.is_cancelled:
            folded = pacer.pump()
            now = (self.feed.connection, self.feed.detail, self.feed.finished)
            state = self.feed.state
            news = (id(state), state.event_count, state.status)
            if now != seen or (folded and not self.shown_run) or news != seen_news:
                self.post_message(FeedChanged(folded, urgent=seen_news is not None
                                              and news != seen_news))
                seen, seen_news = now, news
            if self.feed.finished and not folded:
                return
            pacer.rest()

    def _folded(self) -> tuple[int, int]:
        """Changes when the worker folds a message (or swaps in a new state)."""
        state = self.feed.state
        return id(state), state.folded

    def on_rank_table_columns_changed(self, message: RankTable.ColumnsChanged) -> None:
        self.dirty = True  # the next frame builds the cells of the scalars now shown

    def on_feed_changed(self, message: FeedChanged) -> None:
        self.dirty = True
        if not self.shown_run and self.feed.state.ranks:
            self.shown_run = True
            self.render_view()  # the first data on screen at once, not at the next tick
        elif (message.urgent and not self._main_view_hidden()
                and time.monotonic() - self.last_render >= URGENT_GAP_S):
            self.render_view()  # a failure, a hang, a status: at once too

    # -- one frame ---------------------------------------------------------------------
    def render_view(self) -> None:
        if self.paused:
            return
        try:
            table = self.query_one(RankTable)
        except NoMatches:
            return  # quitting: Textual removes the widgets before it stops the frame timer
        self._render(table)

    def _render(self, table: RankTable) -> None:
        """One frame: each panel is handed the feed and builds from it, under the
        feed's lock for its own build only (mainpanels.py); the rows are built here,
        the table and the map draw them."""
        feed = self.feed
        now = feed.now()
        banner = self.header.show_run(feed, now, self._note(), paced=bool(self.map_shown))
        with feed.lock:
            state = feed.state
            self.shown_folded = self._folded()
            if self.map_shown is None and state.ranks:
                self.action_rank_map(rankmap.wanted(state))
                self.refresh_bindings()
            table.set_scalars(sorted(state.scalars))
            scalars = list(table.shown_scalars)
            sorted_by = fmt.scalar_name(self.sort_key)
            if sorted_by is not None and sorted_by not in scalars:
                scalars.append(sorted_by)  # sorted by a column the width has since dropped
            # The map instead of the rows (thousands of them: a waste); False: not laid out.
            laid_out = not self.map_shown or self.query_one(rankmap.MapView).draw(state, now)
            rows = [] if self.map_shown else fmt.rank_rows(state, now, scalars)
        rows = fmt.filter_rows(rows, self.filter_text, self.problems_only)
        rows = fmt.sort_rows(rows, self.sort_key, self.sort_reverse)
        self.banner.text = banner
        table.set_rows(rows)
        self._fit_table(table, len(rows), self.banner.outer_size.height if banner else 0)
        charts_waiting = False
        if not self.map_shown:  # behind the map: not built at all
            selected = table.selected_rank
            charts_waiting = self.chart_grid.show_run(feed, selected)
            self.comm.show_run(feed, now, selected)
        self.events.show_run(feed)
        self.frames += 1
        # The map just shown: drawn at the next tick, laid out; charts waiting for their
        # turn: drawn at the next tick too.
        self.dirty = not laid_out or charts_waiting
        self.last_render = time.monotonic()

    def _fit_table(self, table: RankTable, rows: int, banner: int) -> None:
        """The table takes the lines its rows need, up to what leaves the panels below
        LOWER_MIN_LINES. Charts 2x2, comm above events; too short for axes: comm and events
        side by side, charts in a row of four if wide enough; narrow: sparklines (tcss)."""
        room = self.size.height - HEADER_LINES - FOOTER_LINES - banner - LOWER_MIN_LINES
        lines = max(TABLE_MIN_LINES, min(rows + 1, room))
        if table.styles.height is None or table.styles.height.value != lines:
            table.styles.height = lines
        lower = self.query_one("#lower")
        below = self.size.height - HEADER_LINES - FOOTER_LINES - banner - lines - 1
        narrow = self.size.width < NARROW_WIDTH
        low = not narrow and below < 2 * MIN_PLOT_HEIGHT
        row = low and (CHARTS_SHARE * self.size.width - CHARTS_MARGIN) / 4 >= MIN_PLOT_WIDTH
        for name, on in (("narrow", narrow), ("low", low), ("row", row)):
            if lower.has_class(name) != on:
                lower.set_class(on, name)

    def _height(self, selector: str) -> int:
        return self.query_one(selector).size.height

    def _note(self) -> str:
        note = panels.note(self.feed, self.replay, self.filter_text, self.problems_only,
                           self.paused)
        if self.chart_grid.whole:
            return note
        latest = f"charts: the newest {CHART_POINTS} steps (w: the whole run)"
        return f"{note} · {latest}" if note else latest

    # -- keys ------------------------------------------------------------------------
    MAIN_VIEW_ACTIONS = frozenset({"sort", "filter", "problems", "pause", "stop_run", "speed",
                                   "clear_filter", "rank_map", "chart_window"})

    # What acts on a live run: out of the footer (and off) in a replay.
    LIVE_ACTIONS = frozenset({"stop_run", "evidence", "profile"})

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """The main view's keys are off (and out of the footer) on the other screens."""
        if action == "rank_map" and not rankmap.wanted(self.feed.state):
            return False  # a small run: the table alone (and `m` out of the footer)
        if action in self.LIVE_ACTIONS and self.replay:
            return False
        return not (action in self.MAIN_VIEW_ACTIONS and len(self.screen_stack) > 1)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_sort(self, reverse: bool = False) -> None:
        if reverse:
            self.sort_reverse = not self.sort_reverse
        else:
            self.sort_index = (self.sort_index + 1) % len(fmt.SORT_KEYS)
            self.sort_key, self.sort_reverse = fmt.SORT_KEYS[self.sort_index], False
        key = self.sort_key
        self.query_one(RankTable).set_sort_key(key, self.sort_reverse)
        self.notify(f"sorted by {fmt.scalar_name(key) or key}"
                    f"{' (reversed)' if self.sort_reverse else ''}", timeout=2)
        self.render_view()

    def on_rank_table_sort_requested(self, message: RankTable.SortRequested) -> None:
        if message.key == self.sort_key:
            self.action_sort(reverse=True)  # a second click on the same title reverses
            return
        if message.key in fmt.SORT_KEYS:  # a scalar's column sorts too, outside `s`'s cycle
            self.sort_index = fmt.SORT_KEYS.index(message.key)
        self.sort_key, self.sort_reverse = message.key, False
        self.query_one(RankTable).set_sort_key(message.key)
        self.render_view()

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = True
        box.value = self.filter_text
        box.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.filter_text = event.value.strip()
        self._close_filter()

    def action_clear_filter(self) -> None:
        box = self.query_one("#filter", Input)
        if box.display:
            self._close_filter()

    def _close_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = False
        self.query_one(RankTable).focus()
        self.render_view()

    def action_rank_map(self, show: bool | None = None) -> None:
        self.map_shown = not self.map_shown if show is None else show
        for selector, on in (("#mapview", True), ("#ranks", False), ("#lower", False)):
            self.query_one(selector).display = on == self.map_shown
        self.query_one(rankmap.RankMap if self.map_shown else RankTable).focus()
        self.dirty = True

    def action_chart_window(self) -> None:
        """The charts over the whole run (thinned), or the newest steps, and back."""
        self.chart_grid.whole = not self.chart_grid.whole  # (the header's note says which)
        self.dirty = True

    def action_problems(self) -> None:
        self.problems_only = not self.problems_only
        self.render_view()
        if self.problems_only and not fmt.filter_rows(
                fmt.rank_rows(self.feed.state, self.feed.now(), ()), "", True):
            self.notify("no rank has a problem: none is stalled, silent, dead or a straggler")

    def action_pause(self) -> None:
        if self.feed.replay_controls:
            self.feed.set_paused(not self.paused)
        self.paused = not self.paused
        if not self.paused:
            self.render_view()
        else:
            self.header.show_note(self.feed, self.feed.now(), self._note())

    def action_speed(self, factor: float) -> None:
        if self.feed.replay_controls:
            current = self.feed.speed or 64.0
            self.feed.set_speed(min(1024.0, max(0.125, current * factor)))
            self.render_view()

    def on_rank_table_selected(self, message: RankTable.Selected) -> None:
        paths = self.feed.paths
        log = paths.rank_log(message.rank) if paths is not None else None
        self.push_screen(RankDetail(self.feed, message.rank, log, self.fps))

    def action_stop_run(self) -> None:
        if not self.can_stop:
            self.notify("stopping is off in this dashboard (ddtop --serve: --allow-stop)",
                        severity="warning")
            return
        if self.feed.stop_endpoint is None:
            self._nothing_to_stop()
            return

        def answered(yes: bool | None) -> None:
            if not yes:
                return
            endpoint = self.feed.stop_endpoint  # the run may have ended while we asked
            if endpoint is None:
                self._nothing_to_stop()
            else:
                self._request_stop(endpoint)

        self.push_screen(ConfirmStop(self.feed.state.run), answered)

    def _nothing_to_stop(self) -> None:
        self.notify("this run is not live: there is nothing to stop", severity="warning")

    @work(thread=True, group="stop", exit_on_error=False)
    def _request_stop(self, endpoint: str) -> None:
        """Ask the daemon to stop the run, off the UI thread: a daemon that does not
        answer costs this worker STOP_REQUEST_TIMEOUT_S, and the dashboard nothing."""
        try:
            reply = control.request(endpoint, protocol.Stop(timeout=STOP_TIMEOUT_S),
                                    STOP_REQUEST_TIMEOUT_S, keys=self.feed.keys)
        except control.Unreachable as e:
            self.post_message(StopAnswered(f"the daemon did not answer: {e}", "error"))
            return
        if reply.ok:
            self.post_message(StopAnswered(
                "stopping: ranks finish their step, rank 0 checkpoints", "information"))
        else:
            self.post_message(StopAnswered(f"the daemon refused: {reply.error}", "error"))

    def action_evidence(self) -> None:
        """Ask the daemon to gather the evidence now (ddtrain evidence): its folder
        comes back as an event of the run, in the event log."""
        if not self.can_stop:  # (py-spy attaches to every rank: the owner's call)
            self.notify("evidence is off in this dashboard (ddtop --serve: --allow-stop)",
                        severity="warning")
            return
        endpoint = self.feed.stop_endpoint
        if endpoint is None:
            self.notify("this run is not live: its evidence is in its folder's evidence/",
                        severity="warning")
            return
        self._request_evidence(endpoint)

    def action_profile(self) -> None:
        """Profile the selected rank for PROFILE_STEPS steps (ddtrain profile): the
        request goes into the run folder; the folder is said, and `ddtrain profile
        --show` prints it."""
        paths = self.feed.paths
        if not self.can_stop or paths is None:  # (the run folder is the owner's)
            self.notify("profiling is off in this dashboard (ddtop --serve: --allow-stop)",
                        severity="warning")
            return
        if self.feed.stop_endpoint is None:
            self.notify("this run is not live: only a live run can be profiled",
                        severity="warning")
            return
        rank = self.query_one(RankTable).selected_rank
        view = self.feed.state.ranks.get(rank) if rank is not None else None
        if rank is None or view is None:
            self.notify("select a rank to profile first", severity="warning")
            return
        start = profilereq.start_after([view.global_step], view.step_time_s or 0.0)
        try:
            request = profilereq.write(paths.logs, [rank], start, PROFILE_STEPS)
        except OSError as e:
            self.notify(f"the profile request could not be written: {e}", severity="error")
            return
        self.notify(f"profiling rank {rank} for steps {start + 1}-{start + PROFILE_STEPS}: "
                    f"ddtrain profile --show {request.id}", severity="information")

    @work(thread=True, group="evidence", exit_on_error=False)
    def _request_evidence(self, endpoint: str) -> None:
        try:
            reply = control.request(endpoint, protocol.Evidence(), STOP_REQUEST_TIMEOUT_S,
                                    keys=self.feed.keys)
        except control.Unreachable as e:
            self.post_message(StopAnswered(f"the daemon did not answer: {e}", "error"))
            return
        self.post_message(StopAnswered(
            "gathering the evidence: its folder is told in the events" if reply.ok
            else f"the daemon refused: {reply.error}", "information" if reply.ok else "error"))

    def on_stop_answered(self, message: StopAnswered) -> None:
        self.notify(message.text, severity=message.severity)
