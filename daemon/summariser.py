"""Node summaries, node K's side: at scale, the hub's work grows with nodes, not ranks.

A node daemon folds and journals every message of its own ranks, as any
daemon does (its full per-step detail stays there); to the hub it sends a
`wire.NodeSummary` every SUMMARY_S instead of every message:

- per rank, every Step since its previous summary merged into one (`merge_steps`:
  the sums added, the newest readings kept, and the compute per step without
  the longest step worked out from the steps merged, so the straggler rule
  judges the window as it would on one node: core/stragglers.py);
- the newest Heartbeat (its phase time brought up to the moment the summary is
  sent), before the merged Step or after it as it came, the newest Scalars;
- each rank's telemetry accounting (received, lost, duplicates, dropped) as the
  node counted it;
- at once, in a summary of their own with the rank's pending readings before
  them, what cannot wait: hellos, events, byes, global metrics the node had not
  seen (not the events the fold does not record: every rank's word of the
  same checkpoint, an epoch's end). A rank's exit, the node's events: the
  daemon's own messages, forwarded as they are (daemon/forwarder.py).

A summary is one frame of at most SUMMARY_BYTES of messages, or of at most
ACCOUNTS_PER_FRAME accounts (a node of many ranks sends several; a message too
large to wrap goes alone, as its rank sent it). A node of 8 ranks stepping 10
times a second sends 2 summaries a second in place of 88 messages; from
LARGE_JOB_NODES nodes, one a second (`every_s`). The hub checks each (`problem`), then
journals and relays it as it came; RunState folds one (core/state.py), the hub's, a
dashboard's and a replay's alike, without the ranks' sequence numbers (most are left
out by design): lost, late and duplicate counts are the node's.

A rank open on a dashboard (its detail: protocol.Focus, passed on by the hub in
its replies to the node's heartbeats) is not merged: its Step messages go as
they came, in the next summary, so the hub has its every step while it is open.

Diagnosis works as on one node, from the summaries: a dead rank is the node's
RankExit, sent at once; a rank's phase and collective come with its
heartbeats (a hang); the steps merged per summary are a straggler window.
Everything here is pure but the clock the caller passes.
"""

from __future__ import annotations

import math

import msgspec

from ddtop.core import events, stragglers, wire
from ddtop.core.rankview import RankView

SUMMARY_S = 0.5  # a node's summary, this often ...
SUMMARY_LARGE_S = 1.0  # ... or this often in a job of LARGE_JOB_NODES nodes or more
LARGE_JOB_NODES = 256
# A summary frame's size, at most: under wire.MAX_FRAME_BYTES with room to spare
# (one message larger than this goes alone).
SUMMARY_BYTES = 48 * 1024
# Scalars messages with different keys held per rank between summaries (the
# newest of each set of keys); beyond it the oldest is dropped (counted).
MAX_SCALARS_HELD = 4
# A focused rank's Step messages held between summaries, at most.
MAX_UNMERGED_HELD = 200
# Rank accounts a frame of their own carries: ACCOUNT_BYTES each at most (five
# 64-bit numbers).
ACCOUNTS_PER_FRAME = 1000
ACCOUNT_BYTES = 46

_encoder = msgspec.msgpack.Encoder()


def every_s(nnodes: int) -> float:
    """How often a node of a job of `nnodes` nodes sends its summary: the hub's
    work (and every dashboard's) is a fold per rank per summary."""
    return SUMMARY_LARGE_S if nnodes >= LARGE_JOB_NODES else SUMMARY_S


# -- the hub's side: what it takes ------------------------------------------------------
def problem(summary: wire.NodeSummary, node: int, run: str, world_size: int) -> str | None:
    """Why the hub refuses a summary forwarded by `node` (a rejected reason), or None."""
    if summary.rank != wire.DAEMON_RANK or summary.node != node:
        return "bad_forward"
    for message in summary.messages:
        if message.run != run or message.v != wire.SCHEMA_VERSION:
            return "bad_forward"
        if not 0 <= message.rank < world_size:
            return "rank_out_of_range"
    for account in summary.accounts:
        if not 0 <= account.rank < world_size:
            return "rank_out_of_range"
    return None


# -- node K's side: summing up ----------------------------------------------------------
class _Merged(msgspec.Struct):
    """A rank's Step messages since its previous summary, merged."""

    step: wire.Step
    compute_s: float  # the steps' compute, as the straggler rule counts it
    longest_s: float  # the longest one-step message's compute
    robust: bool  # each message a single step, or carrying its own trimmed compute


def _compute(step: wire.Step) -> tuple[float, bool]:
    """(compute of a Step message's steps, as stragglers.add_steps counts it,
    whether each of its steps is seen on its own or trimmed)."""
    trim = step.compute_trim_s
    if (trim is not None and step.steps >= stragglers.TRIM_MIN_STEPS and math.isfinite(trim)
            and trim >= 0):
        return trim * step.steps, True
    return max(0.0, step.step_s - step.comm_s), step.steps == 1


def _start(step: wire.Step) -> _Merged:
    compute, robust = _compute(step)
    return _Merged(step, compute, compute if step.steps == 1 else 0.0, robust)


def merge_steps(merged: _Merged, step: wire.Step) -> _Merged:
    """`step` (newer) merged into `merged`: sums added, the newest readings kept."""
    a = merged.step
    compute, robust = _compute(step)
    steps = a.steps + step.steps
    weight = a.weight() + step.weight()
    overlap = (msgspec.UNSET if isinstance(a.comm_overlap_s, msgspec.UnsetType)
               or isinstance(step.comm_overlap_s, msgspec.UnsetType)
               else a.comm_overlap_s + step.comm_overlap_s)
    both_unweighted = (isinstance(a.loss_weight, msgspec.UnsetType)
                       and isinstance(step.loss_weight, msgspec.UnsetType))
    counts = [*_counts(a), *_counts(step)][-wire.MAX_COUNTS:]
    runq = (msgspec.UNSET if isinstance(a.runq_s, msgspec.UnsetType)
            or isinstance(step.runq_s, msgspec.UnsetType) else a.runq_s + step.runq_s)
    faults = (msgspec.UNSET if isinstance(a.major_faults, msgspec.UnsetType)
              or isinstance(step.major_faults, msgspec.UnsetType)
              else a.major_faults + step.major_faults)
    combined = msgspec.structs.replace(
        step, steps=steps, samples=a.samples + step.samples,
        loss_sum=a.loss_sum + step.loss_sum, step_s=a.step_s + step.step_s,
        data_s=a.data_s + step.data_s, forward_s=a.forward_s + step.forward_s,
        backward_s=a.backward_s + step.backward_s, optimizer_s=a.optimizer_s + step.optimizer_s,
        comm_s=a.comm_s + step.comm_s, comm_bytes=a.comm_bytes + step.comm_bytes,
        comm_ops=a.comm_ops + step.comm_ops, sync_wait_s=a.sync_wait_s + step.sync_wait_s,
        dropped=a.dropped + step.dropped, comm_overlap_s=overlap,
        loss_weight=msgspec.UNSET if both_unweighted else weight, compute_trim_s=None,
        group_counts=counts or msgspec.UNSET, runq_s=runq, major_faults=faults)
    longest = max(merged.longest_s, compute if step.steps == 1 else 0.0)
    return _Merged(combined, merged.compute_s + compute, longest, merged.robust and robust)


def _counts(step: wire.Step) -> list[wire.GroupCounts]:
    return [] if isinstance(step.group_counts, msgspec.UnsetType) else step.group_counts


def merged_step(merged: _Merged) -> wire.Step:
    """The merged Step as it goes to the hub: with its steps' compute per step
    without the longest one, where every step was seen (from TRIM_MIN_STEPS)."""
    step = merged.step
    if merged.robust and step.steps >= stragglers.TRIM_MIN_STEPS and step.steps > 1:
        trim = (merged.compute_s - merged.longest_s) / (step.steps - (merged.longest_s > 0))
        return msgspec.structs.replace(step, compute_trim_s=trim)
    return step


class _Pending(msgspec.Struct):
    step: _Merged | None = None
    unmerged: list[wire.Step] = []  # a focused rank's Step messages, as they came
    beat: wire.Heartbeat | None = None
    beat_at: float = 0.0  # when the node received it (wall clock)
    beat_after_step: bool = False
    scalars: list[wire.Scalars] = []


class Summariser:
    """Node K's side: `take` every rank message its relay folds; `due` says when a
    summary is to go; `frames` makes it (and `urgent` what must go at once)."""

    def __init__(self, run: str, node: int, every_s: float = SUMMARY_S) -> None:
        self.run, self.node, self.every_s = run, node, every_s
        self.pending: dict[int, _Pending] = {}
        self.urgent: list[wire.Summed] = []  # what goes at once, in order
        self.aggregates_seen: set[tuple[int, str]] = set()
        self.accounts_sent: dict[int, tuple[int, int, int, int]] = {}
        self.last = 0.0
        self.seq = 0
        self.dropped = 0  # Scalars dropped (MAX_SCALARS_HELD), or frames too large to send
        # Ranks open on a dashboard (the hub's reply says which): each Step as it came.
        self.focus: set[int] = set()

    def take(self, message: wire.Message, received: float) -> bool:
        """One rank message the node folded; True when a summary should go now."""
        if isinstance(message, wire.Step):
            held = self._held(message.rank)
            if message.rank in self.focus:
                held.unmerged.append(message)
                if len(held.unmerged) > MAX_UNMERGED_HELD:
                    del held.unmerged[0]
                    self.dropped += 1
            else:
                held.step = (_start(message) if held.step is None
                             else merge_steps(held.step, message))
            held.beat_after_step = False
            return False
        if isinstance(message, wire.Heartbeat):
            held = self._held(message.rank)
            held.beat, held.beat_at, held.beat_after_step = message, received, True
            return False
        if isinstance(message, wire.Scalars):
            held = self._held(message.rank)
            keys = message.values.keys()
            held.scalars = [s for s in held.scalars if s.values.keys() != keys] + [message]
            if len(held.scalars) > MAX_SCALARS_HELD:
                del held.scalars[0]
                self.dropped += 1
            return False
        if isinstance(message, wire.Aggregate):
            key = (message.global_step, message.scope)
            if key in self.aggregates_seen:
                return False  # every rank sends the same numbers: the first is enough
            self.aggregates_seen.add(key)
            if len(self.aggregates_seen) > 1024:
                self.aggregates_seen = {key}
        if isinstance(message, wire.Event) and not events.shown(message):
            return False  # what the fold would not record
        if isinstance(message, wire.Hello | wire.Event | wire.Bye | wire.Aggregate):
            self.urgent.extend(self._flush_rank(message.rank, received))
            self.urgent.append(message)
            return True
        return False  # the daemon's own messages are forwarded as they are

    def hurry(self, rank: int, t: float) -> None:
        """`rank`'s held readings to go at once (its exit is about to be said)."""
        self.urgent.extend(self._flush_rank(rank, t))

    def due(self, now: float) -> bool:
        return bool(self.urgent) or now - self.last >= self.every_s

    def frames(self, accounts: dict[int, RankView], now: float, t: float) -> list[bytes]:
        """The summaries due at `now` (monotonic; `t`: wall clock), as frames: the
        urgent messages alone when a periodic one is not due, else everything held,
        with the accounting of every rank (in `accounts`) that changed."""
        messages, self.urgent = self.urgent, []
        periodic = now - self.last >= self.every_s
        if periodic:
            self.last = now
            for rank in list(self.pending):
                messages.extend(self._flush_rank(rank, t))
        changed = []
        if periodic:
            for rank, view in accounts.items():
                said = (view.received, view.lost, view.duplicates, view.sender_dropped)
                if self.accounts_sent.get(rank) != said:
                    self.accounts_sent[rank] = said
                    changed.append(wire.RankAccount(rank, *said))
        if not messages and not changed:
            return []
        return self._pack(messages, changed, t)

    def _held(self, rank: int) -> _Pending:
        held = self.pending.get(rank)
        if held is None:
            held = self.pending[rank] = _Pending()
        return held

    def _flush_rank(self, rank: int, t: float) -> list[wire.Summed]:
        """Rank `rank`'s held messages, in order, as of wall clock `t`."""
        held = self.pending.pop(rank, None)
        if held is None:
            return []
        out: list[wire.Summed] = []
        beat = held.beat
        if beat is not None:
            # Its phase time as of now: the hub counts on from when it receives it.
            beat = msgspec.structs.replace(beat, phase_s=beat.phase_s + max(0.0, t - held.beat_at))
        if beat is not None and not held.beat_after_step:
            out.append(beat)
        if held.step is not None:
            out.append(merged_step(held.step))
        out.extend(held.unmerged)
        if beat is not None and held.beat_after_step:
            out.append(beat)
        out.extend(held.scalars)
        return out

    def _pack(self, messages: list[wire.Summed], accounts: list[wire.RankAccount],
              t: float) -> list[bytes]:
        """Frames under wire.MAX_FRAME_BYTES: messages in chunks of SUMMARY_BYTES, the
        accounts with the last chunk as far as they fit, else in frames of their
        own; a message too large to wrap goes alone, as the rank's own frame (the
        hub takes it as a forwarded rank message)."""
        frames: list[bytes] = []
        chunk: list[wire.Summed] = []
        size = 0
        for message in messages:
            encoded = _encoder.encode(message)
            if len(encoded) > SUMMARY_BYTES:
                frames.append(encoded)
                continue
            if chunk and size + len(encoded) > SUMMARY_BYTES:
                frames.append(self._frame(chunk, [], t))
                chunk, size = [], 0
            chunk.append(message)
            size += len(encoded)
        # The accounts (ACCOUNT_BYTES each at most) with the last messages where they
        # fit, the rest in frames of their own.
        room = max(0, (SUMMARY_BYTES - size) // ACCOUNT_BYTES) if chunk else 0
        if chunk:
            frames.append(self._frame(chunk, accounts[:room], t))
        for i in range(room, len(accounts), ACCOUNTS_PER_FRAME):
            frames.append(self._frame([], accounts[i:i + ACCOUNTS_PER_FRAME], t))
        kept = [f for f in frames if len(f) <= wire.MAX_FRAME_BYTES]
        self.dropped += len(frames) - len(kept)
        return kept

    def _frame(self, messages: list[wire.Summed], accounts: list[wire.RankAccount],
               t: float) -> bytes:
        summary = wire.NodeSummary(run=self.run, rank=wire.DAEMON_RANK, seq=self.seq, t=t,
                                   node=self.node, messages=messages, accounts=accounts)
        self.seq += 1
        return _encoder.encode(summary)
