"""When a rank's heartbeat goes out: only when it tells the daemon something a
Step message has not (pure; the sender thread keeps the clock and asks).

A Step message already proves the rank alive and ends the phase and the
collective its newest heartbeat named (core/state.py `_apply_step`), so a
stepping rank needs no heartbeat. One goes out:

- when no Step message went out, and no heartbeat was tried, for
  HEARTBEAT_INTERVAL_S: a rank blocked in a collective, in a slow data loader,
  evaluating or idle heartbeats every second, its first one at most a second
  after its last step, as when heartbeats went out every second regardless (the
  daemon's silence at 5 s and its hang rule, at least 4.5 s, read them);
- at once (within a send round) when its phase changed in a way that changes
  the daemon's rules: into or out of work outside the steps (set-up,
  evaluation, checkpoint), whose stall limit is longer and whose rank the
  others are excused for waiting for (core/rankview.py SLOW_PHASES,
  RunState.rank_states); but never sooner than HEARTBEAT_INTERVAL_S after the
  last heartbeat, so that a script whose phase flips every step (an evaluation
  forward in each training step) sends no more than one a second, as before.
  A change between two step phases is not worth a message (the Step message
  carries each phase's time), nor is "done" (the bye says it). Work outside the
  steps entered again is news too, though its name is the one told: an
  evaluation every few steps whose end could not be said in time (less than a
  second after the heartbeat before it) is said when it begins again, not only
  a second after the rank's last step.

The collective a rank enters is not worth a message of its own: while the rank
steps, the next Step message ends it; once it stops stepping, in the
collective or anywhere else, its heartbeat a second later says where. Except
one with a signature (a script's own `torch.distributed` call, whose group the
daemon compares across ranks: core/desync.py): once the rank has been inside it
for COLLECTIVE_NEWS_S, a heartbeat says it (once per collective, and not
sooner than HEARTBEAT_INTERVAL_S after the last heartbeat), so that a desync
is named within a second of the second side entering.

So a rank never sends more than a heartbeat a second, and a heartbeat that
could not go out (nobody listening, the queue full) is tried again a second
later, as before: a missing daemon costs one dropped message a second.
"""

from __future__ import annotations

import math

from ddtop.core import wire

HEARTBEAT_INTERVAL_S = 1.0
# A signed collective the rank has been inside this long is said (see above).
COLLECTIVE_NEWS_S = 0.3


def phase_news(phase: wire.Phase, told: wire.Phase) -> bool:
    """Whether the daemon, told `told`, must hear of `phase` (without waiting
    for the rank to stop stepping): a change into, out of or between phases
    outside the steps (not "done": the bye says it)."""
    if phase == told or phase == "done":
        return False
    return phase not in wire.STEP_PHASES or told not in wire.STEP_PHASES


class Beats:
    """What the daemon was told of the rank's phase, and when the rank last said
    it was alive; all times on one monotonic clock."""

    def __init__(self) -> None:
        # The phase the daemon holds: its newest heartbeat's, as its fold moves it
        # on (a Step message ends set-up). None: no heartbeat has gone out.
        self.told: wire.Phase | None = None
        self.told_since: float | None = None  # when the rank entered the phase told
        self.last = -math.inf  # a Step message went out, or a heartbeat was tried
        self.beat_at = -math.inf  # a heartbeat was tried
        # The signed collective the rank was last seen inside, since when, and
        # whether a heartbeat has said it.
        self.coll: object | None = None
        self.coll_at = -math.inf
        self.coll_told = False

    def due(self, now: float, phase: wire.Phase, since: float | None = None) -> bool:
        """Whether a heartbeat saying `phase`, entered at `since`, goes out at `now`."""
        if now - self.last >= HEARTBEAT_INTERVAL_S:
            return True
        if self.told is None or now - self.beat_at < HEARTBEAT_INTERVAL_S:
            return False
        again = (phase == self.told and phase not in wire.STEP_PHASES and phase != "done"
                 and since is not None and since != self.told_since)
        return again or phase_news(phase, self.told)

    def inside(self, now: float, coll: object | None) -> bool:
        """Whether a heartbeat goes out at `now` for the signed collective `coll`
        the rank is inside (None: none): once it has been inside it for
        COLLECTIVE_NEWS_S, if no heartbeat was tried for HEARTBEAT_INTERVAL_S;
        once per collective. Asked at every send round: it notes when `coll` was
        first seen."""
        if coll is not self.coll:
            self.coll, self.coll_at, self.coll_told = coll, now, False
        return (coll is not None and not self.coll_told
                and now - self.coll_at >= COLLECTIVE_NEWS_S
                and now - self.beat_at >= HEARTBEAT_INTERVAL_S)

    def next_at(self) -> float:
        """When one is due at the latest, if nothing goes out until then."""
        return self.last + HEARTBEAT_INTERVAL_S

    def stepped(self, now: float) -> None:
        """A Step message went out: the rank is alive, out of set-up (as the
        daemon's fold reads it)."""
        self.last = now
        if self.told == "setup":
            self.told = "data"

    def beat(self, now: float, phase: wire.Phase, sent: bool,
             since: float | None = None) -> None:
        """A heartbeat saying `phase` (entered at `since`) was tried at `now`;
        `sent`: it went out."""
        self.last = self.beat_at = now
        if sent:
            self.told, self.told_since = phase, since
            self.coll_told = True  # (a heartbeat carries the collective the rank is in)
