"""The rank map: every rank of a large job in one screen, and its outliers first.

Above MAP_MIN_RANKS ranks the dashboard's main view is `MapView` (`m` swaps it
with the ranks table): the `RankMap`, a half block `▀` per two ranks (the upper
half one rank, the lower half the next), a node's ranks side by side, each line
labelled with the first node it holds (a one-column gap between nodes where the
height allows it), coloured by state and, for a running rank, by its step time
against the median of the running ranks; under it the step and comm time
distribution and the outliers (failed, hung, slowest, fastest, silent), one line
each. 16,384 ranks of 8 a node fit 200x60 (43 lines of 48 nodes). The arrows
move a cursor over the map (`o`: to the next outlier listed); Enter opens the
rank's detail, the way the table's
Enter does (the same `RankTable.Selected` message). A frame costs the ranks' states,
one pass over them (rankstats.py) and a strip per line, a segment per run of cells
coloured alike (16,384 ranks: about 30 ms of CPU on 2 cores, bench/rankmap.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import ClassVar, cast

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.strip import Strip
from textual.widget import Widget

from ddtop.core.state import RunState
from ddtop.dashboard.rankstats import COLOURS, KINDS, Kind, Snapshot, node_label
from ddtop.dashboard.rankstats import snapshot as snapshot
from ddtop.dashboard.widgets import RankTable, TextPanel

MAP_MIN_RANKS = 256  # from this many ranks the map is the default view
GLYPH = "▀"  # foreground: the upper rank; background: the lower rank
LABEL_MAX = 10  # a line's node label, at most this wide
OUTLIERS_MIN_LINES = 8  # the map leaves the outliers at least this many lines
CURSOR_COLOUR = "#ffffff"


def groups(state: RunState, ranks: Sequence[int]) -> list[tuple[str, list[int]]]:
    """The ranks by node, the nodes in the order of their first rank."""
    by_node: dict[str, list[int]] = {}
    for rank in ranks:
        by_node.setdefault(node_label(state, rank), []).append(rank)
    return list(by_node.items())


Cell = tuple[int, int | None] | None  # (upper rank, lower rank); None: the gap between nodes


@dataclass
class Layout:
    lines: list[tuple[str, list[Cell]]]  # a label and the cells of each line
    at: dict[int, tuple[int, int, int]]  # rank -> (line, column, half)

    def rank_at(self, line: int, column: int, half: int) -> int | None:
        if not 0 <= line < len(self.lines):
            return None
        cells = self.lines[line][1]
        cell = cells[column] if 0 <= column < len(cells) else None
        return None if cell is None else cell[half] if half else cell[0]


def pack(nodes: list[tuple[str, list[int]]], room: int, gap: int) -> Layout:
    """Nodes laid out left to right, a line at a time; a node wider than a line
    goes on over several."""
    room = max(1, room)
    lines: list[tuple[str, list[Cell]]] = []
    label, cells = "", cast(list[Cell], [])  # the line being filled
    for name, ranks in nodes:
        pairs: list[Cell] = [(ranks[i], ranks[i + 1] if i + 1 < len(ranks) else None)
                             for i in range(0, len(ranks), 2)]
        if cells and len(cells) + gap + len(pairs) > room:
            lines.append((label, cells))
            label, cells = "", []
        if cells and gap:
            cells.append(None)
        label = label or name
        while pairs:
            take = room - len(cells)
            cells.extend(pairs[:take])
            pairs = pairs[take:]
            if pairs:
                lines.append((label, cells))
                label, cells = name, []
    if cells:
        lines.append((label, cells))
    at: dict[int, tuple[int, int, int]] = {}
    for y, (_, row) in enumerate(lines):
        for x, cell in enumerate(row):
            if cell is not None:
                at[cell[0]] = (y, x, 0)
                if cell[1] is not None:
                    at[cell[1]] = (y, x, 1)
    return Layout(lines, at)


def columns(lines: list[Text], width: int, height: int) -> Text:
    """`lines` in as many columns as `height` needs (the first line across them all)."""
    if not lines:
        return Text()
    head, rest = lines[0], lines[1:]
    rows = max(1, height - 1)
    count = max(1, -(-len(rest) // rows))
    each = max(1, width // count)
    out = Text()
    out.append_text(head)
    for y in range(min(rows, len(rest))):
        out.append("\n")
        for c in range(count):
            i = c * rows + y
            if i < len(rest):
                cell = rest[i].copy()
                cell.truncate(each - 1, overflow="ellipsis", pad=True)
                out.append_text(cell)
                out.append(" ")
    return out


class RankMap(Widget, can_focus=True):
    """The map itself: a legend line, then the ranks' cells (see the module's text)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("left,h", "move(0, -1)", show=False),
        Binding("right,l", "move(0, 1)", show=False),
        Binding("up,k", "move(-1, 0)", show=False),
        Binding("down,j", "move(1, 0)", show=False),
        Binding("home", "first", show=False),
        Binding("o", "outlier", "next outlier"),
        Binding("enter", "select", "detail"),
    ]

    def __init__(self, id: str | None = None) -> None:
        super().__init__(id=id)
        self.kinds: dict[int, Kind] = {}
        self.outliers: list[int] = []  # the outliers' ranks, as listed under the map
        self.median: float | None = None
        self.layout_: Layout = Layout([], {})
        self._layout_key: tuple[object, ...] | None = None
        self.cursor: int | None = None  # the rank under the cursor
        self.top = 0  # the first map line shown
        self.strips: list[Strip] = []  # this frame's lines, the legend first
        self._styles: dict[tuple[str, str | None], Style] = {}
        self._label = 1  # the width of a line's node label, with its space

    # -- data in ---------------------------------------------------------------------
    def set_data(self, state: RunState, ranks: Sequence[int], data: Snapshot, rows: int) -> None:
        """This frame's data; `rows`: the most lines the map may take (gaps between
        nodes where they fit)."""
        self.kinds, self.median = data.kinds, data.median
        self.outliers = data.outlier_ranks
        key = (id(state), len(ranks), len(state.ranks), len(state.rank_nodes),
               self.size.width, rows)
        if key != self._layout_key:
            self._layout_key = key
            nodes = groups(state, ranks)
            label = min(LABEL_MAX, max((len(n) for n, _ in nodes), default=1)) + 1
            room = self.size.width - label
            self.layout_ = pack(nodes, room, 1)
            if len(self.layout_.lines) > rows:  # no gaps between nodes: fewer lines
                self.layout_ = pack(nodes, room, 0)
            self._label = label
        if self.cursor not in self.layout_.at:
            self.cursor = next(iter(self.layout_.at), None)
        self._build()

    def _style(self, upper: str, lower: str | None) -> Style:
        style = self._styles.get((upper, lower))
        if style is None:
            style = self._styles[(upper, lower)] = Style(color=upper, bgcolor=lower)
        return style

    def _build(self) -> None:
        """Every line again (a frame)."""
        self.strips = [self._legend(self.size.width)]
        self.strips += [self._line(y) for y in range(len(self.layout_.lines))]
        self.refresh()

    def _line(self, y: int) -> Strip:
        """A line of cells, a segment per run of cells coloured alike (most of a line
        at 16,384 ranks: a few segments, not 200)."""
        label, cells = self.layout_.lines[y]
        kinds, cursor = self.kinds, self.cursor

        def colour(rank: int) -> str:
            return CURSOR_COLOUR if rank == cursor else COLOURS[kinds.get(rank, "starting")]

        keys = [None if cell is None else
                (colour(cell[0]), None if cell[1] is None else colour(cell[1]))
                for cell in cells]
        segments = [Segment(label[:self._label - 1].ljust(self._label), Style(dim=True))]
        for key, run in groupby(keys):
            count = sum(1 for _ in run)
            segments.append(Segment(" " * count) if key is None
                            else Segment(GLYPH * count, self._style(*key)))
        return Strip(segments).adjust_cell_length(self.size.width)

    def _moved(self, before: int | None) -> None:
        """The cursor moved from `before`: its line and the cursor's again, and the legend."""
        lines = {self.layout_.at[rank][0] for rank in (before, self.cursor)
                 if rank is not None and rank in self.layout_.at}
        if len(self.strips) != len(self.layout_.lines) + 1:
            self._build()
            return
        self.strips[0] = self._legend(self.size.width)
        for y in lines:
            self.strips[y + 1] = self._line(y)
        self.refresh()

    def _legend(self, width: int) -> Strip:
        segments = []
        for _, colour, word in KINDS:
            segments += [Segment("█", Style(color=colour)), Segment(f" {word}  ")]
        if self.cursor is not None:
            half = self.layout_.at[self.cursor][2]
            segments.append(Segment(f"│ cursor r{self.cursor} ({'upper' if not half else 'lower'}"
                                    f" half) {self.kinds.get(self.cursor, '')}",
                                    Style(bold=True)))
        return Strip(segments).adjust_cell_length(width)

    # -- drawing ---------------------------------------------------------------------
    def render_line(self, y: int) -> Strip:
        width = self.size.width
        if y == 0 and self.strips:
            return self.strips[0]
        index = self.top + y
        if y > 0 and index < len(self.strips):
            return self.strips[index]
        return Strip.blank(width)

    def on_resize(self, event: events.Resize) -> None:
        self._layout_key = None  # laid out again at the next frame

    @property
    def shown_lines(self) -> int:
        return max(1, self.size.height - 1)

    # -- keys ------------------------------------------------------------------------
    def action_move(self, lines: int, columns: int) -> None:
        if self.cursor is None:
            return
        y, x, half = self.layout_.at[self.cursor]
        if columns:
            found = self._find(y, x, half, 0, columns)
        else:  # by half a cell: the lower half is one down from the upper
            step = 2 * y + half + lines
            found = self._find(step // 2, x, step % 2, lines, 0) if step >= 0 else None
        if found is not None:
            before, self.cursor = self.cursor, found
            line = self.layout_.at[found][0]
            if line < self.top:
                self.top = line
            elif line >= self.top + self.shown_lines:
                self.top = line - self.shown_lines + 1
            self._moved(before)

    def _find(self, y: int, x: int, half: int, lines: int, columns: int) -> int | None:
        """The rank at (y, x, half), past gaps in the direction of the move; on a shorter
        line, its last cell."""
        layout = self.layout_
        if not 0 <= y < len(layout.lines):
            return None
        cells = layout.lines[y][1]
        x = min(x, len(cells) - 1)
        while 0 <= x < len(cells):
            rank = layout.rank_at(y, x, half)
            if rank is not None:
                return rank
            if not columns and half:  # no lower half here: the upper one
                return layout.rank_at(y, x, 0)
            x += columns or -1
        return None

    def action_first(self) -> None:
        self.cursor, self.top = next(iter(self.layout_.at), None), 0
        self._build()

    def action_outlier(self) -> None:
        """The cursor to the next outlier listed under the map (after the cursor's
        own, if it is one; from the first again after the last)."""
        shown = [r for r in self.outliers if r in self.layout_.at]
        if not shown:
            return
        after = shown.index(self.cursor) + 1 if self.cursor in shown else 0
        self.jump(shown[after % len(shown)])

    def jump(self, rank: int) -> None:
        """The cursor to `rank`, its line scrolled into view."""
        before, self.cursor = self.cursor, rank
        line = self.layout_.at[rank][0]
        if line < self.top or line >= self.top + self.shown_lines:
            self.top = max(0, line - self.shown_lines // 2)
            self._build()
        else:
            self._moved(before)

    def action_select(self) -> None:
        if self.cursor is not None:
            self.post_message(RankTable.Selected(self.cursor))  # the app's detail screen

    def visible_text(self) -> list[str]:
        return [strip.text for strip in self.strips]


class MapView(Vertical):
    """The rank map over its outliers; the app hands it the RunState each frame."""

    def compose(self) -> ComposeResult:
        yield RankMap(id="rankmap")
        yield TextPanel(id="outliers")

    def draw(self, state: RunState, now: float) -> bool:
        """Build this frame (under the feed's lock): the map's lines and the outliers.
        False, and nothing built, while the map has no width yet (just shown: laid out
        at 0 columns, a line a rank; the app draws it again at its next tick)."""
        rank_map = self.query_one(RankMap)
        if not rank_map.size.width:
            return False
        states, data = snapshot(state, now)
        room = max(2, self.size.height - OUTLIERS_MIN_LINES)
        rank_map.set_data(state, list(states), data, room - 1)
        # The map takes the lines its nodes need (and its legend); the outliers the rest.
        lines = min(room, len(rank_map.layout_.lines) + 1)
        if rank_map.styles.height is None or rank_map.styles.height.value != lines:
            rank_map.styles.height = lines
        self.query_one("#outliers", TextPanel).set_text(
            columns(data.outliers, self.size.width, self.size.height - lines - 1))  # its border
        return True


def wanted(state: RunState) -> bool:
    """The map, not the table, is the default view of this run."""
    return max(state.world_size, len(state.ranks)) >= MAP_MIN_RANKS
