"""Timing DDP's gradient all-reduces: a communication hook (GPU), DDP's own
statistics (CPU).

(No `from __future__ import annotations` here: DDP checks the hook's
annotations at run time against the real `dist.GradBucket` and `Future` types.)

The hook does what torch's own `allreduce_hook` does (divide the bucket by the
world size in place, all-reduce it, hand back the result: exactly what DDP does
without a hook), with a clock around the all-reduce alone, so training gives the
same weights with and without it (tested). The division is local compute and is
not charged as communication (for a 16.8 MB bucket on this CPU it is ~1 ms, 10%
of the all-reduce).

- CPU / gloo: the time from launching a bucket's all-reduce to its future
  completing. Buckets queue behind each other on one process group, so each
  bucket is charged only from when the previous one finished: the sum is the
  wall time spent communicating, and bytes / that time is the bandwidth.
  (ddtop times a DDP model on CPU with DDPStats below, not this hook; the
  benches still time the hook on CPU, as what any Python hook costs.)
- CUDA: CUDA events recorded around each all-reduce, read back later with
  `event.query()` (a completed pair is harvested at the next step; nothing
  ever waits for the device).

A DDP model takes one comm hook, once. When a user's script registers its own
(`import ddtop`, training/api.py), the timer becomes the `inner` hook's
wrapper: the user's hook does the communication, exactly as it would alone,
and the clock runs from calling it to its future completing (bytes: the
bucket before the hook compresses it).
"""

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddtop.core import wire
from ddtop.training.collectives import group_entered
from ddtop.training.telemetry import LiveTelemetry, Signature, Telemetry

# A comm hook as DDP calls it: hook(state, bucket) -> future of the reduced bucket.
Hook = Callable[[Any, Any], torch.futures.Future[torch.Tensor]]


class CommTimer:
    def __init__(self, telemetry: Telemetry, cuda: bool,
                 process_group: dist.ProcessGroup | None = None) -> None:
        self.telemetry, self.cuda = telemetry, cuda
        self.process_group = process_group  # None: the default group
        # The hook that communicates, when not ours: (hook, its state).
        self.inner: tuple[Hook, object] | None = None
        self._lock = threading.Lock()  # the hook and its callbacks run on other threads
        self._last_end = 0.0
        self._pending: list[tuple[Any, Any, int]] = []  # CUDA: (start, end, bytes)
        # Resolved at the first bucket (the group DDP reduces over never changes).
        self._group: dist.ProcessGroup | None = None
        self._world_size = 1
        self._allreduce_opts = dist.AllreduceOptions()  # SUM, async: as dist.all_reduce's

    def __deepcopy__(self, memo: dict[int, Any]) -> "CommTimer":
        """A copy of a watched model (an EMA copy, say) shares its timer: the timer
        holds a lock and the rank's telemetry, which are not copied."""
        return self

    def attach(self, ddp: DDP) -> None:
        if self.process_group is None:
            self.process_group = ddp.process_group
        ddp.register_comm_hook(state=self, hook=timed_allreduce)

    def wrap(self, hook: Hook, state: object) -> None:
        """From now on `hook` communicates, timed (a user's hook, registered late)."""
        self.inner = (hook, state)

    def harvest(self) -> None:
        """CUDA only: account for the all-reduces whose end event has completed."""
        if not self._pending:
            return
        with self._lock:
            done = [p for p in self._pending if p[1].query()]
            self._pending = [p for p in self._pending if not p[1].query()]
        for start, end, nbytes in done:
            self.telemetry.comm_done(start.elapsed_time(end) / 1000.0, nbytes)

    # -- inside the hook -----------------------------------------------------------
    # DDP calls this once per bucket per step, on the critical path of a step, and
    # `finished` runs on gloo's thread while the training thread waits for it: at a
    # few ms per step each Python line here shows, so the group, its size and the
    # all-reduce's options are looked up once, and the all-reduce is issued as
    # `dist.all_reduce` issues it (`group.allreduce([tensor], opts)`, SUM, async)
    # without its per-call checks, which cannot fail for a DDP bucket.
    def _resolve_group(self) -> dist.ProcessGroup:
        group = self.process_group or dist.group.WORLD
        assert group is not None
        self._group, self._world_size = group, group.size()
        return group

    def launch(self, bucket: Any) -> torch.futures.Future[torch.Tensor]:  # a dist.GradBucket
        buffer = bucket.buffer()
        nbytes = buffer.nbytes
        inner = self.inner  # read once: a hook registered meanwhile applies from the next bucket
        group = self._group
        if group is None:
            group = self._resolve_group()
        if inner is None:
            buffer.div_(self._world_size)  # as allreduce_hook: divide first, then sum
        coll = self.telemetry.collective_started("allreduce", nbytes)
        if self.cuda:
            start_ev = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start_ev.record()
        start = time.perf_counter()
        if inner is not None:
            hook, state = inner
            fut: torch.futures.Future[Any] = hook(state, bucket)
        elif buffer.is_complex():  # dist.all_reduce sums it as real pairs
            fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
        else:
            fut = group.allreduce([buffer], self._allreduce_opts).get_future()

        def finished(f: torch.futures.Future[Any]) -> torch.Tensor:
            if self.cuda:
                end_ev = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                end_ev.record()  # on the stream the reduced gradients are ready on
                with self._lock:
                    self._pending.append((start_ev, end_ev, nbytes))
            else:
                end = time.perf_counter()
                with self._lock:
                    charged = end - max(start, self._last_end)
                    self._last_end = end
                self.telemetry.comm_done(charged, nbytes)
            self.telemetry.collective_completed(coll)
            value = f.value()  # raises what the all-reduce raised, into DDP
            # all_reduce's future holds [tensor]; a comm hook's holds the tensor.
            reduced: torch.Tensor = value if inner is not None else value[0]
            return reduced

        return fut.then(finished)


def timed_allreduce(state: "CommTimer",
                     bucket: dist.GradBucket  # type: ignore[name-defined]
                     ) -> torch.futures.Future[torch.Tensor]:
    return state.launch(bucket)


# -- DDP models on CPU: timed from DDP's own statistics ------------------------------------
# At most one iteration in this much time is timed and read (timing one costs DDP
# ~10 µs, reading it ~30 µs in the middle of training; at 10 ms, steps of 10 ms or
# more are all read, which the straggler rule needs at the step times of small
# runs: docs/performance.md).
READ_EVERY_S = 0.01
# ... but each of the first iterations: short runs get readings, and the median
# that steps not read are given settles past the first iterations' outliers (DDP
# rebuilds its buckets in the first) before it is used.
READ_FIRST = 20
MAX_RATE = (1 << 31) - 1  # DDP's sample rate is a C int


class DDPStats:
    """Times a DDP model's gradient all-reduce from the statistics DDP keeps in
    C++ (the reducer times an iteration's communication, from launching its
    first bucket to the last one done, when the iteration's number is a
    multiple of its "runtime logging sample rate"), with no Python on the
    all-reduce's path: no comm hook, so a user's own hook, built-in or not, is
    timed as it is.

    The wrapped forward (watched.py) tells this object of every forward that
    all-reduces in its backward, before it runs (`starting`) and after
    (`synced`). Before, it picks whether DDP times the iteration beginning: at
    most one every READ_EVERY_S, and each of the first READ_FIRST (so every
    step when steps are longer than that, and a long wait, such as an
    evaluation on another rank, is read), by setting the sample rate so that
    the iteration's number is a multiple of it and the next ones' are not.
    DDP computes a timed iteration's figures at the next such forward, and
    reading them costs tens of µs: `synced` reads them then. A step not read
    is given its model's recent compute, the rest of its time being the
    all-reduce's (stepfold.py, the estimate). Bytes and buckets are counted,
    and the collective a hung rank waits in is named, once that forward's
    backward has reached the model's first parameter (a post-accumulate-grad
    hook on it: its gradient is, as a rule, the last to be ready, and DDP
    waits for the all-reduce right after): so a forward with no backward after
    it (an evaluation with gradients on, a step skipped on a NaN) is not an
    all-reduce, and a rank still in its backward is not yet inside one: the
    others, done, wait for it.
    """

    def __init__(self, telemetry: LiveTelemetry, ddp: DDP) -> None:
        self.telemetry = telemetry
        params = getattr(ddp, "_module_parameters", None) or list(ddp.module.parameters())
        grads = [p for p in params if p.requires_grad]
        self.grad_bytes = sum(p.numel() * p.element_size() for p in grads)
        # Its signature, the same on every rank of its group: the step's all-reduce of
        # every gradient (however DDP buckets them), counted as one collective of the group.
        self.group = ddp.process_group
        dtypes = {str(p.dtype).removeprefix("torch.") for p in grads}
        self.dtype = dtypes.pop() if len(dtypes) == 1 else "mixed"  # (wire.DtypeName allows no "+")
        self.count = sum(p.numel() for p in grads)
        self.buckets = 1  # all-reduces per step: DDP's first iteration has one bucket
        self.coll: wire.Collective | None = None  # the all-reduce named since the forward
        self.timings = 0  # iterations DDP was asked to time
        self._next_read = -math.inf  # (perf_counter) an iteration may be timed from then
        self._last_start: int | None = None  # the reading last sent, by its start (ns)
        # The reducer's iteration count as of the forward last seen (DDP counts the
        # forwards that all-reduce; corrected from each reading), the one timed
        # last, and the sample rate set.
        self.iteration = 0
        self.timed = -1
        self._read_due = False  # the forward in progress has the last timed one's figures
        self._rate = 0  # (not set yet: DDP's default times one iteration in 100)
        self.armed = False  # a forward that all-reduces has run; its backward not begun
        self.failed = ""  # why reading stopped, once it has
        self.reducer = ddp.reducer  # (a deep copy of the model, sharing this object, has its own)
        first = next((p for p in params if p.requires_grad), None)
        if first is not None:
            first.register_post_accumulate_grad_hook(self._backward_done)

    def signature(self) -> Signature | None:
        """The signature of the all-reduce beginning, counted in its group's sequence."""
        try:
            return group_entered(self.group, self.dtype, self.count)
        except Exception:  # noqa: BLE001 - instrumentation must never break the script
            return None

    def __deepcopy__(self, memo: dict[int, Any]) -> "DDPStats":
        return self  # (a copy of a watched model, an EMA copy say, shares it)

    def starting(self) -> None:
        """Before a forward that all-reduces in the backward to come (if one
        comes): DDP counts an iteration; have it timed if one is due."""
        n = self.iteration = self.iteration + 1
        last_timed = self._read_due = self.timed == n - 1  # (its figures: computed now)
        now = time.perf_counter()
        if now >= self._next_read and not self.failed:
            self.timed = n
            self.timings += 1
            if self.timings >= READ_FIRST:
                self._next_read = now + READ_EVERY_S
            rate = 1 if last_timed else n  # n a multiple, and n - 1 too if it must be
        elif last_timed and self._rate == 1 and not self.failed:
            rate = n - 1  # n - 1 a multiple, n not
        else:
            return  # (DDP may time a multiple of the rate meanwhile: unread, harmless)
        if rate != self._rate and not self._set_rate(rate):
            self.timed = -1  # nothing to wait for

    def synced(self, ddp: DDP) -> None:
        """After that forward: DDP has the last iteration's figures; read them
        if it was timed."""
        if self._read_due and not self.failed:
            self._read(ddp)
        self.armed = True

    def _set_rate(self, rate: int) -> bool:
        """Set DDP's sample rate; False (and timing stopped) if it cannot be."""
        self._rate = rate
        try:
            self.reducer._set_ddp_runtime_logging_sample_rate(min(max(1, rate), MAX_RATE))
        except Exception as e:  # noqa: BLE001 - a prototype interface of torch's
            self._failed(e)
            return False
        return True

    def _backward_done(self, param: torch.Tensor) -> None:
        """The model's first parameter has its gradient: the backward is through
        the model, and its all-reduce is what it waits for."""
        if self.armed:
            self.armed = False
            self.coll = self.telemetry.ddp_all_reduce(self, self.timed == self.iteration)

    def over(self) -> None:
        """The step's all-reduce is over (the optimizer steps, or the next forward)."""
        if self.coll is not None:
            self.telemetry.collective_over(self.coll)
            self.coll = None

    def _read(self, ddp: DDP) -> None:
        try:
            assert ddp.logger is not None
            ints = ddp.logger._get_ddp_logging_data().ints_map
        except Exception as e:  # noqa: BLE001 - a prototype interface of torch's
            self._failed(e)
            return
        iteration = ints.get("iteration")
        start, took = ints.get("backward_comm_time_start"), ints.get("backward_comm_time")
        if isinstance(iteration, int) and iteration != self.iteration - 1:
            # Counted wrong (watched after some iterations, or forwards DDP does
            # not count): counting on from DDP's count.
            self._recount(iteration + 1)
            return
        if start and start == self._last_start:
            self._recount(self.iteration)  # the figures read last time: not the timed one
            return
        if not start or took is None or took < 0:
            return  # (none yet, or unset: 0)
        self._last_start = start
        buckets = ints.get("num_buckets_reduced")
        if isinstance(buckets, int) and buckets > 0:
            self.buckets = buckets
        self.telemetry.ddp_reading(self, took / 1e9)

    def _recount(self, iteration: int) -> None:
        """DDP's count differs from ours: from `iteration` on, time every
        iteration (rate 1: whatever the count) until a reading agrees."""
        self.iteration = self.timed = iteration
        self._next_read, self.timings = -math.inf, 0
        self._set_rate(1)

    def _failed(self, e: Exception) -> None:
        self.failed = f"{type(e).__name__}: {e}"
        self.telemetry.event("warning", "comm time unavailable: reading DDP's "
                             f"statistics failed: {self.failed}"[:1000])
