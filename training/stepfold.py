"""The step folder: a rank's marks (marks.py), folded into step windows, the
sums one Step message carries.

Pure: no thread, socket or clock. The sender thread (sender.py) hands it the
marks of a round with the time of the round (`time.monotonic`), and takes the
windows ready to go out; its unit tests (tests/test_stepfold.py) hand it marks
made by hand. What it decides:

- A step's time runs from the step marked before it to its own mark, less the
  time in phases that are not step phases (evaluation, checkpoint, setup: work
  that only some ranks may do); its time per step phase goes with it. No phase
  spans two steps.
- Communication marked before a step is counted goes with that step, so a
  window taken in between never gets the communication without its step.
- The open step: a counted step stays open (not yet in the window) until the
  next step is counted or the windows are taken, so that a reading of its DDP
  all-reduce, which DDP has only at the next forward, still goes with it. A
  step whose reading will come (DDP timed it) waits for it, at most OPEN_WAIT_S.
- The estimate for a DDP all-reduce not read (`_close_open`): a step with one
  all-reduce, read: its time outside it (its compute) joins the recent ones.
  Not read: the step is given the median of its model's recent computes, and
  the rest of its time is the all-reduce's, but never less than the
  all-reduce's usual share of a step (median reading over median reading plus
  median compute: a step quicker than the usual compute was quicker in both;
  the run's last step, whose reading never comes, is one). A rank's compute
  per step is what stays steady; its wait in the all-reduce moves with the
  other ranks', which the step's own time already shows, and a step long
  enough to matter is read (commtimer.DDPStats). With no compute known yet, or
  several all-reduces in the step, each takes the median of its model's recent
  readings. Never more communication than the step's time.
- The epoch split: a window never spans two epochs, so per-epoch sums stay exact.
- The loss: weighted by the step's samples if given, else 1 (`loss_weight`).
  A number as given; a tensor read here, unless it was changed in place since
  `ddtop.step` had it: then it is left out, and that is said once
  (LOSS_OVERWRITTEN, in `said`); a GPU loss as its device's running sum, read
  by the sender. A step counted by the optimizer hook of a script that calls
  `ddtop.step` is held for that call's loss, at most `hold_s` from the first
  step that waits (a script that calls `ddtop.step` only now and then must not
  hold its steps back).
- Dropped steps: a step mark numbered past the last one folded stands for
  itself and the steps whose marks were dropped (marks.FoldRounds.step).
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ddtop.core import wire
from ddtop.training.marks import (
    AllReduceSource,
    CommMark,
    CudaLoss,
    DdpReadingMark,
    DdpSyncMark,
    ExposedMark,
    FoldRounds,
    LossMark,
    Mark,
    PhaseMark,
    ResumeMark,
    StepMark,
    SyncWaitMark,
    TensorLoss,
    loss_value,
)

STEP_PHASES = frozenset(wire.STEP_PHASES)
TRIM_MIN_STEPS = 3  # Step.compute_trim_s from this many steps (as core/stragglers.py reads it)
OPEN_WAIT_S = 1.0  # how long a counted step waits for the reading of its all-reduce
MAX_PENDING_SYNCS = 64  # all-reduces kept for a step not counted yet (no step ever: dropped)
TYPICAL_OF = 9  # an all-reduce not read takes the median of this many recent readings
COMPUTE_OF = 5  # ... or its step, the median of this many recent computes (see _close_open)

LOSS_OVERWRITTEN = (
    "ddtop.step(loss=...): the loss tensor was changed in place before ddtop read it, so "
    "such steps are shown without their loss; pass a tensor not reused after the call "
    "(or loss.item())")


@dataclass
class StepWindow:
    """Sums over the steps since the last Step message was taken."""

    steps: int = 0
    samples: int = 0
    loss_sum: Any = 0.0  # float; a device tensor for a loss on another device (not CUDA)
    step_s: float = 0.0
    phase_s: dict[str, float] = field(default_factory=lambda: collections.defaultdict(float))
    sync_wait_s: float = 0.0
    comm_s: float = 0.0
    comm_bytes: int = 0
    comm_ops: int = 0
    # Each step's time outside its communication: summed, the longest, and how
    # many (Step.compute_trim_s leaves the longest out: a descheduled step).
    compute_sum_s: float = 0.0
    compute_max_s: float = 0.0
    compute_steps: int = 0
    # Bytes weighted by each op's bus factor, 2(n-1)/n for an all-reduce
    # (busbw = comm_bus_bytes / comm_s).
    comm_bus_bytes: float = 0.0
    # Of comm_s, the time the rank sat blocked waiting for it (training/strategies.py);
    # None: not measured (a user's script).
    comm_exposed_s: float | None = None
    epoch: int | None = None  # None: not known (wire.Epoch)
    step: int = 0
    steps_per_epoch: int = 0
    global_step: int = 0
    lr: float = 0.0
    loss_weight: float = 0.0  # what loss_sum is the sum over (samples, or 1 per loss)
    loss_cuda: CudaLoss | None = None  # its latest loss on a GPU, as the device's running sum
    # Each group's collectives at the steps that took them (wire.COUNTS_EVERY), newest last.
    counts: list[wire.GroupCounts] = field(default_factory=list)


# CUDA allocated, CUDA reserved, RSS, RSS's peak, CUDA allocated's peak
Memory = tuple[int | None, int | None, int | None, int | None, int | None]


def step_message(w: StepWindow, run: str, rank: int, world_size: int,
                 memory: Memory, host: tuple[float, int] | None = None) -> wire.Step:
    """The Step message of window `w` (its loss read: `loss_sum` a number); `host`:
    the run-queue wait and major faults over it (training/hostreadings.py)."""
    algbw, _ = wire.algbw_busbw(w.comm_bytes, w.comm_s, world_size)
    busbw = w.comm_bus_bytes / w.comm_s / 1e9 if w.comm_s > 0 else 0.0
    overlap: float | msgspec.UnsetType = msgspec.UNSET  # not measured
    if w.comm_exposed_s is not None:
        overlap = max(0.0, w.comm_s - w.comm_exposed_s)
    cuda_allocated, cuda_reserved, rss, rss_peak, cuda_peak = memory
    n = w.compute_steps
    trimmed = (w.compute_sum_s - w.compute_max_s) / (n - 1) if n >= TRIM_MIN_STEPS else None
    return wire.Step(
        run=run, rank=rank, epoch=w.epoch, step=w.step,
        steps_per_epoch=w.steps_per_epoch, global_step=w.global_step, steps=w.steps,
        samples=w.samples, loss_sum=float(w.loss_sum), lr=w.lr, step_s=w.step_s,
        data_s=w.phase_s["data"], forward_s=w.phase_s["forward"],
        backward_s=w.phase_s["backward"], optimizer_s=w.phase_s["optimizer"],
        comm_s=w.comm_s, comm_bytes=w.comm_bytes, comm_ops=w.comm_ops,
        algbw_gbps=algbw, busbw_gbps=busbw, sync_wait_s=w.sync_wait_s,
        cuda_allocated=cuda_allocated, cuda_reserved=cuda_reserved, rss=rss,
        rss_peak=rss_peak, cuda_peak=cuda_peak,
        loss_weight=w.loss_weight, comm_overlap_s=overlap, compute_trim_s=trimmed,
        group_counts=w.counts[-wire.MAX_COUNTS:] if w.counts else msgspec.UNSET,
        runq_s=host[0] if host is not None else msgspec.UNSET,
        major_faults=host[1] if host is not None else msgspec.UNSET,
    )


class Recent:
    """One DDP model's recent all-reduces, as read: their times (and median),
    and their steps' time outside them (and median)."""

    def __init__(self) -> None:
        self.readings: collections.deque[float] = collections.deque(maxlen=TYPICAL_OF)
        self.typical = 0.0  # the readings' median
        self.computes: collections.deque[float] = collections.deque(maxlen=COMPUTE_OF)
        self.compute = 0.0  # the computes' median


class DdpSync:
    """One DDP all-reduce of a step: its model, its time once read (None: not
    read), and whether DDP timed it (a reading will come)."""

    __slots__ = ("reading", "source", "timed")

    def __init__(self, source: AllReduceSource, reading: float | None, timed: bool) -> None:
        self.source, self.reading, self.timed = source, reading, timed


class StepFolder:
    """Marks in, step windows out (the module's docstring says how)."""

    def __init__(self, world_size: int, rounds: FoldRounds, start: float, hold_s: float) -> None:
        """`rounds`: counts the steps each step mark stands for; `start`: when
        the rank began (perf_counter, the marks' clock), in setup; `hold_s`: how
        long a step may wait for its loss."""
        n = max(1, world_size)
        self.allreduce_bus_factor = 2 * (n - 1) / n  # nccl-tests' busbw / algbw
        self.rounds = rounds
        self.hold_s = hold_s
        self.said: list[str] = []  # warnings for the sender to send, in order
        self._said_overwritten = False
        # The phase the rank is in and since when, the current step's start, its
        # time outside step phases and per step phase.
        self._phase: str = "setup"
        self._since = start
        self._step_start = start
        self._excluded = 0.0
        self._acc: collections.defaultdict[str, float] = collections.defaultdict(float)
        # The step counted last, not yet in the window, since when (the round's
        # time), and its DDP all-reduces; those of the step in progress.
        self._open: StepWindow | None = None
        self._open_since = 0.0
        self._open_syncs: list[DdpSync] = []
        self._pending_syncs: list[DdpSync] = []
        self._recent: collections.defaultdict[Any, Recent] = collections.defaultdict(Recent)
        # Until then (the rounds' time) the window whose last step the optimizer
        # hook counted waits for that step's ddtop.step(loss=...).
        self._hold_until = 0.0
        self._window = StepWindow()
        self._comm_pending = StepWindow()  # communication of the step not yet counted
        self._finished: list[StepWindow] = []  # windows closed at an epoch boundary

    def fold(self, marks: Iterable[Mark], now: float) -> None:
        """`marks`, in order, folded in the round of time `now`."""
        for m in marks:  # (the commonest kinds first)
            if type(m) is PhaseMark:
                self._account_phase(m.at)
                self._phase, self._since = m.name, m.at
            elif type(m) is StepMark:
                self._close_open()
                self._open_step(m, now)
            elif type(m) is LossMark:
                self._add_loss(self._open or self._window, m.loss, m.samples)
                if m.release:
                    self._hold_until = 0.0
            elif type(m) is CommMark:
                pending = self._comm_pending
                pending.comm_s += m.seconds
                pending.comm_bytes += m.nbytes
                pending.comm_ops += 1
                pending.comm_bus_bytes += m.nbytes * m.bus_factor
            elif type(m) is ExposedMark:
                pending = self._comm_pending
                pending.comm_exposed_s = (pending.comm_exposed_s or 0.0) + m.seconds
            elif type(m) is SyncWaitMark:
                self._window.sync_wait_s += m.seconds
            elif type(m) is DdpSyncMark:
                if len(self._pending_syncs) < MAX_PENDING_SYNCS:
                    self._pending_syncs.append(DdpSync(m.source, None, m.timed))
            elif type(m) is DdpReadingMark:
                self._reading(m)
            elif type(m) is ResumeMark:
                self.rounds.resumed(m.global_step)

    def ready(self, now: float, final: bool = False) -> list[StepWindow]:
        """The windows to send at time `now`, oldest first: those closed at an
        epoch boundary, and the current one unless it is held for its loss; the
        open step closed first unless it waits for its reading. `final`: the
        last round, nothing waits."""
        if self._open is not None and (final or not self._open_waits(now)):
            self._close_open()
        windows, self._finished = self._finished, []
        held = not final and now < self._hold_until
        if self._window.steps and not held:
            windows.append(self._window)
            self._window = StepWindow()
        return windows

    def wait(self, windows: list[StepWindow]) -> None:
        """`windows` (from `ready`) wait for their loss: they go out first next time."""
        self._finished[:0] = windows

    def _reading(self, m: DdpReadingMark) -> None:
        recent = self._recent[m.source]
        recent.readings.append(m.seconds)
        recent.typical = statistics.median(recent.readings)
        for sync in self._open_syncs:
            if sync.source is m.source and sync.reading is None and sync.timed:
                sync.reading = m.seconds
                break

    def _account_phase(self, at: float) -> None:
        """The time in the current phase until `at`: step time or not."""
        spent = at - self._since
        if self._phase in STEP_PHASES:
            self._acc[self._phase] += spent
        else:
            self._excluded += spent

    def _open_step(self, m: StepMark, now: float) -> None:
        self._account_phase(m.at)  # no phase spans two steps
        if m.then:
            self._phase = m.then
        elif self._phase == "setup":
            self._phase = "data"  # set-up is over once a step is done
        self._since = m.at
        o = StepWindow(steps=self.rounds.step(m.global_step, m.at),
                       step_s=max(0.0, m.at - self._step_start - self._excluded),
                       epoch=m.epoch, step=m.step, steps_per_epoch=m.steps_per_epoch,
                       global_step=m.global_step, lr=m.lr, phase_s=self._acc)
        self._acc = collections.defaultdict(float)
        pending = self._comm_pending
        if pending.comm_ops or pending.comm_exposed_s is not None:
            _take_comm(o, pending)
        self._add_loss(o, m.loss, m.samples)
        if m.counts is not None:
            o.counts.append(m.counts)
        self._hold_until = (self._hold_until or now + self.hold_s) if m.hold else 0.0
        self._step_start, self._excluded = m.at, 0.0
        self._open, self._open_since = o, now
        self._open_syncs, self._pending_syncs = self._pending_syncs, []

    def _open_waits(self, now: float) -> bool:
        """The open step waits for a reading of its all-reduce that will come
        (DDP timed it; the model reads it at its next forward that all-reduces),
        not for too long."""
        return (any(s.reading is None and s.timed for s in self._open_syncs)
                and now - self._open_since < OPEN_WAIT_S)

    def _close_open(self) -> None:
        """The open step, with its all-reduces' time (read or estimated: the
        module's docstring), into the window."""
        o = self._open
        if o is None:
            return
        self._open = None
        syncs, self._open_syncs = self._open_syncs, []
        if len(syncs) == 1:
            source, reading = syncs[0].source, syncs[0].reading
            recent = self._recent[source]
            if reading is not None:
                recent.computes.append(max(0.0, o.step_s - o.comm_s - reading))
                recent.compute = statistics.median(recent.computes)
            elif recent.computes:
                step = max(0.0, o.step_s - o.comm_s)
                usual = recent.typical + recent.compute
                share = step * recent.typical / usual if usual > 0 else 0.0
                syncs = [DdpSync(source, max(step - recent.compute, share), False)]
        for sync in syncs:
            reading = sync.reading
            if reading is None:
                reading = self._recent[sync.source].typical
            o.comm_s += reading
            o.comm_bytes += sync.source.grad_bytes
            o.comm_ops += sync.source.buckets
            o.comm_bus_bytes += sync.source.grad_bytes * self.allreduce_bus_factor
        o.comm_s = min(o.comm_s, o.step_s)  # (a reading of warm-up, or a median: never more)
        w = self._window
        if w.steps and w.epoch != o.epoch:  # never one message across two epochs
            self._finished.append(w)
            w = self._window = StepWindow()
        compute = max(0.0, o.step_s - o.comm_s)
        w.compute_sum_s += compute
        w.compute_max_s = max(w.compute_max_s, compute)
        w.compute_steps += 1
        w.steps += o.steps  # (more than 1: steps whose marks were dropped, marks.py)
        w.step_s += o.step_s
        for phase, spent in o.phase_s.items():
            w.phase_s[phase] += spent
        _take_comm(w, o)
        w.samples += o.samples
        w.loss_sum = w.loss_sum + o.loss_sum
        w.loss_weight += o.loss_weight
        if o.loss_cuda is not None:
            w.loss_cuda = o.loss_cuda
        w.epoch, w.step, w.steps_per_epoch = o.epoch, o.step, o.steps_per_epoch
        w.global_step, w.lr = o.global_step, o.lr
        w.counts.extend(o.counts)

    def _add_loss(self, w: StepWindow, loss: Any, samples: int | None) -> None:
        count = samples if isinstance(samples, int) and samples > 0 else 0
        w.samples += count
        if type(loss) is CudaLoss:  # read from the running sum when the window is sent
            w.loss_cuda = loss
            w.loss_weight += count or 1
            return
        if type(loss) is TensorLoss:  # a tensor and its version when ddtop.step had it
            if loss.tensor._version != loss.version:  # changed in place since: its value is gone
                if not self._said_overwritten:
                    self._said_overwritten = True
                    self.said.append(LOSS_OVERWRITTEN)
                return
            loss = loss.tensor
        value = loss_value(loss) if loss is not None else None
        if value is not None:
            weight = count or 1
            w.loss_sum = w.loss_sum + value * weight
            w.loss_weight += weight


def _take_comm(w: StepWindow, pending: StepWindow) -> None:
    """The communication in `pending` into `w`, and `pending`'s cleared."""
    w.comm_s += pending.comm_s
    w.comm_bytes += pending.comm_bytes
    w.comm_ops += pending.comm_ops
    w.comm_bus_bytes += pending.comm_bus_bytes
    if pending.comm_exposed_s is not None:
        w.comm_exposed_s = (w.comm_exposed_s or 0.0) + pending.comm_exposed_s
    pending.comm_s, pending.comm_bytes, pending.comm_ops = 0.0, 0, 0
    pending.comm_bus_bytes, pending.comm_exposed_s = 0.0, None
