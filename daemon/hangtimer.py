"""--hang-timeout's clock: a hang that RunState.hung declares (daemon/hangs.py),
held for the limit, is judged: the rank blamed (the lowest of those the others
wait for; without one, the lowest stalled rank), why, and the hang in words.
The supervisor acts on the verdict (stacks, then every rank stopped)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddtop.daemon.rankview import STALLED

if TYPE_CHECKING:
    from ddtop.daemon.state import RunState


class HangTimer:
    def __init__(self, limit: float | None) -> None:
        self.limit = limit
        self.since: float | None = None  # wall clock: since when the run hangs

    def reset(self) -> None:
        self.since = None

    def judge(self, state: RunState, now: float) -> tuple[int, str, str] | None:
        """(rank blamed, reason, the hang in words) once a hang has lasted the limit."""
        if self.limit is None:
            return None
        found = state.hung(now)
        if found is None:
            self.since = None
            return None
        if self.since is None:
            self.since = now
        if now - self.since < self.limit:
            return None
        waited_for, text = found
        stalled = [r for r, s in state.rank_states(now).items() if s == STALLED]
        reason = f"hung for {self.limit:g} s (--hang-timeout {self.limit:g})"
        return min(waited_for or stalled or [0]), reason, text
