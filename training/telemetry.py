"""What a rank tells the outside world while it trains, over ZeroMQ.

A rank reports through `ddtop`'s API (api/__init__.py, training/api.py: the
built-in trainer and a user's script alike), which keeps one `LiveTelemetry`
per process when DDTOP_TELEMETRY names an endpoint. Code that reports more
than the API carries (the trainer's events, aggregates and collectives) holds
a `Telemetry`: the base class, whose methods do nothing, when telemetry is off.

- The training thread only marks: which phase it enters (`phase`), that a
  step was counted (`count_step`) and what it added (`add_loss`), what a
  collective took (`comm_done`), which collective it waits in (`collective`).
  Each mark is a tuple appended to a bounded deque; the sender thread folds the
  marks into the step window, in order, a bounded share per round
  (training/marks.py). Nothing is summed, encoded or sent on the training thread.
- A loss tensor on a device is summed on that device (no synchronisation on
  the training thread); the sender thread reads the sum when it sends. Each
  loss weighs its samples if given, else 1 (the Step message's `loss_weight`).
- Time in phases that are not step phases (evaluation, checkpoint, setup:
  work that only some ranks may do) is not step time.
- A Step message never spans two epochs, so per-epoch sums stay exact.
- Custom scalars (`add_scalars`) are kept newest per key and sent as one
  Scalars message per send interval, bounded as the wire bounds them.
- One sender thread owns the PUSH socket (ZeroMQ sockets are not thread-safe).
  Every SEND_INTERVAL_S it sends the steps accumulated since its last Step
  message as one message (sums and counts, so nothing is lost by coalescing);
  every HEARTBEAT_INTERVAL_S a heartbeat with the current phase and the last
  collective started and completed, so a rank stuck in a collective still says
  where; events as soon as they are queued, never coalesced.
- Sends never block (NOBLOCK, small high-water mark): when nobody listens or
  the queue is full, the message is dropped, counted, and the count rides on
  the next message that gets through. Every attempt takes a sequence number, so
  a receiver sees each loss as a gap.
"""

from __future__ import annotations

import collections
import math
import os
import re
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import torch
import zmq

from ddtop.daemon import wire
from ddtop.daemon.keys import secure
from ddtop.training.marks import (
    COMM,
    DDP_READING,
    DDP_SYNC,
    EXPOSED,
    LOSS,
    MAX_MARKS,
    PHASE,
    RESUME,
    STEP,
    SYNC,
    FoldRounds,
)

SEND_INTERVAL_S = 0.1  # at most ~10 Step messages per second per rank
HEARTBEAT_INTERVAL_S = 1.0
SEND_HWM = 64  # messages ZeroMQ may queue before sends fail (and are counted)
MAX_QUEUED_EVENTS = 1000
CLOSE_LINGER_MS = 250  # how long the last messages (bye) may take to leave on exit
CLOSE_TIMEOUT_S = 2.0
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
STATM = Path("/proc/self/statm")
RSS_EVERY_S = 1.0  # how often the process's resident memory is read again
STEP_PHASES = frozenset(wire.STEP_PHASES)
TRIM_MIN_STEPS = 3  # Step.compute_trim_s from this many steps (as daemon/stragglers.py reads it)


class CudaLoss(NamedTuple):
    """The running sum of a rank's losses on a GPU (each times its weight, float64)
    up to a step, and an event that has passed once the sum is computed."""

    total: torch.Tensor
    ready: Any  # torch.cuda.Event


LOSS_OVERWRITTEN = (
    "ddtop.step(loss=...): the loss tensor was changed in place before ddtop read it, so "
    "such steps are shown without their loss; pass a tensor not reused after the call "
    "(or loss.item())")

OPEN_WAIT_S = 1.0  # how long a counted step waits for the reading of its all-reduce
MAX_PENDING_SYNCS = 64  # all-reduces kept for a step not counted yet (no step ever: dropped)
TYPICAL_OF = 9  # an all-reduce not read takes the median of this many recent readings
COMPUTE_OF = 5  # ... or its step, the median of this many recent computes (see _close_open)


class _Recent:
    """The sender's record of one DDP model's recent all-reduces, as read: their
    times (and median), and their steps' time outside them."""

    def __init__(self) -> None:
        self.readings: collections.deque[float] = collections.deque(maxlen=TYPICAL_OF)
        self.typical = 0.0  # the readings' median
        self.computes: collections.deque[float] = collections.deque(maxlen=COMPUTE_OF)
        self.compute = 0.0  # the computes' median


@dataclass
class StepWindow:
    """Sums over the steps since the last Step message was taken."""

    steps: int = 0
    samples: int = 0
    loss_sum: Any = 0.0  # float on CPU; a device tensor on CUDA (no sync per step)
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
    epoch: int = 0
    step: int = 0
    steps_per_epoch: int = 0
    global_step: int = 0
    lr: float = 0.0
    loss_weight: float = 0.0  # what loss_sum is the sum over (samples, or 1 per loss)
    loss_cuda: CudaLoss | None = None  # its latest loss on a GPU, as the device's running sum


class Telemetry:
    """Telemetry switched off: every method does nothing."""

    live = False

    def phase(self, name: wire.Phase) -> None:
        pass

    @contextmanager
    def collective(self, op: str, nbytes: int = 0) -> Iterator[None]:
        yield

    def collective_started(self, op: str, nbytes: int) -> wire.Collective | None:
        return None

    def collective_completed(self, coll: wire.Collective | None) -> None:
        pass

    def comm_done(self, seconds: float, nbytes: int, bus_factor: float | None = None) -> None:
        pass

    def comm_exposed(self, seconds: float) -> None:
        pass

    def collective_over(self, coll: wire.Collective) -> None:
        pass

    def aggregate(self, scope: wire.Scope, epoch: int, global_step: int, **metrics: Any) -> None:
        pass

    def event(self, type: wire.EventType, message: str, traceback: str | None = None,
              **data: str | int | float | bool | None) -> None:
        pass

    def error(self, exc: BaseException) -> None:
        pass

    def close(self, exit_code: int) -> None:
        pass


class LiveTelemetry(Telemetry):
    live = True

    def __init__(self, endpoint: str, hello: wire.Hello) -> None:
        self.endpoint, self.run, self.rank = endpoint, hello.run, hello.rank
        self.world_size = hello.world_size
        n = max(1, self.world_size)
        self._allreduce_bus_factor = 2 * (n - 1) / n  # nccl-tests' busbw / algbw
        self.memory_device: torch.device | None = None  # the CUDA device the model is on
        # State the training thread writes and the sender thread reads (plain
        # attribute stores, atomic under the GIL): the phase and since when, as one
        # value (what a heartbeat reads: never a torn pair), the step for heartbeats,
        # the collectives started and completed.
        now = time.perf_counter()
        self._phase_now: tuple[wire.Phase, float] = ("setup", now)
        self._epoch = 0
        self._global_step = 0
        self._coll_seq = 0
        self._coll_started: wire.Collective | None = None
        self._coll_completed: wire.Collective | None = None
        # What happened, in order, for the sender to fold: phases entered, steps
        # counted, losses, communication (from any thread: deque appends are atomic).
        self._marks: collections.deque[tuple[Any, ...]] = collections.deque(maxlen=MAX_MARKS)
        self._cuda_loss: dict[torch.device, torch.Tensor] = {}  # running sums (float64)
        self._said_overwritten = False  # a loss changed in place before it was read: warned
        # The sender's fold of the marks: the phase it is in and since when, the
        # current step's start, its time outside step phases and per step phase.
        self._f_phase: str = "setup"
        self._f_since = now
        self._f_step_start = now
        self._f_excluded = 0.0
        self._f_acc: collections.defaultdict[str, float] = collections.defaultdict(float)
        # The running CUDA loss sums up to the last window sent, by device.
        self._cuda_loss_sent: dict[torch.device, float] = {}
        # The step counted last, not yet in the window (see _fold), since when
        # (monotonic), and its DDP all-reduces: [source, seconds read or None,
        # whether DDP timed it].
        self._open: StepWindow | None = None
        self._open_since = 0.0
        self._open_syncs: list[list[Any]] = []
        self._pending_syncs: list[list[Any]] = []  # the step in progress's
        self._recent: collections.defaultdict[Any, _Recent] = collections.defaultdict(_Recent)
        # Until then (monotonic) the window whose last step the optimizer hook
        # counted waits for that step's ddtop.step(loss=...) before it is sent.
        self._hold_until = 0.0
        self._scalars: dict[str, float | torch.Tensor] = {}
        self._lock = threading.Lock()  # the scalars, swapped out by the sender
        # The sender's alone:
        self._window = StepWindow()
        self._comm_pending = StepWindow()  # all-reduces of the step not yet counted
        self._finished: list[StepWindow] = []  # windows closed at an epoch boundary
        self._events: collections.deque[wire.Message] = collections.deque([hello])
        self._queue_dropped = 0
        self._rounds = FoldRounds(self.rank)  # how much of the marks a round folds
        self._rss: int | None = None  # resident memory as last read, and when (monotonic)
        self._rss_at = -math.inf
        self._bye: wire.Bye | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._context = zmq.Context()
        self._thread = threading.Thread(target=self._run, name="ddtop-telemetry", daemon=True)
        self._thread.start()

    @property
    def current_phase(self) -> wire.Phase:
        return self._phase_now[0]

    def send_hello(self, hello: wire.Hello) -> None:
        """Hello again: what the rank learned since (its model, totals)."""
        self._queue(hello)

    # -- called from the training thread ----------------------------------------
    # Every step runs through these, on the step's critical path: each records what
    # happened as one mark (a tuple appended to a deque, no lock, no arithmetic) and
    # the sender folds the marks into windows. Right after a step, with the caches
    # cold, every line here costs microseconds.
    def phase(self, name: wire.Phase) -> None:
        """Several times per step."""
        now = time.perf_counter()
        self._phase_now = (name, now)
        self._marks.append((PHASE, name, now))

    def count_step(self, epoch: int, step: int, steps_per_epoch: int, global_step: int,
                   lr: float, loss: Any = None, samples: int | None = None,
                   hold: bool = False, then: wire.Phase | None = None) -> None:
        """One optimizer step done: its time is everything since the last one but
        time in phases that are not step phases; its loss and samples, if given,
        go with it. `hold`: its loss comes later (add_loss with release). `then`:
        the phase the rank is in from now (as `phase(then)` would say)."""
        now = time.perf_counter()
        phase = then or self._phase_now[0]
        self._phase_now = ("data" if phase == "setup" else phase, now)  # no phase spans two steps
        if isinstance(loss, torch.Tensor):
            loss = self._loss_mark(loss, samples)
        self._marks.append((STEP, now, epoch, step, steps_per_epoch, global_step, lr, loss,
                            samples, hold, then))
        self._epoch, self._global_step = epoch, global_step

    def resume_at(self, epoch: int, global_step: int) -> None:
        """Steps done before this process started (a resumed run), for heartbeats."""
        self._epoch, self._global_step = epoch, global_step
        self._marks.append((RESUME, global_step))  # (no step was dropped in between)

    def add_loss(self, loss: Any, samples: int | None, release: bool = False) -> None:
        """The last step's loss (a number or a tensor, any device) and samples;
        `release`: the step held for it may go out now."""
        self._marks.append((LOSS, self._loss_mark(loss, samples), samples, release))

    def _loss_mark(self, loss: Any, samples: int | None) -> Any:
        """A loss as its mark carries it, for the sender to read. A number: as
        given. A tensor on the CPU: with its version counter as of the call, a
        `(tensor, version)` tuple. It is not read here: `item()` releases the GIL,
        and with the sender thread awake that doubled the training thread's cost
        per step (bench/telemetry.py). A loss on a GPU is added on the device,
        times its weight, to a running sum, with an event the sender waits for
        without blocking (a hung collective must not stop heartbeats): a CudaLoss."""
        if not isinstance(loss, torch.Tensor):
            return loss
        if not loss.is_cuda:
            return (loss, loss._version)
        value = _loss_value(loss)
        if not isinstance(value, torch.Tensor):
            return value
        weight = samples if isinstance(samples, int) and samples > 0 else 1
        value = value.double() * weight
        previous = self._cuda_loss.get(value.device)
        total = self._cuda_loss[value.device] = value if previous is None else previous + value
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record()
        return CudaLoss(total, ready)

    def add_scalars(self, scalars: dict[str, Any]) -> list[str]:
        """Keep each scalar's newest value; what was dropped, in words."""
        problems = []
        for key, raw in scalars.items():
            if not 0 < len(key) <= wire.MAX_SCALAR_KEY_CHARS:
                problems.append(f"key {key[:wire.MAX_SCALAR_KEY_CHARS]!r}... is longer than "
                                f"{wire.MAX_SCALAR_KEY_CHARS} characters: dropped")
                continue
            if not _KEY.match(key):
                problems.append(f"key {key!r} may hold only letters, digits and _.:/@+-: "
                                "dropped")
                continue
            value = _scalar_value(raw)
            if value is None:
                problems.append(f"{key}={type(raw).__name__} is not a number: dropped")
                continue
            with self._lock:
                if key not in self._scalars and len(self._scalars) >= wire.MAX_SCALAR_KEYS:
                    problems.append(f"more than {wire.MAX_SCALAR_KEYS} keys at once: "
                                    f"{key} dropped")
                    continue
                self._scalars[key] = value
        if self._scalars:
            self._wake.set()
        return problems

    @contextmanager
    def collective(self, op: str, nbytes: int = 0) -> Iterator[None]:
        """Around a blocking collective (metric sync, barrier): time waited in it."""
        coll = self.collective_started(op, nbytes)
        start = time.perf_counter()
        try:
            yield
        finally:
            self._marks.append((SYNC, time.perf_counter() - start))
            self.collective_completed(coll)

    def collective_started(self, op: str, nbytes: int) -> wire.Collective:
        self._coll_seq += 1
        coll = wire.Collective(seq=self._coll_seq, op=op, bytes=nbytes)
        self._coll_started = coll
        return coll

    def collective_completed(self, coll: wire.Collective | None) -> None:
        self._coll_completed = coll

    def comm_done(self, seconds: float, nbytes: int, bus_factor: float | None = None) -> None:
        """One gradient all-reduce finished (called by the DDP comm hook, on any
        thread). It belongs to the step in progress, which is counted later: held
        until then, so that a window sent in between cannot get the communication
        without its step. `bus_factor`: the op's busbw / algbw when it is not an
        all-reduce (training/strategies.py: all-gather, reduce-scatter)."""
        self._marks.append((COMM, seconds, nbytes,
                            self._allreduce_bus_factor if bus_factor is None else bus_factor))

    def comm_exposed(self, seconds: float) -> None:
        """Of the step's communication, `seconds` the rank sat waiting for it."""
        self._marks.append((EXPOSED, seconds))

    # A DDP model timed from DDP's own statistics (training/commtimer.py DDPStats):
    def ddp_all_reduce(self, source: Any, timed: bool) -> wire.Collective:
        """`source`'s model is all-reducing its gradients in this step: its bytes
        and buckets, and its time (read if `timed`, else estimated:
        `_close_open`); the collective heartbeats name meanwhile."""
        self._marks.append((DDP_SYNC, source, timed))
        return self.collective_started("allreduce", source.grad_bytes)

    def ddp_reading(self, source: Any, seconds: float) -> None:
        """What `source`'s last all-reduce took, read from DDP's statistics (the
        one of the step counted last)."""
        self._marks.append((DDP_READING, source, seconds))

    def collective_over(self, coll: wire.Collective) -> None:
        """`coll` is over, unless another collective started since (then that one
        is what a heartbeat names)."""
        if self._coll_started is coll:
            self._coll_completed = coll

    # -- the sender's fold of the marks ----------------------------------------------
    # A counted step stays open (not yet in the window) until the next step is
    # counted or the window is sent, so that a reading of its all-reduce, which
    # DDP only has at the next forward, still goes with it; a step whose reading
    # is due waits for it at most OPEN_WAIT_S.
    def _fold(self, final: bool = False) -> None:
        """The marks, into the windows, as many as a round's budget allows
        (training/marks.py: its CPU time and wall time bounded)."""
        for m in self._rounds.take(self._marks, final):
            kind = m[0]
            if kind is PHASE:
                self._account_phase(m[2])
                self._f_phase, self._f_since = m[1], m[2]
            elif kind is STEP:
                self._close_open()
                self._open_step(m)
            elif kind is LOSS:
                self._add_loss(self._open or self._window, m[1], m[2])
                if m[3]:
                    self._hold_until = 0.0
            elif kind is COMM:
                pending = self._comm_pending
                pending.comm_s += m[1]
                pending.comm_bytes += m[2]
                pending.comm_ops += 1
                pending.comm_bus_bytes += m[2] * m[3]
            elif kind is EXPOSED:
                pending = self._comm_pending
                pending.comm_exposed_s = (pending.comm_exposed_s or 0.0) + m[1]
            elif kind is SYNC:
                self._window.sync_wait_s += m[1]
            elif kind is DDP_SYNC:
                if len(self._pending_syncs) < MAX_PENDING_SYNCS:
                    self._pending_syncs.append([m[1], None, m[2]])
            elif kind is DDP_READING:
                recent = self._recent[m[1]]
                recent.readings.append(m[2])
                recent.typical = statistics.median(recent.readings)
                for sync in self._open_syncs:
                    if sync[0] is m[1] and sync[1] is None and sync[2]:  # (a timed one)
                        sync[1] = m[2]
                        break
            elif kind is RESUME:
                self._rounds.resumed(m[1])

    def _account_phase(self, now: float) -> None:
        """The time in the current phase until `now`: step time or not."""
        spent = now - self._f_since
        if self._f_phase in STEP_PHASES:
            self._f_acc[self._f_phase] += spent
        else:
            self._f_excluded += spent

    def _open_step(self, m: tuple[Any, ...]) -> None:
        _, now, epoch, step, steps_per_epoch, global_step, lr, loss, samples, hold, then = m
        self._account_phase(now)  # no phase spans two steps
        if then:
            self._f_phase = then
        elif self._f_phase == "setup":
            self._f_phase = "data"  # set-up is over once a step is done
        self._f_since = now
        o = StepWindow(steps=self._rounds.step(global_step, now),
                       step_s=max(0.0, now - self._f_step_start - self._f_excluded),
                       epoch=epoch, step=step, steps_per_epoch=steps_per_epoch,
                       global_step=global_step, lr=lr, phase_s=self._f_acc)
        self._f_acc = collections.defaultdict(float)
        pending = self._comm_pending
        if pending.comm_ops or pending.comm_exposed_s is not None:
            self._take_comm(o)
        self._add_loss(o, loss, samples)
        # Held at most one send interval from the first step that waits (a script
        # that calls ddtop.step only now and then must not hold its steps back).
        self._hold_until = ((self._hold_until or time.monotonic() + SEND_INTERVAL_S)
                            if hold else 0.0)
        self._f_step_start, self._f_excluded = now, 0.0
        self._open, self._open_since = o, time.monotonic()
        self._open_syncs, self._pending_syncs = self._pending_syncs, []

    def _open_waits(self) -> bool:
        """The open step waits for a reading of its all-reduce that will come
        (DDP timed it; the model reads it at its next forward that all-reduces),
        not for too long."""
        return (any(reading is None and timed for _, reading, timed in self._open_syncs)
                and time.monotonic() - self._open_since < OPEN_WAIT_S)

    def _close_open(self) -> None:
        """The open step, with its all-reduces' time, into the window. A step with
        one all-reduce, read: its time outside it (its compute) joins the recent
        ones. Not read: the step is given the median of its model's recent
        computes, and the rest of its time is the all-reduce's, but never less than
        the all-reduce's usual share of a step (median reading over median reading
        plus median compute: a step quicker than the usual compute was quicker in
        both; the run's last step, whose reading never comes, is one). (A rank's compute
        per step is what stays steady; its wait in the all-reduce moves with the
        other ranks', which the step's own time already shows. A step long
        enough to matter is read: `_open_waits`.) With no compute known yet, or
        several all-reduces in the step, each takes the median of its model's
        recent readings."""
        o = self._open
        if o is None:
            return
        self._open = None
        syncs, self._open_syncs = self._open_syncs, []
        if len(syncs) == 1:
            source, reading, _ = syncs[0]
            recent = self._recent[source]
            if reading is not None:
                recent.computes.append(max(0.0, o.step_s - o.comm_s - reading))
                recent.compute = statistics.median(recent.computes)
            elif recent.computes:
                step = max(0.0, o.step_s - o.comm_s)
                usual = recent.typical + recent.compute
                share = step * recent.typical / usual if usual > 0 else 0.0
                syncs = [[source, max(step - recent.compute, share), False]]
        for source, reading, _ in syncs:
            if reading is None:
                reading = self._recent[source].typical
            o.comm_s += reading
            o.comm_bytes += source.grad_bytes
            o.comm_ops += source.buckets
            o.comm_bus_bytes += source.grad_bytes * self._allreduce_bus_factor
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
        self._take_comm(w, o)
        w.samples += o.samples
        w.loss_sum = w.loss_sum + o.loss_sum
        w.loss_weight += o.loss_weight
        if o.loss_cuda is not None:
            w.loss_cuda = o.loss_cuda
        w.epoch, w.step, w.steps_per_epoch = o.epoch, o.step, o.steps_per_epoch
        w.global_step, w.lr = o.global_step, o.lr

    def _add_loss(self, w: StepWindow, loss: Any, samples: int | None) -> None:
        count = samples if isinstance(samples, int) and samples > 0 else 0
        w.samples += count
        if type(loss) is CudaLoss:  # read from the running sum when the window is sent
            w.loss_cuda = loss
            w.loss_weight += count or 1
            return
        if type(loss) is tuple:  # a tensor and its version when ddtop.step had it
            loss, version = loss
            if loss._version != version:  # changed in place since: its value is gone
                if not self._said_overwritten:
                    self._said_overwritten = True
                    self.event("warning", LOSS_OVERWRITTEN)
                return
        value = _loss_value(loss) if loss is not None else None
        if value is not None:
            weight = count or 1
            w.loss_sum = w.loss_sum + value * weight
            w.loss_weight += weight

    def _take_comm(self, w: StepWindow, pending: StepWindow | None = None) -> None:
        """The communication in `pending` (by default: of the step about to be
        counted), into `w`."""
        if pending is None:
            pending = self._comm_pending
        w.comm_s += pending.comm_s
        w.comm_bytes += pending.comm_bytes
        w.comm_ops += pending.comm_ops
        w.comm_bus_bytes += pending.comm_bus_bytes
        if pending.comm_exposed_s is not None:
            w.comm_exposed_s = (w.comm_exposed_s or 0.0) + pending.comm_exposed_s
        pending.comm_s, pending.comm_bytes, pending.comm_ops = 0.0, 0, 0
        pending.comm_bus_bytes, pending.comm_exposed_s = 0.0, None

    def aggregate(self, scope: wire.Scope, epoch: int, global_step: int, **metrics: Any) -> None:
        self._queue(wire.Aggregate(run=self.run, rank=self.rank, scope=scope, epoch=epoch,
                                   global_step=global_step, **metrics))

    def event(self, type: wire.EventType, message: str, traceback: str | None = None,
              **data: str | int | float | bool | None) -> None:
        self._queue(wire.Event(run=self.run, rank=self.rank, type=type, message=message,
                               traceback=traceback, data=data))

    def error(self, exc: BaseException) -> None:
        tb = "".join(traceback.format_exception(exc))[-wire.MAX_TRACEBACK_CHARS:]
        self.event("error", f"{type(exc).__name__}: {exc}"[:1000], traceback=tb,
                   phase=self.current_phase, global_step=self._global_step)

    def close(self, exit_code: int) -> None:
        """Send what is pending and a bye, then stop; never waits long."""
        self.phase("done")
        self._bye = wire.Bye(run=self.run, rank=self.rank, exit_code=exit_code)
        self._stop.set()
        self._wake.set()
        self._thread.join(CLOSE_TIMEOUT_S)

    def _queue(self, message: wire.Message) -> None:
        if len(self._events) >= MAX_QUEUED_EVENTS:
            self._queue_dropped += 1  # counted: the receiver sees the loss
            return
        self._events.append(message)
        self._wake.set()

    # -- the sender thread ----------------------------------------------------------
    def _run(self) -> None:
        sock = self._context.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.LINGER, 0)
        self._seq = 0
        self._dropped = 0
        try:
            secure(sock, self.endpoint, None)  # the run's keys, when the daemon is on TCP
            sock.connect(self.endpoint)
            next_step = next_beat = time.monotonic()
            while True:
                stopping = self._stop.is_set()
                self._send_events(sock)
                now = time.monotonic()
                if now >= next_step or stopping:
                    self._send_window(sock, final=stopping)
                    next_step = now + SEND_INTERVAL_S
                if now >= next_beat:
                    self._send(sock, self._heartbeat())
                    next_beat = now + HEARTBEAT_INTERVAL_S
                if stopping:
                    self._send_events(sock)  # what the last fold said (a warning), before bye
                    if self._bye is not None:
                        self._send(sock, self._bye)
                    break
                self._wake.wait(max(0.0, min(next_step, next_beat) - time.monotonic()))
                self._wake.clear()
        except Exception as e:  # noqa: BLE001 - telemetry must never take training down
            print(f"warning: telemetry to {self.endpoint} stopped: {e}", file=sys.stderr)
        finally:
            self._marks = collections.deque(maxlen=0)  # nobody folds them from now on
            sock.close(linger=CLOSE_LINGER_MS)
            self._context.term()

    def _send_events(self, sock: zmq.Socket[bytes]) -> None:
        while self._events:
            self._send(sock, self._events.popleft())

    def _send(self, sock: zmq.Socket[bytes], message: wire.Message) -> None:
        message.seq, message.t = self._seq, time.time()
        self._seq += 1
        message.dropped = self._dropped + self._queue_dropped
        try:
            sock.send_multipart(wire.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            self._dropped += 1
            return
        self._dropped = 0
        self._queue_dropped = 0

    def _heartbeat(self) -> wire.Heartbeat:
        phase, since = self._phase_now
        return wire.Heartbeat(
            run=self.run, rank=self.rank, phase=phase, epoch=self._epoch,
            global_step=self._global_step, phase_s=time.perf_counter() - since,
            coll_started=self._coll_started, coll_completed=self._coll_completed,
        )

    def _send_window(self, sock: zmq.Socket[bytes], final: bool = False) -> None:
        """The steps counted since the last send, but a window that waits for its
        loss (held, or a GPU loss not computed yet: never a blocking read here)
        and those after it, unless `final`."""
        self._fold(final)
        flood = self._rounds.warning()
        if flood is not None:
            self.event("warning", flood)
        if self._open is not None and (final or not self._open_waits()):
            self._close_open()
        windows, self._finished = self._finished, []
        held = not final and time.monotonic() < self._hold_until
        if self._window.steps and not held:
            windows.append(self._window)
            self._window = StepWindow()
        with self._lock:
            scalars, self._scalars = self._scalars, {}
        for i, w in enumerate(windows):
            cuda = w.loss_cuda
            if cuda is not None:
                if not cuda.ready.query():
                    if not final:
                        self._finished[:0] = windows[i:]  # in order, before newer ones
                        break
                    w.loss_sum, w.loss_weight = 0.0, 0.0  # never read: the device is stuck
                else:
                    device, total = cuda.total.device, float(cuda.total)
                    w.loss_sum = w.loss_sum + total - self._cuda_loss_sent.get(device, 0.0)
                    self._cuda_loss_sent[device] = total
            self._send_step(sock, w)
        if scalars:
            values = {key: float(value) for key, value in scalars.items()}
            self._send(sock, wire.Scalars(run=self.run, rank=self.rank, values=values,
                                          global_step=self._global_step))

    def _send_step(self, sock: zmq.Socket[bytes], w: StepWindow) -> None:
        algbw, _ = wire.algbw_busbw(w.comm_bytes, w.comm_s, self.world_size)
        busbw = w.comm_bus_bytes / w.comm_s / 1e9 if w.comm_s > 0 else 0.0
        overlap: float | msgspec.UnsetType = msgspec.UNSET  # not measured
        if w.comm_exposed_s is not None:
            overlap = max(0.0, w.comm_s - w.comm_exposed_s)
        cuda_allocated, cuda_reserved, rss = self._memory()
        n = w.compute_steps
        trimmed = (w.compute_sum_s - w.compute_max_s) / (n - 1) if n >= TRIM_MIN_STEPS else None
        self._send(sock, wire.Step(
            run=self.run, rank=self.rank, epoch=w.epoch, step=w.step,
            steps_per_epoch=w.steps_per_epoch, global_step=w.global_step, steps=w.steps,
            samples=w.samples, loss_sum=float(w.loss_sum), lr=w.lr, step_s=w.step_s,
            data_s=w.phase_s["data"], forward_s=w.phase_s["forward"],
            backward_s=w.phase_s["backward"], optimizer_s=w.phase_s["optimizer"],
            comm_s=w.comm_s, comm_bytes=w.comm_bytes, comm_ops=w.comm_ops,
            algbw_gbps=algbw, busbw_gbps=busbw, sync_wait_s=w.sync_wait_s,
            cuda_allocated=cuda_allocated, cuda_reserved=cuda_reserved, rss=rss,
            loss_weight=w.loss_weight, comm_overlap_s=overlap, compute_trim_s=trimmed,
        ))

    def _memory(self) -> tuple[int | None, int | None, int | None]:
        """(CUDA allocated, CUDA reserved, process RSS) in bytes; None where absent.
        CUDA only once it is initialised (never initialising it from this thread)."""
        device = self.memory_device
        # torch leaves is_initialized unannotated.
        if device is not None and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return (torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device),
                    None)
        now = time.monotonic()
        if now - self._rss_at >= RSS_EVERY_S:  # (reading it costs more than the rest of a send)
            self._rss_at = now
            try:
                self._rss = int(STATM.read_text().split()[1]) * PAGE_SIZE
            except (OSError, IndexError, ValueError):
                self._rss = None
        return None, None, self._rss


_KEY = re.compile(wire.SCALAR_KEY_PATTERN)


def _loss_value(loss: Any) -> float | torch.Tensor | None:
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


def _scalar_value(raw: Any) -> float | torch.Tensor | None:
    if isinstance(raw, torch.Tensor):
        if raw.numel() != 1 or raw.is_complex():
            return None
        value = raw.detach().reshape(())
        return float(value) if value.device.type == "cpu" else value
    if isinstance(raw, bool | int | float):
        try:
            return float(raw)
        except OverflowError:  # an int beyond any float
            return math.copysign(math.inf, raw)
    return None
