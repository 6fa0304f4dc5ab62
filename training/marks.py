"""The marks the training thread leaves for telemetry's sender thread, and how
much of them the sender folds per round (stepfold.py does the fold, sender.py
runs it).

- A mark is a small frozen struct (`PhaseMark`, `StepMark`, ...: what happened,
  in the training thread's words, with its time where time matters) appended
  to a deque bounded at MAX_MARKS: an append never
  waits, and costs the training thread the same whatever the sender does.
  (msgspec structs: as cheap to make as a tuple, and typed.)
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
from typing import Any, Protocol

import msgspec
import torch

from ddtop.core import wire

MAX_MARKS = 1 << 16  # marks not yet folded; beyond, the oldest are dropped
FOLD_CHUNK = 64  # marks folded between two looks at the clocks (about ten steps)
FOLD_BUDGET_S = 0.02  # CPU time a round may fold for (a fifth of the send interval)
FOLD_WALL_S = 0.05  # and wall time, the GIL's waits included (half the send interval)
FINAL_BUDGET_S = 0.5  # the last round, at close (which waits 3 s for the sender)
MEASURE_S = 1.0  # marks that keep the deque full are measured this long, then said



# What the training thread marks. Times are its perf_counter; `gc=False`: a mark
# refers to nothing that refers back to it, so the collector need not track it.
class PhaseMark(msgspec.Struct, frozen=True, gc=False):
    """The rank entered phase `name` at `at`."""

    name: wire.Phase
    at: float


class StepMark(msgspec.Struct, frozen=True, gc=False):
    """An optimizer step counted at `at` (`count_step`'s arguments): its
    position, and its loss (as `loss_mark` made it) and samples if given.
    `hold`: its loss comes later (a LossMark with `release`); `then`: the phase
    the rank is in from now."""

    at: float
    epoch: int | None  # None: not known (wire.Epoch)
    step: int
    steps_per_epoch: int
    global_step: int
    lr: float
    loss: Any
    samples: int | None
    hold: bool
    then: wire.Phase | None
    # At a multiple of wire.COUNTS_EVERY: each group's collectives entered so far.
    counts: wire.GroupCounts | None = None


class LossMark(msgspec.Struct, frozen=True, gc=False):
    """The last step's loss and samples, given after it was counted;
    `release`: the step held for it may go out now."""

    loss: Any
    samples: int | None
    release: bool


class CommMark(msgspec.Struct, frozen=True, gc=False):
    """A collective of the step in progress took `seconds` for `nbytes`;
    `bus_factor`: its busbw / algbw."""

    seconds: float
    nbytes: int
    bus_factor: float


class ExposedMark(msgspec.Struct, frozen=True, gc=False):
    """Of the step's communication, `seconds` the rank sat waiting for it."""

    seconds: float


class SyncWaitMark(msgspec.Struct, frozen=True, gc=False):
    """`seconds` blocked in a metric sync or checkpoint collective."""

    seconds: float


class AllReduceSource(Protocol):
    """A DDP model timed from DDP's own statistics (commtimer.DDPStats): what
    one of its steps all-reduces."""

    grad_bytes: int  # bytes all-reduced per step
    buckets: int  # all-reduces per step

    def signature(self) -> tuple[str, int, str, int, str, int, int, str] | None:
        """The signature of the step's all-reduce, counted in its group (telemetry.Signature)."""


class DdpSyncMark(msgspec.Struct, frozen=True, gc=False):
    """`source`'s model all-reduces its gradients in the step in progress;
    `timed`: DDP times this one (a reading follows, at its next forward)."""

    source: AllReduceSource
    timed: bool


class DdpReadingMark(msgspec.Struct, frozen=True, gc=False):
    """What `source`'s last timed all-reduce took, read from DDP's statistics."""

    source: AllReduceSource
    seconds: float


class ResumeMark(msgspec.Struct, frozen=True, gc=False):
    """Steps go on from `global_step` (a resumed run): none was dropped."""

    global_step: int


Mark = (PhaseMark | StepMark | LossMark | CommMark | ExposedMark | SyncWaitMark | DdpSyncMark
        | DdpReadingMark | ResumeMark)
Marks = collections.deque[Mark]


# A loss as a mark carries it: a number as given; a tensor not on a GPU with its
# version counter (TensorLoss, read by the sender); a GPU loss as its device's
# running sum (CudaLoss). See LiveTelemetry.loss_mark.
class TensorLoss(msgspec.Struct, frozen=True, gc=False):
    """A loss tensor and its version counter when `ddtop.step` had it: if the
    counter moved by the time it is read, it was changed in place and its value
    is gone."""

    tensor: torch.Tensor
    version: int


class CudaLoss(msgspec.Struct, frozen=True, gc=False):
    """The running sum of a rank's losses on a GPU (each times its weight, float64)
    up to a step, and an event that has passed once the sum is computed."""

    total: torch.Tensor
    ready: Any  # torch.cuda.Event


def loss_value(loss: Any) -> float | torch.Tensor | None:
    """A loss to sum: a float, or a detached one-element tensor left on its device."""
    if isinstance(loss, torch.Tensor):
        n = loss.numel()
        if n == 0:
            return None
        if n == 1 and loss.is_cpu:
            return float(loss.item())  # (the common case, in one call)
        value = loss.detach()
        value = value.float().mean() if value.numel() > 1 else value.reshape(())
        return float(value) if value.device.type == "cpu" else value
    if isinstance(loss, int | float) and not isinstance(loss, bool):
        return float(loss)
    return None


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

    def take(self, marks: Marks, final: bool = False) -> Iterator[Mark]:
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
                    last = next((m for m in reversed(rest) if type(m) is StepMark), None)
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
