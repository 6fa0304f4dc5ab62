"""The marks the training thread leaves for telemetry's sender thread, and how
much of them the sender folds per round (training/telemetry.py does the fold).

- A mark is a tuple appended to a deque bounded at MAX_MARKS: an append never
  waits, and costs the training thread the same whatever the sender does.
  Beyond the bound the deque itself drops the oldest marks: nothing is counted
  on the training thread.
- The sender folds for at most FOLD_BUDGET_S of its own CPU time per round (a
  round every SEND_INTERVAL_S), and at most FOLD_WALL_S of wall time, looking
  at the clocks every FOLD_CHUNK marks. So however fast marks come (a thread
  calling `ddtop.step` in a loop) its heartbeats and Step messages still go out
  every round, and its share of the GIL stays bounded (a fifth at most). The
  budget is CPU time, not wall time, so that the time spent waiting for the
  GIL (the interpreter hands it over every 5 ms) does not count as folding: a
  training thread that holds the GIL at 300 steps/s (3,000 marks/s) is folded
  whole every round, as a few hundred thousand marks/s would be. What is left
  waits for the next round, or is dropped when more keep coming.
- Dropped steps are still counted, from the step numbers the marks carry: a
  step mark numbered k past the last one folded stands for k steps.
- Marks that keep the deque full are said once, as a warning event, a second
  after they began: how fast steps came, how fast the sender folds, how many
  marks were dropped.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from typing import Any

MAX_MARKS = 1 << 16  # marks not yet folded; beyond, the oldest are dropped
FOLD_CHUNK = 64  # marks folded between two looks at the clocks (about ten steps)
FOLD_BUDGET_S = 0.02  # CPU time a round may fold for (a fifth of the send interval)
FOLD_WALL_S = 0.05  # and wall time, the GIL's waits included (half the send interval)
FINAL_BUDGET_S = 0.5  # the last round, at close (which waits 2 s for the sender)
MEASURE_S = 1.0  # marks that keep the deque full are measured this long, then said

# What the training thread marks (the first item of a mark).
PHASE, STEP, LOSS, COMM, EXPOSED, SYNC = "phase", "step", "loss", "comm", "exposed", "sync"
DDP_SYNC, DDP_READING, RESUME = "ddp sync", "ddp reading", "resume"

Marks = collections.deque[tuple[Any, ...]]


class FoldRounds:
    """The sender's budget for folding marks, and what it learns of marks that
    come faster than it folds."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        # The step number of the last step mark folded: steps count from 1, so marks
        # dropped before the first fold (a flood fills the queue in milliseconds on a
        # fast core) are counted too; a resumed run says where it goes on (RESUME).
        self.last_step = 0
        self.dropped_steps = 0  # step marks dropped (counted from the step numbers)
        self.flood_since: float | None = None  # when the deque was first found full
        self.said = False
        self._folded = 0  # marks folded since flood_since
        self._first: tuple[float, int] | None = None  # (time, step) of a step mark since
        self._last: tuple[float, int] | None = None

    def take(self, marks: Marks, final: bool = False) -> Iterator[tuple[Any, ...]]:
        """The oldest marks, for at most this round's budget."""
        now = time.monotonic()
        budget = FINAL_BUDGET_S if final else FOLD_BUDGET_S
        deadline = now + (FINAL_BUDGET_S if final else FOLD_WALL_S)
        cpu_deadline = time.thread_time() + budget
        if self.flood_since is None and len(marks) >= (marks.maxlen or 1):
            self.flood_since = now  # full: marks are being dropped
        while marks:
            n = min(len(marks), FOLD_CHUNK)
            for _ in range(n):
                yield marks.popleft()
            if self.flood_since is not None:
                self._folded += n
            if time.monotonic() >= deadline or time.thread_time() >= cpu_deadline:
                if final:  # the rest is dropped, but its last step still counts them
                    rest = marks.copy()
                    marks.clear()
                    last = next((m for m in reversed(rest) if m[0] is STEP), None)
                    if last is not None:
                        yield last
                return

    def step(self, number: int, at: float) -> int:
        """How many steps the step mark numbered `number` (marked at `at`,
        perf_counter) stands for: itself and those whose marks were dropped."""
        last = self.last_step
        self.last_step = max(last, number)
        if self.flood_since is not None:
            if self._first is None:
                self._first = (at, number)
            self._last = (at, number)
        dropped = number - last - 1
        if dropped <= 0:
            return 1
        self.dropped_steps += dropped
        return 1 + dropped

    def resumed(self, number: int) -> None:
        """The steps go on from `number` (a resumed run): no step was dropped."""
        self.last_step = number

    def warning(self) -> str | None:
        """Once, MEASURE_S after the deque was first found full: that, in words."""
        since = self.flood_since
        if self.said or since is None or time.monotonic() - since < MEASURE_S:
            return None
        self.said = True
        fold_rate = self._folded / max(time.monotonic() - since, 1e-9)
        step_rate = 0.0
        if self._first is not None and self._last is not None and self._last[0] > self._first[0]:
            step_rate = (self._last[1] - self._first[1]) / (self._last[0] - self._first[0])
        if self.dropped_steps:
            return (f"rank {self.rank}: ddtop.step called {step_rate:,.0f} times/s, faster "
                    f"than telemetry can fold ({fold_rate:,.0f} marks/s): marks beyond "
                    f"{MAX_MARKS:,} waiting are dropped (at least {self.dropped_steps:,} so "
                    "far), so its steps are counted from their numbers and its step times "
                    "and phases are approximate; call ddtop.step once per optimizer step")
        return (f"rank {self.rank}: ddtop calls came faster than telemetry can fold "
                f"({fold_rate:,.0f} marks/s): marks beyond {MAX_MARKS:,} waiting are "
                "dropped, so its step times and phases are approximate")
