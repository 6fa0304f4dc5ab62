"""The main view's panels, each a widget that owns what it shows.

A panel is handed the feed (and what the user chose: the selected rank) at each frame,
and decides for itself: when to build again (at once when what it is built from
changes, else at its own pace: pacing.py), reading the RunState under the feed's lock
for its own build only, and what it shows, a reactive attribute whose watcher redraws
it when it changes (a TextPanel the lines that changed, a Chart a new plot). The app
routes: it builds none of them, and holds the lock across none of them.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Container
from textual.reactive import reactive
from textual.widgets import Static

from ddtop.dashboard import panels, series
from ddtop.dashboard.charts import Chart
from ddtop.dashboard.feed import Feed
from ddtop.dashboard.pacing import CHARTS_EVERY_S, HEADER_EVERY_S, PANELS_EVERY_S, Every
from ddtop.dashboard.widgets import TextPanel

CHART_POINTS = 120  # global steps a run-wide chart shows in the latest window (key w)
# The run-wide charts: widget id, title, the y axis's unit.
CHARTS = (("loss-global", "loss: global", "loss"), ("loss-rank", "loss: selected rank", "loss"),
          ("rate", "samples/s", "samples/s"), ("comm-share", "comm %", "% of step"))


class ShownText(TextPanel):
    """A TextPanel whose text is a reactive attribute (`shown`): set it, and the lines
    that changed are drawn again (TextPanel.set_text)."""

    shown: reactive[Text] = reactive(Text, layout=False, repaint=False, init=False)

    def watch_shown(self, text: Text) -> None:
        self.set_text(text)


class RunHeader(ShownText):
    """The run in a few lines (panels.header), and the banner under it (a failure, a
    hang, a lost connection): built at once when the status, an event, the note or the
    connection changes; behind the rank map (`paced`), else at most once a
    HEADER_EVERY_S (each asks every rank's state: pacing.py)."""

    def __init__(self, id: str | None = None) -> None:
        super().__init__(id=id)
        self.every = Every(HEADER_EVERY_S)
        self.banner: Text | None = None

    def show_run(self, feed: Feed, now: float, note: str, paced: bool) -> Text | None:
        """Built again if due; the banner to show (None: none)."""
        with feed.lock:
            state = feed.state
            if not self.every.due((id(state), note, state.status, state.event_count,
                                   feed.connection, feed.detail), not paced):
                return self.banner
            text = panels.header(state, now, note, self.size.width or None)
            self.banner = panels.banner(state, now, feed.connection, feed.detail)
        self.shown = text
        return self.banner

    def show_note(self, feed: Feed, now: float, note: str) -> None:
        """The header at once, for a note that changed (the dashboard paused)."""
        with feed.lock:
            text = panels.header(feed.state, now, note, self.size.width or None)
        self.shown = text


class Banner(Static):
    """The banner's text, or none: hidden then; its height follows its lines."""

    text: reactive[Text | None] = reactive(None, layout=True)

    def watch_text(self, text: Text | None) -> None:
        self.display = text is not None
        if text is not None:
            self.update(text, layout=True)


class CommPanel(ShownText):
    """Communication: the selected rank's, or the run's (panels.comm), built again once
    a PANELS_EVERY_S, or at once for another rank, size or state: each costs Textual a
    redraw of the whole panel."""

    def __init__(self, id: str | None = None) -> None:
        super().__init__(id=id)
        self.every = Every(PANELS_EVERY_S)

    def show_run(self, feed: Feed, now: float, selected: int | None) -> None:
        height = max(4, self.size.height)
        with feed.lock:
            state = feed.state
            if not self.every.due((id(state), selected, height), feed.finished):
                return
            text = panels.comm(state, now, selected, height)
        self.shown = text


class EventsPanel(ShownText):
    """The run's newest events (panels.events): built again when one comes (they
    change seldom), or for another height or state."""

    def __init__(self, id: str | None = None) -> None:
        super().__init__(id=id)
        self.key: tuple[int, int, int] | None = None

    def show_run(self, feed: Feed) -> None:
        lines = max(3, self.size.height - 1)
        with feed.lock:
            state = feed.state
            key = (state.event_count, id(state), lines)
            if key == self.key:
                return
            self.key = key
            text = panels.events(state, lines)
        self.shown = text


class ChartGrid(Container):
    """The four run-wide charts: their data (series.charts) built again at most once a
    CHARTS_EVERY_S (plotext takes 5 to 20 ms a plot), or at once for another rank or
    state, and handed to one chart a frame, taking turns (all of them once the run is
    over), so that four plots never hold up one frame."""

    def __init__(self, id: str | None = None) -> None:
        super().__init__(id=id)
        self.every = Every(CHARTS_EVERY_S)
        self.data: dict[str, series.ChartData] = {}  # the newest, by chart id
        self.charts = {name: Chart(title, unit, id=name) for name, title, unit in CHARTS}
        self.turn = 0  # the chart first in line for new data
        self.finished = False
        self.whole = True  # the whole run (thinned); False: the newest CHART_POINTS steps

    def compose(self) -> ComposeResult:
        yield from self.charts.values()

    def show_run(self, feed: Feed, selected: int | None) -> bool:
        """New data handed out; True while a chart still waits for its turn (the app
        draws another frame for it at once, not at its next idle one)."""
        with feed.lock:
            state = feed.state
            self.finished = feed.finished
            if self.every.due((id(state), selected, self.whole), feed.finished):
                self.data = series.charts(state, selected,
                                          None if self.whole else CHART_POINTS)
        return self.hand_out()

    def hand_out(self) -> bool:
        """New data to the next chart in turn whose data changed (to every one once
        the run is over); True while another one's data changed too."""
        names = list(self.data)
        for i in range(len(names)):
            name = names[(self.turn + i) % len(names)]
            if self.charts[name].set_data(self.data[name]) and not self.finished:
                self.turn = (self.turn + i + 1) % len(names)
                return any(self.charts[n].data != self.data[n] for n in names)
        return False
