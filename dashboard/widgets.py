"""The dashboard's widgets. They display what they are given; the app decides what.

RankTable draws the ranks with Textual's Line API: one pre-built Strip per
visible row, rebuilt only when the app hands it new rows (at most once per
frame), so a thousand ranks cost what the thirty on screen cost. (A DataTable
with every cell changing each tick falls behind at a few dozen rows.)

A script's ddtop.log scalars get a column each, right of the fixed ones, in
name order, as many as fit (`fit_columns`); the app asks which are shown and
builds only their cells.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.binding import Binding, BindingType
from textual.geometry import Region
from textual.message import Message
from textual.strip import Strip
from textual.visual import Visual, visualize
from textual.widget import Widget
from textual.widgets import Sparkline

from ddtop.dashboard import format as fmt
from ddtop.dashboard.panels import STATE_STYLE

# Where the ddtop.log scalars' columns rank in PRIORITY: after the columns every
# run needs, before those a script can do without (its progress, epoch, host...).
SCALARS = "*scalars*"
# Columns kept when the terminal is narrow, most important first.
PRIORITY = ("rank", "state", "step", "loss", "rate", "comm_share", "step_ms", "seen", SCALARS,
            "progress", "epoch", "comm_ms", "host", "busbw", "sync", "memory", "device")
MARK_WIDTH = 2  # "▲ " slowest rank, "! " straggler
HEADER_STYLE = Style(bold=True, reverse=True)
CURSOR_STYLE = Style(bgcolor="grey35", bold=True)


@dataclass(frozen=True)
class TableLayout:
    """The columns drawn, in table order (the fixed ones, then the scalars shown),
    and the scalars that did not fit: "+N more" after the last title, room allowing."""

    width: int
    columns: tuple[fmt.Column, ...]
    scalars: tuple[str, ...] = ()  # names of the scalars shown, in order
    hidden: int = 0
    more: str = ""  # "+N more", or "" when nothing is hidden or it has no room


def fit_columns(width: int, scalars: Sequence[str] = ()) -> TableLayout:
    """The columns that fit in `width` cells, most important first (PRIORITY),
    with as many of the `scalars` (in their order) as fit at their rank. When some
    do not, "+N more" takes the cells after the last title, and no column of
    lower priority is drawn (it would take a scalar's place)."""
    by_key = {c.key: c for c in fmt.COLUMNS}
    chosen: set[str] = set()
    shown: list[fmt.Column] = []
    hidden, more = 0, ""
    used = MARK_WIDTH
    for key in PRIORITY:
        if key == SCALARS:
            shown = _fit_scalars(width - used, scalars)
            used += sum(c.width + 1 for c in shown)
            hidden = len(scalars) - len(shown)
            if hidden and used + len(f"+{hidden} more") <= width:
                more = f"+{hidden} more"
            continue
        if hidden:
            break
        need = by_key[key].width + 1
        if used + need <= width or not chosen:
            chosen.add(key)
            used += need
    names = tuple(name for c in shown if (name := fmt.scalar_name(c.key)) is not None)
    return TableLayout(width, tuple(c for c in fmt.COLUMNS if c.key in chosen) + tuple(shown),
                       names, hidden, more)


def _fit_scalars(room: int, scalars: Sequence[str]) -> list[fmt.Column]:
    """The most of the first scalars' columns that fit in `room` cells, leaving
    room for "+N more" when some are left out."""
    columns = [fmt.scalar_column(name) for name in scalars]
    for n in range(len(columns), 0, -1):
        need = sum(c.width + 1 for c in columns[:n])
        if n < len(columns):
            need += len(f"+{len(columns) - n} more")
        if need <= room:
            return columns[:n]
    return []


class RankTable(Widget, can_focus=True):
    """Ranks, one per line, with a cursor; Enter asks for the rank's detail."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up,k", "move(-1)", "up", show=False),
        Binding("down,j", "move(1)", "down", show=False),
        Binding("pageup", "move(-20)", show=False),
        Binding("pagedown", "move(20)", show=False),
        Binding("home", "move(-1000000)", show=False),
        Binding("end", "move(1000000)", show=False),
        Binding("enter", "select", "detail"),
    ]

    class Selected(Message):
        def __init__(self, rank: int) -> None:
            super().__init__()
            self.rank = rank

    class SortRequested(Message):
        """A column title was clicked."""

        def __init__(self, key: str) -> None:
            super().__init__()
            self.key = key

    class ColumnsChanged(Message):
        """A resize changed which scalars are shown: their cells are needed."""

    def __init__(self, id: str | None = None) -> None:
        super().__init__(id=id)
        self.rows: list[fmt.Row] = []
        self.cursor = 0
        self.top = 0  # index of the first row shown
        self.sort_key, self.sort_reverse = "rank", False
        self._strips: dict[int, Strip] = {}  # row index -> strip, for this frame's rows
        self._scalars: list[str] = []  # every ddtop.log scalar of the run, by name
        self._table_layout: TableLayout | None = None  # for the current width and scalars
        self._header: Strip | None = None

    # -- data in ---------------------------------------------------------------------
    def set_rows(self, rows: list[fmt.Row]) -> None:
        """New rows for this frame; the cursor stays on the same rank. Only the lines
        whose row (or cursor) changed are drawn again: a redraw costs Textual far more
        than comparing the few rows on screen."""
        keep = self.selected_rank
        before, cursor, top = self.rows, self.cursor, self.top
        self.rows = rows
        if keep is not None:
            for i, row in enumerate(rows):
                if row.rank == keep:
                    self.cursor = i
                    break
        self.cursor = max(0, min(self.cursor, len(rows) - 1))
        self._scroll_to_cursor()
        # The strips cached are those of the lines on screen: keep the unchanged ones.
        self._strips = {i: strip for i, strip in self._strips.items()
                        if i < len(rows) and i < len(before) and rows[i] == before[i]
                        and (i == self.cursor) == (i == cursor)}
        if self.top != top or len(rows) != len(before):
            self.refresh()
            return
        width = self.size.width
        changed = [Region(0, y, width, 1) for y in range(1, self.size.height)
                   if self.top + y - 1 < len(rows) and self.top + y - 1 not in self._strips]
        if changed:
            self.refresh(*changed)

    def set_scalars(self, names: list[str]) -> None:
        """The run's ddtop.log scalars, in column order. The columns change only
        when a new name comes (or the width changes), never as values move."""
        if names != self._scalars:
            self._scalars = list(names)
            self._relayout()

    @property
    def shown_scalars(self) -> tuple[str, ...]:
        """The scalars that have a column at the current width."""
        return self.table_layout.scalars

    @property
    def table_layout(self) -> TableLayout:
        if self._table_layout is None or self._table_layout.width != self.size.width:
            return self._relayout()
        return self._table_layout

    def _relayout(self) -> TableLayout:
        before = self._table_layout
        layout = self._table_layout = fit_columns(self.size.width, self._scalars)
        self._header = None
        self._strips.clear()
        self.refresh()
        if before is not None and before.scalars != layout.scalars:
            self.post_message(self.ColumnsChanged())
        return layout

    @property
    def selected_rank(self) -> int | None:
        return self.rows[self.cursor].rank if 0 <= self.cursor < len(self.rows) else None

    @property
    def page(self) -> int:
        return max(1, self.size.height - 1)

    def _scroll_to_cursor(self) -> None:
        if self.cursor < self.top:
            self.top = self.cursor
        elif self.cursor >= self.top + self.page:
            self.top = self.cursor - self.page + 1
        self.top = max(0, min(self.top, max(0, len(self.rows) - self.page)))

    # -- keys and mouse ------------------------------------------------------------------
    def action_move(self, delta: int) -> None:
        if not self.rows:
            return
        self.cursor = max(0, min(len(self.rows) - 1, self.cursor + delta))
        self._scroll_to_cursor()
        self._strips.clear()
        self.refresh()

    def action_select(self) -> None:
        rank = self.selected_rank
        if rank is not None:
            self.post_message(self.Selected(rank))

    def on_mouse_scroll_down(self, event: events.MouseScrollDown) -> None:
        self.action_move(3)

    def on_mouse_scroll_up(self, event: events.MouseScrollUp) -> None:
        self.action_move(-3)

    def column_at(self, x: int) -> str | None:
        """The key of the column drawn at cell `x`."""
        left = MARK_WIDTH
        for c in self.table_layout.columns:
            if left <= x < left + c.width + 1:
                return c.key
            left += c.width + 1
        return None

    def on_click(self, event: events.Click) -> None:
        if event.y == 0:
            key = self.column_at(event.x)
            if key is not None:
                self.post_message(self.SortRequested(key))
            return
        index = self.top + event.y - 1
        if event.y >= 1 and 0 <= index < len(self.rows):
            self.cursor = index
            self._strips.clear()
            self.refresh()
            if event.chain == 2:
                self.action_select()

    def on_resize(self, event: events.Resize) -> None:
        self._relayout()
        self._scroll_to_cursor()

    # -- drawing (the Line API) ------------------------------------------------------------
    def render_line(self, y: int) -> Strip:
        width = self.size.width
        if y == 0:
            if self._header is None:
                self._header = self._header_strip(width)
            return self._header
        index = self.top + y - 1
        if index >= len(self.rows):
            return Strip.blank(width)
        strip = self._strips.get(index)
        if strip is None:
            strip = self._strips[index] = self._row_strip(self.rows[index], index, width)
        return strip

    def _header_strip(self, width: int) -> Strip:
        titles = []
        layout = self.table_layout
        for c in layout.columns:
            arrow = ("▲" if self.sort_reverse else "▼") if c.key == self.sort_key else ""
            title = c.title + arrow
            if len(title) > c.width:  # a scalar's name keeps its start, a fixed title its end
                title = (c.title[: c.width - len(arrow)] + arrow
                         if fmt.scalar_name(c.key) is not None else title[-c.width:])
            titles.append(title.rjust(c.width) if c.right else title.ljust(c.width))
        if layout.more:
            titles.append(layout.more)
        text = " " * MARK_WIDTH + " ".join(titles)
        return Strip([Segment(text, HEADER_STYLE)]).adjust_cell_length(width, HEADER_STYLE)

    def _row_strip(self, row: fmt.Row, index: int, width: int) -> Strip:
        base = CURSOR_STYLE if index == self.cursor and self.has_focus else Style()
        mark = "▲ " if row.slowest else "! " if row.straggler else "  "
        segments = [Segment(mark, base + Style(color="yellow", bold=True))]
        for c in self.table_layout.columns:
            # A scalar shown since this frame's rows were built has no cell until the next.
            text = row.cells.get(c.key, "")[: c.width]
            text = text.rjust(c.width) if c.right else text.ljust(c.width)
            style = base
            if c.key == "state":
                style = base + Style.parse(STATE_STYLE.get(row.state, ""))
            elif c.key == "progress":
                style = base + Style(color="green")
            elif row.straggler and c.key in ("rate", "step_ms"):
                style = base + Style(color="yellow", bold=True)
            segments.append(Segment(text + " ", style))
        return Strip(segments).adjust_cell_length(width, base)

    def on_focus(self) -> None:
        self._strips.clear()
        self.refresh()

    def on_blur(self) -> None:
        self._strips.clear()
        self.refresh()

    def set_sort_key(self, key: str, reverse: bool = False) -> None:
        self.sort_key, self.sort_reverse = key, reverse
        self._header = None
        self.refresh()

    def visible_text(self) -> list[str]:
        """The table as plain text lines, as drawn (for tests and snapshots)."""
        return [self.render_line(y).text.rstrip() for y in range(self.size.height)]


class TextPanel(Widget):
    """Lines of text that change a few at a time (the header, the comm panel, the
    events), drawn with the Line API: `set_text` compares the new lines with those
    shown and has Textual draw again only the lines that changed, each rendered
    alone the way a Static renders it (the widget's CSS: no wrap, "…" at the end).
    A Static draws all its lines again, and lays out the screen, on every update:
    at five frames a second that was most of the dashboard's CPU time."""

    def __init__(self, text: str | Text = "", id: str | None = None) -> None:
        super().__init__(id=id)
        self._lines: list[Text] = []
        self._keys: list[tuple[object, ...]] = []
        self._strips: dict[int, Strip] = {}
        if text:
            self.set_text(text)

    def set_text(self, text: str | Text) -> None:
        whole = Text(text) if isinstance(text, str) else text
        lines = list(whole.split("\n", allow_blank=True))
        keys: list[tuple[object, ...]] = [(line.plain, tuple(line.spans), str(line.style))
                                          for line in lines]
        if keys == self._keys:
            return
        if not self.is_mounted or len(keys) != len(self._keys):
            changed = None  # all of it
        else:
            changed = [y for y, (new, old) in enumerate(zip(keys, self._keys, strict=True))
                       if new != old]
        self._lines, self._keys = lines, keys
        if changed is None:
            self._strips.clear()
            self.refresh()
            return
        width = self.size.width
        for y in changed:
            self._strips.pop(y, None)
        self.refresh(*(Region(0, y, width, 1) for y in changed))

    @property
    def text(self) -> str:
        """What the panel shows, as plain text."""
        return "\n".join(line.plain for line in self._lines)

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        if y >= len(self._lines):
            return Strip.blank(width, self.visual_style.rich_style)
        strip = self._strips.get(y)
        if strip is None:
            strips = Visual.to_strips(self, visualize(self, self._lines[y]), width, 1,
                                      self.visual_style)
            strip = strips[0] if strips else Strip.blank(width, self.visual_style.rich_style)
            self._strips[y] = strip
        return strip

    def on_resize(self, event: events.Resize) -> None:
        self._strips.clear()
        self.refresh()


def set_chart(chart: Sparkline, data: list[float]) -> None:
    """Hand a chart its points only when they differ: a new list redraws all of them."""
    if chart.data != data:
        chart.data = data
