"""RunState: everything known about a run, folded from its telemetry messages.

This is the one fold. The daemon applies every message it accepts (and its own
RankExit / RunStatus / Event messages) to a RunState, answers `status` and
`snapshot` requests from it, and journals the same messages; a dashboard
starts from a snapshot and applies the live messages newer than it; a replay
applies the journal. No torch, no sockets, no clock: the caller passes the
time a message was received, and the time "now" when it asks what a rank's
state is, so the fold is tested on recorded sequences without waiting.

Per rank, messages are ordered by their sequence number `seq`:
- a jump forward counts the skipped numbers as lost (they may still arrive);
- a number that was counted lost and arrives late is un-lost; a late step adds
  its samples to the totals but does not overwrite newer readings;
- a number already seen is a duplicate: counted and ignored;
- a `hello` with a new pid (a restarted rank) starts a new sequence.
"""

from __future__ import annotations

import statistics
from typing import Any

import msgspec

from ddtop.daemon import wire

SILENT_AFTER_S = 5.0  # no message for this long (heartbeats come every 1 s): silent
STALL_MIN_S = 10.0  # a step phase lasting this long (and STALL_STEPS steps' time): stalled
STALL_STEPS = 20
SLOW_PHASE_STALL_S = 300.0  # set-up, evaluation and checkpoints may take longer
STRAGGLER_FACTOR = 1.25  # compute time per step this far above the median: straggler
STRAGGLER_MIN_S = 0.001
# ... and by more than this share of the median step time: jitter of a few per cent
# between ranks on a busy machine is not a straggler.
STRAGGLER_STEP_SHARE = 0.10
HISTORY_POINTS = 120  # per rank
MAX_EVENTS = 500
MAX_MISSING = 10_000  # sequence numbers remembered as lost, per rank
MAX_RANKS = 1 << 16
STEP_PHASES = ("data", "forward", "backward", "optimizer", "metric_sync")

# Rank states, as shown.
STARTING, RUNNING, STALLED, SILENT, DEAD, FINISHED = (
    "starting", "running", "stalled", "silent", "dead", "finished")


class Point(msgspec.Struct, array_like=True):
    """One Step message's reading, for charts."""

    t: float
    global_step: int
    loss: float
    samples_per_s: float
    comm_share: float


class GlobalPoint(msgspec.Struct, array_like=True):
    """One metric sync's global numbers, for charts."""

    t: float
    global_step: int
    train_loss: float
    train_accuracy: float


class RankView(msgspec.Struct, kw_only=True):
    rank: int
    # From hello.
    host: str = ""
    pid: int | None = None
    local_rank: int | None = None
    device: str = ""
    backend: str = ""
    # Progress, from step messages (the newest one; totals over all).
    epoch: int = 0
    step: int = 0
    steps_per_epoch: int = 0
    global_step: int = 0
    samples: int = 0
    loss: float | None = None
    step_time_s: float | None = None  # per step
    samples_per_s: float | None = None
    comm_s: float | None = None  # per step
    comm_bytes: int | None = None  # per step
    comm_ops: float | None = None  # collectives per step (gradient buckets), averaged
    algbw_gbps: float | None = None
    busbw_gbps: float | None = None
    sync_wait_s: float = 0.0  # total
    phase_split: dict[str, float] = {}  # seconds per step: data, forward, backward, optimizer
    lr: float | None = None
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    rss: int | None = None
    last_step_t: float | None = None  # sender time of the newest step message
    # Liveness, from heartbeats (receiver clock).
    phase: str = "setup"
    phase_s: float = 0.0
    phase_at: float | None = None
    coll_started: wire.Collective | None = None
    coll_completed: wire.Collective | None = None
    first_seen: float | None = None
    last_seen: float | None = None
    # The end, from bye (the rank) and rank_exit (the daemon, which saw the process exit).
    bye_code: int | None = None
    exited: bool = False
    exit_code: int | None = None
    signal: str | None = None
    stopped_by_daemon: bool = False
    error: str | None = None
    traceback: str | None = None
    # Telemetry accounting.
    max_seq: int = -1
    received: int = 0
    lost: int = 0
    duplicates: int = 0
    sender_dropped: int = 0
    missing: set[int] = set()
    history: list[Point] = []

    # -- derived ------------------------------------------------------------------
    @property
    def comm_share(self) -> float | None:
        if self.comm_s is None or not self.step_time_s:
            return None
        return min(1.0, self.comm_s / self.step_time_s)

    @property
    def compute_s(self) -> float | None:
        """Time per step not spent in (or waiting for) the gradient all-reduce:
        the rank that needs most of it is the one the others wait for."""
        if self.step_time_s is None:
            return None
        return max(0.0, self.step_time_s - (self.comm_s or 0.0))

    @property
    def memory(self) -> int | None:
        return self.cuda_allocated if self.cuda_allocated is not None else self.rss

    @property
    def in_collective(self) -> bool:
        started, completed = self.coll_started, self.coll_completed
        return started is not None and (completed is None or completed.seq < started.seq)

    def phase_elapsed(self, now: float) -> float:
        if self.phase_at is None:
            return 0.0
        return self.phase_s + max(0.0, now - self.phase_at)

    def state(self, now: float) -> str:
        if self.exited:
            return FINISHED if self.exit_code == 0 else DEAD
        if self.bye_code is not None:
            return FINISHED if self.bye_code == 0 else DEAD
        if self.last_seen is None:
            return STARTING
        if now - self.last_seen > SILENT_AFTER_S:
            return SILENT
        if self.phase_elapsed(now) > self.stall_after():
            return STALLED
        return RUNNING

    def stall_after(self) -> float:
        if self.phase not in STEP_PHASES:
            return float("inf") if self.phase == "done" else SLOW_PHASE_STALL_S
        return max(STALL_MIN_S, STALL_STEPS * (self.step_time_s or 0.0))

    def where(self) -> str:
        """Where the rank is, in words: 'in allreduce #12 (4.2 MB)' or 'in forward of step 7'."""
        if self.in_collective:
            assert self.coll_started is not None
            c = self.coll_started
            size = f" ({c.bytes / 1e6:.1f} MB)" if c.bytes else ""
            return f"in {c.op} #{c.seq}{size}"
        return f"in {self.phase} of step {self.global_step + 1}"


class RunState(msgspec.Struct, kw_only=True):
    run: str
    world_size: int = 0
    model: str = ""
    dataset: str = ""
    epochs: int = 0
    global_batch: int = 0
    backend: str = ""
    config_digest: str = ""
    status: str = "starting"
    status_message: str = ""
    restarts: int = 0
    timeline: list[dict[str, Any]] = []  # restarts: which rank, why, at what step, from where
    failure: dict[str, Any] | None = None
    started: float | None = None  # receiver clock
    updated: float | None = None  # receiver time of the newest message folded
    ranks: dict[int, RankView] = {}
    aggregate: wire.Aggregate | None = None  # newest global metrics
    epochs_done: list[wire.Aggregate] = []
    events: list[dict[str, Any]] = []  # the newest MAX_EVENTS
    event_count: int = 0  # events ever recorded: readers print those after the last they saw
    global_history: list[GlobalPoint] = []  # metric syncs, newest HISTORY_POINTS
    folded: int = 0
    rejected: dict[str, int] = {}  # frames the daemon refused, by reason (not in the journal)

    # -- folding -------------------------------------------------------------------
    def apply(self, message: wire.Message, received: float) -> bool:
        """Fold one message received at `received`; False when it was ignored
        (a duplicate, or from a rank number out of range)."""
        if self.started is None:
            self.started = received
        self.updated = max(self.updated or received, received)
        if message.rank == wire.DAEMON_RANK:
            self._apply_daemon(message, received)
            self.folded += 1
            return True
        if not 0 <= message.rank < MAX_RANKS:
            return False
        view = self.ranks.get(message.rank)
        if view is None:
            view = self.ranks[message.rank] = RankView(rank=message.rank)
        if isinstance(message, wire.Hello) and view.max_seq >= 0 and message.pid != view.pid:
            self._new_incarnation(view)
        late = self._sequence(view, message.seq)
        if late is None:
            return False
        view.received += 1
        view.sender_dropped += message.dropped
        view.first_seen = view.first_seen or received
        view.last_seen = max(view.last_seen or received, received)
        self.folded += 1
        if isinstance(message, wire.Step):
            self._apply_step(view, message, late)
        elif isinstance(message, wire.Heartbeat):
            if not late:
                self._apply_heartbeat(view, message, received)
        elif isinstance(message, wire.Hello):
            self._apply_hello(view, message)
        elif isinstance(message, wire.Aggregate):
            self._apply_aggregate(message)
        elif isinstance(message, wire.Event):
            self._apply_event(view, message)
        elif isinstance(message, wire.Bye):
            view.bye_code = message.exit_code
            view.phase = "done"
        return True

    @staticmethod
    def _sequence(view: RankView, seq: int) -> bool | None:
        """False: in order; True: late (counted lost before); None: duplicate."""
        if seq > view.max_seq:
            gap = seq - view.max_seq - 1
            if gap:
                view.lost += gap
                if len(view.missing) + gap <= MAX_MISSING:
                    view.missing.update(range(view.max_seq + 1, seq))
            view.max_seq = seq
            return False
        if seq in view.missing:
            view.missing.discard(seq)
            view.lost -= 1
            return True
        view.duplicates += 1
        return None

    @staticmethod
    def _new_incarnation(view: RankView) -> None:
        """The rank's process was restarted: a new sequence, a new life."""
        view.max_seq = -1
        view.missing = set()
        view.bye_code = None
        view.exited = False
        view.exit_code = view.signal = view.error = view.traceback = None
        view.stopped_by_daemon = False
        view.phase, view.phase_s, view.phase_at = "setup", 0.0, None
        view.coll_started = view.coll_completed = None
        view.last_step_t = None

    def _apply_hello(self, view: RankView, m: wire.Hello) -> None:
        view.host, view.pid, view.local_rank = m.host, m.pid, m.local_rank
        view.device, view.backend = m.device, m.backend
        self.world_size = self.world_size or m.world_size
        self.model, self.dataset, self.epochs = m.model, m.dataset, m.epochs
        self.global_batch, self.backend = m.global_batch, m.backend
        self.config_digest = m.config_digest
        self._event(m.t, m.rank, "join", f"rank {m.rank} joined: {m.host} pid {m.pid}, "
                    f"{m.device}, {m.backend}")
        if self.status == "starting":
            self.status = "running"

    def _apply_step(self, view: RankView, m: wire.Step, late: bool) -> None:
        view.samples += m.samples
        if late or m.steps <= 0:
            return  # a newer reading is already shown
        steps = m.steps
        rate = m.samples / m.step_s if m.step_s > 0 else None
        if view.last_step_t is not None and m.t > view.last_step_t:
            # Wall clock, so syncs count; never less than the steps took (a message sent
            # right after the previous one, at an epoch end, would otherwise spike).
            rate = m.samples / max(m.t - view.last_step_t, m.step_s)
        view.last_step_t = m.t
        view.epoch, view.step, view.steps_per_epoch = m.epoch, m.step, m.steps_per_epoch
        view.global_step = max(view.global_step, m.global_step)
        view.loss = m.loss_sum / m.samples if m.samples else None
        view.step_time_s = m.step_s / steps
        view.samples_per_s = rate
        view.comm_s = m.comm_s / steps
        view.comm_bytes = m.comm_bytes // steps
        view.comm_ops = m.comm_ops / steps
        view.algbw_gbps, view.busbw_gbps = m.algbw_gbps, m.busbw_gbps
        view.sync_wait_s += m.sync_wait_s
        view.phase_split = {"data": m.data_s / steps, "forward": m.forward_s / steps,
                            "backward": m.backward_s / steps, "optimizer": m.optimizer_s / steps}
        view.lr = m.lr
        view.cuda_allocated, view.cuda_reserved, view.rss = (
            m.cuda_allocated, m.cuda_reserved, m.rss)
        view.history.append(Point(m.t, m.global_step, view.loss or 0.0, rate or 0.0,
                                  view.comm_share or 0.0))
        if len(view.history) > HISTORY_POINTS:
            del view.history[: len(view.history) - HISTORY_POINTS]

    @staticmethod
    def _apply_heartbeat(view: RankView, m: wire.Heartbeat, received: float) -> None:
        view.phase, view.phase_s, view.phase_at = m.phase, m.phase_s, received
        view.coll_started, view.coll_completed = m.coll_started, m.coll_completed
        view.epoch = max(view.epoch, m.epoch)
        view.global_step = max(view.global_step, m.global_step)

    def _apply_aggregate(self, m: wire.Aggregate) -> None:
        # Every rank sends the same numbers; the first to arrive is kept.
        current = self.aggregate
        if current is not None and (current.global_step, current.scope) == (m.global_step, m.scope):
            return
        if current is None or m.global_step >= current.global_step:
            self.aggregate = m
            self.global_history.append(GlobalPoint(m.t, m.global_step, m.train_loss,
                                                   m.train_accuracy))
            if len(self.global_history) > HISTORY_POINTS:
                del self.global_history[: len(self.global_history) - HISTORY_POINTS]
        if m.scope == "epoch" and all(e.epoch != m.epoch or e.global_step != m.global_step
                                      for e in self.epochs_done):
            self.epochs_done.append(m)
            val = (f"; val loss {m.val_loss:.4f} acc {100 * m.val_accuracy:.2f}%"
                   if m.val_loss is not None and m.val_accuracy is not None else "")
            self._event(m.t, m.rank, "epoch_end", f"epoch {m.epoch + 1} done: train loss "
                        f"{m.train_loss:.4f} acc {100 * m.train_accuracy:.2f}%{val}")

    def _apply_event(self, view: RankView, m: wire.Event) -> None:
        if m.type == "error":
            view.error, view.traceback = m.message, m.traceback
        if m.type == "epoch_end":
            return  # shown from the aggregate, with the global metrics
        if m.type in ("checkpoint", "resumed", "stopped") and m.rank != 0:
            return  # rank 0 speaks for the run: every rank says the same
        self._event(m.t, m.rank, m.type, m.message, m.data, m.traceback)

    def _apply_daemon(self, m: wire.Message, received: float) -> None:
        if isinstance(m, wire.RankExit):
            view = self.ranks.get(m.exited)
            if view is None:
                view = self.ranks[m.exited] = RankView(rank=m.exited)
            view.exited, view.exit_code, view.signal = True, m.exit_code, m.signal
            view.stopped_by_daemon, view.pid = m.stopped_by_daemon, m.pid
            view.error = view.error or m.message
            view.traceback = view.traceback or m.traceback
            how = describe_exit(m.exit_code, m.signal)
            # The culprit may have been stopped by the daemon while it was still
            # exiting after its error; it failed by itself all the same.
            failed = m.culprit or (m.exit_code != 0 and not m.stopped_by_daemon)
            if m.culprit or (failed and self.failure is None):
                self.failure = {"rank": m.exited, "pid": m.pid, "exit_code": m.exit_code,
                                "signal": m.signal, "message": view.error,
                                "traceback": view.traceback, "global_step": view.global_step}
            if failed or m.exit_code != 0:
                by = " (stopped by the daemon)" if m.stopped_by_daemon else ""
                self._event(m.t, m.exited, "exit" if not failed else "error",
                            f"rank {m.exited} (pid {m.pid}) {how}{by}",
                            traceback=view.traceback if failed else None)
        elif isinstance(m, wire.RunStatus):
            if m.status == "restarting":
                self.failure = None
            self.status, self.restarts, self.status_message = m.status, m.restarts, m.message
            self.world_size = m.world_size or self.world_size
            self._event(m.t, m.rank, "status", m.message or f"run {m.status}")
        elif isinstance(m, wire.Event):
            if m.type == "restart":
                self.timeline.append(dict(m.data))
            self._event(m.t, m.rank, m.type, m.message, m.data, m.traceback)

    def _event(self, t: float, rank: int, type: str, message: str,
               data: dict[str, Any] | None = None, traceback: str | None = None) -> None:
        self.events.append({"t": t, "rank": rank, "type": type, "message": message,
                            "data": dict(data or {}), "traceback": traceback})
        self.event_count += 1
        if len(self.events) > MAX_EVENTS:
            del self.events[: len(self.events) - MAX_EVENTS]

    # -- what the fold tells -----------------------------------------------------------
    def rank_states(self, now: float) -> dict[int, str]:
        states = {r: v.state(now) for r, v in sorted(self.ranks.items())}
        for r in range(self.world_size):
            states.setdefault(r, STARTING if self._young(now) else SILENT)
        return dict(sorted(states.items()))

    def _young(self, now: float) -> bool:
        return self.started is None or now - self.started <= SILENT_AFTER_S * 6

    def stragglers(self) -> tuple[int | None, float, list[int]]:
        """(slowest rank, skew in s per step, straggling ranks) from compute time per
        step: in DDP every rank waits in the all-reduce for the slowest one, so the
        slowest is the one that computes longest and waits least."""
        busy = {r: v.compute_s for r, v in self.ranks.items()
                if v.compute_s is not None and not v.exited and v.bye_code is None}
        if len(busy) < 2:
            return None, 0.0, []
        values: dict[int, float] = {r: b for r, b in busy.items() if b is not None}
        slowest = max(values, key=lambda r: values[r])
        skew = values[slowest] - min(values.values())
        median = statistics.median(values.values())
        step = statistics.median(v.step_time_s or 0.0 for r, v in self.ranks.items() if r in busy)
        margin = max(STRAGGLER_MIN_S, STRAGGLER_STEP_SHARE * step)
        slow = [r for r, b in sorted(values.items())
                if b > median * STRAGGLER_FACTOR and b - median > margin]
        return slowest, skew, slow

    def hang(self, now: float) -> str | None:
        """Which ranks wait in which collective, and for whom, when some are stalled."""
        states = self.rank_states(now)
        stalled = [r for r, s in states.items() if s == STALLED]
        if not stalled:
            return None
        live = [r for r, s in states.items() if s in (RUNNING, STALLED, SILENT)]
        waiting = [r for r in live if self.ranks.get(r) is not None and self.ranks[r].in_collective]
        if not waiting:
            return "; ".join(f"rank {r} stalled {self.ranks[r].where()}" for r in stalled)
        newest = max(self.ranks[r].coll_started.seq for r in waiting)  # type: ignore[union-attr]
        inside = [r for r in waiting
                  if self.ranks[r].coll_started.seq == newest]  # type: ignore[union-attr]
        coll = self.ranks[inside[0]].coll_started
        assert coll is not None
        others = [r for r in live if r not in inside]
        text = f"{rank_list(inside)} wait in {coll.op} #{coll.seq}"
        for r in others:
            view = self.ranks.get(r)
            where = view.where() if view is not None else "not heard from"
            text += f"; rank {r} is {'silent, last ' if states[r] == SILENT else ''}{where}"
        dead = [r for r, s in states.items() if s == DEAD]
        if dead:
            text += f"; {rank_list(dead)} dead"
        return text

    def telemetry_loss(self) -> float:
        """Fraction of rank messages lost (sequence gaps), 0..1."""
        lost = sum(v.lost for v in self.ranks.values())
        total = lost + sum(v.received for v in self.ranks.values())
        return lost / total if total else 0.0

    def throughput(self, now: float) -> float:
        """Samples per second, all ranks that are running or stalled."""
        states = self.rank_states(now)
        return sum(v.samples_per_s or 0.0 for r, v in self.ranks.items()
                   if states.get(r) in (RUNNING, STALLED))

    def progress(self) -> tuple[int, int]:
        """(global steps done by the slowest rank, total global steps)."""
        spe = max((v.steps_per_epoch for v in self.ranks.values()), default=0)
        done = min((v.global_step for v in self.ranks.values()), default=0)
        return done, spe * self.epochs

    def summary(self, now: float) -> dict[str, Any]:
        """Plain data: for `ddtrain status --json` and the headless summary."""
        states = self.rank_states(now)
        slowest, skew, slow = self.stragglers()
        done, total = self.progress()
        agg = self.aggregate
        return {
            "run_id": self.run, "status": self.status, "world_size": self.world_size,
            "model": self.model, "dataset": self.dataset, "backend": self.backend,
            "restarts": self.restarts, "timeline": self.timeline, "failure": self.failure,
            "global_step": done, "total_steps": total,
            "samples_per_s": self.throughput(now),
            "telemetry_loss": self.telemetry_loss(), "rejected": dict(self.rejected),
            "slowest_rank": slowest, "skew_s": skew, "stragglers": slow,
            "hang": self.hang(now),
            "metrics": None if agg is None else {
                k: v for k, v in msgspec.to_builtins(agg).items()
                if k not in ("kind", "v", "run", "rank", "seq", "dropped")},
            "ranks": [{
                "rank": r, "state": state,
                "host": (v := self.ranks.get(r, RankView(rank=r))).host, "pid": v.pid,
                "epoch": v.epoch, "step": v.step, "global_step": v.global_step,
                "loss": v.loss, "samples_per_s": v.samples_per_s, "comm_share": v.comm_share,
                "exit_code": v.exit_code, "signal": v.signal, "phase": v.phase,
                "stopped_by_daemon": v.stopped_by_daemon,
                "last_seen_s": None if v.last_seen is None else max(0.0, now - v.last_seen),
                "lost": v.lost,
            } for r, state in states.items()],
        }


def describe_exit(exit_code: int | None, signal: str | None) -> str:
    if signal is not None:
        return f"was killed by {signal}"
    return f"exited with code {exit_code}"


def rank_list(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2, 5'; [3] -> 'rank 3'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    parts, start, prev = [], ranks[0], ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(f"{start}-{prev}" if prev > start else str(start))
        if r is not None:
            start = prev = r
    return "ranks " + ", ".join(parts)


_snapshot_encoder = msgspec.msgpack.Encoder()
_snapshot_decoder = msgspec.msgpack.Decoder(RunState)


def encode_snapshot(state: RunState) -> bytes:
    return _snapshot_encoder.encode(state)


def decode_snapshot(data: bytes) -> RunState:
    return _snapshot_decoder.decode(data)
