"""A rank whose memory grows steadily: "memory creeping", with its rate.

A leak (a list of losses kept with their graphs, a cache that never evicts)
shows as memory that only grows, minute after minute, long before the OOM
killer or CUDA's allocator ends the run. Each rank's memory (CUDA allocated
where it uses CUDA, else its RSS) is looked at, at most every SAMPLE_S, as its
Step messages bring it (`Creep.add`). A run of growth begins at a reading and
goes on while no reading falls more than SLACK below the run's highest
(allocators and collectors give some back now and then) and a new highest comes
within FLAT_S; a larger fall, or memory flat that long (grown at start-up, then
steady: not a leak), begins a new run there. The rank is creeping once its run
has lasted CREEP_AFTER_S and grown by at least MIN_GROWTH bytes and MIN_SHARE of
where it began:

    memory creeping: +12.0 MiB/min for 6 min (1.20 GiB -> 1.27 GiB)

Pure and O(1) a rank: the fold (core/state.py) keeps a Creep in each RankView.
"""

from __future__ import annotations

import msgspec

SAMPLE_S = 10.0  # readings at least this far apart
CREEP_AFTER_S = 300.0  # growth lasting this long ...
MIN_GROWTH = 64 << 20  # ... by at least this much ...
MIN_SHARE = 0.05  # ... and this share of where it began
SLACK_BYTES = 16 << 20  # a fall below the run's highest by more than the larger of
SLACK_SHARE = 0.02  # these begins a new run
FLAT_S = 120.0  # so does no new highest for this long
MIB = 1 << 20


class Creep(msgspec.Struct, array_like=True):
    """One rank's current run of growth: where and when it began, its highest, and
    the newest reading."""

    began_t: float = 0.0
    began: int = -1  # bytes; -1: no reading yet
    top: int = 0
    last_t: float = 0.0
    last: int = 0
    top_t: float = 0.0  # when the highest was read

    def add(self, t: float, memory: int | None) -> None:
        """A reading of `memory` bytes at `t` (seconds, any clock the fold keeps)."""
        if memory is None or (self.began >= 0 and t - self.last_t < SAMPLE_S):
            return
        slack = max(SLACK_BYTES, int(SLACK_SHARE * self.top))
        if self.began < 0 or memory < self.top - slack or (
                memory <= self.top and t - self.top_t > FLAT_S):
            self.began_t, self.began, self.top, self.top_t = t, memory, memory, t
        if memory > self.top:
            self.top, self.top_t = memory, t
        self.last_t, self.last = t, memory

    def rate(self) -> float | None:
        """Bytes a second it grows by, while creeping; None while it is not."""
        lasted, grown = self.last_t - self.began_t, self.last - self.began
        if self.began < 0 or lasted < CREEP_AFTER_S or grown < max(MIN_GROWTH,
                                                                   MIN_SHARE * self.began):
            return None
        return grown / lasted

    def words(self) -> str | None:
        """'memory creeping: +12.0 MiB/min for 6 min (1.20 GiB -> 1.27 GiB)', or None."""
        rate = self.rate()
        if rate is None:
            return None
        return (f"memory creeping: +{rate * 60 / MIB:,.1f} MiB/min for "
                f"{(self.last_t - self.began_t) / 60:.0f} min ({_size(self.began)} -> "
                f"{_size(self.last)})")


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / MIB:,.0f} MiB"
