"""RankView: what is known about one rank, and what state that puts it in.

Folded by RunState (core/state.py) from the rank's messages and the daemon's
RankExit, in the order of the rank's sequence numbers (`sequence`: lost, late
and duplicate messages counted; `new_incarnation`: a restarted process starts
a new sequence); the state a rank is in (starting, running, stalled, silent, dead,
finished; unreached: never heard from) is derived here from those readings and
the time "now" the caller passes, so the rule is tested without waiting.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

from ddtop.core import memcreep, wire
from ddtop.core.stragglers import Evidence
from ddtop.core.thinned import Thinned, mean

SILENT_AFTER_S = 5.0  # no message for this long (heartbeats come every 1 s): silent
# A step phase lasting this long (and STALL_STEPS steps' time): stalled. A hung rank
# is named within max(5 s, 3 step times) of its fault: the others are in their
# collective a moment after it, and a heartbeat every second tells the phase.
STALL_MIN_S = 4.5
STALL_STEPS = 3
SLOW_PHASE_STALL_S = 300.0  # set-up, evaluation and checkpoints may take longer
HISTORY_POINTS = 120  # per rank ...
# ... and all ranks together, at most this many (a 16,384-rank job keeps 16 a
# rank): what a hub holds and a dashboard's snapshot carries stays bounded.
HISTORY_BUDGET = 262_144
MAX_MISSING = 10_000  # sequence numbers remembered as lost, per rank
# Work outside the steps (wire.STEP_PHASES), stalled only after SLOW_PHASE_STALL_S
# ("done" never).
SLOW_PHASES: tuple[wire.Phase, ...] = ("setup", "evaluation", "checkpoint")
# The upper bounds (s) of a step's time that /metrics' histogram counts steps by: from a
# small model's few ms to a big one's minute.
STEP_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                                   10.0, 30.0, 60.0)
STEP_SLOTS = len(STEP_BUCKETS) + 1  # and one for the slower

# A rank's state, as shown: `RankView.state` tells the first six from its readings;
# RunState.rank_states the rest, from the run's (LOST: core/summary.py).
RankState = Literal["starting", "running", "stalled", "silent", "dead", "finished",
                    "unreached", "unreachable", "lost"]
STARTING: Final = "starting"
RUNNING: Final = "running"
STALLED: Final = "stalled"
SILENT: Final = "silent"
DEAD: Final = "dead"
FINISHED: Final = "finished"
# Never heard from, long after the run started: its telemetry never reached the
# daemon (wrong CURVE keys, an endpoint it cannot reach), which is not a hang.
UNREACHED: Final = "unreached"
# On a node the hub cannot reach (or has lost): how it stands is unknown.
UNREACHABLE: Final = "unreachable"


def merge_points(a: Point, wa: int, b: Point, wb: int) -> Point:
    """Two readings as one (core/thinned.py), weighted: at the later one's step and time."""
    return Point(b.t, b.global_step, mean(a.loss, wa, b.loss, wb),
                 mean(a.samples_per_s, wa, b.samples_per_s, wb),
                 mean(a.comm_share, wa, b.comm_share, wb),
                 # The higher of the two: a thinned chart keeps the peaks (what runs out).
                 b.memory if a.memory is None else a.memory if b.memory is None
                 else max(a.memory, b.memory))


def history_points(world_size: int) -> int:
    """Points of history kept per rank in a job of `world_size` ranks."""
    return max(8, min(HISTORY_POINTS, HISTORY_BUDGET // max(1, world_size)))


class Point(msgspec.Struct, array_like=True):
    """One Step message's reading, for charts: None where the rank did not report it
    (a zero-code rank's loss and samples), never 0."""

    t: float
    global_step: int
    loss: float | None
    samples_per_s: float | None
    comm_share: float | None
    memory: int | None = None  # bytes: CUDA allocated where it uses CUDA, else its RSS


class RankView(msgspec.Struct, kw_only=True):
    rank: int
    # From hello.
    host: str = ""
    pid: int | None = None
    local_rank: int | None = None
    device: str = ""
    backend: str = ""
    collectives: bool = False  # every collective it enters is seen (zero-code: its hello)
    communicated: bool = False  # one was: a step's communication, a heartbeat's collective
    # Progress, from step messages (the newest one; totals over all).
    epoch: int | None = None  # from 0; None: not known (a script's sampler never set_epoch'd)
    step: int = 0
    steps_per_epoch: int = 0
    global_step: int = 0
    samples: int = 0
    stepping_s: float = 0.0  # the time its samples took: the spans its step messages covered
    # Every Step message's sums, added up (/metrics' counters): its steps' time, of it in
    # communication, and in the data phase (waiting for its batches).
    step_s_total: float = 0.0
    comm_s_total: float = 0.0
    data_s_total: float = 0.0
    # ... and its work's phases, and its steps by time (STEP_BUCKETS: each message's steps
    # at their mean time; the last count, those slower than every bound).
    forward_s_total: float = 0.0
    backward_s_total: float = 0.0
    optimizer_s_total: float = 0.0
    step_buckets: list[int] = msgspec.field(default_factory=lambda: [0] * STEP_SLOTS)
    loss: float | None = None
    step_time_s: float | None = None  # per step
    samples_per_s: float | None = None
    comm_s: float | None = None  # per step
    comm_bytes: int | None = None  # per step
    comm_ops: float | None = None  # collectives per step (gradient buckets), averaged
    comm_overlap_s: float | None = None  # per step, of comm_s: overlapping the rank's work
    algbw_gbps: float | None = None
    busbw_gbps: float | None = None
    sync_wait_s: float = 0.0  # total
    phase_split: dict[str, float] = {}  # seconds per step: data, forward, backward, optimizer
    lr: float | None = None
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    rss: int | None = None
    rss_peak: int | None = None  # the peaks so far, as the rank read them
    cuda_peak: int | None = None
    # Its memory's current run of growth ("memory creeping": core/memcreep.py).
    creep: memcreep.Creep = msgspec.field(default_factory=memcreep.Creep)
    last_step_t: float | None = None  # sender time of the newest step message
    # Liveness, from heartbeats (receiver clock).
    phase: wire.Phase = "setup"
    phase_s: float = 0.0
    phase_at: float | None = None
    # Global steps done when the phase reading was taken: the heartbeat's, or a
    # newer Step message's (a step done since ends the phase and any collective
    # the heartbeat said; RunState._apply_step). -1: no reading in this process.
    phase_step: int = -1
    # In the data phase: inside its data loader (True), between steps outside it
    # (False), or not known (None: another phase, a sender that does not say).
    loader: bool | None = None
    # Between steps: where its main thread is in the script ("train.py:88 in main").
    at: str | None = None
    # When (receiver clock) a Step message last moved phase_step past a heartbeat's.
    stepped_at: float | None = None
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
    left_early: bool = False  # exit code 0 before its work was done (core/blame.py)
    error: str | None = None
    traceback: str | None = None
    # Telemetry accounting.
    max_seq: int = -1
    received: int = 0
    lost: int = 0
    duplicates: int = 0
    sender_dropped: int = 0
    missing: set[int] = set()
    # Against forged numbers (RunState._below): the sequence as it stood before the
    # rank's first gap since it was last set back (its number, lost, global step and
    # epoch); the newest of the messages that came at or below the newest number,
    # and how many such came in a row, each past the one before.
    before: tuple[int, int, int, int | None] | None = None
    below_seq: int = -1
    below_run: int = 0
    history: list[Point] = []
    whole: Thinned[Point] = msgspec.field(default_factory=Thinned)  # the whole run, even
    # Whether the others wait for it: windows of its steps, judged (core/stragglers.py).
    evidence: Evidence = msgspec.field(default_factory=Evidence)

    # -- its messages' order ---------------------------------------------------------
    def sequence(self, seq: int) -> bool | None:
        """Count message `seq` in: False: in order; True: late (counted lost
        before); None: a duplicate (counted, to be ignored)."""
        if seq > self.max_seq:
            gap = seq - self.max_seq - 1
            if gap:
                if self.before is None:
                    self.before = (self.max_seq, self.lost, self.global_step, self.epoch)
                self.lost += gap
                if len(self.missing) + gap <= MAX_MISSING:
                    self.missing.update(range(self.max_seq + 1, seq))
            self.max_seq = seq
            return False
        if seq in self.missing:
            self.missing.discard(seq)
            self.lost -= 1
            return True
        self.duplicates += 1
        return None

    def set_back(self, seq: int) -> None:
        """Message `seq` shows the rank's own sequence goes on below the numbers
        taken above it (RunState._below): those were forged. The sequence is set back
        to just before `seq`, as it stood then (the numbers above it neither seen nor
        lost; the global step and epoch from before the first gap, none where that
        lies above `seq`), so `seq` and what follows it are folded as new."""
        top = seq - 1
        self.missing = {s for s in self.missing if s <= top}
        if self.before is not None and self.before[0] <= top:
            start, lost, self.global_step, self.epoch = self.before
            self.lost = lost + sum(1 for s in self.missing if s > start)
        else:
            self.lost = max(0, self.lost - (self.max_seq - top))
            self.global_step, self.epoch = 0, None  # its next step or heartbeat says
        self.max_seq, self.before = top, None
        self.below_seq, self.below_run = -1, 0
        self.phase_step, self.last_step_t = -1, None

    def new_incarnation(self) -> None:
        """The rank's process was restarted: a new sequence, a new life."""
        self.max_seq = -1
        self.missing = set()
        self.before, self.below_seq, self.below_run = None, -1, 0
        self.bye_code = None
        self.exited = False
        self.exit_code = self.signal = self.error = self.traceback = None
        self.stopped_by_daemon = False
        self.phase, self.phase_s, self.phase_at, self.phase_step = "setup", 0.0, None, -1
        self.stepped_at = None
        self.coll_started = self.coll_completed = None
        self.last_step_t = None
        self.evidence = Evidence()

    # -- derived ------------------------------------------------------------------
    @property
    def comm_share(self) -> float | None:
        if self.comm_s is None or not self.step_time_s:
            return None
        return min(1.0, self.comm_s / self.step_time_s)

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

    def state(self, now: float) -> RankState:
        if self.exited:
            return FINISHED if self.exit_code == 0 and not self.left_early else DEAD
        if self.bye_code is not None:
            return FINISHED if self.bye_code == 0 else DEAD
        if self.last_seen is None:
            return STARTING
        if now - self.last_seen > SILENT_AFTER_S:
            return SILENT
        # phase_elapsed(now) > stall_after(), written out: this runs for every rank
        # at every summary, half the time of the two calls (8 ms at 16,384 ranks);
        # tests/test_big_summary.py checks it against them.
        at = self.phase_at
        if at is None:  # elapsed 0: under any limit
            return RUNNING
        elapsed = self.phase_s + (now - at if now > at else 0.0)
        if self.phase in wire.STEP_PHASES:
            steps = STALL_STEPS * (self.step_time_s or 0.0)
            return STALLED if elapsed > (steps if steps > STALL_MIN_S else STALL_MIN_S) else RUNNING
        if self.phase == "done":
            return RUNNING
        return STALLED if elapsed > SLOW_PHASE_STALL_S else RUNNING

    def stall_after(self) -> float:
        if self.phase not in wire.STEP_PHASES:
            return float("inf") if self.phase == "done" else SLOW_PHASE_STALL_S
        return max(STALL_MIN_S, STALL_STEPS * (self.step_time_s or 0.0))

    def where(self) -> str:
        """Where the rank is, in words: 'in allreduce #12 (4.2 MB)' or 'in forward of step 7'."""
        if self.in_collective:
            assert self.coll_started is not None
            c = self.coll_started
            size = f" ({c.bytes / 1e6:.1f} MB)" if c.bytes else ""
            return f"in {c.op} #{c.seq}{size}"
        if self.phase == "data" and self.loader is False:
            return (f"in Python between steps {self.global_step} and {self.global_step + 1}, "
                    "outside any collective and its data loader"
                    + (f" ({self.at})" if self.at else ""))
        return f"in {self.phase} of step {self.global_step + 1}"
