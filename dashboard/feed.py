"""Where a dashboard's RunState comes from, and what a reader may do with it.

Three feeds, one interface (`Feed`):

    LiveFeed     a live run's daemon (live.py)
    ReplayFeed   a run's journal played back (replay.py)
    StateFeed    a RunState someone else folds, in the same thread (tests, benchmarks)

`open_feed` (live.py) picks one for a run directory or an endpoint.

Every feed folds into `feed.state` under `feed.lock` and tells the time with
`feed.now()`: wall-clock time while a run is live, the journal's time in a
replay, and the time of the last message once a run is over (so that a finished
run does not age into "silent"). `pump()` is called in a loop by one thread (a
Textual worker, or the headless printer); readers in other threads hold the lock.

What a reader may do with a feed, the feed says (readers never test its class):
`replay_controls` (speed and pause: `set_speed`, `set_paused`), `stop_endpoint`
(where to send `stop`), `note` (a line to show once: where the state comes
from, when that is not what was asked for), and `close()`, safe to call on any feed.

What the journal cannot tell (frames the daemon refused: `rejected`) comes from
run.json once the run is over (`conclude`).

A watcher's loop pumps through a `Pacer`: a feed whose messages trickle in (a
live run of a few ranks: `paced`) is pumped at most once per period, what comes
meanwhile waiting in the socket to be folded together.
"""

from __future__ import annotations

import gc
import threading
import time

from ddtop.core import wire
from ddtop.core.keys import RunKeys
from ddtop.core.rundir import RunPaths
from ddtop.core.runinfo import RunInfo, merged_counts
from ddtop.core.state import RunState
from ddtop.core.summary import LOST

BATCH = 5000  # messages folded per pump() at most, so a flood never starves the reader
PACE_BELOW = 2000  # messages/s under which a paced feed is pumped once per period (Pacer)
FREEZE_FROM_RANKS = 256  # a state of this many ranks: its objects out of the collector's sight

CONNECTING, LIVE, GONE, ENDED, REPLAY = "connecting", "live", "gone", "ended", "replay"


class Feed:
    """What every feed offers; see the module docstring."""

    def __init__(self, run: str) -> None:
        self.state = RunState(run=run)
        self.lock = threading.Lock()
        self.connection = CONNECTING  # connecting | live | gone | ended | replay
        self.detail = ""  # a line for the banner: what is wrong, what is being tried
        self.note = ""  # a line to show once, e.g. a renamed run folder replayed
        self.finished = False  # nothing more will come: the run is over or its journal played
        self.keys: RunKeys | None = None  # the run's CURVE keys, for a daemon over TCP
        self.paths: RunPaths | None = None
        self.speed = 1.0  # run seconds per wall second: 1 live; a replay's own (0: at once)
        # Whether a watcher should gather this feed's messages (Pacer): a live run's
        # come one by one as ranks send them; a replay's or a StateFeed's do not.
        self.paced = False

    def pump(self, timeout_s: float) -> int:
        """Fold what arrives within `timeout_s`; the number of messages folded."""
        raise NotImplementedError

    def now(self) -> float:
        return time.time()

    @property
    def replay_controls(self) -> bool:
        """Whether `set_speed` and `set_paused` steer this feed (a journal played back)."""
        return False

    def set_speed(self, speed: float) -> None:
        """Play at `speed` times real time (0: at once); only where `replay_controls`."""
        raise NotImplementedError(f"{type(self).__name__} has no speed to set")

    def set_paused(self, paused: bool) -> None:
        """Stop (or restart) the feed's clock; only where `replay_controls`."""
        raise NotImplementedError(f"{type(self).__name__} cannot pause")

    @property
    def stop_endpoint(self) -> str | None:
        """The control endpoint to send `stop` to: a live run's daemon while the run
        is unfinished; None when there is nothing this feed can stop."""
        return None

    def close(self) -> None:
        pass


class StateFeed(Feed):
    """A RunState folded by its owner (the daemon's Supervisor) in the same thread."""

    def __init__(self, state: RunState) -> None:
        super().__init__(state.run)
        self.state = state
        self.connection = LIVE

    def pump(self, timeout_s: float) -> int:
        """Nothing to fold here: it waits out `timeout_s`, as a feed with nothing come
        does (returned at once, the app's worker would spin a core)."""
        self.finished = self.state.status in wire.FINAL_STATUSES
        if not self.finished:
            time.sleep(timeout_s)
        return 0

    def now(self) -> float:
        return (self.state.updated or time.time()) if self.finished else time.time()


def conclude(state: RunState, paths: RunPaths) -> RunState:
    """Complete a state folded from a run's journal with what run.json knows once
    the daemon is gone: a run whose journal never reached a final status was lost."""
    info = RunInfo.load(paths)
    if state.status not in wire.FINAL_STATUSES:
        record = info.record
        state.status = record.status if record.status in wire.FINAL_STATUSES else LOST
        state.exit_code = record.exit_code
        if state.status == LOST:
            state.status_message = (f"the daemon (pid {info.daemon_pid}) is gone and the run "
                                    "did not finish: it was killed")
    state.failure = state.failure or info.record.failure
    state.world_size = state.world_size or info.world_size
    state.rejected = merged_counts(state.rejected, info.record.rejected)
    return state


def freeze_due(frozen: tuple[int, int] | None, state: int, ranks: int) -> bool:
    """Pacer's freeze: a state of FREEZE_FROM_RANKS ranks or more not frozen yet (by
    its id), or twice as large as at the last freeze, `frozen`: (state's id, ranks)."""
    return ranks >= FREEZE_FROM_RANKS and (frozen is None or frozen[0] != state
                                           or ranks >= 2 * frozen[1])


class Pacer:
    """One watcher's loop over a feed: `pump()`, the watcher's own work, `rest()`.

    After a pump of a paced feed that folded a few messages (fewer than BATCH),
    `rest()` sleeps out the rest of `period_s`: what comes meanwhile waits in the
    socket and is folded together, one wakeup per period instead of one per
    message (a few ranks send a few dozen a second; each would wake the
    watcher). A feed that brought PACE_BELOW messages a second or more over the
    last second (hundreds of ranks) is not held back: its messages come in
    bursts that wake the watcher once each anyway, and each burst is folded as
    it comes. Nor is a flood (a pump that folded BATCH), nor a quiet feed (a
    pump that folded nothing already waited its period)."""

    def __init__(self, feed: Feed, period_s: float) -> None:
        self.feed, self.period_s = feed, period_s
        self.busy = False  # PACE_BELOW messages a second or more, over the last second
        self._start = self._since = time.monotonic()
        self._folded = self._count = 0  # the last pump's; the last second's so far
        self._frozen: tuple[int, int] | None = None  # (state's id, its ranks) at the last freeze

    def pump(self) -> int:
        """The feed's pump, waiting up to a period; the number of messages folded."""
        self._start = time.monotonic()
        self._folded = self.feed.pump(self.period_s)
        self._settle()
        self._count += self._folded
        if self._start - self._since >= 1.0:
            self.busy = self._count >= PACE_BELOW * (self._start - self._since)
            self._count, self._since = 0, self._start
        return self._folded

    def _settle(self) -> None:
        """A large state, new (a snapshot decoded, a journal read) or twice as large as at
        the last freeze: every object alive now frozen (gc.freeze). The collector's full
        passes go over every object alive, millions in a state of 16,384 ranks: a quarter
        of a second each, a third of the dashboard's CPU while it folds. Frozen objects
        are left out of them (freed by their reference counts as ever; only cycles already
        garbage at the freeze stay)."""
        state = self.feed.state
        if freeze_due(self._frozen, id(state), len(state.ranks)):
            gc.freeze()
            self._frozen = (id(state), len(state.ranks))

    def rest(self) -> None:
        """Sleep out the period the last pump began, where that is worth it."""
        if self.feed.paced and not self.busy and 0 < self._folded < BATCH:
            time.sleep(max(0.0, self._start + self.period_s - time.monotonic()))
