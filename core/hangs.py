"""A hang, named: when some ranks are stalled, the ranks the others wait for and
what each is doing, from the ranks' views alone (pure: RunState.hung asks it with
the states it derived; the supervisor's --hang-timeout acts on the answer). A
desync (core/desync.py) is named first, before any rank has stalled.

    "ranks 0-6 wait in allreduce #1234; rank 7 is in forward of step 1233"
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from ddtop.core import desync, wire
from ddtop.core.rankview import DEAD, RUNNING, SILENT, STALLED, RankState, RankView
from ddtop.core.text import rank_list

__all__ = ["hung", "members", "rank_list"]
# A range in a group's ranks ("0-65535") wider than this is not unrolled: not a group's.
MAX_GROUP_SPAN = 1 << 16


def hung(ranks: Mapping[int, RankView], states: Mapping[int, RankState],
         counted: tuple[list[int], str] | None = None) -> tuple[list[int], str] | None:
    """When some ranks are stalled: the ranks the others wait for (those not
    inside the collective the others wait in; without one, the stalled ranks;
    [] when every live rank waits in it), and the hang in words. A desync
    (core/desync.py) comes first, stalled or not yet: its odd ranks, and it.
    `counted`, one the ranks' counts of collectives showed (desync.Counts), comes
    before one the ranks are inside: it came first, and caused what followed."""
    live = [r for r, s in states.items() if s in (RUNNING, STALLED, SILENT)]
    found = counted or desync.find(ranks, live)
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
    # A rank inside a sub-group's collective (its signature names the group) waits
    # for the group's ranks not inside it, and one in a send or recv for its peer,
    # not for the world (every other waits as the world's).
    sub = {r: c for r, c in waiting.items() if members(c) is not None}
    world = {r: c for r, c in waiting.items() if r not in sub}
    if world:
        newest = max(c.seq for c in world.values())
        inside = [r for r, c in world.items() if c.seq == newest]
    else:
        inside = []
    within = set(inside)  # a set: thousands of ranks may wait in it
    others = [r for r in live if r not in within]
    # A rank that stepped past the step they wait in since their newest reading
    # is not waited for: it has been through their collective, so that reading
    # is stale (a stopped rank resumed; their own steps and heartbeats are on
    # the way). Only since their reading: a rank that is ahead and stuck (a
    # constant offset, rank 0 alone saving) is waited for once they report again.
    if inside:
        waits_in = min(ranks[r].phase_step for r in inside)
        read_at = max(ranks[r].phase_at or 0.0 for r in inside)
        if any(v.phase_step > waits_in and v.stepped_at is not None
               and v.stepped_at > read_at
               for r in others if (v := ranks.get(r)) is not None):
            return None
    parts = [f"{rank_list(inside)} wait in {world[inside[0]].op} #{world[inside[0]].seq}"
             ] if inside else []
    waited = _sub_waits(sub, within, parts) if sub else set()
    for r in others:
        if r in sub:
            continue
        if not inside and r not in waited:
            continue  # (no world collective: only the ranks a group waits for)
        view = ranks.get(r)
        where = view.where() if view is not None else "not heard from"
        parts.append(f"rank {r} is {'silent, last ' if states[r] == SILENT else ''}{where}")
    text = "; ".join(parts)
    if sub:  # the roots: waited for, and not themselves inside a collective
        roots = [r for r in others if r not in sub and (inside or r in waited)]
        others = roots or others
    dead = [r for r, s in states.items() if s == DEAD]
    if dead:
        text += f"; {rank_list(dead)} dead"
    return others, text


def members(c: wire.Collective) -> frozenset[int] | None:
    """The ranks a collective waits among, from its signature: a sub-group's, or
    a point-to-point call's peer; None for the world's, an unsigned collective,
    or ranks cut short."""
    if c.peer >= 0:
        return frozenset((c.peer,))
    if not c.group or c.group == "world":
        return None
    return _parsed(c.group_ranks)


@functools.lru_cache(maxsize=1024)
def _parsed(text: str) -> frozenset[int] | None:
    """'0,2,4-6' -> {0, 2, 4, 5, 6}; None for '' or ranks cut short ('...')."""
    found: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            return None
        low, high = int(first), int(last or first)
        if high < low or high - low > MAX_GROUP_SPAN:
            return None
        found.update(range(low, high + 1))
    return frozenset(found)


def _sub_waits(sub: Mapping[int, wire.Collective], within: set[int], parts: list[str]
               ) -> set[int]:
    """'rank 3 wait in group [2,3] all_reduce #4 for rank 2' for each sub-group
    collective ranks are inside, 'rank 1 wait in recv #12 from rank 0' for each
    point-to-point call (added to `parts`); the ranks they wait for."""
    sides: dict[tuple[str, int, int], list[int]] = {}
    for r, c in sub.items():
        key = (c.group, c.group_seq, -1) if c.peer < 0 else ("", c.seq, r)
        sides.setdefault(key, []).append(r)
    waited: set[int] = set()
    for side in sides.values():
        c = sub[side[0]]
        group: frozenset[int] = members(c) or frozenset()
        missing = sorted(group - set(side))
        waited.update(missing)
        if c.peer >= 0:
            way = "from" if c.op in ("recv", "irecv") else "to"
            parts.append(f"rank {side[0]} wait in {c.op} #{c.seq} {way} rank {c.peer}")
            continue
        whom = f" for {rank_list(missing)}" if missing else ""
        parts.append(f"{rank_list(sorted(side))} wait in group {c.group_words()} {c.op} "
                     f"#{c.group_seq}{whom}")
    return waited - within
