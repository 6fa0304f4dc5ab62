"""What a rank tells the outside world while it trains, over ZeroMQ: the glue.

A rank reports through `ddtop`'s API (api/__init__.py, training/api.py: the
built-in trainer and a user's script alike), which keeps one `LiveTelemetry`
per process when DDTOP_TELEMETRY names an endpoint. Code that reports more
than the API carries (the trainer's events, aggregates and collectives) holds
a `Telemetry`: the base class, whose methods do nothing, when telemetry is off.

Three pieces, one per module, two threads:

- The training thread only marks (this module): which phase it enters
  (`phase`), that a step was counted (`count_step`) and what it added
  (`add_loss`), what a collective took (`comm_done`), which collective it waits
  in (`collective`). Each mark is a small typed struct appended to a bounded
  deque (marks.py); nothing is summed, encoded or sent on the training thread.
  What a heartbeat must say even while the training thread is blocked (the
  phase, the step, the collectives) it also stores in `Said`, and custom
  scalars in `LatestScalars` (sender.py).
- The step folder (stepfold.py, pure): marks into step windows, the DDP
  estimate for all-reduces not read, the open step, the epoch split, the loss
  held or overwritten.
- The sender thread (sender.py): folds the marks a bounded share per round,
  reads GPU losses without blocking, sends Step, Scalars and heartbeats (only
  when they say something a Step message has not: beats.py), events as soon as
  they are queued, and a bye at close; sends never block.
- A loss tensor on a device is summed on that device (no synchronisation on
  the training thread); the sender thread reads the sum when it sends. Each
  loss weighs its samples if given, else 1 (the Step message's `loss_weight`).
"""

from __future__ import annotations

import collections
import math
import re
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ddtop.core import wire
from ddtop.training.beats import Beats
from ddtop.training.marks import (
    MAX_MARKS,
    AllReduceSource,
    CommMark,
    CudaLoss,
    DdpReadingMark,
    DdpSyncMark,
    ExposedMark,
    FoldRounds,
    LossMark,
    Marks,
    PhaseMark,
    ResumeMark,
    StepMark,
    SyncWaitMark,
    TensorLoss,
    loss_value,
)
from ddtop.training.sender import SEND_INTERVAL_S, LatestScalars, Said, Sender
from ddtop.training.stepfold import LOSS_OVERWRITTEN as LOSS_OVERWRITTEN
from ddtop.training.stepfold import StepFolder

# A collective's signature as training/collectives.py gives it: its group's name,
# size and ranks, the group's count of collectives on this rank, its dtype, the
# elements of its input, a point-to-point call's peer, and the group's description
# (a DeviceMesh dimension's: wire.Collective's fields of the same names).
Signature = tuple[str, int, str, int, str, int, int, str]


class Telemetry:
    """Telemetry switched off: every method does nothing."""

    live = False

    def phase(self, name: wire.Phase, loader: bool = False) -> None:
        pass

    def in_loader(self, inside: bool) -> None:
        pass

    @contextmanager
    def collective(self, op: str, nbytes: int = 0, sig: Signature | None = None
                   ) -> Iterator[None]:
        yield

    def collective_started(self, op: str, nbytes: int, sig: Signature | None = None
                           ) -> wire.Collective | None:
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
    """Telemetry on: the training thread's marks, a step folder and a sender thread."""

    live = True

    def __init__(self, endpoint: str, hello: wire.Hello, beats: Beats | None = None) -> None:
        """`beats`: when heartbeats go out (training/beats.py's rule unless given:
        bench/rank_wire.py gives the old one, a heartbeat every second)."""
        self.endpoint, self.run, self.rank = endpoint, hello.run, hello.rank
        self.world_size = hello.world_size
        n = max(1, self.world_size)
        self._allreduce_bus_factor = 2 * (n - 1) / n  # nccl-tests' busbw / algbw
        now = time.perf_counter()
        # What the training thread writes (from any thread, for the marks: deque
        # appends are atomic) and the sender thread reads.
        self._said = Said(("setup", now))
        self._marks: Marks = collections.deque(maxlen=MAX_MARKS)
        self._scalars = LatestScalars()
        # The training thread's alone.
        self._coll_seq = 0
        self._cuda_loss: dict[torch.device, torch.Tensor] = {}  # running sums (float64)
        rounds = FoldRounds(self.rank)  # how much of the marks a round folds
        folder = StepFolder(self.world_size, rounds, now, hold_s=SEND_INTERVAL_S)
        self._sender = Sender(endpoint, hello, self._marks, self._said, self._scalars, folder,
                              rounds, ended=self._unmarked, beats=beats)

    @property
    def current_phase(self) -> wire.Phase:
        return self._said.phase[0]

    @property
    def memory_device(self) -> torch.device | None:
        """The CUDA device the model is on (its memory goes with each Step)."""
        return self._said.memory_device

    @memory_device.setter
    def memory_device(self, device: torch.device | None) -> None:
        self._said.memory_device = device

    def send_hello(self, hello: wire.Hello) -> None:
        """Hello again: what the rank learned since (its model, totals)."""
        self._sender.queue(hello)

    # -- called from the training thread ----------------------------------------
    # Every step runs through these, on the step's critical path: each records what
    # happened as one mark (a struct appended to a deque, no lock, no arithmetic) and
    # the sender folds the marks into windows. Right after a step, with the caches
    # cold, every line here costs microseconds.
    def phase(self, name: wire.Phase, loader: bool = False) -> None:
        """Several times per step. `loader`: in the data phase, inside the data
        loader (a `ddtop.phase("data")` block, not the data phase a step ends in)."""
        now = time.perf_counter()
        self._said.loader = loader
        self._said.phase = (name, now)
        self._marks.append(PhaseMark(name, now))

    def in_loader(self, inside: bool) -> None:
        """A DataLoader's `__next__` entered (or left) in the data phase (autowatch)."""
        self._said.loader = inside

    def count_step(self, epoch: int | None, step: int, steps_per_epoch: int, global_step: int,
                   lr: float, loss: Any = None, samples: int | None = None,
                   hold: bool = False, then: wire.Phase | None = None,
                   counted: wire.GroupCounts | None = None) -> None:
        """One optimizer step done: its time is everything since the last one but
        time in phases that are not step phases; its loss and samples, if given,
        go with it. `hold`: its loss comes later (add_loss with release). `then`:
        the phase the rank is in from now (as `phase(then)` would say). `counted`:
        each group's collectives so far (at a multiple of wire.COUNTS_EVERY)."""
        now = time.perf_counter()
        said = self._said
        phase = then or said.phase[0]
        said.loader = False  # (a step ends outside the data loader)
        said.phase = ("data" if phase == "setup" else phase, now)  # no phase spans two steps
        if isinstance(loss, torch.Tensor):
            loss = self._loss_mark(loss, samples)
        self._marks.append(StepMark(now, epoch, step, steps_per_epoch, global_step, lr, loss,
                                    samples, hold, then, counted))
        said.epoch, said.global_step = epoch, global_step

    def resume_at(self, epoch: int | None, global_step: int) -> None:
        """Steps done before this process started (a resumed run), for heartbeats."""
        self._said.epoch, self._said.global_step = epoch, global_step
        self._marks.append(ResumeMark(global_step))  # (no step was dropped in between)

    def enter_epoch(self, epoch: int | None) -> None:
        """The rank is in `epoch` now (from 0; None: not known), for heartbeats
        until its next step says it."""
        self._said.epoch = epoch

    def add_loss(self, loss: Any, samples: int | None, release: bool = False) -> None:
        """The last step's loss (a number or a tensor, any device) and samples;
        `release`: the step held for it may go out now."""
        self._marks.append(LossMark(self._loss_mark(loss, samples), samples, release))

    def _loss_mark(self, loss: Any, samples: int | None) -> Any:
        """A loss as its mark carries it, for the sender to read. A number: as
        given. A tensor not on a GPU: with its version counter as of the call, a
        TensorLoss. It is not read here: `item()` releases the GIL,
        and with the sender thread awake that doubled the training thread's cost
        per step (bench/telemetry.py). A loss on a GPU is added on the device,
        times its weight, to a running sum, with an event the sender waits for
        without blocking (a hung collective must not stop heartbeats): a CudaLoss."""
        if not isinstance(loss, torch.Tensor):
            return loss
        if not loss.is_cuda:
            return TensorLoss(loss, loss._version)
        value = loss_value(loss)
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
            if not self._scalars.keep(key, value):
                problems.append(f"more than {wire.MAX_SCALAR_KEYS} keys at once: "
                                f"{key} dropped")
        if self._scalars:
            self._sender.wake()
        return problems

    @contextmanager
    def collective(self, op: str, nbytes: int = 0, sig: Signature | None = None
                   ) -> Iterator[None]:
        """Around a blocking collective (metric sync, barrier): time waited in it;
        `sig`: its signature, as collective_started takes it."""
        coll = self.collective_started(op, nbytes, sig)
        start = time.perf_counter()
        try:
            yield
        finally:
            self._marks.append(SyncWaitMark(time.perf_counter() - start))
            self.collective_completed(coll)

    def collective_started(self, op: str, nbytes: int, sig: Signature | None = None
                           ) -> wire.Collective:
        """`sig`: the collective's signature where known (training/collectives.py:
        group, its size, its ranks, the group's count, dtype, elements)."""
        self._coll_seq += 1
        if sig is None:
            coll = wire.Collective(seq=self._coll_seq, op=op, bytes=nbytes)
        else:
            group, size, ranks, group_seq, dtype, count, peer, desc = sig
            coll = wire.Collective(seq=self._coll_seq, op=op, bytes=nbytes, group=group,
                                   group_size=size, group_ranks=ranks, group_seq=group_seq,
                                   dtype=dtype, count=count, peer=peer, group_desc=desc)
        self._said.coll_started = coll
        return coll

    def collective_completed(self, coll: wire.Collective | None) -> None:
        self._said.coll_completed = coll

    def comm_done(self, seconds: float, nbytes: int, bus_factor: float | None = None) -> None:
        """One gradient all-reduce finished (called by the DDP comm hook, on any
        thread). It belongs to the step in progress, which is counted later: held
        until then, so that a window sent in between cannot get the communication
        without its step. `bus_factor`: the op's busbw / algbw when it is not an
        all-reduce (training/strategies.py: all-gather, reduce-scatter)."""
        self._marks.append(CommMark(seconds, nbytes, self._allreduce_bus_factor
                                    if bus_factor is None else bus_factor))

    def comm_exposed(self, seconds: float) -> None:
        """Of the step's communication, `seconds` the rank sat waiting for it."""
        self._marks.append(ExposedMark(seconds))

    # A DDP model timed from DDP's own statistics (training/commtimer.py DDPStats):
    def ddp_all_reduce(self, source: AllReduceSource, timed: bool) -> wire.Collective:
        """`source`'s model is all-reducing its gradients in this step: its bytes
        and buckets, and its time (read if `timed`, else estimated: stepfold.py);
        the collective heartbeats name meanwhile."""
        self._marks.append(DdpSyncMark(source, timed))
        return self.collective_started("allreduce", source.grad_bytes, source.signature())

    def ddp_reading(self, source: AllReduceSource, seconds: float) -> None:
        """What `source`'s last all-reduce took, read from DDP's statistics (the
        one of the step counted last)."""
        self._marks.append(DdpReadingMark(source, seconds))

    def collective_over(self, coll: wire.Collective) -> None:
        """`coll` is over, unless another collective started since (then that one
        is what a heartbeat names)."""
        if self._said.coll_started is coll:
            self._said.coll_completed = coll

    def aggregate(self, scope: wire.Scope, epoch: int, global_step: int, **metrics: Any) -> None:
        self._sender.queue(wire.Aggregate(run=self.run, rank=self.rank, scope=scope,
                                          epoch=epoch, global_step=global_step, **metrics))

    def event(self, type: wire.EventType, message: str, traceback: str | None = None,
              **data: str | int | float | bool | None) -> None:
        self._sender.queue(wire.Event(run=self.run, rank=self.rank, type=type,
                                      message=message, traceback=traceback, data=data))

    def error(self, exc: BaseException) -> None:
        tb = "".join(traceback.format_exception(exc))[-wire.MAX_TRACEBACK_CHARS:]
        self.event("error", f"{type(exc).__name__}: {exc}"[:1000], traceback=tb,
                   phase=self.current_phase, global_step=self._said.global_step)

    def close(self, exit_code: int) -> None:
        """Send what is pending and a bye, then stop; never waits long."""
        self.phase("done")
        self._sender.close(wire.Bye(run=self.run, rank=self.rank, exit_code=exit_code))

    def _unmarked(self) -> None:
        """The sender has stopped: marks from now on go nowhere."""
        self._marks = collections.deque(maxlen=0)


_KEY = re.compile(wire.SCALAR_KEY_PATTERN)


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
