"""--hang-timeout's clock: a hang that RunState.hung declares (core/hangs.py),
held for the limit, is judged: the rank blamed (the lowest of those the others
wait for; without one, the lowest stalled rank; of a desync, the lowest odd
rank), why, and the hang in words.
The supervisor acts on the verdict (stacks, then every rank stopped)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddtop.core import desync
from ddtop.core.rankview import STALLED

if TYPE_CHECKING:
    from ddtop.core.state import RunState

# A hang is looked for at every pass of the daemon's loop (ten a second, more
# under a flood of messages), but that above MANY_RANKS one look costs
# milliseconds (7 ms at 16,384 ranks: bench/summary.py): there, at most
# every LOOK_EVERY_S, a small part of any --hang-timeout.
MANY_RANKS = 1024
LOOK_EVERY_S = 0.5


class HangTimer:
    def __init__(self, limit: float | None) -> None:
        self.limit = limit
        self.since: float | None = None  # wall clock: since when the run hangs
        self.looked: float | None = None  # when a hang was last looked for
        self.news_looked: float | None = None  # when a desync was last looked for
        self.told: str | None = None  # where the desync last told is ("desync in group world #20")
        self.seen: str | None = None  # the desync seen at the last look

    def reset(self) -> None:
        self.since = None

    def desync_news(self, state: RunState, now: float) -> str | None:
        """A desync (core/desync.py) not told yet, in words, once for its group and
        number, when two looks in a row saw the same words; looked for at most
        every LOOK_EVERY_S, with or without a limit (the daemon says it as an event:
        the journal keeps it)."""
        if self.news_looked is not None and 0 <= now - self.news_looked < LOOK_EVERY_S:
            return None
        self.news_looked = now
        found = state.hung(now)
        text = found[1] if found is not None and desync.named(found[1]) else None
        seen, self.seen = self.seen, text
        where = text.partition(":")[0] if text else None  # "desync in group world #20"
        # Told once the same words were seen at two looks in a row: the sides are
        # whole (each rank's heartbeat comes on its own), and told once.
        if text is None or text != seen or where == self.told:
            return None
        self.told = where
        return text

    def judge(self, state: RunState, now: float) -> tuple[int, str, str] | None:
        """(rank blamed, reason, the hang in words) once a hang has lasted the limit."""
        if self.limit is None:
            return None
        if (len(state.ranks) > MANY_RANKS and self.looked is not None
                and 0 <= now - self.looked < LOOK_EVERY_S):
            return None
        self.looked = now
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
        if desync.counted(text):
            reason = (f"entered another number of its group's collectives (--hang-timeout "
                      f"{self.limit:g})")
        elif desync.named(text) and desync.P2P_WORDS in text:  # the cause: it, not the waits
            reason = (f"entered a send or recv its peer's cannot meet (--hang-timeout "
                      f"{self.limit:g})")
        elif desync.named(text):
            reason = f"entered another collective than its group's (--hang-timeout {self.limit:g})"
        else:
            reason = f"hung for {self.limit:g} s (--hang-timeout {self.limit:g})"
        return min(waited_for or stalled or [0]), reason, text
