"""What one scrape of /metrics shows: the run's numbers copied out of the RunState at
one moment, plain and frozen (`read`, called by the daemon's loop between two messages;
pure, tested without a server). daemon/metrictable.py spells a Reading as metric
families; daemon/exporter.py hands readings from the loop to the scrapes.
"""

from __future__ import annotations

from typing import get_args

import msgspec

from ddtop.core import desync, endings, wire
from ddtop.core.rankview import FINISHED, RUNNING, STARTING, RankState
from ddtop.core.state import RunState
from ddtop.core.summary import LOST

# A rank's identity, the same across its restarts (a series per rank, not per process);
# what changes with its process is on ddtop_rank_info (INFO_LABELS).
RANK_LABELS = ("run", "rank", "node", "host")
INFO_LABELS = ("pid", "local_rank", "device")
RANK_STATES: tuple[str, ...] = get_args(RankState)
RUN_STATUSES: tuple[str, ...] = (*get_args(wire.RunStatusName), LOST)


class RankReading(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's numbers at the moment of a reading."""

    labels: tuple[str, ...]  # RANK_LABELS' values
    pid: str  # its process's, "" before it said hello (INFO_LABELS)
    local_rank: str
    device: str = ""  # as its hello said: "cpu", "cuda:3"
    state: str
    global_step: int
    last_step_t: float | None  # the rank's own clock: its newest step message's time
    step_s: float | None
    comm_s: float | None
    compute_s: float | None
    comm_share: float | None
    busbw_bytes: float | None
    samples_per_s: float | None
    loss: float | None
    straggler: bool
    cause: str | None  # a straggler's (core/causes.py), where judged
    waited_for: bool
    restarts: int  # restarts its failure caused
    lost: int
    rss: int | None = None  # bytes, as the rank last read them
    rss_peak: int | None = None
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    cuda_peak: int | None = None
    creep: float | None = None  # bytes a second its memory grows by, while it creeps
    # Counters, from its Step messages added up: steps, samples, and seconds of its steps
    # outside communication, in it, and in the data phase.
    steps_total: int | None = None
    samples_total: int | None = None
    compute_total: float | None = None
    comm_total: float | None = None
    data_total: float | None = None
    forward_total: float | None = None  # of its steps' work: each phase's seconds
    backward_total: float | None = None
    optimizer_total: float | None = None
    # Its steps by time, a count per STEP_BUCKETS bound and one for the slower (not added
    # up), and their seconds: the histogram's.
    step_buckets: tuple[int, ...] = ()
    step_seconds_total: float = 0.0
    lr: float | None = None
    epoch: int | None = None  # counted from 1, as status and the training log count it


class Reading(msgspec.Struct, frozen=True, kw_only=True):
    """The run's numbers at one moment: what one scrape shows."""

    run: str
    status: str
    world_size: int
    restarts: int
    global_step: int
    total_steps: int
    samples_per_s: float | None
    hung: bool
    desync: bool
    lost: int
    rejected: dict[str, int]
    journal_dropped: int
    info: dict[str, str]
    aggregate: wire.Aggregate | None
    ranks: list[RankReading]
    taken: float = 0.0  # when it was read (the daemon's clock)
    last_checkpoint: float | None = None  # the newest checkpoint's time (its rank's clock)
    # Once the run has ended: when (the daemon's clock), how, and a failed run's cause.
    ended: float | None = None
    outcome: tuple[str, str] | None = None
    failures: dict[str, int] = {}  # by cause (core/endings.py): every restart's, the last's


def read(state: RunState, now: float, host: str = "") -> Reading:
    """The numbers of `state` at `now` (the daemon's loop calls it, between messages).
    `host`: the daemon's, the host label of its own node's ranks (node 0) before they say
    hello, so that a rank's series are the same from its start."""
    states = state.rank_states(now)
    _, _, stragglers = state.stragglers()
    why = state.straggler_causes(stragglers)
    hung = state.hung(now)
    waited = set(hung[0]) if hung is not None else set()
    blamed: dict[int, int] = {}
    for entry in state.timeline:
        blamed[entry.rank] = blamed.get(entry.rank, 0) + 1
    ranks = []
    for r, rank_state in states.items():
        v = state.ranks.get(r)
        # A multi-node job's rank whose node is not known yet: no node or host said.
        known = r in state.rank_nodes or not state.node_states
        node = state.rank_nodes.get(r, 0)
        own = host if known and node == 0 else ""
        if v is None:
            ranks.append(RankReading(labels=(state.run, str(r), str(node) if known else "",
                                             own), pid="", local_rank="",
                                     state=rank_state, global_step=0, last_step_t=None,
                                     step_s=None, comm_s=None, compute_s=None, comm_share=None,
                                     busbw_bytes=None, samples_per_s=None, loss=None,
                                     straggler=False, cause=None, waited_for=r in waited,
                                     restarts=blamed.get(r, 0), lost=0))
            continue
        compute = None
        if v.step_time_s is not None and v.comm_s is not None:
            exposed = v.comm_s - (v.comm_overlap_s or 0.0)  # overlapped comm is compute time
            compute = max(0.0, v.step_time_s - exposed)
        ranks.append(RankReading(
            labels=(state.run, str(r), str(node) if known else "", v.host or own),
            pid=_text(v.pid), local_rank=_text(v.local_rank), device=v.device,
            state=rank_state,
            global_step=v.global_step, last_step_t=v.last_step_t,
            step_s=v.step_time_s, comm_s=v.comm_s, compute_s=compute, comm_share=v.comm_share,
            busbw_bytes=None if v.busbw_gbps is None else v.busbw_gbps * 1e9,
            samples_per_s=_stepping(v.samples_per_s, rank_state), loss=v.loss,
            straggler=r in stragglers,
            cause=why[r][0] if r in why else None, waited_for=r in waited,
            restarts=blamed.get(r, 0), lost=v.lost, rss=v.rss, rss_peak=v.rss_peak,
            cuda_allocated=v.cuda_allocated, cuda_reserved=v.cuda_reserved,
            cuda_peak=v.cuda_peak, creep=v.creep.rate(), steps_total=v.global_step,
            samples_total=v.samples, compute_total=max(0.0, v.step_s_total - v.comm_s_total),
            comm_total=v.comm_s_total, data_total=v.data_s_total,
            forward_total=v.forward_s_total, backward_total=v.backward_s_total,
            optimizer_total=v.optimizer_s_total, step_buckets=tuple(v.step_buckets),
            step_seconds_total=v.step_s_total, lr=v.lr,
            epoch=None if v.epoch is None else v.epoch + 1))
    done, total = state.progress()
    outcome = endings.outcome(state.status, state.failure)
    rate = state.throughput(now)
    if hung is not None and outcome is None and rate is not None:
        rate = 0.0  # a hang is a stall: no sample goes through (the fold keeps the last rate)
    info = {"model": state.model, "dataset": state.dataset, "backend": state.backend,
            "strategy": state.strategy, "program": state.program}
    return Reading(
        run=state.run, status=state.status, world_size=state.world_size,
        restarts=state.restarts, global_step=done, total_steps=total,
        samples_per_s=rate, hung=hung is not None,
        desync=hung is not None and desync.named(hung[1]),
        lost=sum(v.lost for v in state.ranks.values()), rejected=dict(state.rejected),
        journal_dropped=state.journal_dropped, info=info, aggregate=state.aggregate,
        ranks=ranks, taken=now, last_checkpoint=state.last_checkpoint,
        ended=state.ended if outcome is not None else None,
        outcome=None if outcome is None else (outcome[0], outcome[1] or ""),
        failures={str(k): n for k, n in endings.failures(
            state.timeline, state.status, state.failure).items()})


def _stepping(rate: float | None, rank_state: str) -> float | None:
    """A rank's samples a second as served: 0 while it takes no step (stalled, silent,
    dead), not the rate of its last window; None where it reports no samples."""
    return rate if rate is None or rank_state in (RUNNING, FINISHED, STARTING) else 0.0


def _text(value: int | None) -> str:
    return "" if value is None else str(value)
