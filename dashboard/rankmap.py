"""The rank map: every rank of a large job in one screen, and its outliers first.

Above MAP_MIN_RANKS ranks the dashboard's main view is `MapView` (`m` swaps it
with the ranks table): the `RankMap`, a half block `▀` per two ranks (the upper
half one rank, the lower half the next), a node's ranks side by side, each line
labelled with the first node it holds (a one-column gap between nodes where the
height allows it), coloured by state and, for a running rank, by its step time
against the median of the running ranks; under it the step and comm time
distribution and the outliers (failed, hung, slowest, fastest, silent), one line
each. 16,384 ranks of 8 a node fit 200x60 (43 lines of 48 nodes). The arrows
move a cursor over the map; Enter opens the rank's detail, the way the table's
Enter does (the same `RankTable.Selected` message). A frame costs a pass over the
ranks' states and a strip per line (16,384 ranks: about 40 ms on 2 cores).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, cast

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.strip import Strip
from textual.widget import Widget

from ddtop.daemon.rankview import (
    DEAD,
    FINISHED,
    RUNNING,
    STALLED,
    STARTING,
    RankState,
)
from ddtop.daemon.state import RunState
from ddtop.daemon.text import num
from ddtop.dashboard import format as fmt
from ddtop.dashboard.widgets import RankTable, TextPanel

MAP_MIN_RANKS = 256  # from this many ranks the map is the default view
GLYPH = "▀"  # foreground: the upper rank; background: the lower rank
LABEL_MAX = 10  # a line's node label, at most this wide
OUTLIERS_MIN_LINES = 8  # the map leaves the outliers at least this many lines
OUTLIERS_EACH = 5  # slowest and fastest shown; failed, hung, silent: up to this many

Kind = Literal["failed", "hung", "silent", "finished", "starting", "fast", "median", "slow",
               "slower"]
# (kind, colour, legend): in the legend's order.
KINDS: tuple[tuple[Kind, str, str], ...] = (
    ("failed", "#ff2020", "failed"), ("hung", "#ff40ff", "hung"),
    ("silent", "#8a8a8a", "silent"), ("finished", "#4e4e80", "finished"),
    ("starting", "#3a3a3a", "starting"), ("fast", "#3a96ff", "<0.9x"),
    ("median", "#20b020", "~median"), ("slow", "#e0c000", "≥1.2x"),
    ("slower", "#ff8000", "≥1.5x"),
)
COLOURS: dict[str, str] = {kind: colour for kind, colour, _ in KINDS}
CURSOR_COLOUR = "#ffffff"
FAST, SLOW, SLOWER = 0.9, 1.2, 1.5  # step time / median: the shades' bounds


def kind_of(state: RankState, ratio: float | None) -> Kind:
    """A rank's colour class: its state; a running rank's step time against the median."""
    if state == DEAD:
        return "failed"
    if state == STALLED:
        return "hung"
    if state == FINISHED:
        return "finished"
    if state == STARTING:
        return "starting"
    if state != RUNNING:
        return "silent"  # silent, unreached, unreachable, lost: not heard from
    if ratio is None:
        return "median"
    if ratio >= SLOWER:
        return "slower"
    if ratio >= SLOW:
        return "slow"
    return "fast" if ratio < FAST else "median"


def node_label(state: RunState, rank: int) -> str:
    """The node a rank is on: 'n37' in a multi-node job, else its host."""
    node = state.rank_nodes.get(rank)
    if node is not None:
        return f"n{node}"
    view = state.ranks.get(rank)
    return view.host if view is not None and view.host else "?"


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


@dataclass
class Snapshot:
    """What one frame of the map needs, from the RunState (read under the feed's lock)."""

    kinds: dict[int, Kind]
    median: float | None  # the running ranks' median step time, s
    outliers: list[Text]  # the distribution, then one line per outlier


def snapshot(state: RunState, now: float) -> tuple[dict[int, RankState], Snapshot]:
    states = state.rank_states(now)
    times = {r: v.step_time_s for r, v in state.ranks.items()
             if v.step_time_s and states.get(r) == RUNNING}
    median = statistics.median(times.values()) if times else None
    kinds = {r: kind_of(st, times[r] / median if median and r in times else None)
             for r, st in states.items()}
    return states, Snapshot(kinds, median, outliers(state, states, kinds, times, median))


def _spread(name: str, values: list[float]) -> str:
    if not values:
        return f"{name} -"
    values.sort()

    def at(q: float) -> str:
        return fmt.millis(values[min(len(values) - 1, int(q * len(values)))])

    return f"{name} min {at(0)} · p50 {at(0.5)} · p90 {at(0.9)} · max {at(1.0)}"


def outliers(state: RunState, states: dict[int, RankState], kinds: dict[int, Kind],
             times: dict[int, float], median: float | None) -> list[Text]:
    """The distribution of step and comm times, then the outliers, one line each."""
    comm = [v.comm_s for r, v in state.ranks.items() if r in times and v.comm_s is not None]
    lines = [Text(f"{len(times):,} running · {_spread('step ms', list(times.values()))} · "
                  f"{_spread('comm ms', comm)}", style="bold")]

    def line(kind: Kind, word: str, rank: int, value: str) -> None:
        text = Text("█ ", style=COLOURS[kind])
        text.append(f"{word:<7} r{rank:<6} {node_label(state, rank):<8} {value}")
        lines.append(text)

    def listed(kind: Kind, word: str, found: list[int], value: Callable[[int], str]) -> None:
        for rank in found[:OUTLIERS_EACH]:
            line(kind, word, rank, value(rank))
        if len(found) > OUTLIERS_EACH:
            lines.append(Text(f"  {word:<7} +{len(found) - OUTLIERS_EACH:,} more"))

    found: dict[str, list[int]] = {"failed": [], "hung": [], "silent": []}
    for rank, kind in kinds.items():
        if kind in found:
            found[kind].append(rank)

    def failed(rank: int) -> str:
        v = state.ranks.get(rank)
        if v is None:
            return DEAD
        return v.signal or (f"exit {v.exit_code}" if v.exit_code is not None else DEAD)

    def hung(rank: int) -> str:
        v = state.ranks.get(rank)
        return v.where() if v is not None else STALLED

    def step(rank: int) -> str:
        ratio = f" ({times[rank] / median:.2f}x)" if median else ""
        return f"{fmt.millis(times[rank])} ms{ratio}"

    def silent(rank: int) -> str:
        v = state.ranks.get(rank)
        if v is None or v.last_seen is None or state.updated is None:
            return states[rank]
        return f"seen {num(max(0.0, state.updated - v.last_seen), '.0f')}s before the newest"

    listed("failed", "failed", found["failed"], failed)
    listed("hung", "hung", found["hung"], hung)
    ranked = sorted(times, key=lambda r: (-times[r], r))
    slowest = ranked[:OUTLIERS_EACH]
    fastest = [r for r in sorted(times, key=lambda r: (times[r], r))[:2 * OUTLIERS_EACH]
               if r not in slowest][:OUTLIERS_EACH]
    for word, chosen in (("slowest", slowest), ("fastest", fastest)):
        for rank in chosen:
            line(kind_of(RUNNING, times[rank] / median if median else None), word, rank,
                 step(rank))
    listed("silent", "silent", found["silent"], silent)
    return lines


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
        Binding("enter", "select", "detail"),
    ]

    def __init__(self, id: str | None = None) -> None:
        super().__init__(id=id)
        self.kinds: dict[int, Kind] = {}
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

    def _colour(self, rank: int) -> str:
        return CURSOR_COLOUR if rank == self.cursor else COLOURS[self.kinds.get(rank, "starting")]

    def _build(self) -> None:
        """Every line again (a frame)."""
        self.strips = [self._legend(self.size.width)]
        self.strips += [self._line(y) for y in range(len(self.layout_.lines))]
        self.refresh()

    def _line(self, y: int) -> Strip:
        label, cells = self.layout_.lines[y]
        segments = [Segment(label[:self._label - 1].ljust(self._label), Style(dim=True))]
        blank = Segment(" ")
        for cell in cells:
            if cell is None:
                segments.append(blank)
                continue
            upper, lower = cell
            segments.append(Segment(GLYPH, self._style(
                self._colour(upper), None if lower is None else self._colour(lower))))
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

    def draw(self, state: RunState, now: float) -> None:
        """Build this frame (under the feed's lock): the map's lines and the outliers."""
        states, data = snapshot(state, now)
        rank_map = self.query_one(RankMap)
        room = max(2, self.size.height - OUTLIERS_MIN_LINES)
        rank_map.set_data(state, list(states), data, room - 1)
        # The map takes the lines its nodes need (and its legend); the outliers the rest.
        lines = min(room, len(rank_map.layout_.lines) + 1)
        if rank_map.styles.height is None or rank_map.styles.height.value != lines:
            rank_map.styles.height = lines
        self.query_one("#outliers", TextPanel).set_text(
            columns(data.outliers, self.size.width, self.size.height - lines - 1))  # its border


def wanted(state: RunState) -> bool:
    """The map, not the table, is the default view of this run."""
    return max(state.world_size, len(state.ranks)) >= MAP_MIN_RANKS
