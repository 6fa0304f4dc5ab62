"""Each rank's state at a time, derived from the ranks' views and the job's node
table: RunState.rank_states' rule, pure, and fast enough for 16,384 ranks (one
pass over the views; the node table and the slow ranks' rule only where they
apply; no dict rebuilt twice).

    derive(views, now, world_size=8, ...) -> {0: "running", 1: "stalled", ...}
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from ddtop.core import wire
from ddtop.core.rankview import (
    DEAD,
    FINISHED,
    RUNNING,
    SLOW_PHASES,
    STALLED,
    STARTING,
    UNREACHABLE,
    UNREACHED,
    RankState,
    RankView,
)
from ddtop.core.summary import LOST

GONE_NODE = ("unreachable", "lost")  # a node in either: its ranks are shown unreachable


def derive(views: Mapping[int, RankView], now: float, *, world_size: int, young: bool,
           local_ranks: Collection[int] = (), rank_nodes: Mapping[int, int] | None = None,
           node_states: Mapping[int, wire.NodeState] | None = None,
           lost: bool = False) -> dict[int, RankState]:
    """Every rank's state at `now`, by rank number: each view's own (RankView.state),
    but that ranks waiting for a slow rank are running, not stalled; the ranks of
    the world not heard from starting while the run is `young`, else unreached
    (on node K's daemon, only its `local_ranks`); the ranks of a node gone silent
    unreachable; and, when the daemon is `lost`, every rank that had not ended lost."""
    states = {r: v.state(now) for r, v in views.items()}
    # Work only some ranks do (rank 0 evaluating or saving: a slow phase, with a
    # long stall limit of its own) keeps the others waiting in their next step's
    # collective: while it is not stalled itself, they wait for it, not stalled.
    slow = [v for r, v in views.items() if v.phase in SLOW_PHASES and states[r] == RUNNING]
    if slow:
        # Waiting for it: inside a collective that the slow rank has not reached.
        reached = min(v.coll_started.seq if v.coll_started else 0 for v in slow)
        for r, v in views.items():
            if (states[r] == STALLED and v.phase in wire.STEP_PHASES and v.in_collective
                    and v.coll_started is not None and v.coll_started.seq > reached):
                states[r] = RUNNING
    unheard: RankState = STARTING if young else UNREACHED
    if local_ranks:
        for r in set(local_ranks):
            if 0 <= r < world_size and r not in states:
                states[r] = unheard
    else:
        for r in range(world_size):
            if r not in states:
                states[r] = unheard
    gone = {k for k, s in (node_states or {}).items() if s in GONE_NODE}
    if gone:  # a node gone silent: its ranks, unknown
        for r, node in (rank_nodes or {}).items():
            if node in gone and states.get(r) not in (None, DEAD, FINISHED):
                states[r] = UNREACHABLE
    if lost:  # the daemon died: ranks that had not exited died with it
        states = {r: st if st in (FINISHED, DEAD) else LOST for r, st in states.items()}
    ranks = list(states)
    ordered = sorted(ranks)
    return states if ranks == ordered else {r: states[r] for r in ordered}
