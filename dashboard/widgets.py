"""The dashboard's widgets. They display what they are given; the app decides what.

RankTable draws the ranks with Textual's Line API: one pre-built Strip per
visible row, rebuilt only when the app hands it new rows (at most once per
frame), so a thousand ranks cost what the thirty on screen cost. (A DataTable
with every cell changing each tick falls behind at a few dozen rows.)
"""

from __future__ import annotations

from typing import ClassVar

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.strip import Strip
from textual.widget import Widget

from ddtop.dashboard import format as fmt
from ddtop.dashboard.panels import STATE_STYLE

# Columns kept when the terminal is narrow, most important first.
PRIORITY = ("rank", "state", "step", "loss", "rate", "comm_share", "step_ms", "seen", "progress",
            "epoch", "comm_ms", "host", "busbw", "sync", "memory", "device")
MARK_WIDTH = 2  # "▲ " slowest rank, "! " straggler
HEADER_STYLE = Style(bold=True, reverse=True)
CURSOR_STYLE = Style(bgcolor="grey35", bold=True)


def fit_columns(width: int) -> list[fmt.Column]:
    """The columns that fit in `width` cells, in table order."""
    by_key = {c.key: c for c in fmt.COLUMNS}
    chosen: set[str] = set()
    used = MARK_WIDTH
    for key in PRIORITY:
        need = by_key[key].width + 1
        if used + need <= width or not chosen:
            chosen.add(key)
            used += need
    return [c for c in fmt.COLUMNS if c.key in chosen]


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

    def __init__(self, id: str | None = None) -> None:
        super().__init__(id=id)
        self.rows: list[fmt.Row] = []
        self.cursor = 0
        self.top = 0  # index of the first row shown
        self.sort_key, self.sort_reverse = "rank", False
        self._strips: dict[int, Strip] = {}  # row index -> strip, for this frame's rows
        self._columns: list[fmt.Column] = []
        self._header: Strip | None = None

    # -- data in ---------------------------------------------------------------------
    def set_rows(self, rows: list[fmt.Row]) -> None:
        """New rows for this frame; the cursor stays on the same rank."""
        keep = self.selected_rank
        self.rows = rows
        if keep is not None:
            for i, row in enumerate(rows):
                if row.rank == keep:
                    self.cursor = i
                    break
        self.cursor = max(0, min(self.cursor, len(rows) - 1))
        self._strips.clear()
        self._scroll_to_cursor()
        self.refresh()

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
        for c in self._columns:
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
        self._columns = fit_columns(event.size.width)
        self._header = None
        self._strips.clear()
        self._scroll_to_cursor()

    # -- drawing (the Line API) ------------------------------------------------------------
    def render_line(self, y: int) -> Strip:
        width = self.size.width
        if not self._columns:
            self._columns = fit_columns(width)
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
        for c in self._columns:
            arrow = ("▲" if self.sort_reverse else "▼") if c.key == self.sort_key else ""
            title = c.title + arrow
            titles.append(title[-c.width:].rjust(c.width) if c.right else title.ljust(c.width))
        text = " " * MARK_WIDTH + " ".join(titles)
        return Strip([Segment(text, HEADER_STYLE)]).adjust_cell_length(width, HEADER_STYLE)

    def _row_strip(self, row: fmt.Row, index: int, width: int) -> Strip:
        base = CURSOR_STYLE if index == self.cursor and self.has_focus else Style()
        mark = "▲ " if row.slowest else "! " if row.straggler else "  "
        segments = [Segment(mark, base + Style(color="yellow", bold=True))]
        for c in self._columns:
            text = row.cells[c.key][: c.width]
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
