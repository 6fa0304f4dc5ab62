"""What the dashboard's charts plot, as plain data built from a RunState.

Pure functions (state in, ChartData out), as panels.py is for text: the chart
grid (mainpanels.py) calls them under the feed's lock and hands the results to
the Chart widgets (charts.py), which only draw. The x axis is the global step; each chart has a
unit for its y axis and a title that says the latest value.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import TypeVar

from ddtop.core.rankview import Point
from ddtop.core.state import GlobalPoint, RunState
from ddtop.core.thinned import Thinned

P = TypeVar("P", Point, GlobalPoint)
PER_RANK_LINES = 4  # up to this many ranks, the comm chart has a line per rank; more: the spread


@dataclass(frozen=True)
class Line:
    """One series: y values over global steps (x ascending), named in the legend."""

    label: str
    xs: tuple[int, ...]
    ys: tuple[float, ...]


@dataclass(frozen=True)
class ChartData:
    """A chart: its name, the y axis's unit, its lines, and the latest value in words
    (at the newest step): its title says them ("loss: global 0.5989 at step 1024")."""

    name: str
    unit: str
    lines: tuple[Line, ...] = ()
    latest: str = ""
    step: int | None = None
    xlabel: str = "step"

    @property
    def empty(self) -> bool:
        return not any(line.xs for line in self.lines)

    @property
    def title(self) -> str:
        at = f" at step {self.step}" if self.step is not None else ""
        return f"{self.name} {self.latest}{at}" if self.latest else self.name

    @property
    def short(self) -> str:
        """The title in the fewest words: the name and the latest value."""
        return f"{self.name} {self.latest}" if self.latest else self.name


def span(thinned: Thinned[P], recent: list[P], whole: bool) -> list[P]:
    """The points a chart draws: the newest readings as they came; with `whole`, the
    whole run thinned (core/thinned.py, its pending readings too), then the newest
    readings past its last point."""
    points = thinned.whole() if whole else []
    if not points:
        return recent
    last: int = points[-1].global_step
    return points + [p for p in recent if p.global_step > last]


def global_loss(state: RunState, whole: bool = False) -> ChartData:
    """The global training loss at each metric sync (`whole`: over the whole run)."""
    points = span(state.global_whole, state.global_history, whole)
    if not points:
        return ChartData("loss: global", "loss")
    last = state.global_history[-1]
    return ChartData("loss: global", "loss",
                     (Line("global", tuple(p.global_step for p in points),
                           tuple(p.train_loss for p in points)),),
                     f"{last.train_loss:.4f}", last.global_step)


def rank_loss(state: RunState, rank: int | None, whole: bool = False) -> ChartData:
    """The selected rank's loss at each of its Step messages that reported one; a
    rank that reports none (zero-code) is said to, never charted as 0."""
    view = state.ranks.get(rank) if rank is not None else None
    if view is None or not view.history:
        return ChartData("loss: selected rank" if rank is None else f"loss: rank {rank}", "loss")
    points = [(p.global_step, p.loss) for p in span(view.whole, view.history, whole)
              if p.loss is not None]
    if not points:
        return ChartData(f"loss: rank {rank}", "loss", latest="not reported")
    newest = [p for p in view.history if p.loss is not None]
    step, loss = (newest[-1].global_step, newest[-1].loss) if newest else points[-1]
    return ChartData(f"loss: rank {rank}", "loss",
                     (Line(f"rank {rank}", tuple(s for s, _ in points),
                           tuple(y for _, y in points)),), f"{loss:.4f}", step)


def _by_step(state: RunState, points: int | None, field: str) -> list[tuple[int, list[float]]]:
    """The ranks' readings of `field` (a Point's) grouped by global step, the newest
    `points` steps (None: the whole run, thinned), oldest first; a reading not reported
    (None) is left out."""
    steps: defaultdict[int, list[float]] = defaultdict(list)
    for view in state.ranks.values():
        for p in span(view.whole, view.history, points is None):
            if (value := getattr(p, field)) is not None:
                steps[p.global_step].append(value)
    found = sorted(steps.items())
    return found if points is None else found[-points:]


def throughput(state: RunState, points: int | None) -> ChartData:
    """Run-wide samples/s at each global step: the sum over the ranks that reported
    it, scaled to all ranks with a history (a rank's reading not yet in counts as
    the mean of the others')."""
    reporting = sum(1 for v in state.ranks.values()
                    if any(p.samples_per_s is not None for p in v.history))
    steps = _by_step(state, points, "samples_per_s")
    if not steps:
        latest = "not reported" if any(v.history for v in state.ranks.values()) else ""
        return ChartData("samples/s", "samples/s", latest=latest)
    ys = tuple(sum(readings) * reporting / len(readings) for _, readings in steps)
    return ChartData("samples/s", "samples/s", (Line("all ranks", tuple(s for s, _ in steps), ys),),
                     f"{ys[-1]:,.0f}", steps[-1][0])


def comm_share(state: RunState, points: int | None) -> ChartData:
    """The share of the step spent communicating, in percent: a line per rank up to
    PER_RANK_LINES ranks, else the spread over ranks (min, median, max) per step."""
    steps = _by_step(state, points, "comm_share")
    if not steps:
        return ChartData("comm %", "% of step")
    xs = tuple(s for s, _ in steps)
    ranks = sorted(r for r, v in state.ranks.items() if v.history)
    if len(ranks) <= PER_RANK_LINES:
        lines = []
        for rank in ranks:
            view = state.ranks[rank]
            mine = [(p.global_step, 100 * p.comm_share)
                    for p in span(view.whole, view.history, points is None)
                    if p.global_step >= xs[0] and p.comm_share is not None]
            lines.append(Line(f"rank {rank}", tuple(s for s, _ in mine),
                              tuple(y for _, y in mine)))
        latest = " ".join(f"r{rank} {line.ys[-1]:.0f}"
                          for rank, line in zip(ranks, lines, strict=True) if line.ys)
        return ChartData("comm %", "% of step", tuple(lines), latest, xs[-1])
    shares = [[100 * share for share in readings] for _, readings in steps]
    spread = (Line("max", xs, tuple(max(s) for s in shares)),
              Line("median", xs, tuple(statistics.median(s) for s in shares)),
              Line("min", xs, tuple(min(s) for s in shares)))
    low, mid, high = (line.ys[-1] for line in reversed(spread))
    return ChartData("comm %", "% of step", spread,
                     f"min {low:.0f} med {mid:.0f} max {high:.0f}", xs[-1])


def charts(state: RunState, selected: int | None, points: int | None) -> dict[str, ChartData]:
    """The main view's four charts, by widget id (mainpanels.CHARTS): the newest `points`
    steps, or (None) the whole run."""
    whole = points is None
    return {"loss-global": global_loss(state, whole),
            "loss-rank": rank_loss(state, selected, whole),
            "rate": throughput(state, points), "comm-share": comm_share(state, points)}

