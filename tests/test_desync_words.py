"""Desyncs from the ranks' views (core/desync.py, through core/hangs.py), the
signature's bounds on the wire (core/wire.py), and the signature a wrapped
collective gives in a real one-rank gloo group (training/collectives.py)."""

from __future__ import annotations

import gc
import socket
from collections.abc import Iterator

import msgspec
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddtop.core import desync, hangs, wire
from ddtop.core.rankview import RUNNING, STALLED, RankView
from ddtop.training import collectives, pendingworks
from ddtop.training.commtimer import DDPStats
from ddtop.training.telemetry import Telemetry


def coll(op: str, group_seq: int, *, dtype: str = "float32", count: int = 4,
         group: str = "world", ranks: str = "0-3", seq: int = 0) -> wire.Collective:
    return wire.Collective(seq=seq or group_seq, op=op, bytes=4 * max(count, 0), group=group,
                           group_size=4, group_ranks=ranks, group_seq=group_seq, dtype=dtype,
                           count=count)


def views(*colls: wire.Collective | None) -> dict[int, RankView]:
    return {r: RankView(rank=r, coll_started=c) for r, c in enumerate(colls)}


def find(*colls: wire.Collective | None) -> tuple[list[int], str] | None:
    ranks = views(*colls)
    return desync.find(ranks, list(ranks))


def test_another_op_at_the_same_point_of_a_group_is_a_desync_blaming_the_odd_side() -> None:
    same = coll("all_reduce", 20)
    assert find(same, same, same, coll("all_gather", 20)) == (
        [3], "desync in group world #20: rank 3 entered all_gather (float32 x 4 per rank) "
             "while ranks 0-2 entered all_reduce (float32 x 4)")
    # Another dtype, another size of the same op.
    assert find(same, coll("all_reduce", 20, dtype="float64"), same, same) == (
        [1], "desync in group world #20: rank 1 entered all_reduce (float64 x 4) "
             "while ranks 0, 2-3 entered all_reduce (float32 x 4)")
    assert find(same, same, coll("all_reduce", 20, count=8), same)[0] == [2]  # type: ignore[index]
    # Three sides: the most ranks' is the group's; each other side named.
    assert find(same, same, coll("broadcast", 20), coll("barrier", 20, dtype="", count=-1)) == (
        [2, 3], "desync in group world #20: rank 2 entered broadcast (float32 x 4); rank 3 "
                "entered barrier while ranks 0-1 entered all_reduce (float32 x 4)")
    # Two ranks, one each: the lowest rank's side is the group's.
    pair = find(coll("all_reduce", 5, group="1", ranks="2,3"),
                coll("all_gather", 5, group="1", ranks="2,3"))
    assert pair is not None and pair[0] == [1] and pair[1].startswith("desync in group [2,3] #5: ")
    assert desync.named(pair[1]) and not desync.named("ranks 0-1 wait in all_reduce #3")
    # DDP's gradient all-reduce of a step, signed (training/commtimer.py), by its name.
    ddp = coll("allreduce", 7, count=9)
    assert find(ddp, ddp, coll("all_reduce", 7, count=1)) == (
        [2], "desync in group world #7: rank 2 entered all_reduce (float32 x 1) "
             "while ranks 0-1 entered DDP's gradient all-reduce (float32 x 9)")


def test_no_desync_where_the_ranks_agree_or_a_signature_is_missing() -> None:
    same = coll("all_reduce", 20)
    assert find(same, same, same, same) is None
    # Different points of the group (one rank behind): a hang's business, not this.
    assert find(same, same, coll("all_gather", 19)) is None
    # Other groups, unknown groups, no group count (DDP's buckets, an older sender).
    assert find(same, coll("all_gather", 20, group="1", ranks="1,2")) is None
    assert find(same, coll("all_gather", 20, group="")) is None
    assert find(same, wire.Collective(seq=20, op="allreduce", bytes=64)) is None
    assert find(same, None) is None
    # all_gather and the all_to_alls take uneven parts: their sizes are not compared.
    assert find(coll("all_gather", 3, count=4), coll("all_gather", 3, count=6)) is None
    assert find(coll("all_to_all_single", 3, count=4), coll("all_to_all_single", 3, count=6)) \
        is None
    assert find(coll("all_gather", 3), coll("all_gather", 3, dtype="int64")) is not None
    # A rank past its collective (a step since) is not inside it.
    ranks = views(same, coll("all_gather", 20))
    ranks[1].coll_completed = ranks[1].coll_started
    assert desync.find(ranks, [0, 1]) is None
    # Only the live ranks are compared.
    assert desync.find(views(same, coll("all_gather", 20)), [0]) is None


def test_a_desync_is_the_hang_before_any_rank_stalls_and_blames_the_odd_rank() -> None:
    same = coll("all_reduce", 7)
    ranks = views(same, same, coll("all_gather", 7))
    found = hangs.hung(ranks, {0: RUNNING, 1: RUNNING, 2: RUNNING})
    assert found is not None and found[0] == [2] and desync.named(found[1])
    assert hangs.hung(views(same, same, same), {0: RUNNING, 1: STALLED, 2: RUNNING}) == (
        [], "ranks 0-2 wait in all_reduce #7")


def test_a_signature_out_of_bounds_is_refused_at_decode() -> None:
    base = {"kind": "heartbeat", "v": wire.SCHEMA_VERSION, "run": "r", "rank": 0, "seq": 1,
            "phase": "data", "epoch": 0, "global_step": 1, "phase_s": 0.0}
    good = {"seq": 3, "op": "all_reduce", "bytes": 16, "group": "world", "group_size": 2,
            "group_ranks": "0,1", "group_seq": 3, "dtype": "float32", "count": 4}
    decoded = wire.decode([msgspec.msgpack.encode({**base, "coll_started": good})], run="r")
    assert isinstance(decoded, wire.Heartbeat) and decoded.coll_started == wire.Collective(**good)
    for bad in ({"group": "x" * 65}, {"group": "a\x1bb"}, {"group_ranks": "0;rm"},
                {"group_ranks": "1" * 129}, {"dtype": "float 32"}, {"count": -2},
                {"group_seq": -1}, {"group_size": -1}):
        with pytest.raises(wire.WireError):
            wire.decode([msgspec.msgpack.encode({**base, "coll_started": {**good, **bad}})],
                        run="r")
    # An older sender's collective, with no signature: read as unknown.
    old = wire.decode([msgspec.msgpack.encode(
        {**base, "coll_started": {"seq": 3, "op": "allreduce", "bytes": 16}})], run="r")
    assert isinstance(old, wire.Heartbeat) and old.coll_started is not None
    assert (old.coll_started.group, old.coll_started.group_seq, old.coll_started.count) == \
        ("", 0, -1)


def test_counts_out_of_bounds_are_refused_at_decode() -> None:
    step = wire.Step(run="r", rank=0, epoch=None, step=4, steps_per_epoch=0, global_step=4,
                     steps=1, samples=0, loss_sum=0.0, lr=0.0, step_s=0.1, data_s=0.0,
                     forward_s=0.0, backward_s=0.0, optimizer_s=0.0, comm_s=0.0, comm_bytes=0,
                     comm_ops=0, algbw_gbps=0.0, busbw_gbps=0.0, sync_wait_s=0.0,
                     group_counts=[wire.GroupCounts(4, [("world", 8), ("1", 4)])])
    frame = msgspec.msgpack.decode(wire.encode(step)[0])
    decoded = wire.decode([msgspec.msgpack.encode(frame)], run="r")
    assert isinstance(decoded, wire.Step) and decoded.group_counts == step.group_counts
    for bad in ([[4, [["world", -1]]]], [[-4, [["world", 1]]]], [[4, [["a\x1bb", 1]]]],
                [[4, [["world", 1]]]] * (wire.MAX_COUNTS + 1),
                [[4, [[str(g), 1] for g in range(wire.MAX_COUNTED_GROUPS + 1)]]]):
        with pytest.raises(wire.WireError):
            wire.decode([msgspec.msgpack.encode({**frame, "group_counts": bad})], run="r")


def test_ranks_text_is_compact_and_bounded() -> None:
    assert collectives.ranks_text([0, 1, 2, 3]) == "0-3"
    assert collectives.ranks_text([2, 3]) == "2,3"
    assert collectives.ranks_text([0, 2, 4, 5, 6, 9]) == "0,2,4-6,9"
    assert collectives.ranks_text([]) == ""
    long = collectives.ranks_text(list(range(0, 400, 2)))
    assert len(long) == collectives.MAX_RANKS_TEXT and long.endswith("...")


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A real gloo process group of one rank, in this process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        collectives._groups.clear()


def test_a_collectives_signature_counts_per_group_from_torchs_own_group(
        one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    c10d = dist.distributed_c10d
    monkeypatch.setattr(collectives, "_members", c10d.GroupMember)  # as wrap() binds it
    described = {name: entry[2] for name, entry in collectives.OPS.items()}
    at = {name: collectives._param_at(getattr(c10d, name), "group") for name in ("all_reduce",
                                                                                "all_gather")}
    t = torch.ones(4)
    first = collectives.signature("all_reduce", (t,), {}, at["all_reduce"],
                                  described["all_reduce"])
    assert first == ("world", 1, "0", 1, "float32", 4, -1, "")
    # The default group by name (group.WORLD) is the same group: its count goes on.
    again = collectives.signature("all_reduce", (t.double(),), {"group": dist.group.WORLD},
                                  at["all_reduce"], described["all_reduce"])
    assert again == ("world", 1, "0", 2, "float64", 4, -1, "")
    sub = dist.new_group([0])
    gathered = collectives.signature("all_gather", ([t], torch.ones(2, 3), sub), {},
                                     at["all_gather"], described["all_gather"])
    assert gathered[0] not in ("", "world") and gathered[1:] == (1, "0", 1, "float32", 6, -1, "")
    # A group's description where one was given (a DeviceMesh's names its dimension),
    # in the words that name the group.
    mesh = dist.new_group([0], group_desc="mesh_tp")
    tp = collectives.signature("all_reduce", (t, "sum", mesh), {}, at["all_reduce"],
                               described["all_reduce"])
    assert tp[7] == "mesh_tp"
    named = wire.Collective(seq=1, op="all_reduce", bytes=16, group=tp[0], group_ranks=tp[2],
                            group_seq=tp[3], group_desc=tp[7])
    assert named.group_words() == "[0] (tp)"
    dist.destroy_process_group(mesh)
    del mesh
    # A group the script destroys is not kept alive by its count.
    dist.destroy_process_group(sub)
    del sub
    gc.collect()
    assert [entry[0] for entry in collectives._groups.values()] == ["world"]
    barrier = collectives.signature("barrier", (), {}, -1, described["barrier"])
    assert barrier == ("world", 1, "0", 3, "", -1, -1, "")
    # A send or recv names its peer, and is not the group's collective: its count
    # stays as it was (0 on the wire).
    send_at = collectives._param_at(c10d.send, "group")
    sent = collectives.signature("send", (t, 0), {}, send_at, described["send"],
                                 collectives.P2P["send"])
    assert sent == ("world", 1, "0", 0, "float32", 4, 0, "")
    received = collectives.signature("recv", (t,), {"src": None}, send_at, described["recv"],
                                     collectives.P2P["recv"])
    assert received == ("world", 1, "0", 0, "float32", 4, -1, "")  # from anyone: not known
    # batch_isend_irecv gives its ops the peer as a rank of the group: named globally.
    batched = collectives.signature("irecv", (t,), {"group": None, "group_src": 0}, send_at,
                                    described["irecv"], collectives.P2P["irecv"])
    assert batched[6] == 0, batched
    assert collectives.signature("barrier", (), {}, -1, described["barrier"])[3] == 4
    # DDP's gradient all-reduce of a step is one collective of its model's group, in the
    # same count: the gradients' dtype and elements (Linear(8, 1): 9), however bucketed.
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    step = DDPStats(Telemetry(), model)  # type: ignore[arg-type]
    assert step.signature() == ("world", 1, "0", 5, "float32", 9, -1, "")
    assert step.signature() == ("world", 1, "0", 6, "float32", 9, -1, "")
    mixed = torch.nn.Linear(8, 1)
    mixed.bias.data = mixed.bias.data.double()
    assert DDPStats(Telemetry(), DistributedDataParallel(mixed)).signature() == (  # type: ignore[arg-type]
        "world", 1, "0", 7, "mixed", 9, -1, "")


def test_a_hang_in_a_sub_group_names_the_group_and_blames_the_root() -> None:
    world = wire.Collective(seq=30, op="allreduce", bytes=64)  # DDP's bucket: unsigned
    pair = coll("all_reduce", 15, group="2", ranks="2,3", seq=29)
    ranks = views(world, world, None, pair)
    states = {0: STALLED, 1: STALLED, 2: RUNNING, 3: STALLED}
    assert hangs.hung(ranks, states) == (
        [2], "ranks 0-1 wait in allreduce #30; rank 3 wait in group [2,3] all_reduce #15 "
             "for rank 2; rank 2 is in setup of step 1")
    # Only sub-groups: each waits for its missing ranks; the ranks not waited for are
    # left out.
    ranks = views(coll("all_reduce", 4, group="1", ranks="0,1"), None, None,
                  coll("all_reduce", 4, group="2", ranks="2,3"))
    states = {0: STALLED, 1: RUNNING, 2: RUNNING, 3: STALLED}
    assert hangs.hung(ranks, states) == (
        [1, 2], "rank 0 wait in group [0,1] all_reduce #4 for rank 1; rank 3 wait in group "
                "[2,3] all_reduce #4 for rank 2; rank 1 is in setup of step 1; rank 2 is in "
                "setup of step 1")
    # The world's collective alone: as it always was.
    assert hangs.hung(views(world, world, None), {0: STALLED, 1: STALLED, 2: RUNNING}) == (
        [2], "ranks 0-1 wait in allreduce #30; rank 2 is in setup of step 1")


def test_a_rank_in_recv_waits_for_its_peer() -> None:
    world = coll("all_reduce", 4, seq=9)
    recv = wire.Collective(seq=9, op="recv", bytes=16, group="world", group_size=4,
                           group_ranks="0-3", dtype="float32", count=4, peer=0)
    ranks = views(None, recv, world, world)
    states = {0: RUNNING, 1: STALLED, 2: STALLED, 3: STALLED}
    assert hangs.hung(ranks, states) == (
        [0], "ranks 2-3 wait in all_reduce #9; rank 1 wait in recv #9 from rank 0; "
             "rank 0 is in setup of step 1")
    assert hangs.members(recv) == {0}
    # Never compared as the group's collective: no desync with the world's #N.
    assert find(coll("all_reduce", 9), recv) is None


def test_a_groups_ranks_are_read_back_from_the_signature() -> None:
    assert hangs.members(coll("x", 1, group="3", ranks="0,2,4-6")) == {0, 2, 4, 5, 6}
    assert hangs.members(coll("x", 1, group="world", ranks="0-3")) is None
    assert hangs.members(coll("x", 1, group="", ranks="0-3")) is None
    assert hangs.members(coll("x", 1, group="3", ranks="0")) == {0}
    for cut in ("0,2,4...", "", "5-2", "0-99999999", "a"):
        assert hangs._parsed(cut) is None, cut


def p2p(op: str, peer: int, count: int = 4, dtype: str = "float32") -> wire.Collective:
    return wire.Collective(seq=9, op=op, bytes=4 * count, group="world", group_size=4,
                           group_ranks="0-3", dtype=dtype, count=count, peer=peer)


def test_a_point_to_point_pair_that_cannot_meet_is_a_desync() -> None:
    world = coll("all_reduce", 4)
    # Ranks 1 and 2 both send to each other: gloo's send waits for the other's recv.
    found = find(world, p2p("send", 2), p2p("send", 1), world)
    assert found == ([2], "desync in group world, send/recv of ranks 1 and 2: rank 2 entered "
                          "send (float32 x 4) to rank 1 while rank 1 entered send (float32 x 4) "
                          "to rank 2 (neither receives)")
    assert desync.named(found[1])
    assert find(p2p("recv", 1), p2p("recv", 0))[1].endswith(  # type: ignore[index]
        "rank 1 entered recv (float32 x 4) from rank 0 while rank 0 entered recv (float32 x 4) "
        "from rank 1 (neither sends)")
    # A send and a recv of another size (gloo returns at once, the data cut: seen only
    # while both are inside).
    assert find(p2p("send", 1), p2p("recv", 0, count=8)) == (
        [1], "desync in group world, send/recv of ranks 0 and 1: rank 1 entered recv "
             "(float32 x 8) from rank 0 while rank 0 entered send (float32 x 4) to rank 1")
    # A send and its recv meet; peers that are not each other's, or a rank not inside
    # one, are waits (the wait-for chain), not a desync.
    assert find(p2p("send", 1), p2p("recv", 0)) is None
    assert find(p2p("send", 1), p2p("send", 2), p2p("send", 0)) is None
    assert find(p2p("send", 1), world) is None
    ranks = views(p2p("send", 1), p2p("send", 0))
    ranks[1].coll_completed = ranks[1].coll_started  # over: not inside it any more
    assert desync.find(ranks, [0, 1]) is None


def counted(step: int, **groups: int) -> list[wire.GroupCounts]:
    return [wire.GroupCounts(step, list(groups.items()))]


def test_a_rank_that_entered_fewer_collectives_by_a_step_is_a_desync() -> None:
    counts = desync.Counts()
    counts.add(0, counted(8, world=10), 4, {})
    counts.add(1, counted(8, world=9), 4, {})
    assert counts.found is None  # two of four: which side is the group's is not known yet
    counts.add(2, counted(8, world=10), 4, {})
    assert counts.found == ([1], "desync in group world by step 8: rank 1 had entered 9 "
                                 "collectives of the group where ranks 0, 2 had entered 10 "
                                 "(1 fewer)")
    assert desync.counted(counts.found[1]) and desync.named(counts.found[1])
    # It comes before a desync the ranks are inside (it came first), and a stalled rank.
    same = coll("all_reduce", 20)
    ranks = views(same, coll("all_gather", 20), same, same)
    states = {r: STALLED for r in ranks}
    assert hangs.hung(ranks, states, counts.found) == counts.found
    assert hangs.hung(ranks, states)[1].startswith("desync in group world #20")  # type: ignore[index]


def test_counts_are_compared_at_the_same_step_per_group_and_anew_after_a_restart() -> None:
    counts = desync.Counts()
    pair = {2: RankView(rank=2, coll_started=coll("all_reduce", 3, group="1", ranks="2,3"))}
    counts.add(0, counted(4, world=4), 4, pair)
    counts.add(1, counted(8, world=9), 4, pair)  # another step: not compared with step 4
    counts.add(2, [wire.GroupCounts(4, [("world", 4), ("1", 2)])], 4, pair)
    assert counts.found is None
    # Rank 3 gives step 4 too: the world agrees; the pair [2,3] does not. A tie of one
    # rank a side: the more collectives are the group's (a skip is likelier).
    counts.add(3, [wire.GroupCounts(4, [("world", 4), ("1", 3)])], 4, pair)
    assert counts.found == ([2], "desync in group [2,3] by step 4: rank 2 had entered 2 "
                                 "collectives of the group where rank 3 had entered 3 (1 fewer)")
    # New processes (a restart) count from 0: what the old ones said is not compared.
    counts = desync.Counts()
    counts.add(0, counted(4, world=4), 2, {})
    counts.restart()
    counts.add(1, counted(4, world=2), 2, {})
    assert counts.found is None
    counts.add(0, counted(4, world=3), 2, {})
    assert counts.found == ([1], "desync in group world by step 4: rank 1 had entered 2 "
                                 "collectives of the group where rank 0 had entered 3 (1 fewer)")


def test_only_the_newest_steps_are_kept() -> None:
    counts = desync.Counts()
    steps = range(4, 4 * (desync.KEEP_STEPS + 10), 4)
    for step in steps:
        counts.add(0, counted(step, world=step), 3, {})
    assert sorted(counts.at) == list(steps[-desync.KEEP_STEPS:])
    counts.add(1, counted(4, world=3), 3, {})  # older than every step kept: not kept
    assert 4 not in counts.at and counts.found is None


def test_a_rank_in_the_data_phase_is_in_data_only_inside_its_data_loader() -> None:
    view = RankView(rank=2, phase="data", global_step=5)
    assert view.where() == "in data of step 6"  # not known (an older sender)
    view.loader = True
    assert view.where() == "in data of step 6"
    view.loader = False
    assert view.where() == ("in Python between steps 5 and 6, outside any collective and its "
                            "data loader")
    view.at = "train.py:88 in main"  # where its main thread is in the script
    assert view.where().endswith("and its data loader (train.py:88 in main)")
    view.phase = "forward"
    assert view.where() == "in forward of step 6"
    # The heartbeat says it in the data phase only.
    beat = wire.decode(wire.encode(wire.Heartbeat(
        run="r", rank=2, phase="data", epoch=0, global_step=5, phase_s=9.0, loader=False)),
        run="r")
    assert isinstance(beat, wire.Heartbeat) and beat.loader is False


def test_a_p2pop_of_torchs_own_isend_taken_before_the_wrap_is_still_accepted(
        one_rank: None) -> None:
    c10d = dist.distributed_c10d
    held_isend, check, batch = dist.isend, c10d._check_op, dist.batch_isend_irecv
    collectives.wrap()
    try:
        assert dist.isend is not held_isend and dist.isend.__wrapped__ is held_isend
        assert c10d.isend is dist.isend and c10d.irecv is dist.irecv
        # torch's P2POp knows isend by identity: the wrapper, and torch's own taken before.
        ops = [dist.P2POp(held_isend, torch.ones(2), 0),
               dist.P2POp(dist.irecv, torch.empty(2), 0)]
        with pytest.raises(ValueError, match="Invalid ``op``"):  # (its own check goes on)
            dist.P2POp(print, torch.ones(2), 0)
        # The batch hands torch's own the wrapper (else torch gives its isend the recv's
        # keyword: a TypeError), then is torch's own: one rank cannot send to itself, as
        # gloo says.
        with pytest.raises(RuntimeError, match="not connected"):
            dist.batch_isend_irecv(ops)
        assert ops[0].op is dist.isend
    finally:
        collectives.unwrap()
    assert dist.isend is held_isend and c10d.isend is held_isend
    assert c10d._check_op is check and dist.batch_isend_irecv is batch
    assert c10d.batch_isend_irecv is batch


class Work:
    """What pendingworks asks of a work: whether it is completed (or it cannot say)."""

    def __init__(self) -> None:
        self.completed: bool | None = False

    def is_completed(self) -> bool:
        if self.completed is None:
            raise RuntimeError("the process group is gone")
        return self.completed


def test_a_work_without_a_future_is_over_once_completed_and_never_kept_forever() -> None:
    over: list[int] = []
    works = [Work() for _ in range(3)]
    for n, work in enumerate(works):
        pendingworks.add(work, lambda n=n: over.append(n))
    pendingworks.poll()
    assert over == [] and pendingworks.count() == 3
    works[1].completed, works[2].completed = True, None  # (one torch cannot say of: over)
    pendingworks.poll()
    assert over == [1, 2] and pendingworks.count() == 1
    # At most MAX_PENDING kept: the oldest let go, as over.
    for n in range(pendingworks.MAX_PENDING):
        pendingworks.add(Work(), lambda n=n: over.append(100 + n))
    assert over == [1, 2, 0] and pendingworks.count() == pendingworks.MAX_PENDING
    pendingworks._pending.clear()
    # A work the program dropped (it will never wait on it) is over, and not kept alive.
    dropped = Work()
    pendingworks.add(dropped, lambda: over.append(-1))
    del dropped
    pendingworks.poll()
    assert over[-1] == -1 and pendingworks.count() == 0
