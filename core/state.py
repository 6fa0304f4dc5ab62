"""RunState: everything known about a run, folded from its telemetry messages.

This is the one fold. The daemon applies every message it accepts (and its own RankExit /
Restarting / RunStatus / Event messages) to a RunState, answers `status` and `snapshot`
requests from it, and journals the same messages; a dashboard starts from a snapshot and
applies the live messages newer than it; a replay applies the journal. No torch, no sockets,
no clock: the caller passes the time a message was received, and the time "now" when it asks
what a rank's state is, so the fold is tested on recorded sequences without waiting.

Per rank, messages are ordered by their sequence number `seq`:
- a jump forward counts the skipped numbers as lost (they may still arrive);
- a number that was counted lost and arrives late is un-lost; a late step adds
  its samples to the totals but does not overwrite newer readings;
- a number already seen is a duplicate: counted and ignored;
- a `hello` with a new pid (a restarted rank) starts a new sequence
  (RankView.sequence and new_incarnation, core/rankview.py).

It records typed events for people (core/events.py); `summary` is a RunSummary (summary.py).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping

import msgspec

from ddtop.core import alone, desync, hangs, rankstates, stragglers, wire
from ddtop.core import summary as told
from ddtop.core.bounds import MAX_JOB_RANKS
from ddtop.core.contract import describe_exit
from ddtop.core.events import (
    EVIDENCE_KEY,
    MAX_EVENTS,
    MAX_EVIDENCE,
    EventData,
    EventKind,
    RunEvent,
    epoch_words,
    shown,
)
from ddtop.core.rankview import DEAD as DEAD  # re-exported: rank states live here too
from ddtop.core.rankview import FINISHED as FINISHED
from ddtop.core.rankview import (
    HISTORY_POINTS,
    RUNNING,
    SILENT_AFTER_S,
    STALLED,
    STEP_BUCKETS,
    Point,
    RankState,
    RankView,
    history_points,
    merge_points,
)
from ddtop.core.rankview import SILENT as SILENT
from ddtop.core.rankview import STARTING as STARTING
from ddtop.core.rankview import UNREACHED as UNREACHED
from ddtop.core.scalars import keep_newest, summaries
from ddtop.core.summary import LOST, Failure, RunSummary, ScalarSummary, Status
from ddtop.core.thinned import Thinned, mean

MAX_RANKS = MAX_JOB_RANKS  # the ranks one fold holds: a job's (core/bounds.py)
# A rank that has spoken sends its next message with the next sequence number, or
# a few later where some were lost. A message further ahead than this is held, not
# folded (counted in rejected `seq_jump`): it is taken only when the rank's next
# message follows it (a real gap: both folded, the count taken back); when the
# next one follows the rank's own sequence instead, the held one was forged and
# is dropped. Forged numbers taken all the same (two or more in a row, far ahead, or
# any number of them under the bound) are undone by the rank's own messages, which
# go on from below them (`_below`): the sequence is set back to the rank's own
# (RankView.set_back, counted in `seq_jump`), and its messages are folded as new.
# So forged numbers ahead, of any size and however many, cannot make the rank's
# own messages look old.
MAX_SEQ_JUMP = 1_000
# Messages of a rank arrive in order (one ZeroMQ connection); one that fills a gap
# late is folded as late. This many in a row, each past the one before, at or below
# the newest number taken, are the rank's own sequence going on beneath forged ones.
MAX_LATE_RUN = 3
MAX_HELD = 64  # messages held at once (a forger's flood); the oldest is dropped


class GlobalPoint(msgspec.Struct, array_like=True):
    """One metric sync's global numbers, for charts."""

    t: float
    global_step: int
    train_loss: float
    train_accuracy: float


def _counted(seconds: float) -> float:
    return seconds if math.isfinite(seconds) and seconds >= 0 else 0.0


def _merge_global(a: GlobalPoint, wa: int, b: GlobalPoint, wb: int) -> GlobalPoint:
    loss, accuracy = (mean(a.train_loss, wa, b.train_loss, wb),
                      mean(a.train_accuracy, wa, b.train_accuracy, wb))
    assert loss is not None and accuracy is not None
    return GlobalPoint(b.t, b.global_step, loss, accuracy)


class RunState(msgspec.Struct, kw_only=True):
    run: str
    world_size: int = 0
    model: str = ""
    dataset: str = ""
    epochs: int = 0
    global_batch: int = 0
    program: str = ""  # a user's own script (ddtop.init), else ""
    total_steps: int = 0  # the script's own total (ddtop.init(total_steps=)), else 0
    backend: str = ""
    strategy: str = ""  # the built-in trainer's --strategy (ddp, fsdp, ...), else ""
    config_digest: str = ""
    status: Status = "starting"
    status_message: str = ""
    exit_code: int | None = None  # from the daemon's final RunStatus
    ended: float | None = None  # its time (the daemon's wall clock)
    last_checkpoint: float | None = None  # the newest checkpoint event's time (its rank's)
    restarts: int = 0
    timeline: list[wire.Restart] = []  # restarts: which rank, why, at what step, from where
    failure: Failure | None = None
    started: float | None = None  # receiver clock
    updated: float | None = None  # receiver time of the newest message folded
    ranks: dict[int, RankView] = {}
    aggregate: wire.Aggregate | None = None  # newest global metrics
    epochs_done: list[wire.Aggregate] = []
    events: list[RunEvent] = []  # the newest MAX_EVENTS (core/events.py)
    event_count: int = 0  # events ever recorded: readers print those after the last they saw
    global_history: list[GlobalPoint] = []  # metric syncs, newest HISTORY_POINTS
    global_whole: Thinned[GlobalPoint] = msgspec.field(default_factory=Thinned)  # all of them
    scalars: dict[str, dict[int, float]] = {}  # ddtop.log: key -> rank -> newest value
    scalars_dropped: int = 0  # keys over MAX_RUN_SCALAR_KEYS (core/scalars.py), ignored
    folded: int = 0
    rejected: dict[str, int] = {}  # frames the daemon refused, by reason (not in the journal)
    held: dict[int, wire.Message] = {}  # rank -> a message far ahead of its sequence (apply)
    straggler_rounds: stragglers.Rounds = msgspec.field(default_factory=stragglers.Rounds)
    # Each group's collectives the ranks had entered at the same steps (core/desync.py).
    counts: desync.Counts = msgspec.field(default_factory=desync.Counts)
    alone: str | None = None  # ranks that never communicated, in words (core/alone.py)
    journal_dropped: int = 0  # records accepted but not written to the journal (a full disk)
    # The evidence the daemon gathered (daemon/evidence.py): its folders, as its events
    # name them, the newest MAX_EVIDENCE.
    evidence: list[str] = []
    # A multi-node job (daemon/hub.py): each rank's node, and each node's state
    # (up, unreachable, lost, done), from the hub's node events.
    rank_nodes: dict[int, int] = {}
    node_states: dict[int, wire.NodeState] = {}
    # Node K's own daemon: the ranks it runs (the others are the hub's to show).
    local_ranks: list[int] = []

    # -- folding -------------------------------------------------------------------
    def apply(self, message: wire.Message, received: float) -> bool:
        """Fold one message received at `received`; False when it was ignored
        (a duplicate, or from a rank number out of range)."""
        if self.started is None:
            self.started = received
        self.updated = max(self.updated or received, received)
        if isinstance(message, wire.NodeSummary):
            return message.rank == wire.DAEMON_RANK and self._apply_summary(message, received)
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
            view.new_incarnation()
            self.held.pop(message.rank, None)
        elif view.max_seq >= 0 and message.seq - view.max_seq > MAX_SEQ_JUMP:
            return self._jump(view, message, received)
        elif self.held.pop(message.rank, None) is not None:
            pass  # the rank's own sequence goes on: what was held was forged (counted)
        return self._sequenced(view, message, received)

    def _sequenced(self, view: RankView, message: wire.Message, received: float) -> bool:
        if message.seq <= view.max_seq and self._below(view, message.seq):
            view.set_back(message.seq)
            self.rejected["seq_jump"] = self.rejected.get("seq_jump", 0) + 1
        late = view.sequence(message.seq)
        if late is None:
            return False
        view.received += 1
        view.sender_dropped += message.dropped
        self._fold_rank(view, message, late, received)
        return True

    @staticmethod
    def _below(view: RankView, seq: int) -> bool:
        """Message `seq`, at or below the rank's newest number: whether it shows the
        numbers taken above it were forged. Yes when it lies more than MAX_SEQ_JUMP
        below (no late message is that late; a jump was taken), or when it makes
        MAX_LATE_RUN in a row below, each past the one before (more than a gap filled
        late: the rank's own sequence going on)."""
        if view.max_seq - seq > MAX_SEQ_JUMP:
            return True
        if view.below_seq < seq <= view.below_seq + MAX_SEQ_JUMP:
            view.below_run += 1
        else:
            view.below_run = 1
        view.below_seq = seq
        return view.below_run >= MAX_LATE_RUN

    def _jump(self, view: RankView, message: wire.Message, received: float) -> bool:
        """A message more than MAX_SEQ_JUMP ahead of the rank's sequence: folded,
        with the one held before it, when it follows that one; else held."""
        held = self.held.pop(message.rank, None)
        if held is not None and 0 < message.seq - held.seq <= MAX_SEQ_JUMP:
            self.rejected["seq_jump"] -= 1  # a real gap after all
            if not self.rejected["seq_jump"]:
                del self.rejected["seq_jump"]
            self._sequenced(view, held, received)
            return self._sequenced(view, message, received)
        if len(self.held) >= MAX_HELD:
            del self.held[next(iter(self.held))]
        self.held[message.rank] = message
        self.rejected["seq_jump"] = self.rejected.get("seq_jump", 0) + 1
        return False

    def _apply_summary(self, summary: wire.NodeSummary, received: float) -> bool:
        """Node `summary.node`'s summary (daemon/summariser.py): its ranks' messages in
        the order the node sent them, without their sequence numbers; its accounting
        (received, lost, duplicates, dropped) as the node counted it."""
        for message in summary.messages:
            rank = message.rank
            if not 0 <= rank < (self.world_size or MAX_RANKS):
                continue
            view = self.ranks.get(rank)
            if view is None:
                view = self.ranks[rank] = RankView(rank=rank)
            if (isinstance(message, wire.Hello) and (view.max_seq >= 0 or view.pid is not None)
                    and message.pid != view.pid):
                view.new_incarnation()  # a restarted rank, as apply tells it
            view.max_seq = max(view.max_seq, message.seq)
            self.rank_nodes[rank] = summary.node
            self._fold_rank(view, message, False, received)
        for account in summary.accounts:
            view = self.ranks.get(account.rank)
            if view is not None:
                view.received, view.lost = account.received, account.lost
                view.duplicates, view.sender_dropped = account.duplicates, account.dropped
        return True

    def _fold_rank(self, view: RankView, message: wire.Message, late: bool,
                   received: float) -> None:
        """One rank message, its order settled (`late`: counted lost before)."""
        view.first_seen = view.first_seen or received
        view.last_seen = max(view.last_seen or received, received)
        self.folded += 1
        if isinstance(message, wire.Step):
            self._apply_step(view, message, late, received)
        elif isinstance(message, wire.Heartbeat):
            if not late:
                self._apply_heartbeat(view, message, received)
        elif isinstance(message, wire.Hello):
            self._apply_hello(view, message)
        elif isinstance(message, wire.Aggregate):
            self._apply_aggregate(message)
        elif isinstance(message, wire.Event):
            self._apply_event(view, message)
        elif isinstance(message, wire.Scalars):
            if not late:
                self.scalars_dropped += keep_newest(self.scalars, message.rank, message.values)
        elif isinstance(message, wire.Bye):
            view.bye_code, view.phase = message.exit_code, "done"

    def _apply_hello(self, view: RankView, m: wire.Hello) -> None:
        # A script's rank says hello again when it learns more (its model, device,
        # backend, totals): the same process updates what it said, no second join.
        again = bool(view.host) and view.pid == m.pid
        if view.pid and not again:  # a rank's new process (a restart) counts from 0 again
            self.counts.restart()
        view.host, view.pid, view.local_rank = m.host, m.pid, m.local_rank
        view.device, view.backend, view.collectives = m.device, m.backend, m.collectives is True
        self.world_size = self.world_size or m.world_size
        self.model, self.dataset, self.epochs = m.model, m.dataset, m.epochs
        self.global_batch, self.backend = m.global_batch, m.backend
        self.config_digest = m.config_digest
        if not isinstance(m.program, msgspec.UnsetType):
            self.program = m.program
        if not isinstance(m.total_steps, msgspec.UnsetType):
            self.total_steps = max(0, m.total_steps)
        if not isinstance(m.strategy, msgspec.UnsetType):
            self.strategy = m.strategy
        if not again:
            where = ", ".join(part for part in (f"{m.host} pid {m.pid}", m.device, m.backend)
                              if part)  # a script's backend is not known at its first hello
            self._event(m.t, m.rank, "join", f"rank {m.rank} joined: {where}")
        if self.status == "starting":
            self.status = "running"

    def _apply_step(self, view: RankView, m: wire.Step, late: bool, received: float) -> None:
        view.samples += m.samples
        # Counters (what a reading's _total series serve): what is not a finite,
        # non-negative number is left out, never added (a NaN would stay for good).
        view.step_s_total += _counted(m.step_s)
        view.comm_s_total += _counted(m.comm_s)
        view.data_s_total += _counted(m.data_s)
        view.forward_s_total += _counted(m.forward_s)
        view.backward_s_total += _counted(m.backward_s)
        view.optimizer_s_total += _counted(m.optimizer_s)
        if m.steps > 0 and math.isfinite(m.step_s) and m.step_s >= 0:
            view.step_buckets[bisect.bisect_left(STEP_BUCKETS, m.step_s / m.steps)] += m.steps
        if not isinstance(m.group_counts, msgspec.UnsetType):
            self.counts.add(m.rank, m.group_counts, self.world_size, self.ranks)
        if late or m.steps <= 0:
            return  # a newer reading is already shown
        if view.phase_at is not None and m.global_step > view.phase_step:
            # A step done since the rank's newest heartbeat (one a second): the phase
            # and the collective that heartbeat named are over (a stopped rank that
            # resumes, and the ranks that waited for it, step at once). As the
            # rank's own clock does, the phase starts again with the step.
            view.phase_s, view.phase_at, view.phase_step = 0.0, received, m.global_step
            view.stepped_at = received
            view.loader, view.at = False, None  # (a step ends outside the data loader)
            if view.phase == "setup":
                view.phase = "data"
            if view.in_collective:
                view.coll_completed = view.coll_started
        runq = None if isinstance(m.runq_s, msgspec.UnsetType) else m.runq_s
        faults = None if isinstance(m.major_faults, msgspec.UnsetType) else m.major_faults
        host = runq is not None and faults is not None  # (the host's readings: both, or none)
        split = stragglers.Window(
            data_s=m.data_s, work_s=max(0.0, m.step_s - m.comm_s - m.data_s),
            runq_s=runq if host and runq is not None else 0.0,
            faults=faults if host and faults is not None else 0,
            host_steps=m.steps if host else 0)
        stragglers.add_steps(self.straggler_rounds, view.evidence, m.steps, m.step_s, m.comm_s,
                             received, self.world_size, self._stepping, m.compute_trim_s, split)
        steps, span = m.steps, m.step_s
        if view.last_step_t is not None and m.t > view.last_step_t:
            # Wall clock, so syncs count; never less than the steps took (a message sent
            # right after the previous one, at an epoch end, would otherwise spike).
            span = max(m.t - view.last_step_t, m.step_s)
        rate = m.samples_per_s(span)
        view.stepping_s += span
        view.last_step_t = m.t
        view.epoch, view.step, view.steps_per_epoch = m.epoch, m.step, m.steps_per_epoch
        view.global_step = max(view.global_step, m.global_step)
        view.communicated = view.communicated or m.comm_ops > 0
        if (self.alone is None and not view.communicated
                and (said := alone.never_communicated(self.ranks, self.world_size))):
            self.alone = said
            self._event(m.t, wire.DAEMON_RANK, "warning", said)
        view.loss = m.mean_loss()
        view.step_time_s = m.step_s / steps
        view.samples_per_s = rate
        view.comm_s = m.comm_s / steps
        view.comm_bytes = m.comm_bytes // steps
        view.comm_ops = m.comm_ops / steps
        view.algbw_gbps, view.busbw_gbps = m.algbw_gbps, m.busbw_gbps
        view.comm_overlap_s = (None if isinstance(m.comm_overlap_s, msgspec.UnsetType)
                               else m.comm_overlap_s / steps)
        view.sync_wait_s += m.sync_wait_s
        view.phase_split = {"data": m.data_s / steps, "forward": m.forward_s / steps,
                            "backward": m.backward_s / steps, "optimizer": m.optimizer_s / steps}
        view.lr = m.lr
        view.cuda_allocated, view.cuda_reserved, view.rss = m.cuda_allocated, m.cuda_reserved, m.rss
        view.rss_peak, view.cuda_peak = m.rss_peak, m.cuda_peak
        view.creep.add(received, view.memory)
        point = Point(m.t, m.global_step, view.loss, rate, view.comm_share, view.memory)
        view.history.append(point)
        if len(view.history) > (keep := history_points(self.world_size)):
            del view.history[: len(view.history) - keep]
        view.whole.add(point, keep, merge_points)

    def _stepping(self) -> dict[int, stragglers.Evidence]:
        """Every running rank's straggler evidence (once per round of windows)."""
        return {r: v.evidence for r, v in self.ranks.items()
                if not v.exited and v.bye_code is None}

    @staticmethod
    def _apply_heartbeat(view: RankView, m: wire.Heartbeat, received: float) -> None:
        view.phase, view.phase_s, view.phase_at = m.phase, m.phase_s, received
        view.loader = None if isinstance(m.loader, msgspec.UnsetType) else m.loader
        view.at = None if isinstance(m.at, msgspec.UnsetType) else m.at
        view.phase_step = m.global_step
        view.coll_started, view.coll_completed = m.coll_started, m.coll_completed
        view.communicated = view.communicated or m.coll_started is not None
        if m.epoch is not None and (view.epoch is None or m.epoch > view.epoch):
            view.epoch = m.epoch  # never lowered by a heartbeat; None says nothing
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
            self.global_whole.add(self.global_history[-1], HISTORY_POINTS, _merge_global)
        if m.scope == "epoch" and all(e.epoch != m.epoch or e.global_step != m.global_step
                                      for e in self.epochs_done):
            self.epochs_done.append(m)
            self._event(m.t, m.rank, "epoch_end", epoch_words(m))

    def _apply_event(self, view: RankView, m: wire.Event) -> None:
        if m.type == "error":
            view.error, view.traceback = m.message, m.traceback
        if shown(m):
            self._event(m.t, m.rank, m.type, m.message, m.data, m.traceback)

    def _apply_daemon(self, m: wire.Message, received: float) -> None:
        if isinstance(m, wire.RankExit) and m.exited < 0:  # a node, blamed as a whole
            if m.culprit:
                self.failure = Failure(rank=m.exited, pid=m.pid, exit_code=m.exit_code,
                                       signal=m.signal, reason=m.reason, node=m.node)
                self._event(m.t, m.rank, "error", self.failure.line())
        elif isinstance(m, wire.RankExit):
            view = self.ranks.get(m.exited)
            if view is None:
                view = self.ranks[m.exited] = RankView(rank=m.exited)
            view.exited, view.exit_code, view.signal = True, m.exit_code, m.signal
            view.stopped_by_daemon, view.pid = m.stopped_by_daemon, m.pid
            view.left_early = m.left_early
            view.error = view.error or m.message
            view.traceback = view.traceback or m.traceback
            how = m.reason or describe_exit(m.exit_code, m.signal)
            # The culprit may have been stopped by the daemon while it was still
            # exiting after its error; it failed by itself all the same.
            failed = m.culprit or (m.exit_code != 0 and not m.stopped_by_daemon)
            if m.culprit or (failed and self.failure is None):
                self.failure = Failure(rank=m.exited, pid=m.pid, exit_code=m.exit_code,
                                       signal=m.signal, message=view.error,
                                       traceback=view.traceback, global_step=view.global_step,
                                       node=self.rank_nodes.get(m.exited), reason=m.reason)
            if failed or m.exit_code != 0:
                # A reason says who stopped it where the daemon did not (SLURM's scancel).
                by = " (stopped by the daemon)" if m.stopped_by_daemon and not m.reason else ""
                self._event(m.t, m.exited, "exit" if not failed else "error",
                            f"rank {m.exited} (pid {m.pid}) {how}{by}",
                            traceback=view.traceback if failed else None)
        elif isinstance(m, wire.RunStatus):
            if m.status == "restarting":
                self.failure = None
            self.status, self.restarts, self.status_message = m.status, m.restarts, m.message
            final = m.status in wire.FINAL_STATUSES
            self.exit_code, self.ended = (m.exit_code, m.t) if final else (None, None)
            self.world_size = m.world_size or self.world_size
            self._event(m.t, m.rank, "status", m.message or f"run {m.status}")
        elif isinstance(m, wire.Restarting):
            self.timeline.append(m.restart)
            self._event(m.t, m.rank, "restart", m.message, msgspec.to_builtins(m.restart))
        elif isinstance(m, wire.Event):
            if m.node is not None:
                self._apply_node(m.node)
            if isinstance(folder := m.data.get(EVIDENCE_KEY), str):
                self.evidence = [*self.evidence, folder][-MAX_EVIDENCE:]
            self._event(m.t, m.rank, m.type, m.message, m.data, m.traceback)

    def _apply_node(self, news: wire.NodeNews) -> None:
        if len(self.node_states) < MAX_RANKS or news.node in self.node_states:
            self.node_states[news.node] = news.node_state
        for rank in news.ranks:
            self.rank_nodes[rank] = news.node
        if news.local and news.ranks:
            self.local_ranks = sorted(r for r, k in self.rank_nodes.items() if k == news.node)

    def _event(self, t: float, rank: int, type: EventKind, message: str,
               data: EventData | None = None, traceback: str | None = None) -> None:
        if type == "checkpoint":
            self.last_checkpoint = t
        self.events.append(RunEvent(t=t, rank=rank, type=type, message=message,
                                    data=dict(data or {}), traceback=traceback))
        self.event_count += 1
        if len(self.events) > MAX_EVENTS:
            del self.events[: len(self.events) - MAX_EVENTS]

    # -- what the fold tells -----------------------------------------------------------
    def rank_states(self, now: float) -> dict[int, RankState]:
        """Each rank's state at `now`, by rank number (core/rankstates.py)."""
        return rankstates.derive(self.ranks, now, world_size=self.world_size,
                                 young=self._young(now), local_ranks=self.local_ranks,
                                 rank_nodes=self.rank_nodes, node_states=self.node_states,
                                 lost=self.status == LOST)

    def _young(self, now: float) -> bool:
        return self.started is None or now - self.started <= SILENT_AFTER_S * 6

    def stragglers(self) -> tuple[int | None, float, list[int]]:
        """(slowest rank, how much longer it computes per step than the median of
        the others in s, straggling ranks): the ranks the others have persistently
        waited for in the all-reduce over the last windows of steps, among those
        still stepping (core/stragglers.py); (None, 0.0, []) without evidence."""
        return stragglers.named(
            (r, v.evidence) for r, v in self.ranks.items()
            if v.evidence.verdict.named and not v.exited and v.bye_code is None
            and not stragglers.quiet(v.evidence, self.updated))

    def creeping(self) -> dict[int, str]:
        """The ranks whose memory creeps, in words (core/memcreep.py), of those not
        ended."""
        return {r: words for r, v in self.ranks.items()
                if not v.exited and (words := v.creep.words()) is not None}

    def straggler_causes(self, slow: list[int] | None = None) -> dict[int, tuple[str, str]]:
        """Each straggler's cause and its words (core/causes.py), where judged; `slow`:
        the stragglers where the caller has them already (stragglers() goes over every
        rank)."""
        if slow is None:
            _, _, slow = self.stragglers()
        return {r: c for r in slow if (c := self.ranks[r].evidence.cause) is not None}

    def hang(self, now: float) -> str | None:
        """Which ranks wait in which collective, and for whom, when some are stalled."""
        found = self.hung(now)
        return found[1] if found is not None else None

    def hung(self, now: float) -> tuple[list[int], str] | None:
        """When some ranks are stalled: the ranks the others wait for, and the hang
        in words (core/hangs.py); None when none is."""
        return hangs.hung(self.ranks, self.rank_states(now), self.counts.found)

    def telemetry_loss(self) -> float:
        """Fraction of rank messages lost (sequence gaps), 0..1."""
        lost = sum(v.lost for v in self.ranks.values())
        total = lost + sum(v.received for v in self.ranks.values())
        return lost / total if total else 0.0

    def throughput(self, now: float) -> float | None:
        """Samples per second, all ranks that are running or stalled; once the run has
        ended, its average: each rank's samples over the time its steps took, summed.
        None where no rank reported its samples (a zero-code run): never 0 for missing."""
        return self._throughput(now, None)

    def _throughput(self, now: float, states: Mapping[int, RankState] | None) -> float | None:
        """throughput(now), from the `states` at `now` where the caller has them."""
        if told.ended(self.status):
            rates = [v.samples / v.stepping_s for v in self.ranks.values()
                     if v.stepping_s and v.samples]
        else:
            states = self.rank_states(now) if states is None else states
            rates = [v.samples_per_s for r, v in self.ranks.items()
                     if v.samples_per_s is not None and states.get(r) in (RUNNING, STALLED)]
        return sum(rates) if rates else None

    def progress(self) -> tuple[int, int]:
        """(global steps done by the slowest rank, total global steps)."""
        spe = max((v.steps_per_epoch for v in self.ranks.values()), default=0)
        done = min((v.global_step for v in self.ranks.values()), default=0)
        return done, self.total_steps or spe * self.epochs

    def eta(self, now: float) -> float | None:
        """Seconds left at the current global rate (steps of the slowest rank); None
        when the total is not known (a script that gave none): no made-up ETA."""
        done, total = self.progress()
        if not total or done >= total or told.ended(self.status):
            return None
        if not self.global_batch:  # a script: its ranks' time per step instead
            times = [v.step_time_s for v in self.ranks.values() if v.step_time_s]
            return (total - done) * max(times) if times else None
        rate = self.throughput(now)
        if rate is None or rate <= 0:
            return None
        return (total - done) * self.global_batch / rate

    def elapsed(self, now: float) -> float:
        return max(0.0, now - self.started) if self.started is not None else 0.0

    def scalar_summaries(self) -> list[ScalarSummary]:
        """Each ddtop.log key across ranks (core/scalars.py)."""
        return summaries(self.scalars)

    def summary(self, now: float) -> RunSummary:
        """The run as it stands at `now`: what `status`, `list`, run.json and the
        headless summary show (core/summary.py)."""
        states = self.rank_states(now)  # once: the ranks, the rate and the hang read it
        slowest, skew, slow = self.stragglers()
        done, total = self.progress()
        hung = hangs.hung(self.ranks, states)
        return RunSummary(
            run_id=self.run, status=self.status, exit_code=self.exit_code,
            world_size=self.world_size, model=self.model, dataset=self.dataset,
            backend=self.backend, restarts=self.restarts, timeline=list(self.timeline),
            failure=self.failure, global_step=done, total_steps=total,
            samples_per_s=self._throughput(now, states), telemetry_loss=self.telemetry_loss(),
            rejected=dict(self.rejected), slowest_rank=slowest, skew_s=skew, stragglers=slow,
            straggler_causes={r: c[1] for r, c in self.straggler_causes(slow).items()},
            memory_creeping=self.creeping(),
            journal_dropped=self.journal_dropped, hang=hung[1] if hung else None,
            ranks=told.rank_summaries(self.ranks, states, self.rank_nodes, now),
            started=self.started, updated=self.updated, metrics=told.user_epochs(self.aggregate),
            program=self.program, scalars=self.scalar_summaries(), alone=self.alone,
            evidence=list(self.evidence))


_snapshot_encoder = msgspec.msgpack.Encoder()
_snapshot_decoder = msgspec.msgpack.Decoder(RunState)


def encode_snapshot(state: RunState) -> bytes:
    return _snapshot_encoder.encode(state)


def decode_snapshot(data: bytes) -> RunState:
    return _snapshot_decoder.decode(data)
