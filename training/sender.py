"""The sender thread: the one thread of a rank that owns its PUSH socket
(ZeroMQ sockets are not thread-safe), and what it alone touches.

- Every SEND_INTERVAL_S it folds the marks the training thread left
  (marks.py: a bounded share per round) into step windows (stepfold.py), and
  sends the windows ready as Step messages (sums and counts, so nothing is
  lost by coalescing), then the custom scalars kept since (newest per key, one
  Scalars message). A window whose loss is still being summed on a GPU waits
  for the next round (never a blocking read here: a hung collective must not
  stop heartbeats), unless it is the last round.
- A heartbeat with what the training thread says now (`Said`: the phase and
  since when, the step, the last collective started and completed), so a rank
  stuck in a collective still says where; only when it tells the daemon
  something (beats.py): HEARTBEAT_INTERVAL_S after the last Step message or
  heartbeat, or when the phase moves into or out of work outside the steps (at
  once, or HEARTBEAT_INTERVAL_S after the previous heartbeat). A rank stepping
  needs none: its Step messages say it is alive.
- Events as soon as they are queued, never coalesced, at most MAX_QUEUED_EVENTS
  waiting (beyond: dropped and counted).
- Sends never block (NOBLOCK, small high-water mark): when nobody listens or
  the queue is full, the message is dropped, counted, and the count rides on
  the next message that gets through. Every attempt takes a sequence number, so
  a receiver sees each loss as a gap.
- Memory: the CUDA device's allocated and reserved bytes once CUDA is
  initialised (never initialising it from this thread), else the process's
  resident memory, read at most every RSS_EVERY_S.
- At close: the last round folds what it can (FINAL_BUDGET_S), sends it, the
  events, then a bye, and gives them CLOSE_LINGER_MS to leave; CONNECTED_LINGER_MS
  where the daemon's socket is connected (a loaded machine may not give the socket's
  thread a CPU within CLOSE_LINGER_MS, and the rank's last steps are the run's
  record), the short one where nobody listens (so exiting is not held up).
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import resource
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from ddtop.core import wire
from ddtop.core.keys import secure
from ddtop.training import flightrec, pendingworks, profiling
from ddtop.training.beats import Beats
from ddtop.training.hostreadings import HostReadings
from ddtop.training.marks import FINAL_BUDGET_S, FoldRounds, Marks
from ddtop.training.stepfold import Memory, StepFolder, StepWindow, step_message

SEND_INTERVAL_S = 0.1  # at most ~10 Step messages per second per rank
SEND_HWM = 64  # messages ZeroMQ may queue before sends fail (and are counted)
MAX_QUEUED_EVENTS = 1000
CLOSE_LINGER_MS = 250  # how long the last messages (bye) may take to leave on exit ...
CONNECTED_LINGER_MS = 2000  # ... and with a connection to the daemon up
# close() waits this long for the thread: the last fold and the linger, with the daemon
# connected, and a margin.
CLOSE_TIMEOUT_S = FINAL_BUDGET_S + CONNECTED_LINGER_MS / 1000 + 0.5
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
STATM = Path("/proc/self/statm")
RSS_EVERY_S = 1.0  # how often the process's resident memory is read again


LINK_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


def connected(link: zmq.Socket[bytes], up: bool = False) -> bool:
    """Whether the socket `link` monitors is connected now: its newest connect or
    disconnect event, or `up` (what it was) when there is none since."""
    while link.poll(0):
        event = recv_monitor_message(link)
        up = event["event"] == zmq.EVENT_CONNECTED
    return up


_MAIN = threading.main_thread().ident
# Files whose frames are not the script's: torch's and ddtop's own (its training
# side, core, and the public API's folder).
_NOT_THE_SCRIPT = tuple(str(Path(path).parent) + os.sep for path in (
    torch.__file__ or "", wire.__file__ or "", __file__,
    getattr(sys.modules.get("ddtop"), "__file__", None) or __file__))


def main_at() -> str | msgspec.UnsetType:
    """Where the main thread is in the script: "train.py:88 in main", its innermost
    frame outside torch and ddtop (UNSET where there is none: the built-in trainer)."""
    frame = sys._current_frames().get(_MAIN) if _MAIN is not None else None
    while frame is not None:
        code = frame.f_code
        if not code.co_filename.startswith(_NOT_THE_SCRIPT):
            at = f"{Path(code.co_filename).name}:{frame.f_lineno} in {code.co_name}"
            return "".join(ch if ch.isprintable() else "?" for ch in at[:160])
        frame = frame.f_back
    return msgspec.UNSET


class Said:
    """What the training thread says of the rank now, for heartbeats: plain
    attribute stores, atomic under the GIL, that the sender only reads. The
    phase and since when are one value, so a heartbeat never reads a torn pair."""

    __slots__ = ("coll_completed", "coll_started", "epoch", "global_step", "loader",
                 "memory_device", "phase")

    def __init__(self, phase: tuple[wire.Phase, float]) -> None:
        self.phase = phase  # (the phase, since when: perf_counter)
        self.epoch: int | None = None  # None: not known (wire.Epoch)
        self.global_step = 0
        self.coll_started: wire.Collective | None = None
        self.coll_completed: wire.Collective | None = None
        self.memory_device: torch.device | None = None  # the CUDA device the model is on
        # In the data phase: inside its data loader (True) or between steps (False).
        self.loader = False


class LatestScalars:
    """Custom scalars, newest per key, at most wire.MAX_SCALAR_KEYS: kept by the
    training thread, taken by the sender (a lock between the two)."""

    def __init__(self) -> None:
        self._values: dict[str, float | torch.Tensor] = {}
        self._lock = threading.Lock()

    def keep(self, key: str, value: float | torch.Tensor) -> bool:
        """False (and nothing kept) for a new key beyond the limit."""
        with self._lock:
            if key not in self._values and len(self._values) >= wire.MAX_SCALAR_KEYS:
                return False
            self._values[key] = value
            return True

    def __bool__(self) -> bool:
        return bool(self._values)

    def take(self) -> dict[str, float | torch.Tensor]:
        with self._lock:
            values, self._values = self._values, {}
        return values


class Sender:
    """The sender thread, started at once; `hello` is the first message it sends."""

    def __init__(self, endpoint: str, hello: wire.Hello, marks: Marks, said: Said,
                 scalars: LatestScalars, folder: StepFolder, rounds: FoldRounds,
                 ended: Callable[[], None], beats: Beats | None = None) -> None:
        """`marks`, `said`, `scalars`: what the training thread writes; `folder`
        and `rounds`: the fold, this thread's alone from now on; `ended`: called
        on this thread once it folds no more (the marks may stop); `beats`: when
        heartbeats go out (beats.py's rule unless given)."""
        self.endpoint, self.run, self.rank = endpoint, hello.run, hello.rank
        self.world_size = hello.world_size
        self._marks, self._said, self._scalars = marks, said, scalars
        self._folder, self._rounds, self._ended = folder, rounds, ended
        self._events: collections.deque[wire.Message] = collections.deque([hello])
        self._queue_dropped = 0  # (counted by whoever queues)
        self._seq = 0
        self._dropped = 0
        self._cuda_loss_sent: dict[torch.device, float] = {}  # the GPU loss sums sent, by device
        self._rss: int | None = None  # resident memory as last read, and when (monotonic)
        self._rss_at = -math.inf
        self._rss_peak: int | None = None  # its peak so far (getrusage's ru_maxrss)
        self._host = HostReadings()  # the training thread's CPU wait, the major faults
        self._bye: wire.Bye | None = None
        self._beats = beats or Beats()  # this thread's alone
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._context = zmq.Context()
        self._thread = threading.Thread(target=self._run, name="ddtop-telemetry", daemon=True)
        self._thread.start()

    # -- called from any thread -------------------------------------------------------
    def queue(self, message: wire.Message) -> None:
        """Send `message` as soon as it can go (dropped and counted beyond the bound)."""
        if len(self._events) >= MAX_QUEUED_EVENTS:
            self._queue_dropped += 1  # counted: the receiver sees the loss
            return
        self._events.append(message)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def close(self, bye: wire.Bye) -> None:
        """Send what is pending and `bye`, then stop; never waits long."""
        self._bye = bye
        self._stop.set()
        self._wake.set()
        self._thread.join(CLOSE_TIMEOUT_S)

    # -- the thread -------------------------------------------------------------------
    def _run(self) -> None:
        sock = self._context.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.LINGER, 0)
        link: zmq.Socket[bytes] | None = None  # the socket's monitor: is the daemon connected
        up = False
        try:
            link = sock.get_monitor_socket(LINK_EVENTS)
            secure(sock, self.endpoint, None)  # the run's keys, when the daemon is on TCP
            sock.connect(self.endpoint)
            next_step = time.monotonic()
            beats = self._beats
            while True:
                stopping = self._stop.is_set()
                up = connected(link, up)  # (read as they come: a reconnecting socket's pile)
                self._send_events(sock)
                flightrec.poll()  # the daemon asked for this rank's stacks: dumped beside
                pendingworks.poll()  # an isend or irecv without a future, completed
                profiling.poll()  # `ddtrain profile` asked for this rank: taken
                now = time.monotonic()
                if (now >= next_step or stopping) and self._send_steps(sock, final=stopping):
                    beats.stepped(now)
                if now >= next_step:
                    next_step = now + SEND_INTERVAL_S
                said = self._said.phase  # (one read: the phase and since when)
                coll = self._said.coll_started
                signed = (coll if coll is not None and coll.group_seq
                          and self._said.coll_completed is not coll else None)
                if beats.inside(now, signed) or beats.due(now, said[0], said[1]):
                    beats.beat(now, said[0], self._send(sock, self._heartbeat(said)), said[1])
                if stopping:
                    self._send_events(sock)  # what the last fold said (a warning), before bye
                    if self._bye is not None:
                        self._send(sock, self._bye)
                    break
                self._wake.wait(max(0.0, min(next_step, beats.next_at()) - time.monotonic()))
                self._wake.clear()
        except Exception as e:  # noqa: BLE001 - telemetry must never take training down
            print(f"warning: telemetry to {self.endpoint} stopped: {e}", file=sys.stderr)
        finally:
            self._ended()  # nobody folds the marks from now on
            if link is not None:
                with contextlib.suppress(zmq.ZMQError):
                    up = connected(link, up)
                    sock.disable_monitor()
                link.close(linger=0)
            sock.close(linger=CONNECTED_LINGER_MS if up else CLOSE_LINGER_MS)
            self._context.term()

    def _send_events(self, sock: zmq.Socket[bytes]) -> None:
        while self._events:
            self._send(sock, self._events.popleft())

    def _send(self, sock: zmq.Socket[bytes], message: wire.Message) -> bool:
        """False: it could not go out (dropped and counted)."""
        message.seq, message.t = self._seq, time.time()
        self._seq += 1
        message.dropped = self._dropped + self._queue_dropped
        try:
            sock.send_multipart(wire.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            self._dropped += 1
            return False
        self._dropped = 0
        self._queue_dropped = 0
        return True

    def _warn(self, message: str) -> None:
        self.queue(wire.Event(run=self.run, rank=self.rank, type="warning", message=message,
                              traceback=None, data={}))

    def _heartbeat(self, phase_since: tuple[wire.Phase, float]) -> wire.Heartbeat:
        said = self._said
        phase, since = phase_since
        return wire.Heartbeat(
            run=self.run, rank=self.rank, phase=phase, epoch=said.epoch,
            global_step=said.global_step, phase_s=time.perf_counter() - since,
            coll_started=said.coll_started, coll_completed=said.coll_completed,
            loader=said.loader if phase == "data" else msgspec.UNSET,
            at=main_at() if phase == "data" and not said.loader else msgspec.UNSET,
        )

    def _send_steps(self, sock: zmq.Socket[bytes], final: bool = False) -> bool:
        """The marks folded (for this round's budget), the steps ready sent, then
        the scalars kept since the last round; True: a Step message went out."""
        folder = self._folder
        folder.fold(self._rounds.take(self._marks, final), time.monotonic())
        for warning in folder.said:
            self._warn(warning)
        folder.said.clear()
        flood = self._rounds.warning()
        if flood is not None:
            self._warn(flood)
        windows = folder.ready(time.monotonic(), final)
        scalars = self._scalars.take()
        stepped = False
        for i, w in enumerate(windows):
            if not self._read_cuda_loss(w, final):
                folder.wait(windows[i:])  # in order, before newer ones
                break
            sent = self._send(sock, step_message(w, self.run, self.rank, self.world_size,
                                                 self._memory(), self._host.take()))
            stepped = stepped or (sent and w.steps > 0)
        if scalars:
            values = {key: float(value) for key, value in scalars.items()}
            self._send(sock, wire.Scalars(run=self.run, rank=self.rank, values=values,
                                          global_step=self._said.global_step))
        return stepped

    def _read_cuda_loss(self, w: StepWindow, final: bool) -> bool:
        """`w`'s loss on a GPU, read into `loss_sum` if the device has computed it;
        False: not yet (it waits), unless `final` (then it is never read: the
        device is stuck)."""
        cuda = w.loss_cuda
        if cuda is None:
            return True
        if not cuda.ready.query():
            if not final:
                return False
            w.loss_sum, w.loss_weight = 0.0, 0.0
            return True
        device, total = cuda.total.device, float(cuda.total)
        w.loss_sum = w.loss_sum + total - self._cuda_loss_sent.get(device, 0.0)
        self._cuda_loss_sent[device] = total
        return True

    def _memory(self) -> Memory:
        """(CUDA allocated, CUDA reserved, process RSS, its peak, CUDA allocated's peak)
        in bytes; None where absent. CUDA only once it is initialised (never
        initialising it from this thread)."""
        device = self._said.memory_device
        # torch leaves is_initialized unannotated.
        if device is not None and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return (torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device),
                    None, None, torch.cuda.max_memory_allocated(device))
        now = time.monotonic()
        if now - self._rss_at >= RSS_EVERY_S:  # (reading it costs more than the rest of a send)
            self._rss_at = now
            try:
                self._rss = int(STATM.read_text().split()[1]) * PAGE_SIZE
                self._rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            except (OSError, IndexError, ValueError):
                self._rss = self._rss_peak = None
        return None, None, self._rss, self._rss_peak, None
