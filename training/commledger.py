"""What the collectives a strategy issues itself cost, into the rank's telemetry.

The strategies of strategies.py issue their collectives through a
`CommLedger`, which counts each one's op and bytes with its bus-bandwidth
factor (busbw / algbw, as nccl-tests has them) and times it.

What is timed, without a device synchronisation (`CommLedger`): on CPU a
blocking collective on the thread that called it, all of it exposed (the rank
waits); an asynchronous one from launch to its future's completion, charged
from when the previous one finished (they queue on one process group), with
the rank's wait for them as the exposed part. DDP: its buckets by the comm
hook; exposed is the time from the last gradient being ready to backward
returning (DDP waits for the last buckets). On CUDA: CUDA events around each
collective, read back once they have completed; exposure is not measured.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from ddtop.training.telemetry import Signature, Telemetry


def allreduce_factor(n: int) -> float:
    """busbw / algbw of an all-reduce (nccl-tests): a ring moves 2(n-1)/n of it."""
    return 2 * (n - 1) / n


def gather_factor(n: int) -> float:
    """busbw / algbw of an all-gather or reduce-scatter (nccl-tests): (n-1)/n."""
    return (n - 1) / n


class CommLedger:
    """Times the collectives a strategy issues itself, into the rank's telemetry."""

    def __init__(self, telemetry: Telemetry, cuda: bool) -> None:
        self.telemetry, self.cuda = telemetry, cuda
        self._lock = threading.Lock()  # future callbacks run on the backend's threads
        self._last_end = 0.0
        self._pending: list[tuple[Any, Any, int, float]] = []  # CUDA: start, end, bytes, factor
        # Not a training step's communication (an evaluation's all-gathers): not
        # counted, or it would land in the next step's numbers.
        self.paused = False

    @contextmanager
    def blocking(self, op: str, nbytes: int, bus_factor: float,
                 sig: Signature | None = None) -> Iterator[None]:
        """Around a collective that returns when it is done (on CPU): all of it is
        time the rank waits."""
        coll = self.telemetry.collective_started(op, nbytes, sig)
        if self.cuda:
            start_ev = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start_ev.record()
        start = time.perf_counter()
        yield
        if self.cuda:
            end_ev = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end_ev.record()
            with self._lock:
                self._pending.append((start_ev, end_ev, nbytes, bus_factor))
        else:
            end = time.perf_counter()
            with self._lock:
                self._last_end = end
            self.telemetry.comm_done(end - start, nbytes, bus_factor)
            self.telemetry.comm_exposed(end - start)
        self.telemetry.collective_completed(coll)

    def launch(self, op: str, nbytes: int, bus_factor: float,
               call: Callable[[], dist.Work]) -> torch.futures.Future[Any]:
        """Start an asynchronous collective; a future that completes once it has
        finished and been accounted for (wait on this one, not the work's)."""
        coll = self.telemetry.collective_started(op, nbytes)
        start = time.perf_counter()
        work = call()

        def finished(f: torch.futures.Future[Any]) -> None:
            end = time.perf_counter()
            with self._lock:
                charged = end - max(start, self._last_end)  # queued behind the previous one
                self._last_end = end
            self.telemetry.comm_done(charged, nbytes, bus_factor)
            self.telemetry.collective_completed(coll)
            f.value()  # raises what the collective raised, into the waiter

        return work.get_future().then(finished)

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Around the rank waiting for its asynchronous collectives (exposed time)."""
        start = time.perf_counter()
        yield
        if not self.cuda:
            self.telemetry.comm_exposed(time.perf_counter() - start)

    def timed(self, op: str, nbytes: int, bus_factor: float, async_op: bool,
              call: Callable[[], dist.Work | None],
              sig: Signature | None = None) -> dist.Work | None:
        """`call()`, a collective that returns its work when `async_op` (whoever
        called it waits on that work: only its duration is known, from its
        future) and blocks otherwise; accounted for either way. `sig`: its
        signature (a blocking one's: training/collectives.py group_entered)."""
        if async_op:
            work = call()
            if work is not None:
                self.launch(op, nbytes, bus_factor, lambda: work)
            return work
        if self.cuda:
            with self.blocking(op, nbytes, bus_factor, sig):
                return call()
        # `blocking` on CPU, spelled out: a collective of FSDP2's costs the rank
        # this, several times a step (a generator-based context costs as much again).
        telemetry = self.telemetry
        coll = telemetry.collective_started(op, nbytes, sig)
        start = time.perf_counter()
        result = call()
        end = time.perf_counter()
        with self._lock:
            self._last_end = end
        telemetry.comm_done(end - start, nbytes, bus_factor)
        telemetry.comm_exposed(end - start)
        telemetry.collective_completed(coll)
        return result

    def harvest(self) -> None:
        """CUDA: account for the collectives whose end event has passed (never waits)."""
        if not self._pending:
            return
        with self._lock:
            done = [p for p in self._pending if p[1].query()]
            self._pending = [p for p in self._pending if p not in done]
        for start_ev, end_ev, nbytes, factor in done:
            self.telemetry.comm_done(start_ev.elapsed_time(end_ev) / 1000.0, nbytes, factor)
