"""The control plane's and the node plane's typed messages (core/protocol.py).

In process: every request and reply round-trips; the maps clients and node
daemons sent before these types decode to them unchanged; and what does not
fit a type (a field of the wrong kind, a text over its bound, a node number
too big) is refused as before, through a real relay's handler: the same
one-line error reply, counted as a bad request or not, nothing kept.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from ddtop.core import protocol
from ddtop.core.blame import Cause
from ddtop.core.config import TrainConfig
from ddtop.daemon import requests, summariser
from ddtop.daemon.forwarder import Forwarder
from ddtop.daemon.hub import DONE, UP, Hub
from ddtop.daemon.relay import Relay

RUN = "20261126-000000-protocol"
WORLD = 4


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[Relay]:
    """A real relay (its ipc sockets bound) of 4 ranks, not a hub."""
    relay = Relay(RUN, tmp_path / "telemetry.journal", tmp_path / "sock", world_size=WORLD)
    yield relay
    relay.close()


@pytest.fixture
def hub(relay: Relay) -> Hub:
    """The relay as the hub of a 2-node job."""
    hub = Hub(TrainConfig(world_size=WORLD, nnodes=2), relay)
    relay.serve_hub(hub)
    return hub


def ask(relay: Relay, request: Any) -> protocol.Reply:
    body = request if isinstance(request, bytes) else msgspec.msgpack.encode(request)
    reply = requests.answer(relay, body)
    msgspec.msgpack.encode(reply)  # and it can be sent
    return reply


def beat(**fields: Any) -> dict[str, Any]:
    """A node heartbeat as node daemons sent it before it was typed."""
    return {"op": "node", "node": 1, "host": "n1", "pid": 4242, "ranks": [2, 3],
            "status": "running", "dropped": 0, **fields}


FAILURE = {"rank": 3, "pid": 77, "exit_code": 1, "cause": 1, "how": "rank 3 raised ValueError",
           "message": "ValueError: boom"}


# -- round trips --------------------------------------------------------------------------
REQUESTS = [protocol.Ping(), protocol.Status(), protocol.Snapshot(), protocol.Stop(),
            protocol.Stop(timeout=2.5), protocol.Stacks(), protocol.Stacks(rank=3),
            protocol.Focus(rank=3),
            protocol.NodeHeartbeat(node=1, status="running", host="n1", pid=9, ranks=[2, 3],
                                   dropped=5),
            protocol.NodeHeartbeat(node=2, status="failed", message="run x failed",
                                   failure=protocol.NodeFailure(rank=3, cause=Cause.OWN_ERROR,
                                                                exit_code=-9, pid=7))]


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: type(r).__name__)
def test_every_request_round_trips(request_: protocol.Request) -> None:
    assert protocol.HUB_REQUESTS.decode(protocol.encode(request_)) == request_


REPLIES = [
    (protocol.Ping, protocol.PingReply(ok=True, run=RUN, seq=7, endpoints={"control": "ipc://c"})),
    (protocol.Snapshot, protocol.SnapshotReply(ok=True, seq=3, state=b"\x80")),
    (protocol.Stop, protocol.StopReply(ok=True, status="stopping")),
    (protocol.Stacks, protocol.Reply(ok=True)),
    (protocol.NodeHeartbeat, protocol.NodeReply(ok=True, stop=2.0, nodes="tcp://10.0.0.1:5")),
    (protocol.NodeHeartbeat, protocol.NodeReply(ok=True)),
]


@pytest.mark.parametrize(("kind", "reply"), REPLIES, ids=lambda r: type(r).__name__)
def test_every_reply_round_trips_and_a_refusal_reads_as_any_reply(
        kind: type[protocol.Request], reply: protocol.Reply) -> None:
    expected = protocol.REPLIES[kind]
    assert protocol.decode_reply(expected, protocol.encode(reply)) == reply
    refusal = protocol.decode_reply(expected, protocol.encode(protocol.refused("no")))
    assert type(refusal) is expected
    assert (refusal.ok, refusal.error) == (False, "no")


def test_the_maps_sent_before_the_types_decode_to_them() -> None:
    """The bytes on the wire did not change: today's decoder reads yesterday's maps."""
    decode = protocol.HUB_REQUESTS.decode
    assert decode(msgspec.msgpack.encode({"op": "stop", "timeout": 5})) == protocol.Stop(timeout=5)
    assert decode(msgspec.msgpack.encode({"op": "stop"})).timeout == 30.0  # type: ignore[union-attr]
    assert decode(msgspec.msgpack.encode({"op": "stacks", "rank": None})) == protocol.Stacks()
    assert decode(msgspec.msgpack.encode({"op": "ping", "extra": [1]})) == protocol.Ping()
    final = decode(msgspec.msgpack.encode(beat(status="failed", message="failed: rank 3",
                                               failure=FAILURE)))
    assert isinstance(final, protocol.NodeHeartbeat) and final.failure is not None
    assert (final.failure.rank, final.failure.cause, final.failure.how) == (
        3, Cause.OWN_ERROR, "rank 3 raised ValueError")
    # ... and what the types send is what the maps were.
    assert msgspec.msgpack.decode(protocol.encode(protocol.Stop(timeout=5.0))) == {
        "op": "stop", "timeout": 5.0}
    assert msgspec.msgpack.decode(protocol.encode(protocol.NodeReply(
        ok=True, nodes="tcp://h:1"))) == {"ok": True, "nodes": "tcp://h:1"}


# -- what a relay answers -------------------------------------------------------------------
def test_requests_are_answered_by_their_type(relay: Relay) -> None:
    assert ask(relay, {"op": "ping"}) == protocol.PingReply(
        ok=True, run=RUN, seq=0, endpoints=relay.endpoints)
    status = ask(relay, {"op": "status"})
    assert isinstance(status, protocol.StatusReply) and status.summary is not None
    assert status.summary.run_id == RUN
    assert ask(relay, {"op": "stop", "timeout": 7}) == protocol.StopReply(ok=True,
                                                                          status="stopping")
    ask(relay, {"op": "stop", "timeout": 1})
    assert ask(relay, {"op": "stacks", "rank": 3}).ok and ask(relay, {"op": "stacks"}).ok
    # Handed to the supervisor as the typed requests, in order; the first stop asked holds.
    assert relay.asked.take() == [protocol.Stop(timeout=7.0), protocol.Stacks(rank=3),
                                  protocol.Stacks(rank=None)]
    assert relay.asked.take() == []  # taken once
    # The evidence asked for: kept once between two takes (later askers share it).
    assert ask(relay, {"op": "evidence"}).ok and ask(relay, {"op": "evidence"}).ok
    assert relay.asked.take() == [protocol.Evidence()]
    ask(relay, {"op": "stop", "timeout": 2})
    assert relay.asked.take() == []  # a stop was asked: later ones are answered, not kept
    # a rank's detail open on a dashboard: its every step for FOCUS_S, renewed
    assert ask(relay, {"op": "focus", "rank": 2}).ok and list(relay.asked.focus) == [2]
    assert not ask(relay, {"op": "focus", "rank": WORLD}).ok  # not a rank of this run
    assert not ask(relay, {"op": "focus"}).ok and list(relay.asked.focus) == [2]
    assert relay.asked.focused(time.monotonic()) == [2]
    assert relay.asked.focused(time.monotonic() + protocol.FOCUS_S + 1) == []
    assert relay.state.rejected == {}


def test_the_daemons_own_ctrl_c_is_a_stop_whatever_was_asked() -> None:
    asked = requests.Asked()
    asked.put(protocol.Stop(timeout=60.0), 0.0)
    asked.put(protocol.Stacks(rank=1), 0.0)
    asked.interrupt(5.0)
    assert asked.take() == [protocol.Stacks(rank=1), protocol.Stop(timeout=5.0)]
    for _ in range(requests.MAX_STACKS_REQUESTS + 3):
        asked.put(protocol.Stacks(rank=None), 0.0)
    assert len(asked.take()) == requests.MAX_STACKS_REQUESTS  # more are answered, not kept


@pytest.mark.parametrize(("body", "error"), [
    (b"\x00garbage", protocol.NOT_A_REQUEST),
    (msgspec.msgpack.encode([1, 2]), protocol.NOT_A_REQUEST),
    (msgspec.msgpack.encode({"op": 3}), protocol.NOT_A_REQUEST),
    (msgspec.msgpack.encode({"timeout": 3}), protocol.NOT_A_REQUEST),
    (msgspec.msgpack.encode({"op": "reboot"}), "unknown op 'reboot': ping, status, snapshot"),
    (msgspec.msgpack.encode({"op": "r" * 100}), f"unknown op {'r' * 40!r}: ping"),
    (msgspec.msgpack.encode({"op": "node", **beat()}), "unknown op 'node'"),  # not a hub
    (msgspec.msgpack.encode({"op": "ping", "pad": "x" * protocol.MAX_REQUEST_BYTES}),
     "request too large"),
])
def test_what_is_not_a_request_is_refused_and_counted(relay: Relay, body: bytes,
                                                      error: str) -> None:
    reply = ask(relay, body)
    assert not reply.ok and reply.error.startswith(error), reply
    assert relay.state.rejected == {"bad_request": 1}


@pytest.mark.parametrize(("request_", "error"), [
    ({"op": "stop", "timeout": "soon"}, "timeout must be a number of seconds >= 0"),
    ({"op": "stop", "timeout": -1}, "timeout must be a number of seconds >= 0"),
    ({"op": "stop", "timeout": float("nan")}, "timeout must be a number of seconds >= 0"),
    ({"op": "stop", "timeout": float("inf")}, "timeout must be a number of seconds >= 0"),
    ({"op": "stop", "timeout": True}, "timeout must be a number of seconds >= 0"),
    ({"op": "stop", "timeout": None}, "timeout must be a number of seconds >= 0"),
    ({"op": "stacks", "rank": -1}, "rank must be a rank of this run"),
    ({"op": "stacks", "rank": WORLD}, "rank must be a rank of this run"),
    ({"op": "stacks", "rank": 2**63}, "rank must be a rank of this run"),
    ({"op": "stacks", "rank": False}, "rank must be a rank of this run"),
])
def test_a_known_request_with_a_bad_argument_is_refused_not_counted(
        relay: Relay, request_: dict[str, Any], error: str) -> None:
    reply = ask(relay, request_)
    assert (reply.ok, reply.error) == (False, error)
    assert relay.state.rejected == {}
    assert relay.asked.take() == []


# -- the hub ------------------------------------------------------------------------------
def test_a_heartbeat_updates_the_node_table_within_the_job(relay: Relay, hub: Hub) -> None:
    hub.nodes_endpoint, hub.stop = "tcp://10.0.0.1:5000", 12.0
    reply = ask(relay, beat(ranks=[3, 2, 3, 9, 1000], dropped=4))
    assert reply == protocol.NodeReply(ok=True, stop=12.0, nodes="tcp://10.0.0.1:5000")
    seen = hub.nodes[1]
    assert (seen.host, seen.pid, seen.ranks, seen.status, seen.dropped, seen.state) == (
        "n1", 4242, [2, 3], "running", 4, UP)  # ranks outside the job left out
    ask(relay, beat(status="failed", message="failed: rank 3", failure=FAILURE))
    assert (seen.state, seen.message) == (DONE, "failed: rank 3")
    assert seen.failure == protocol.NodeFailure(rank=3, cause=Cause.OWN_ERROR, exit_code=1,
                                                pid=77, how="rank 3 raised ValueError",
                                                message="ValueError: boom")
    ask(relay, beat(status="failed", failure={**FAILURE, "rank": WORLD}))
    assert seen.failure is None  # a rank outside the job is no culprit
    assert relay.state.rejected == {}


LONG = "x" * (protocol.MAX_HOST_CHARS + 1)


@pytest.mark.parametrize(("fields", "where"), [
    ({"node": 0}, "$.node"),
    ({"node": 10**7}, "$.node"),  # no job has that many nodes
    ({"node": 2**63}, "$.node"),
    ({"node": "1"}, "$.node"),
    ({"node": True}, "$.node"),
    ({"host": 5}, "$.host"),
    ({"host": LONG}, "$.host"),
    ({"pid": -1}, "$.pid"),
    ({"ranks": ["0"]}, "$.ranks[0]"),
    ({"ranks": [-1]}, "$.ranks[0]"),
    ({"status": "sleeping"}, "$.status"),
    ({"status": None}, "$.status"),
    ({"dropped": -1}, "$.dropped"),
    ({"status": "failed", "message": "m" * (protocol.MAX_HEADLINE_CHARS + 1)}, "$.message"),
    ({"status": "failed", "failure": {**FAILURE, "cause": 99}}, "$.failure.cause"),
    ({"status": "failed", "failure": {**FAILURE, "exit_code": 256}}, "$.failure.exit_code"),
    ({"status": "failed", "failure": {**FAILURE, "how": LONG + LONG}}, "$.failure.how"),
    ({"status": "failed", "failure": "rank 3"}, "$.failure"),
])
def test_a_heartbeat_that_does_not_fit_is_refused_whole(
        relay: Relay, hub: Hub, fields: dict[str, Any], where: str) -> None:
    """Refused, answered with msgspec's words naming the field, not counted (as a
    bad node number was), and nothing of it kept."""
    reply = ask(relay, beat(**fields))
    assert not reply.ok and reply.error.startswith("node: "), reply
    assert reply.error.endswith(f" - at `{where}`"), reply
    assert hub.nodes == {} and relay.state.rejected == {}


def test_a_node_number_past_the_jobs_nodes_is_refused_by_the_hub(relay: Relay,
                                                                  hub: Hub) -> None:
    reply = ask(relay, beat(node=2))
    assert (reply.ok, reply.error) == (False, "node must be 1 to 1")
    assert hub.nodes == {} and relay.state.rejected == {}


# -- the node daemon's side -----------------------------------------------------------------
def test_forwards_carry_a_node_number_of_at_most_six_digits() -> None:
    frame = b"message"
    assert protocol.forward_node(protocol.forward_frames(12, frame)) == 12
    assert protocol.forward_node([protocol.NODE_HEADER, b"9" * 6, frame]) == 999_999
    for bad in ([protocol.NODE_HEADER, b"9" * 7, frame], [protocol.NODE_HEADER, b"9" * 5000, frame],
                [protocol.NODE_HEADER, b"", frame], [protocol.NODE_HEADER, b"-1", frame],
                [protocol.NODE_HEADER, b"1\xff", frame], [b"ddtop-node/2", b"1", frame],
                [protocol.NODE_HEADER, b"1"]):
        assert protocol.forward_node(bad) is None, bad


def forwarder() -> Forwarder:
    """A node daemon's forwarder: its reply handling, not its sockets."""
    forwarder = object.__new__(Forwarder)
    forwarder.push, forwarder.stop, forwarder.heard = None, None, None
    forwarder.control_endpoint = "tcp://h:9"  # where it reached the hub (host h)
    forwarder.summariser = summariser.Summariser("r", 1)
    forwarder.connected = []  # type: ignore[attr-defined]
    forwarder._connect = forwarder.connected.append  # type: ignore[attr-defined,method-assign]
    return forwarder


def test_the_hubs_reply_is_taken_only_whole() -> None:
    taken = forwarder()
    taken.take_reply(protocol.encode(protocol.NodeReply(ok=True, stop=3.0, nodes="tcp://h:1",
                                                        focus=[3])))
    assert (taken.stop, taken.connected, taken.heard is not None) == (  # type: ignore[attr-defined]
        3.0, ["tcp://h:1"], True)
    assert taken.summariser.focus == {3}  # a rank open on a dashboard: its every step
    for reply in ({"ok": True, "stop": -1.0}, {"ok": True, "stop": True},
                  {"ok": True, "focus": [-1]}, {"ok": True, "focus": list(range(17))},
                  {"ok": True, "nodes": "udp://h:1"}, {"ok": True, "nodes": "tcp://" + "h" * 300},
                  {"stop": 1.0}, [1]):
        refused = forwarder()
        refused.take_reply(msgspec.msgpack.encode(reply))
        assert (refused.stop, refused.connected, refused.heard) == (  # type: ignore[attr-defined]
            None, [], None), reply
        assert refused.summariser.focus == set(), reply
    heard = forwarder()  # a refusal is the hub's answer all the same
    heard.take_reply(protocol.encode(protocol.refused("node must be 1 to 1")))
    assert heard.heard is not None and heard.stop is None


def test_a_node_gathers_its_evidence_when_the_hub_names_a_new_bundle() -> None:
    node = forwarder()
    reply = protocol.NodeReply(ok=True, evidence="20261207-101502")
    node.take_reply(protocol.encode(reply))  # (from before this node heard the hub)
    assert (node.evidence_heard, node.evidence_asked) == ("20261207-101502", "")
    node.take_reply(protocol.encode(reply))
    assert node.evidence_asked == ""
    node.take_reply(protocol.encode(protocol.NodeReply(ok=True, evidence="20261207-101502-1")))
    assert node.evidence_asked == "20261207-101502-1"
    for bad in ("../../etc", "x" * 40, "20261207 101502"):  # not a bundle's name: refused whole
        refused = forwarder()
        refused.take_reply(msgspec.msgpack.encode({"ok": True, "evidence": bad}))
        assert (refused.evidence_heard, refused.evidence_asked, refused.heard) == (None, "", None)


def test_the_hub_passes_the_ranks_open_on_a_dashboard_to_the_nodes(relay: Relay,
                                                                   hub: Hub) -> None:
    reply = ask(relay, beat())
    assert isinstance(reply, protocol.NodeReply) and reply.focus == []
    assert ask(relay, {"op": "focus", "rank": 3}).ok
    reply = ask(relay, beat())
    assert isinstance(reply, protocol.NodeReply) and reply.focus == [3]
    relay.asked.focus[3] = 0.0  # its time is up: no longer passed on
    reply = ask(relay, beat())
    assert isinstance(reply, protocol.NodeReply) and reply.focus == []
