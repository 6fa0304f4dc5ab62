"""No input can stop the daemon's loop: the frames that once did, sent for real.

Two bytes of bad UTF-8 inside msgpack and 5 KB of arrays nested 5,000 deep,
sent to a live run's telemetry and control sockets, ended its supervision
(the ranks trained on unwatched, the run read `lost`); a node number of 5,000
digits on the hub's node socket ended a whole multi-node job. Now each is
refused and counted, the steps keep moving and the run succeeds.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from helpers import detached
from test_fuzz import BAD_UTF8, DEEP, DEEP_IN_MAP

from ddtop.core import protocol, wire
from ddtop.core.config import TrainConfig
from ddtop.core.keys import RunKeys
from ddtop.daemon.hub import Hub
from ddtop.daemon.relay import Relay

RUN = "frames"
BAD = [BAD_UTF8, DEEP, DEEP_IN_MAP]
SERVE_TIMEOUT_S = 10.0


@pytest.mark.processes
def test_malformed_frames_on_a_live_run_are_counted_and_the_run_succeeds(tmp_path: Path) -> None:
    with detached("-n", "2", "--epochs", "3", "--synthetic-train-samples", "8192",
                  "--run-id", RUN, cwd=tmp_path) as run:
        assert run.started.returncode == 0, run.started.stdout + run.started.stderr
        first = run.wait_for(RUN, lambda s: all(r["global_step"] > 0 for r in s["ranks"]))
        endpoints = json.loads((tmp_path / "runs" / RUN / "run.json").read_text())["endpoints"]
        context = zmq.Context()
        push, asker = context.socket(zmq.PUSH), context.socket(zmq.DEALER)
        try:
            for sock, endpoint in ((push, "telemetry"), (asker, "control")):
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(endpoints[endpoint])
            for frame in BAD:
                push.send(frame)
            replies = []
            for frame in BAD:
                asker.send_multipart([b"", frame])
                assert asker.poll(10_000), "the daemon stopped answering"
                replies.append(msgspec.msgpack.decode(asker.recv_multipart()[-1]))
        finally:
            push.close(linger=0)
            asker.close(linger=0)
            context.term()
        assert [r["ok"] for r in replies] == [False] * len(BAD), replies
        # Malformed, or (where the decoder takes the nesting: Python 3.12) of no version.
        moved = run.wait_for(RUN, lambda s: s["rejected"].get("malformed", 0)
                             + s["rejected"].get("wrong_version", 0) >= len(BAD)
                             and min(r["global_step"] for r in s["ranks"])
                             > max(r["global_step"] for r in first["ranks"]) + 10)
        assert moved["rejected"].get("bad_request", 0) >= len(BAD), moved["rejected"]
        assert "internal_error" not in moved["rejected"], moved["rejected"]
        final = run.wait_for(RUN, lambda s: s["status"] in wire.FINAL_STATUSES, timeout=120)
        assert final["status"] == "succeeded", final
        assert final["exit_code"] == 0
        assert run.leftovers() == []


def _serve_until(relay: Relay, done: object, timeout_s: float = SERVE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:  # type: ignore[operator]
        relay.serve(0.05)
    assert done(), relay.state.rejected  # type: ignore[operator]


def test_a_node_number_of_5000_digits_is_refused_and_the_hub_goes_on(tmp_path: Path) -> None:
    """Over real CURVE on loopback, as a node daemon holding the job's keys sends."""
    keys = RunKeys.create(tmp_path / "keys")
    relay = Relay("job", tmp_path / "telemetry.journal", bind="127.0.0.1", keys=keys,
                  world_size=4, nodes=True)
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    try:
        relay.serve_hub(Hub(TrainConfig(world_size=4, nnodes=2), relay))
        push.setsockopt(zmq.LINGER, 0)
        RunKeys.load(tmp_path / "keys").client(push)
        push.connect(relay.endpoints["nodes"])
        beat = wire.Heartbeat(run="job", rank=3, phase="forward", epoch=0, global_step=7,
                              phase_s=0.1)
        frame = wire.encode(beat)[0]
        for node in (b"9" * 5000, b"0", b"2", b"1\xff", b"1"):
            push.send_multipart([protocol.NODE_HEADER, node, frame])
        _serve_until(relay, lambda: 3 in relay.state.ranks)
        assert relay.state.rejected.get("bad_forward") == 4, relay.state.rejected
        assert relay.state.ranks[3].global_step == 7
    finally:
        push.close(linger=0)
        context.term()
        relay.close()


def test_an_exception_in_a_handler_is_said_counted_and_the_loop_goes_on(tmp_path: Path) -> None:
    """Whatever a handler of the loop raises (a defect not yet found): the relay
    says it once (stderr, a warning event), counts every one, and serves on."""
    relay = Relay(RUN, tmp_path / "telemetry.journal", tmp_path / "sock", world_size=2)
    try:
        def broken() -> None:
            raise KeyError("a defect")

        for _ in range(3):
            relay.guarded("stacks", broken)
        assert relay.state.rejected["internal_error"] == 3
        warnings = [e for e in relay.state.events if e.type == "warning"]
        assert len(warnings) == 1, warnings
        assert "internal error in the stacks handler" in warnings[0].message
        assert "KeyError" in warnings[0].message
        context = zmq.Context()
        asker = context.socket(zmq.REQ)
        try:
            asker.setsockopt(zmq.LINGER, 0)
            asker.connect(relay.endpoints["control"])
            asker.send(msgspec.msgpack.encode({"op": "ping"}))
            _serve_until(relay, lambda: asker.poll(0))
            assert msgspec.msgpack.decode(asker.recv())["run"] == RUN
        finally:
            asker.close(linger=0)
            context.term()
    finally:
        relay.close()
