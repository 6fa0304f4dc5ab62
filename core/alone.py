"""Ranks that train alone: a run of several ranks in which no rank has entered
a collective is most likely several independent copies of one training (no
process group, no DDP: Accelerate without `cpu=True` on a machine with no GPU
does that), which would otherwise end as a plain success. Said once, as a
warning, when every rank of the world has done ALONE_AFTER_STEPS optimizer
steps, each of them seeing every collective it enters (zero-code mode says so
in its hello) and none seen.

Pure, as stragglers.py and hangs.py: the fold (core/state.py) keeps, per
rank, whether its collectives are seen and whether one was (RankView), and
asks `never_communicated` as steps come until it answers.
"""

from __future__ import annotations

from collections.abc import Mapping

from ddtop.core.hangs import rank_list
from ddtop.core.rankview import RankView

# Optimizer steps every rank has done before ranks that never communicated are
# said to: enough that a script's first collectives (DDP's first all-reduce, a
# framework's flag before the first batch) have been seen if there are any.
ALONE_AFTER_STEPS = 20


def never_communicated(ranks: Mapping[int, RankView], world_size: int) -> str | None:
    """The warning, in words, when the `world_size` ranks (more than one) have
    each done ALONE_AFTER_STEPS steps with their collectives seen and none seen;
    else None."""
    if world_size < 2:
        return None
    for rank in range(world_size):
        view = ranks.get(rank)
        if (view is None or not view.collectives or view.communicated
                or view.global_step < ALONE_AFTER_STEPS):
            return None
    return (f"{rank_list(list(range(world_size)))} never communicated in "
            f"{ALONE_AFTER_STEPS} steps each: are they training independently? (no "
            "collective of torch.distributed was seen in any of them)")
