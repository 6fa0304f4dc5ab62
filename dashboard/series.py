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

from ddtop.core.state import RunState

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


def global_loss(state: RunState) -> ChartData:
    """The global training loss at each metric sync."""
    points = state.global_history
    if not points:
        return ChartData("loss: global", "loss")
    last = points[-1]
    return ChartData("loss: global", "loss",
                     (Line("global", tuple(p.global_step for p in points),
                           tuple(p.train_loss for p in points)),),
                     f"{last.train_loss:.4f}", last.global_step)


def rank_loss(state: RunState, rank: int | None) -> ChartData:
    """The selected rank's loss at each of its Step messages that reported one; a
    rank that reports none (zero-code) is said to, never charted as 0."""
    view = state.ranks.get(rank) if rank is not None else None
    if view is None or not view.history:
        return ChartData("loss: selected rank" if rank is None else f"loss: rank {rank}", "loss")
    points = [(p.global_step, p.loss) for p in view.history if p.loss is not None]
    if not points:
        return ChartData(f"loss: rank {rank}", "loss", latest="not reported")
    step, loss = points[-1]
    return ChartData(f"loss: rank {rank}", "loss",
                     (Line(f"rank {rank}", tuple(s for s, _ in points),
                           tuple(y for _, y in points)),), f"{loss:.4f}", step)


def _by_step(state: RunState, points: int, field: str) -> list[tuple[int, list[float]]]:
    """The ranks' readings of `field` (a Point's) grouped by global step, the newest
    `points` steps, oldest first; a reading not reported (None) is left out."""
    steps: defaultdict[int, list[float]] = defaultdict(list)
    for view in state.ranks.values():
        for p in view.history:
            if (value := getattr(p, field)) is not None:
                steps[p.global_step].append(value)
    return sorted(steps.items())[-points:]


def throughput(state: RunState, points: int) -> ChartData:
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


def comm_share(state: RunState, points: int) -> ChartData:
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
            mine = [(p.global_step, 100 * p.comm_share) for p in state.ranks[rank].history
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


def charts(state: RunState, selected: int | None, points: int) -> dict[str, ChartData]:
    """The main view's four charts, by widget id (mainpanels.CHARTS)."""
    return {"loss-global": global_loss(state), "loss-rank": rank_loss(state, selected),
            "rate": throughput(state, points), "comm-share": comm_share(state, points)}
