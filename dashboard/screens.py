"""Screens over the main view: a rank's detail, the help, the stop confirmation."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import ClassVar

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Sparkline, Static

from ddtop.core import control, protocol
from ddtop.dashboard import panels
from ddtop.dashboard.feed import Feed
from ddtop.dashboard.pacing import CHARTS_EVERY_S, Every
from ddtop.dashboard.widgets import TextPanel, set_chart

LOG_TAIL_LINES = 15
LOG_TAIL_BYTES = 16 * 1024

HELP = """\
[b]ddtop keys[/b]

  [b]q[/b]        quit the dashboard (the run goes on; ddtop re-attaches)
  [b]?[/b]        this help (arrows and PgUp/PgDn scroll it)
  [b]s[/b] / [b]S[/b]    sort by the next column / reverse the order
  [b]/[/b]        filter ranks: a rank number, part of a host name, or a
           state (running, stalled, silent, dead, finished,
           straggler); empty clears
  [b]f[/b]        problems only: stalled, silent, dead and straggling ranks
  [b]m[/b]        rank map / ranks table (256 ranks or more: the map first,
           a half cell a rank by node; arrows move on it, Enter: its
           detail)
  [b]p[/b]        pause the view (telemetry is still read, nothing is lost)
  [b]w[/b]        charts: the whole run (its older steps thinned) or the
           newest 120 steps
  [b]Enter[/b]    the selected rank's detail: charts, step breakdown,
           events, log; there [b]t[/b] shows the rank's Python stacks now
           (all threads, also inside a collective), [b]l[/b] the log again
  [b]x[/b]        stop the run (asks first): ranks finish the step, rank 0
           checkpoints
  [b]e[/b]        gather the evidence now: every rank's stacks and state, in
           the run's evidence/ folder (the events say which)
  [b]P[/b]        profile the selected rank for 5 steps (torch.profiler;
           then ddtrain profile --show prints its top operators)
  [b]+[/b] / [b]-[/b]    replay faster / slower (with --replay)

[b]Ranks table[/b]
  [yellow]![/yellow] a straggler: for 4 windows of 5+ steps in a row it computed
    1.25x as long per step as the others' median, and they waited 15%
    of each step for it
  [yellow]▲[/yellow] the slowest straggler (the one the others wait for longest):
    their wait counts in their STEP ms and COMM%, so its own row may
    read faster than theirs
  STATE  [green]running[/green]  [yellow]stalled[/yellow] (no progress, heartbeats still come)
         [magenta]silent[/magenta] (no message for 5 s)  [red]dead[/red] (exit code or signal)
         [blue]finished[/blue]  [magenta]unreached[/magenta] (never heard from, 30 s into
         the run)
  COMM%  share of the step spent in the gradient all-reduce
  BUSBW  all-reduce bus bandwidth, GB/s (nccl-tests' definition)
  SYNC s time spent waiting in metric syncs (all_gather_object), in all
  SEEN   seconds since the rank's last message
  then your script's ddtop.log scalars, a column each (the rank's
  newest value; - not logged by it) as many as fit; "+N more" counts
  the others (Enter: all)

Press Escape or ? to close."""


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,question_mark,q", "dismiss", "close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):  # taller than a 24-line terminal: it scrolls
            yield Static(HELP)


class ConfirmStop(ModalScreen[bool]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("y", "answer(True)", "yes, stop it"),
                Binding("n,escape", "answer(False)", "no")]

    def __init__(self, run: str) -> None:
        super().__init__()
        self.run = run

    def compose(self) -> ComposeResult:
        yield Static(f"Stop run [b]{self.run}[/b]?\n\nEvery rank finishes its step, rank 0 "
                     "writes a checkpoint, and the ranks exit (resume later with "
                     f"ddtrain start --resume --run-id {self.run}).\n\n"
                     "[b]y[/b] stop it    [b]n[/b] keep it running", id="confirm")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class RankDetail(Screen[None]):
    """One rank: its numbers, step breakdown, charts, events and log tail; `t`
    asks the daemon for the rank's Python stacks and shows them in place of the
    log (`l` back to the log). While open, it asks the daemon for the rank's
    every step (protocol.Focus: on a multi-node hub, another node's rank is
    otherwise summed up, a point a summary)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,enter,backspace", "app.pop_screen", "back"),
        Binding("t", "stacks", "stacks"),
        Binding("l", "log", "log"),
        Binding("q", "app.quit", "quit"),
    ]

    def __init__(self, feed: Feed, rank: int, log: Path | None, fps: float) -> None:
        super().__init__()
        self.feed, self.rank, self.log_path, self.fps = feed, rank, log, fps
        self.stacks_from: int | None = None  # showing the stacks dumped after this offset
        self.stacks_note = ""
        # The log file's size and time with the tail read from it (read again only
        # when they change). The panels redraw only lines that changed (TextPanel).
        self.tail: tuple[object, Text] | None = None
        self.charts_every = Every(CHARTS_EVERY_S)  # the charts handed new data, as the main view's

    @property
    def stacks_path(self) -> Path | None:
        return None if self.log_path is None else self.log_path.with_suffix(".stacks")

    def action_stacks(self) -> None:
        endpoint, path = self.feed.stop_endpoint, self.stacks_path
        if endpoint is None or path is None:
            self.notify("stacks: only for a live run opened by its directory", severity="warning")
            return
        self.stacks_from = path.stat().st_size if path.exists() else 0
        self.stacks_note = "asking the daemon..."
        self._ask_for_stacks(endpoint)

    @work(thread=True, group="stacks", exit_on_error=False)
    def _ask_for_stacks(self, endpoint: str) -> None:
        try:
            reply = control.request(endpoint, protocol.Stacks(rank=self.rank),
                                    control.STOP_REQUEST_TIMEOUT_S, keys=self.feed.keys)
            self.stacks_note = ("waiting for the rank's dump..." if reply.ok
                                else f"refused: {reply.error}")
        except control.Unreachable as e:
            self.stacks_note = f"the daemon did not answer: {e}"

    def action_log(self) -> None:
        self.stacks_from = None

    def compose(self) -> ComposeResult:
        with Horizontal(id="detail-top"):
            yield TextPanel(id="detail-info")
            with Vertical(id="detail-charts"):
                yield Static("loss", classes="chart-title")
                yield Sparkline([], id="detail-loss")
                yield Static("samples/s", classes="chart-title")
                yield Sparkline([], id="detail-rate")
                yield Static("comm share of step", classes="chart-title")
                yield Sparkline([], id="detail-comm")
                yield Static("memory", classes="chart-title", id="detail-memory-title")
                yield Sparkline([], id="detail-memory")
        with Horizontal(id="detail-bottom"):
            yield TextPanel(id="detail-events")
            yield TextPanel(id="detail-log")
        yield Footer()

    def on_mount(self) -> None:
        self.refresh_view()
        self.set_interval(1 / self.fps, self.refresh_view)
        # While open: the rank's every step, asked of the daemon (a hub asks the
        # rank's node: protocol.Focus), renewed before it runs out.
        if self.feed.stop_endpoint is not None:
            self._focus()
            self.set_interval(protocol.FOCUS_S / 3, self._focus)

    @work(thread=True, group="focus", exit_on_error=False)
    def _focus(self) -> None:
        endpoint = self.feed.stop_endpoint
        if endpoint is None or not self.is_attached:
            return
        with contextlib.suppress(control.Unreachable):  # said by the feed, not here
            control.request(endpoint, protocol.Focus(rank=self.rank),
                            control.STOP_REQUEST_TIMEOUT_S, keys=self.feed.keys)

    def refresh_view(self) -> None:
        if not self.is_attached or not self.query("#detail-info"):
            return  # closing: the widgets are gone before the timer stops
        with self.feed.lock:
            state, now = self.feed.state, self.feed.now()
            width = self.query_one("#detail-info").content_size.width
            info = panels.detail(state, self.rank, now, width)
            events = panels.events(state, 12, rank=self.rank, title="events of this rank")
            view = state.ranks.get(self.rank)
            history = list(view.history) if view is not None else []
            memory = [p.memory for p in history if p.memory is not None]
            memory_title = panels.memory_title(view, memory)  # (reads the view: locked)
        # Wrapped here, at the panel's width (a TextPanel draws a line per row).
        self._show("#detail-info", Text("\n").join(info.wrap(self.app.console, max(1, width))))
        self._show("#detail-events", events)
        # The charts as often as the main view's run-wide ones (each redraw renders
        # every point): at most once a CHARTS_EVERY_S, and at once when the run is over.
        if self.charts_every.due(None, force=self.feed.finished):
            # A reading the rank did not report (a zero-code loss) is left out, not 0.
            self._chart("#detail-loss", [p.loss for p in history if p.loss is not None])
            self._chart("#detail-rate", [p.samples_per_s for p in history
                                         if p.samples_per_s is not None])
            self._chart("#detail-comm", [p.comm_share for p in history
                                         if p.comm_share is not None])
            self._chart("#detail-memory", [float(b) for b in memory])
            self.query_one("#detail-memory-title", Static).update(memory_title)
        self._show("#detail-log", self._log_tail())

    def _show(self, selector: str, content: Text) -> None:
        self.query_one(selector, TextPanel).set_text(content)  # redraws changed lines

    def _chart(self, selector: str, data: list[float]) -> None:
        set_chart(self.query_one(selector, Sparkline), data)

    def _stacks(self) -> Text:
        path, start = self.stacks_path, self.stacks_from
        assert path is not None and start is not None
        text = Text(f"stacks of rank {self.rank}  ({path})  t again, l the log\n", "bold")
        try:
            with path.open("rb") as f:
                f.seek(start)
                data = f.read(LOG_TAIL_BYTES * 4).decode(errors="replace")
        except OSError:
            data = ""
        if not data:
            return text.append(self.stacks_note, "dim")
        return text.append(data)

    def _log_tail(self) -> Text:
        """The stacks, or the log's tail: read again only when the file's size or
        modification time (or what is asked for) changed."""
        path = self.stacks_path if self.stacks_from is not None else self.log_path
        try:
            st = path.stat() if path is not None else None
            key: object = (self.stacks_from, self.stacks_note, st and (st.st_size, st.st_mtime_ns))
        except OSError:
            key = None  # unreadable: read (and say so) every time
        if key is not None and self.tail is not None and self.tail[0] == key:
            return self.tail[1]
        text = self._read_tail()
        self.tail = (key, text) if key is not None else None
        return text

    def _read_tail(self) -> Text:
        if self.stacks_from is not None:
            return self._stacks()
        if self.log_path is None:
            return Text("log: not available when attached by --connect", "bold")
        text = Text(f"log {self.log_path.name}  ({self.log_path.parent})\n", "bold")
        try:
            with self.log_path.open("rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
                data = f.read().decode(errors="replace")
        except OSError as e:
            return text.append(f"cannot read it: {e.strerror}", "dim")
        for line in data.splitlines()[-LOG_TAIL_LINES:]:
            text.append(line + "\n")
        return text

