"""A run's journal played back as a dashboard's feed (feed.py says what every feed offers).

    ReplayFeed   the journal at a chosen speed (0: at once), pausable; a run folder
                 renamed since is played all the same (its records carry the old
                 run id: `note` says so). Once played, run.json completes the story.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

from ddtop.core import journal, wire
from ddtop.core.contract import UsageError
from ddtop.core.rundir import RunPaths
from ddtop.core.summary import LOST
from ddtop.dashboard.feed import BATCH, REPLAY, Feed, conclude

INSTANT_STEP_S = 0.1  # journal time folded per pump() of a replay at speed 0


class ReplayFeed(Feed):
    """A journal played back: `speed` times real time; 0 folds it all at once."""

    def __init__(self, paths: RunPaths, speed: float = 1.0,
                 instant_step_s: float = INSTANT_STEP_S, replaying: bool = True) -> None:
        super().__init__(paths.run_id)
        self.instant_step_s = instant_step_s
        self.replaying = replaying  # False: a finished run read at once, not played back
        self.paths = paths
        _readable(paths.journal)
        recorded = journal.recorded_run(paths.journal) if paths.journal.exists() else None
        if recorded not in (None, paths.run_id):
            self.note = (f"{paths.root}'s telemetry journal is of run {recorded!r}: the folder "
                         "was renamed since; replaying it all the same")
        self.records: Iterator[journal.Record] = (
            journal.read(paths.journal) if paths.journal.exists() else iter(()))
        self.pending: journal.Record | None = next(self.records, None)
        self.speed = speed
        self.paused = False
        self.connection = REPLAY
        first = self.pending.received if self.pending is not None else time.time()
        self._anchor(first)
        if self.pending is None:
            self._finish()

    def _anchor(self, replay_t: float) -> None:
        self.anchor_replay, self.anchor_wall = replay_t, time.monotonic()

    def now(self) -> float:
        if self.finished:
            return self.state.updated or self.anchor_replay
        if self.paused or self.speed == 0:
            return self.anchor_replay
        return self.anchor_replay + (time.monotonic() - self.anchor_wall) * self.speed

    @property
    def replay_controls(self) -> bool:
        return self.replaying

    def set_speed(self, speed: float) -> None:
        self._anchor(self.now())
        self.speed = max(0.0, speed)

    def set_paused(self, paused: bool) -> None:
        self._anchor(self.now())
        self.paused = paused

    def pump(self, timeout_s: float) -> int:
        if self.finished or self.paused:
            time.sleep(timeout_s)
            return 0
        # At speed 0 each pump folds the next INSTANT_STEP_S of the journal's time, so
        # that readers that print per interval of run time still see every interval.
        horizon = (self.anchor_replay + self.instant_step_s if self.speed == 0
                   else self.now())
        reached = self.anchor_replay
        folded = 0
        with self.lock:
            while self.pending is not None and folded < BATCH:
                record = self.pending
                if record.received > horizon:
                    break
                reached = record.received
                try:
                    # Any run id: the journal holds only what its daemon accepted.
                    self.state.apply(wire.decode([record.frame]), record.received)
                    folded += 1
                except wire.WireError:
                    pass  # the journal holds only accepted frames; a damaged one is skipped
                self.pending = next(self.records, None)
            if self.speed == 0:
                # All at once (instant_step_s infinite): the clock stands at the last
                # record folded until the rest is, never at infinity.
                self.anchor_replay = horizon if math.isfinite(horizon) else max(
                    self.anchor_replay, reached)
        if self.pending is None:
            self._finish()
        elif not folded and self.speed:
            wait = (self.pending.received - self.now()) / self.speed
            time.sleep(max(0.0, min(timeout_s, wait)))
        return folded

    def _finish(self) -> None:
        assert self.paths is not None
        with self.lock:
            state = conclude(self.state, self.paths)
        self.finished = True
        self.detail = state.status_message if state.status == LOST else ""


def _readable(path: Path) -> None:
    """A journal that is there must be a file this process can read: else one line
    (UsageError), not a traceback. None there is a run with nothing recorded."""
    if not path.exists() and not path.is_symlink():
        return
    try:
        if not path.is_file():
            raise IsADirectoryError(0, "not a file")
        with path.open("rb"):
            pass
    except OSError as e:
        raise UsageError(f"cannot read the run's telemetry journal {path}: "
                         f"{e.strerror or e}; it should be the file the daemon wrote "
                         "(move what is there aside)") from None
