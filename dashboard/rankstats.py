"""What one frame of the rank map shows, from a RunState, in one pass over its ranks.

Pure (RunState in, `Snapshot` out; rankmap.py draws it): each rank's colour class
(its state; a running rank's step time against the median of the running ranks),
the distribution of step and comm times, and the outliers (failed, hung, the
slowest, the fastest, silent), one line each. At 16,384 ranks the frame's work is
one `RunState.rank_states` (the states, with their rules: slow phases, lost nodes),
one pass over the states that classes every rank and gathers the running ranks'
times and the failed, hung and silent ranks, one sort of the step times (median
and percentiles alike) and of the comm times, and a partial selection of the 5
slowest and fastest (heapq): no sort by key of 16,384 ranks.
"""

from __future__ import annotations

import heapq
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from rich.text import Text

from ddtop.core.rankview import DEAD, FINISHED, RUNNING, STALLED, STARTING, RankState
from ddtop.core.state import RunState
from ddtop.core.text import num
from ddtop.dashboard import format as fmt

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
FAST, SLOW, SLOWER = 0.9, 1.2, 1.5  # step time / median: the shades' bounds
# A rank's class by its state alone (a running rank's by its step time: kind_of);
# any other state (silent, unreached, unreachable, lost) is "silent": not heard from.
BY_STATE: dict[RankState, Kind] = {DEAD: "failed", STALLED: "hung", FINISHED: "finished",
                                   STARTING: "starting", RUNNING: "median"}


def kind_of(state: RankState, ratio: float | None) -> Kind:
    """A rank's colour class: its state; a running rank's step time against the median."""
    if state != RUNNING or ratio is None:
        return BY_STATE.get(state, "silent")
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


@dataclass
class Snapshot:
    """What one frame of the map needs, from the RunState (read under the feed's lock)."""

    kinds: dict[int, Kind]
    median: float | None  # the running ranks' median step time, s
    outliers: list[Text]  # the distribution, then one line per outlier
    outlier_ranks: list[int]  # the ranks of those lines, in their order


@dataclass
class Readings:
    """The pass's gatherings: running ranks' step times (s), their comm times sorted,
    and the ranks of each listed kind, in rank order."""

    times: dict[int, float]
    step_sorted: list[float]
    comm_sorted: list[float]
    found: dict[str, list[int]]


def snapshot(state: RunState, now: float) -> tuple[dict[int, RankState], Snapshot]:
    """The ranks' states (RunState.rank_states, once) and the map's frame from them."""
    states = state.rank_states(now)
    views = state.ranks
    times: dict[int, float] = {}
    comm: list[float] = []
    found: dict[str, list[int]] = {"failed": [], "hung": [], "silent": []}
    kinds: dict[int, Kind] = {}
    for rank, st in states.items():
        kind = BY_STATE.get(st, "silent")
        kinds[rank] = kind
        if st == RUNNING:
            view = views.get(rank)
            if view is not None and view.step_time_s:
                times[rank] = view.step_time_s
                if view.comm_s is not None:
                    comm.append(view.comm_s)
        elif kind in found:
            found[kind].append(rank)
    step_sorted = sorted(times.values())
    median = statistics.median(step_sorted) if step_sorted else None
    if median:  # the running ranks' shades (kind_of's bounds, without its calls)
        for rank, took in times.items():
            ratio = took / median
            if ratio >= SLOWER:
                kinds[rank] = "slower"
            elif ratio >= SLOW:
                kinds[rank] = "slow"
            elif ratio < FAST:
                kinds[rank] = "fast"
    comm.sort()
    readings = Readings(times, step_sorted, comm, found)
    lines, ranks = outliers(state, states, readings, median)
    return states, Snapshot(kinds, median, lines, ranks)


def _spread(name: str, values: list[float]) -> str:
    """min, p50, p90 and max of `values`, sorted."""
    if not values:
        return f"{name} -"

    def at(q: float) -> str:
        return fmt.millis(values[min(len(values) - 1, int(q * len(values)))])

    return f"{name} min {at(0)} · p50 {at(0.5)} · p90 {at(0.9)} · max {at(1.0)}"


def outliers(state: RunState, states: dict[int, RankState], readings: Readings,
             median: float | None) -> tuple[list[Text], list[int]]:
    """The distribution of step and comm times, then the outliers, one line each;
    and the outliers' ranks in the order of their lines."""
    times, found = readings.times, readings.found
    lines = [Text(f"{len(times):,} running · {_spread('step ms', readings.step_sorted)} · "
                  f"{_spread('comm ms', readings.comm_sorted)}", style="bold")]
    ranks: list[int] = []

    def line(kind: Kind, word: str, rank: int, value: str) -> None:
        text = Text("█ ", style=COLOURS[kind])
        text.append(f"{word:<7} r{rank:<6} {node_label(state, rank):<8} {value}")
        lines.append(text)
        ranks.append(rank)

    def listed(kind: Kind, word: str, ranks: list[int], value: Callable[[int], str]) -> None:
        for rank in ranks[:OUTLIERS_EACH]:
            line(kind, word, rank, value(rank))
        if len(ranks) > OUTLIERS_EACH:
            lines.append(Text(f"  {word:<7} +{len(ranks) - OUTLIERS_EACH:,} more"))

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
    slowest = heapq.nsmallest(OUTLIERS_EACH, times, key=lambda r: (-times[r], r))
    fastest = [r for r in heapq.nsmallest(2 * OUTLIERS_EACH, times,
                                          key=lambda r: (times[r], r))
               if r not in slowest][:OUTLIERS_EACH]
    for word, chosen in (("slowest", slowest), ("fastest", fastest)):
        for rank in chosen:
            line(kind_of(RUNNING, times[rank] / median if median else None), word, rank,
                 step(rank))
    listed("silent", "silent", found["silent"], silent)
    return lines, ranks
