"""A chart's series over the whole run in a bounded number of points.

The fold keeps each rank's newest readings as they came (RankView.history: the latest
window); a `Thinned` keeps the whole run beside them, evenly: each of its points stands
for `every` readings in a row (their mean, at the last one's step and time), and when it
holds more than its bound, neighbouring points are merged in pairs and `every` doubles.
So a run of any length is at most `keep` points, all of the same weight, from its first
readings to its newest (the last not yet `every` of them: `pending`). Pure and small:
the dashboard's whole-run charts read it (dashboard/series.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import msgspec

T = TypeVar("T")
# Two readings (or points) as one, given each one's weight: the later one's step and time.
Merge = Callable[[T, int, T, int], T]


class Thinned(msgspec.Struct, Generic[T]):
    points: list[T] = []
    every: int = 1  # readings each point stands for
    pending: T | None = None  # the newest readings, fewer than `every`, merged
    pending_n: int = 0

    def add(self, reading: T, keep: int, merge: Merge[T]) -> None:
        """One more reading, the series kept to at most `keep` points (2 at least)."""
        if self.pending is None:
            self.pending, self.pending_n = reading, 1
        else:
            self.pending = merge(self.pending, self.pending_n, reading, 1)
            self.pending_n += 1
        if self.pending_n < self.every:
            return
        self.points.append(self.pending)
        self.pending, self.pending_n = None, 0
        if len(self.points) > max(2, keep):
            points = self.points
            merged = [merge(points[i], self.every, points[i + 1], self.every)
                      for i in range(0, len(points) - 1, 2)]
            if len(points) % 2:  # the newest, alone: it goes on filling
                self.pending, self.pending_n = points[-1], self.every
            self.points = merged
            self.every *= 2

    def whole(self) -> list[T]:
        """Every point, the pending one last."""
        return [*self.points, self.pending] if self.pending is not None else list(self.points)


def mean(a: float | None, wa: int, b: float | None, wb: int) -> float | None:
    """The weighted mean of two readings; what one of them did not report, the other's."""
    if a is None:
        return b
    if b is None:
        return a
    return (a * wa + b * wb) / (wa + wb)
