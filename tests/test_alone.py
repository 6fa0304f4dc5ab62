"""Ranks that never communicate (core/alone.py), through the fold: one warning
once every rank of the world has done enough steps with its collectives seen
and none seen; nothing when one was, when they are not seen, or alone."""

from __future__ import annotations

import msgspec
from test_state import RUN, beat, fold, hello, step

from ddtop.core import alone, wire
from ddtop.core.state import RunState

AFTER = alone.ALONE_AFTER_STEPS


def seen(rank: int) -> wire.Hello:
    """A hello of a rank whose every collective is seen (zero-code)."""
    return msgspec.structs.replace(hello(rank), collectives=True)


def quiet(rank: int, seq: int, global_step: int, steps: int = 10) -> wire.Step:
    """Steps with no communication in them."""
    return msgspec.structs.replace(step(rank, seq, global_step, steps), comm_s=0.0,
                                   comm_bytes=0, comm_ops=0)


def warnings(s: RunState) -> list[str]:
    return [e.message for e in s.events if e.type == "warning"]


def test_ranks_that_never_communicate_are_told_once_all_have_stepped_enough() -> None:
    s = fold(seen(0), seen(1), quiet(0, 1, AFTER), quiet(1, 1, AFTER - 1))
    assert warnings(s) == [] and s.alone is None  # rank 1 is one step short
    s.apply(quiet(1, 2, AFTER), 101.0)
    said = (f"ranks 0-1 never communicated in {AFTER} steps each: are they training "
            "independently? (no collective of torch.distributed was seen in any of them)")
    assert warnings(s) == [said] and s.alone == said
    assert s.events[-1].rank == wire.DAEMON_RANK and s.events[-1].source() == "daemon"
    s.apply(quiet(0, 2, 2 * AFTER), 102.0)
    s.apply(quiet(1, 3, 2 * AFTER), 102.0)
    assert warnings(s) == [said]  # once
    assert s.summary(103.0).alone == said


def test_a_collective_seen_in_a_step_or_a_heartbeat_is_communication() -> None:
    by_step = fold(seen(0), seen(1), step(0, 1, 5, steps=5), quiet(0, 2, 2 * AFTER),
                   quiet(1, 1, 2 * AFTER))
    assert warnings(by_step) == [] and by_step.alone is None
    by_heartbeat = fold(seen(0), seen(1), beat(1, 1, "data", 0, started=1, completed=1),
                        quiet(0, 1, 2 * AFTER), quiet(1, 2, 2 * AFTER))
    assert warnings(by_heartbeat) == []


def test_ranks_whose_collectives_are_not_seen_or_a_world_of_one_are_not_told() -> None:
    unseen = fold(hello(0), seen(1), quiet(0, 1, 2 * AFTER), quiet(1, 1, 2 * AFTER))
    assert warnings(unseen) == []  # rank 0's hello does not say (the API alone)
    missing = fold(seen(0), quiet(0, 1, 2 * AFTER))  # rank 1 of 2 not heard from
    assert warnings(missing) == []
    one = RunState(run=RUN)
    one.apply(msgspec.structs.replace(seen(0), world_size=1), 100.0)
    one.apply(quiet(0, 1, 2 * AFTER), 100.0)
    assert warnings(one) == []
