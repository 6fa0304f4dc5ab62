"""Node summaries (daemon/summariser.py): a real hub, 64 simulated nodes.

The hub is node 0's real relay (TCP with CURVE, the `nodes` socket) and node
table (daemon/hub.Hub), served here; 64 nodes of 8 ranks each run in one
process of bench/simnodes.py, each a real Summariser sending its summaries and
heartbeats over CURVE. One job, its faults one after the other: a 1.5x
straggler on node 37 from the start; a rank of node 13 dies at 3 s; node 50
goes silent at 3 s; a rank of node 53 hangs at 9 s (the others wait for it in
the all-reduce). Each is named at the hub from the summaries alone, in time,
and nothing else is named. The merge itself is tested in-process below.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from ddtop.core import journal, protocol, stragglers, wire
from ddtop.core.config import TrainConfig
from ddtop.core.keys import RunKeys
from ddtop.core.rankview import DEAD, UNREACHABLE, RankView
from ddtop.core.state import RunState
from ddtop.daemon import summariser
from ddtop.daemon.forwarder import Forwarder
from ddtop.daemon.hub import NODE_TIMEOUT_S, NOT_ITS_RANK, Hub
from ddtop.daemon.relay import Relay

SIM = Path(__file__).resolve().parents[1] / "bench" / "simnodes.py"
NODES, PER = 64, 8
WORLD = NODES * PER
SLOW_NODE, SLOW = 37, (37 - 1) * PER + 3
DEAD_NODE, DEAD_RANK, DEAD_AT = 13, (13 - 1) * PER + 4, 3.0
SILENT_NODE, SILENT_AT = 50, 3.0
HANG_NODE, HANG_RANK, HANG_AT = 53, (53 - 1) * PER + 6, 9.0
FOCUS_RANK = (8 - 1) * PER + 2  # its detail open on a dashboard: its every step
RUN_S = 18.0


@pytest.mark.processes
def test_faults_among_64_nodes_are_named_at_the_hub_from_summaries(tmp_path: Path) -> None:
    keys = RunKeys.create(tmp_path / "keys")
    relay = Relay("sim", tmp_path / "telemetry.journal", world_size=WORLD, bind="127.0.0.1",
                  keys=keys, nodes=True)
    config = TrainConfig(world_size=WORLD, nnodes=NODES + 1, nproc_per_node=PER,
                         rdzv_endpoint="127.0.0.1:1", run_id="sim", launcher="torchrun")
    hub = Hub(config, relay)
    relay.serve_hub(hub)
    hub.nodes_endpoint = relay.endpoints["nodes"]
    (tmp_path / "hub.json").write_text(json.dumps(relay.endpoints))
    scenario = {"slow": {str(SLOW): 1.5}, "dead": [DEAD_RANK, DEAD_AT],
                "silent": [SILENT_NODE, SILENT_AT], "hang": [HANG_RANK, HANG_AT]}
    sim = subprocess.Popen(
        [sys.executable, str(SIM), "--folder", str(tmp_path), "--run", "sim", "--world",
         str(WORLD), "--per", str(PER), "--first", "1", "--count", str(NODES), "--seconds",
         str(RUN_S), "--scenario", json.dumps(scenario)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # A dashboard opens a rank's detail (protocol.Focus, as RankDetail sends it).
    asker = zmq.Context.instance().socket(zmq.REQ)
    asker.setsockopt(zmq.LINGER, 0)
    keys.client(asker)
    asker.connect(relay.endpoints["control"])
    asker.send(protocol.encode(protocol.Focus(rank=FOCUS_RANK)))
    named_at = dead_at = silent_at = hang_at = None
    named_step = 0
    false_names: set[int] = set()
    hang_text = ""
    start: float | None = None
    try:
        deadline = time.monotonic() + RUN_S + 30
        while sim.poll() is None and time.monotonic() < deadline:
            relay.serve(0.05)
            hub.check()
            state, now = relay.state, time.time()  # the simulation's clock is wall time too
            if start is None:
                if not (tmp_path / "simstart.1").exists() or len(state.ranks) < WORLD:
                    continue
                start = float((tmp_path / "simstart.1").read_text())  # the scenario's clock
            elapsed = now - start
            _, _, named = state.stragglers()
            false_names.update(r for r in named if r != SLOW)
            if SLOW in named and named_at is None:
                named_at, named_step = elapsed, state.ranks[SLOW].global_step
            states = state.rank_states(now)
            if dead_at is None and states.get(DEAD_RANK) == DEAD:
                dead_at = elapsed
            if silent_at is None and state.node_states.get(SILENT_NODE) == "unreachable":
                silent_at = elapsed
                assert all(states[r] == UNREACHABLE
                           for r in range((SILENT_NODE - 1) * PER, SILENT_NODE * PER))
            found = state.hung(now)
            if found is not None and hang_at is None:
                assert elapsed > HANG_AT, (elapsed, found)  # no hang named before there is one
                assert found[0] == [HANG_RANK], found
                hang_at, hang_text = elapsed, found[1]
        out = sim.communicate(timeout=20)[0]
        assert asker.poll(0) and protocol.decode_reply(protocol.Reply, asker.recv()).ok
    finally:
        asker.close()
        if sim.poll() is None:
            sim.kill()
            sim.communicate()
        relay.close()
    assert sim.returncode == 0, out[-2000:]
    print(f"\n64 nodes x 8 ranks, at the hub: straggler rank {SLOW} named at {named_at or 0:.2f} s "
          f"(its step {named_step}); dead rank {DEAD_RANK} "
          f"{(dead_at or 0) - DEAD_AT:.2f} s after it died; node {SILENT_NODE} unreachable "
          f"{(silent_at or 0) - SILENT_AT:.2f} s after it went silent; hang named "
          f"{(hang_at or 0) - HANG_AT:.2f} s after it began: {hang_text[:120]}\n{out[-300:]}")
    assert not false_names, false_names
    assert named_at is not None and named_step <= 25, (named_at, named_step)
    # Counted from the scenario's clock: a fault is named within the time promised
    # on one node (and the run is not over before it).
    assert dead_at is not None and dead_at - DEAD_AT < 2.0, dead_at
    assert silent_at is not None and silent_at - SILENT_AT < NODE_TIMEOUT_S + 2, silent_at
    assert hang_at is not None and hang_at - HANG_AT < 4.5 + 3, hang_at
    assert f"rank {HANG_RANK} is in forward" in hang_text, hang_text
    assert relay.state.rejected == {}, relay.state.rejected
    # The rank open on a dashboard: its Step messages unmerged (several a summary,
    # each of one step); the others' merged (one a summary)
    steps_in: dict[int, list[int]] = {FOCUS_RANK: [], FOCUS_RANK + 1: []}
    for record in journal.read(tmp_path / "telemetry.journal"):
        m = wire.decode([record.frame])
        if isinstance(m, wire.NodeSummary):
            for rank, found in steps_in.items():
                n = sum(isinstance(x, wire.Step) and x.rank == rank for x in m.messages)
                if n:
                    found.append(n)
    assert max(steps_in[FOCUS_RANK]) >= 3 and max(steps_in[FOCUS_RANK + 1]) == 1, steps_in


# -- the merge, in-process ------------------------------------------------------------
def _step(seq: int, compute: float, comm: float = 0.03, **extra: object) -> wire.Step:
    fields: dict[str, object] = dict(
        run="r", rank=3, seq=seq, t=100.0 + seq, epoch=0, step=seq, steps_per_epoch=100,
        global_step=seq, steps=1, samples=32, loss_sum=32 * 2.0, lr=0.1,
        step_s=compute + comm, data_s=0.01, forward_s=0.02, backward_s=0.03,
        optimizer_s=0.01, comm_s=comm, comm_bytes=1000, comm_ops=4, algbw_gbps=1.0,
        busbw_gbps=2.0, sync_wait_s=0.0)
    fields.update(extra)
    return wire.Step(**fields)  # type: ignore[arg-type]


def test_merged_steps_sum_and_keep_the_newest_readings() -> None:
    s = summariser.Summariser("r", 2)
    computes = [0.07, 0.07, 0.30, 0.07, 0.07]  # one step descheduled
    for i, c in enumerate(computes, start=1):
        s.take(_step(i, c, lr=0.1 * i), 200.0 + i)
    (frame,) = s.frames({3: RankView(rank=3, received=5)}, now=10.0, t=300.0)
    summary = wire.decode([frame], "r")
    assert isinstance(summary, wire.NodeSummary) and summary.node == 2
    assert summary.accounts == [wire.RankAccount(3, 5, 0, 0, 0)]  # in the same frame
    (merged,) = summary.messages
    assert isinstance(merged, wire.Step)
    assert (merged.steps, merged.samples, merged.seq, merged.global_step) == (5, 160, 5, 5)
    assert merged.step_s == pytest.approx(sum(computes) + 5 * 0.03)
    assert merged.comm_ops == 20 and merged.comm_bytes == 5000 and merged.lr == pytest.approx(0.5)
    # the compute per step without the longest step: the spike left out, as the
    # straggler rule wants (core/stragglers.py)
    assert merged.compute_trim_s == pytest.approx(0.07)
    # folded, the rank's per-step readings are those of one node's fold
    state = RunState(run="r", world_size=4)
    state.apply(summary, 300.0)
    view = state.ranks[3]
    assert view.step_time_s == pytest.approx((sum(computes) + 0.15) / 5)
    assert view.loss == pytest.approx(2.0) and view.global_step == 5
    assert state.rank_nodes[3] == 2
    window = view.evidence.newest
    assert window is not None and window.robust and window.steps == 5
    assert window.compute_s == pytest.approx(0.07 * 5)
    # fewer steps than a trim takes: no trim, as one node's fold would do
    few = summariser.Summariser("r", 2)
    few.take(_step(1, 0.07), 1.0)
    few.take(_step(2, 0.07), 1.0)
    (f,) = few.frames({}, now=10.0, t=2.0)
    m = wire.decode([f], "r")
    assert isinstance(m, wire.NodeSummary) and isinstance(m.messages[0], wire.Step)
    assert m.messages[0].compute_trim_s is None and stragglers.TRIM_MIN_STEPS == 3


def test_a_heartbeat_after_the_steps_goes_after_them_with_its_phase_time_brought_on() -> None:
    s = summariser.Summariser("r", 1)
    s.take(_step(1, 0.07), 100.0)
    beat = wire.Heartbeat(run="r", rank=3, seq=2, t=100.5, phase="forward", epoch=0,
                          global_step=1, phase_s=1.0)
    s.take(beat, 100.5)
    (frame,) = s.frames({}, now=10.0, t=103.0)
    m = wire.decode([frame], "r")
    assert isinstance(m, wire.NodeSummary)
    kinds = [type(x).__name__ for x in m.messages]
    assert kinds == ["Step", "Heartbeat"]
    held = m.messages[1]
    assert isinstance(held, wire.Heartbeat) and held.phase_s == pytest.approx(3.5)
    # nothing new: no summary; then only the accounting that changed
    assert s.frames({}, now=20.0, t=104.0) == []
    view = RankView(rank=3, received=7, lost=1)
    (acc,) = s.frames({3: view}, now=30.0, t=105.0)
    m = wire.decode([acc], "r")
    assert isinstance(m, wire.NodeSummary) and m.messages == []
    assert m.accounts == [wire.RankAccount(3, 7, 1, 0, 0)]
    assert s.frames({3: view}, now=40.0, t=106.0) == []
    state = RunState(run="r", world_size=4)
    state.apply(m, 106.0)
    assert 3 not in state.ranks  # accounts of a rank never heard of are not made up


def test_what_cannot_wait_goes_at_once_after_the_ranks_held_readings() -> None:
    s = summariser.Summariser("r", 1)
    assert s.take(_step(1, 0.07), 1.0) is False
    bye = wire.Bye(run="r", rank=3, seq=2, t=2.0, exit_code=0)
    assert s.take(bye, 2.0) is True
    frames = s.frames({}, now=0.0, t=2.0)  # a periodic one is not due at 0
    m = wire.decode(frames, "r")
    assert isinstance(m, wire.NodeSummary)
    assert [type(x).__name__ for x in m.messages] == ["Step", "Bye"]
    # every rank sends the same global metrics: the node sends them once
    agg = dict(run="r", seq=3, t=3.0, scope="sync", epoch=0, global_step=10, train_loss=1.0,
               train_accuracy=0.5, train_samples=64)
    assert s.take(wire.Aggregate(rank=3, **agg), 3.0) is True  # type: ignore[arg-type]
    s.frames({}, now=0.0, t=3.0)
    assert s.take(wire.Aggregate(rank=4, **agg), 3.0) is False  # type: ignore[arg-type]
    # every rank's word of the same checkpoint: rank 0's only, as the fold records it
    saved = dict(run="r", seq=4, t=4.0, type="checkpoint", message="saved step 10")
    assert s.take(wire.Event(rank=3, **saved), 4.0) is False  # type: ignore[arg-type]
    assert s.take(wire.Event(rank=0, **saved), 4.0) is True  # type: ignore[arg-type]
    assert s.take(wire.Event(rank=3, **{**saved, "type": "error"}), 4.0) is True  # type: ignore[arg-type]


def test_a_node_of_many_ranks_sends_frames_under_the_bound() -> None:
    s = summariser.Summariser("r", 1)
    for rank in range(1024):
        s.take(msgspec.structs.replace(_step(1, 0.07), rank=rank), 1.0)
    frames = s.frames({}, now=10.0, t=2.0)
    assert len(frames) > 1 and all(len(f) <= summariser.SUMMARY_BYTES + 4096 for f in frames)
    state = RunState(run="r", world_size=1024)
    for f in frames:
        state.apply(wire.decode([f], "r"), 2.0)
    assert sorted(state.ranks) == list(range(1024))


def test_the_hub_refuses_a_summary_that_speaks_for_another_node_or_rank() -> None:
    def summary(node: int = 1, rank: int = 3, run: str = "r") -> wire.NodeSummary:
        step = msgspec.structs.replace(_step(1, 0.07), rank=rank, run=run)
        return wire.NodeSummary(run="r", rank=wire.DAEMON_RANK, node=node, messages=[step])

    assert summariser.problem(summary(), 1, "r", 8) is None
    assert summariser.problem(summary(node=2), 1, "r", 8) == "bad_forward"
    assert summariser.problem(summary(rank=8), 1, "r", 8) == "rank_out_of_range"
    assert summariser.problem(summary(run="other"), 1, "r", 8) == "bad_forward"
    forged = msgspec.structs.replace(summary(), rank=5)
    assert summariser.problem(forged, 1, "r", 8) == "bad_forward"
    state = RunState(run="r", world_size=8)
    assert state.apply(forged, 1.0) is False and state.ranks == {}


def test_what_does_not_fit_a_summary_still_goes() -> None:
    s = summariser.Summariser("r", 1)
    # a message too large to wrap goes alone, as its rank sent it
    big = wire.Event(run="r", rank=3, seq=1, t=1.0, type="error", message="x" * 60_000)
    assert s.take(big, 1.0) is True
    (frame,) = s.frames({}, now=0.0, t=1.0)
    assert len(frame) <= wire.MAX_FRAME_BYTES and wire.decode([frame], "r") == big
    # accounts in frames of their own, however many and however large their counts
    views = {r: RankView(rank=r, received=2**40, lost=2**40, duplicates=2**40,
                         sender_dropped=2**40) for r in range(2500)}
    frames = s.frames(views, now=10.0, t=2.0)
    assert len(frames) == 3 and all(len(f) <= wire.MAX_FRAME_BYTES for f in frames)
    summed = [wire.decode([f], "r") for f in frames]
    assert sum(len(m.accounts) for m in summed if isinstance(m, wire.NodeSummary)) == 2500
    assert s.dropped == 0


def test_a_ranks_held_readings_go_before_its_exit_and_a_restart_is_a_new_life() -> None:
    s = summariser.Summariser("r", 1)
    s.take(_step(1, 0.07), 1.0)
    s.hurry(3, 2.0)  # its node is about to say it exited
    (frame,) = s.frames({}, now=0.0, t=2.0)
    m = wire.decode([frame], "r")
    assert isinstance(m, wire.NodeSummary) and [type(x).__name__ for x in m.messages] == ["Step"]
    # at the hub: the rank's exit (its pid never known), then a new process's hello
    state = RunState(run="r", world_size=4)
    state.apply(m, 2.0)
    state.apply(wire.RankExit(run="r", rank=wire.DAEMON_RANK, seq=0, t=2.1, exited=3, pid=None,
                              exit_code=1, signal=None), 2.1)
    assert state.ranks[3].exited
    hello = wire.Hello(run="r", rank=3, seq=0, t=3.0, local_rank=3, host="n1", pid=42,
                       device="cpu", backend="gloo", world_size=4, config_digest="", model="",
                       dataset="", epochs=1, global_batch=4)
    state.apply(wire.NodeSummary(run="r", rank=wire.DAEMON_RANK, node=1, messages=[hello]), 3.0)
    assert not state.ranks[3].exited and state.ranks[3].pid == 42


def test_a_focused_ranks_steps_go_unmerged() -> None:
    s = summariser.Summariser("r", 1)
    s.focus = {3}
    for i in (1, 2, 3):
        s.take(_step(i, 0.07), float(i))
        s.take(msgspec.structs.replace(_step(i, 0.07), rank=2), float(i))
    (frame,) = s.frames({}, now=10.0, t=4.0)
    m = wire.decode([frame], "r")
    assert isinstance(m, wire.NodeSummary)
    # rank 3's three as they came, rank 2's merged into one (ranks in the order heard)
    assert [(x.rank, x.steps) for x in m.messages if isinstance(x, wire.Step)] == [
        (3, 1), (3, 1), (3, 1), (2, 3)]
    state = RunState(run="r", world_size=4)
    state.apply(m, 4.0)
    assert len(state.ranks[3].history) == 3 and len(state.ranks[2].history) == 1


def test_a_node_speaks_only_for_its_own_ranks_over_the_real_node_plane(tmp_path: Path) -> None:
    """A key holder's node daemon (node 2) sends a Step for rank 0, which node 0
    runs, and for rank 2, node 1's, and a forged exit of rank 2: before, the hub
    showed rank 0 on node 2 at step 99,999 with loss 54,321 to the end, and a live
    rank dead. Now each claim is refused and counted, and node 1's own go on. A
    rank that node 1's heartbeat no longer claims (an elastic restart) is node 2's
    to take. Real CURVE sockets: the hub's relay and two real Forwarders."""
    keys = RunKeys.create(tmp_path / "keys")
    relay = Relay("r", tmp_path / "telemetry.journal", world_size=4, bind="127.0.0.1",
                  keys=keys, nodes=True)
    config = TrainConfig(world_size=4, nnodes=3, nproc_per_node=2, run_id="r",
                         rdzv_endpoint="127.0.0.1:1", launcher="torchrun")
    hub = Hub(config, relay, lambda: [0, 1])
    relay.serve_hub(hub)
    hub.nodes_endpoint = relay.endpoints["nodes"]
    node = {k: Forwarder(dataclasses.replace(config, node_rank=k),
                         relay.endpoints["control"], keys, "r", dict) for k in (1, 2)}
    said = {1: [2], 2: [3]}

    def step(rank: int, seq: int, global_step: int, loss: float = 2.0) -> wire.Step:
        return msgspec.structs.replace(_step(seq, 0.07), rank=rank, global_step=global_step,
                                       loss_sum=loss * 32)

    def send(k: int, message: wire.Message) -> None:
        node[k].forward(message, wire.encode(message)[0], time.time())
        node[k].summariser.last = 0.0  # due now
        node[k].tick(said[k], "running")

    def serve_until(done) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + 10
        while not done() and time.monotonic() < deadline:
            relay.serve(0.05)
            for k in node:
                node[k].tick(said[k], "running")
        assert done()

    try:
        serve_until(lambda: all(f.push is not None for f in node.values())
                    and hub.nodes.get(1) and hub.nodes.get(2))
        send(1, step(2, 1, 10))
        serve_until(lambda: 2 in relay.state.ranks)
        send(2, step(0, 1, 99_999, loss=54_321.0))
        serve_until(lambda: relay.state.rejected.get(NOT_ITS_RANK, 0) >= 1)
        send(2, step(2, 2, 99_999, loss=54_321.0))
        exit2 = wire.RankExit(run="r", rank=wire.DAEMON_RANK, seq=1, t=time.time(), exited=2,
                              pid=None, exit_code=-9, signal="SIGKILL")
        node[2].forward(exit2, wire.encode(exit2)[0], time.time())
        said[2] = [2, 3]  # and its heartbeat claims rank 2 too
        node[2].last_beat = 0.0
        serve_until(lambda: relay.state.rejected.get(NOT_ITS_RANK, 0) >= 4)
        state = relay.state
        assert 0 not in state.ranks
        assert (state.ranks[2].global_step, state.ranks[2].exited) == (10, False)
        assert hub.nodes[2].ranks == [3] and hub.owner[2] == 1
        warnings = [e.message for e in state.events if "spoke for" in e.message]
        assert warnings == ["node 2 spoke for rank 0 (node 0's): refused, a node speaks only "
                            "for its own ranks (counted: rejected.not_its_rank)"], warnings
        # Node 1's own rank goes on.
        send(1, step(2, 2, 20))
        serve_until(lambda: state.ranks[2].global_step == 20)
        # An elastic restart moves rank 2: node 1 no longer claims it, node 2 may.
        said[1] = []
        node[1].last_beat = 0.0
        serve_until(lambda: 2 not in hub.owner)
        node[2].last_beat = 0.0
        serve_until(lambda: hub.nodes[2].ranks == [2, 3])
    finally:
        for f in node.values():
            f.close([], protocol.NodeFinal(status="succeeded"))
        relay.close()
