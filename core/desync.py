"""A desync, named: ranks of one process group that have entered different
collectives at the same point of that group (pure: core/hangs.py asks it first,
with the live ranks, before any rank has stalled).

    "desync in group world #20: rank 3 entered all_gather (float32 x 4 per rank)
     while ranks 0-2 entered all_reduce (float32 x 4)"

Each watched rank counts the collectives it enters on each group
(training/collectives.py: the group's own sequence number) and says the one it
is in with its signature: the op, the dtype and elements of its input. Every
rank of a group must enter the same collective as its #N; ranks inside #N of a
group with different signatures will never meet (a hang), or worse, meet and
exchange the wrong data. Compared where both sides are inside it, so a desync
is named as soon as the heartbeats of both sides have come (a rank 0.3 s inside
a signed collective says so: training/beats.py). A rank that skipped a
collective is named the same way when its #N, the others' #N+1, differs.

A point-to-point pair is compared too: two ranks inside a send or a recv with
each other as the peer must be one send and one recv of the same dtype and
elements; both sending (or both receiving) never meet:

    "desync in group world, send/recv of ranks 0 and 1: rank 1 entered send (float32
     x 4) to rank 0 while rank 0 entered send (float32 x 4) to rank 1 (neither receives)"

A rank that skipped a collective whose successors have the same signatures as
the ones it skipped is not inside a collective the others are not: gloo pairs
them, silently, one apart. Every wire.COUNTS_EVERY global steps each rank says
how many collectives it has entered on each of its groups (Step.group_counts);
every rank of a group must have entered as many by the same step (`Counts`):

    "desync in group world by step 8: rank 1 had entered 9 collectives of the group
     where rank 0 had entered 10 (1 fewer)"

DDP's gradient all-reduce of a step is one collective of its group (its
buckets together: "DDP's gradient all-reduce (float32 x N)", N the gradients'
elements), so a rank that enters a collective of its own where the others
enter DDP's is named too. Not compared: the elements of the ops that take
uneven parts (all_gather, all_to_all, all_to_all_single), a collective
without a signature (an older sender's), and a group unknown to the rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from ddtop.core import wire
from ddtop.core.rankview import RankView
from ddtop.core.text import rank_list

# Ops whose ranks may give inputs of different sizes: their elements are not compared.
UNEVEN = frozenset({"all_gather", "all_to_all", "all_to_all_single"})
# Ops whose input is one rank's part of what all of them gather or scatter.
PER_RANK = frozenset({"all_gather", "all_gather_into_tensor", "reduce_scatter",
                      "reduce_scatter_tensor"})

# DDP's gradient all-reduce of a step (every bucket: one collective of its group,
# training/commtimer.py), as heartbeats name it, and as a desync's words do.
DDP_OP, DDP_NAME = "allreduce", "DDP's gradient all-reduce"

Sig = tuple[str, str, int]
PREFIX = "desync in group "  # how a desync's words begin


def named(text: str | None) -> bool:
    """Whether a hang in words (core/hangs.py) is a desync."""
    return text is not None and text.startswith(PREFIX)


def _sig(c: wire.Collective) -> Sig:
    return c.op, c.dtype, -1 if c.op in UNEVEN else c.count


def find(ranks: Mapping[int, RankView], live: Iterable[int]) -> tuple[list[int], str] | None:
    """The first desync among the `live` ranks (by group, then its number): the
    ranks on the odd side, and the desync in words; None when there is none."""
    sides: dict[tuple[str, int], dict[Sig, list[int]]] = {}
    for r in live:
        view = ranks.get(r)
        if view is None or (c := view.coll_started) is None or not c.group_seq or not c.group:
            continue
        if not view.in_collective:
            continue
        sides.setdefault((c.group, c.group_seq), {}).setdefault(_sig(c), []).append(r)
    for (_group, number), by_sig in sorted(sides.items()):
        if len(by_sig) < 2:
            continue
        # The side most ranks are on is the group's; a tie goes to the lowest rank's.
        order = sorted(by_sig.values(), key=lambda side: (-len(side), min(side)))
        usual = order[0]
        odd = sorted(r for side in order[1:] for r in side)
        first = ranks[usual[0]].coll_started
        assert first is not None  # (as _what's)
        name = first.group_words()
        told = [f"{rank_list(sorted(side))} entered {_what(ranks[side[0]].coll_started)}"
                for side in order[1:]]
        text = (f"{PREFIX}{name} #{number}: {'; '.join(told)} while "
                f"{rank_list(sorted(usual))} entered {_what(first)}")
        return odd, text
    return _pair(ranks, live)


COUNTED_WORDS = " collectives of the group where "  # how Counts' desync says it


def counted(text: str | None) -> bool:
    """Whether a desync in words is one the ranks' counts showed (Counts)."""
    return named(text) and text is not None and COUNTED_WORDS in text


P2P = frozenset({"send", "recv"})
P2P_WORDS = ", send/recv of ranks "  # how a pair's desync names it, after its group


def _pair(ranks: Mapping[int, RankView], live: Iterable[int]) -> tuple[list[int], str] | None:
    """The first point-to-point pair (by its lower rank) inside ops that cannot meet:
    the pair's higher rank (blamed: neither is the group's), and the words."""
    inside: dict[int, wire.Collective] = {}
    for r in live:
        view = ranks.get(r)
        c = None if view is None else view.coll_started
        if c is not None and c.op in P2P and c.peer >= 0 and view is not None \
                and view.in_collective:
            inside[r] = c
    for a in sorted(inside):
        mine = inside[a]
        b = mine.peer
        theirs = inside.get(b)
        if b <= a or theirs is None or theirs.peer != a:
            continue
        if mine.op != theirs.op and (mine.dtype, mine.count) == (theirs.dtype, theirs.count):
            continue  # a send and its recv: they meet
        why = (" (neither receives)" if mine.op == "send" == theirs.op else
               " (neither sends)" if mine.op == "recv" == theirs.op else "")
        group = mine.group_words()
        text = (f"{PREFIX}{group}{P2P_WORDS}{a} and {b}: rank {b} entered "
                f"{_p2p(theirs)} while rank {a} entered {_p2p(mine)}{why}")
        return [b], text
    return None


def _p2p(c: wire.Collective) -> str:
    """'send (float32 x 4) to rank 1', 'recv (float32 x 8) from rank 0'."""
    return f"{_what(c)} {'to' if c.op == 'send' else 'from'} rank {c.peer}"


def _what(c: wire.Collective | None) -> str:
    """'all_reduce (float32 x 4)', 'all_gather (float32 x 4 per rank)', 'barrier'."""
    assert c is not None  # (a rank on a side is inside its collective)
    op = DDP_NAME if c.op == DDP_OP else c.op
    if not c.dtype:
        return op
    count = f" x {c.count:,}" if c.count >= 0 else ""
    per = " per rank" if c.op in PER_RANK and count else ""
    return f"{op} ({c.dtype}{count}{per})"


KEEP_STEPS = 64  # the steps whose counts are kept, newest
RANKS_KEPT = 16  # ranks kept per side of a step's counts (the others counted)


class Side(msgspec.Struct):
    """The ranks (the first RANKS_KEPT) that had entered one count of a group's
    collectives by a step, and how many they are."""

    ranks: list[int] = []
    n: int = 0


class Counts(msgspec.Struct):
    """The ranks' counts of each group's collectives at the same steps (module
    docstring): `found`, once two sides are seen at a step that enough ranks gave
    (three, or all of a smaller world), the odd ranks and the desync in words."""

    at: dict[int, dict[str, dict[int, Side]]] = {}  # step -> group -> count -> side
    given: dict[int, int] = {}  # step -> ranks that gave it
    found: tuple[list[int], str] | None = None

    def restart(self) -> None:
        """New processes count from 0: what the old ones said is not compared."""
        self.at, self.given = {}, {}

    def add(self, rank: int, taken: Iterable[wire.GroupCounts], world: int,
            ranks: Mapping[int, RankView]) -> None:
        for counted in taken:
            step = counted.global_step
            if step not in self.at:
                self.at[step], self.given[step] = {}, 0
                if len(self.at) > KEEP_STEPS:  # the oldest step goes (this one, if it is)
                    oldest = min(self.at)
                    del self.at[oldest], self.given[oldest]
                    if oldest == step:
                        continue
            self.given[step] += 1
            groups = self.at[step]
            for group, count in counted.counts:
                side = groups.setdefault(group, {}).setdefault(count, Side())
                side.n += 1
                if len(side.ranks) < RANKS_KEPT:
                    side.ranks.append(rank)
            if self.found is None and self.given[step] >= min(3, max(world, 2)):
                self._look(step, ranks)

    def _look(self, step: int, ranks: Mapping[int, RankView]) -> None:
        for group, by_count in sorted(self.at[step].items()):
            if len(by_count) < 2:
                continue
            # The side most ranks are on is the group's; a tie goes to the higher count
            # (one rank skipping is likelier than one entering more).
            order = sorted(by_count.items(), key=lambda c: (-c[1].n, -c[0]))
            usual_count, usual = order[0]
            odd = sorted(r for _, side in order[1:] for r in side.ranks)
            told = [f"{_ranks_of(side)} had entered {count:,}" for count, side in order[1:]]
            diff = order[1][0] - usual_count
            self.found = odd, (
                f"{PREFIX}{_group_name(group, ranks)} by step {step}: {'; '.join(told)}"
                f"{COUNTED_WORDS}{_ranks_of(usual)} had entered "
                f"{usual_count:,} ({abs(diff)} {'fewer' if diff < 0 else 'more'})")
            return


def _ranks_of(side: Side) -> str:
    more = side.n - len(side.ranks)
    return rank_list(sorted(side.ranks)) + (f" and {more:,} more" if more > 0 else "")


def group_names(ranks: Mapping[int, RankView]) -> dict[str, str]:
    """Each group the ranks' last collectives named, as words name it ("world",
    "[2,3] (tp)"), by torch's name of the group."""
    names = {}
    for view in ranks.values():
        for c in (view.coll_started, view.coll_completed):
            if c is not None and c.group and c.group_ranks:
                names[c.group] = c.group_words()
    return names


def _group_name(group: str, ranks: Mapping[int, RankView]) -> str:
    """'world', or '[2,3]' as a rank's signature of the group gives its ranks."""
    return "world" if group == "world" else group_names(ranks).get(group, repr(group))
