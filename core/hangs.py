"""A hang, named: when some ranks are stalled, the ranks the others wait for and
what each is doing, from the ranks' views alone (pure: RunState.hung asks it with
the states it derived; the supervisor's --hang-timeout acts on the answer). A
desync (core/desync.py) is named first, before any rank has stalled.

    "ranks 0-6 wait in allreduce #1234; rank 7 is in forward of step 1233"
"""

from __future__ import annotations

from collections.abc import Mapping

from ddtop.core import desync
from ddtop.core.rankview import DEAD, RUNNING, SILENT, STALLED, RankState, RankView
from ddtop.core.text import rank_list

__all__ = ["hung", "rank_list"]


def hung(ranks: Mapping[int, RankView], states: Mapping[int, RankState]
     ) -> tuple[list[int], str] | None:
    """When some ranks are stalled: the ranks the others wait for (those not
    inside the collective the others wait in; without one, the stalled ranks;
    [] when every live rank waits in it), and the hang in words. A desync
    (core/desync.py) comes first, stalled or not yet: its odd ranks, and it."""
    live = [r for r, s in states.items() if s in (RUNNING, STALLED, SILENT)]
    found = desync.find(ranks, live)
    if found is not None:
        return found
    stalled = [r for r, s in states.items() if s == STALLED]
    if not stalled:
        return None
    # The collective each live rank is inside, if any.
    waiting = {r: c for r in live if r in ranks and ranks[r].in_collective
               and (c := ranks[r].coll_started) is not None}
    if not waiting:
        return stalled, "; ".join(f"rank {r} stalled {ranks[r].where()}"
                                  for r in stalled)
    newest = max(c.seq for c in waiting.values())
    inside = [r for r, c in waiting.items() if c.seq == newest]
    coll = waiting[inside[0]]
    within = set(inside)  # a set: thousands of ranks may wait in it
    others = [r for r in live if r not in within]
    # A rank that stepped past the step they wait in since their newest reading
    # is not waited for: it has been through their collective, so that reading
    # is stale (a stopped rank resumed; their own steps and heartbeats are on
    # the way). Only since their reading: a rank that is ahead and stuck (a
    # constant offset, rank 0 alone saving) is waited for once they report again.
    waits_in = min(ranks[r].phase_step for r in inside)
    read_at = max(ranks[r].phase_at or 0.0 for r in inside)
    if any(v.phase_step > waits_in and v.stepped_at is not None and v.stepped_at > read_at
           for r in others if (v := ranks.get(r)) is not None):
        return None
    text = f"{rank_list(inside)} wait in {coll.op} #{coll.seq}"
    for r in others:
        view = ranks.get(r)
        where = view.where() if view is not None else "not heard from"
        text += f"; rank {r} is {'silent, last ' if states[r] == SILENT else ''}{where}"
    dead = [r for r, s in states.items() if s == DEAD]
    if dead:
        text += f"; {rank_list(dead)} dead"
    return others, text
