"""Property-based fuzzing of every decoder of what ddtop receives.

The rule: no input can stop the daemon's loop. Every decoder of bytes from
outside (a telemetry frame, a relayed frame, a control request and each reply,
a node daemon's forward and heartbeat, the hub's reply, a journal, run.json,
config.json, a rank's error report, hub.json, a snapshot, the run's key files)
either takes it or refuses it in its one documented way (a counted rejection,
a WireError, a ValueError, a UsageError, None, a request's one-line refusal);
and whatever the wire lets through, the state's fold takes without raising.

Each property runs twice in `make test`: a fixed number of examples from a
fixed seed (DDTOP_FUZZ_EXAMPLES, default 100: the same every run) and a few
fresh random ones. `make fuzz` runs them long (20,000 examples each).
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddtop.core import blame, journal, protocol, wire
from ddtop.core.config import TrainConfig
from ddtop.core.contract import UsageError
from ddtop.core.keys import RunKeys
from ddtop.core.rundir import RunPaths, read_json
from ddtop.core.runinfo import RunInfo
from ddtop.core.state import RunState, decode_snapshot, encode_snapshot
from ddtop.daemon import requests
from ddtop.daemon.forwarder import Forwarder
from ddtop.daemon.hub import Hub
from ddtop.daemon.hubfile import read_hub_file
from ddtop.daemon.relay import Relay

RUN = "20261126-000000-fuzz"
EXAMPLES = int(os.environ.get("DDTOP_FUZZ_EXAMPLES", "100"))
RANDOM_EXAMPLES = 10
FIXED = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                 suppress_health_check=list(HealthCheck))
RANDOM = settings(max_examples=RANDOM_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))

# The frames that once ended supervision: bad UTF-8 inside msgpack (a str of one
# byte, 0xff), and 5 KB of arrays nested 5,000 deep, bare and inside a map.
BAD_UTF8 = b"\xa1\xff"
DEEP = b"\x91" * 5000 + b"\xc0"
DEEP_IN_MAP = b"\x82\xa1v" + DEEP + b"\xa3run\xa1x"
DEEP_JSON = b"[" * 5000 + b"]" * 5000
LONG_NUMBER = b"9" * 5000  # int() takes at most 4,300 digits
KNOWN = [BAD_UTF8, DEEP, DEEP_IN_MAP, DEEP_JSON, LONG_NUMBER, b"", b"\xc1", b"{}", b"[]"]


# -- what is thrown at them ------------------------------------------------------------
scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
           | st.binary(max_size=12))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=16)
keys = st.sampled_from(["v", "run", "rank", "seq", "kind", "op", "node", "host", "pid", "ranks",
                        "status", "failure", "stop", "nodes", "timeout", "schema", "exit_code"])
maps = st.dictionaries(keys | st.text(max_size=6), values, max_size=6)


def valid_frames() -> list[bytes]:
    coll = wire.Collective(seq=7, op="allreduce", bytes=1024)
    return [wire.encode(m)[0] for m in (
        wire.Hello(run=RUN, rank=1, local_rank=1, host="h", pid=42, device="cpu",
                   backend="gloo", world_size=2, config_digest="abc", model="mlp",
                   dataset="synthetic", epochs=3, global_batch=64),
        wire.Heartbeat(run=RUN, rank=0, phase="backward", epoch=0, global_step=3, phase_s=2.5,
                       coll_started=coll),
        wire.Event(run=RUN, rank=0, type="error", message="x", data={"a": 1}),
        wire.Bye(run=RUN, rank=1, exit_code=0))]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid frame, then cut, spliced or with bytes flipped."""
    data = bytearray(draw(st.sampled_from(valid_frames())))
    for _ in range(draw(st.integers(1, 4))):
        where = draw(st.integers(0, len(data)))
        how = draw(st.sampled_from(["flip", "cut", "insert"]))
        if how == "flip" and where < len(data):
            data[where] = draw(st.integers(0, 255))
        elif how == "cut":
            del data[where:where + draw(st.integers(1, 8))]
        else:
            data[where:where] = draw(st.sampled_from([BAD_UTF8, b"\x91" * 40, b"\xcf" + b"\xff" * 8,
                                                      b"\xcb\x7f\xf8" + b"\0" * 6]))
    return bytes(data)


untrusted = st.one_of(st.binary(max_size=300), values.map(msgspec.msgpack.encode),
                      maps.map(msgspec.msgpack.encode), mutated(), st.sampled_from(KNOWN),
                      values.map(msgspec.json.encode), maps.map(msgspec.json.encode))


# -- the decoders ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Relay]:
    """A real relay (its ipc sockets bound) as a hub of 2 nodes, for the
    in-process handlers of what its sockets receive."""
    folder = tmp_path_factory.mktemp("relay")
    relay = Relay(RUN, folder / "telemetry.journal", folder / "sock", world_size=4)
    relay.hub = Hub(TrainConfig(world_size=4, nnodes=2), relay)
    yield relay
    relay.close()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> RunPaths:
    paths = RunPaths(tmp_path_factory.mktemp("runs") / RUN)
    paths.root.mkdir()
    return paths


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("keys") / "keys"
    RunKeys.create(folder)
    return folder


def telemetry(data: bytes, **_: Any) -> None:
    with contextlib.suppress(wire.WireError):
        wire.decode([data], RUN)


def relayed(data: bytes, **_: Any) -> None:
    with contextlib.suppress(wire.WireError):
        wire.decode_relayed([data[:8], data[8:]], RUN)


def control_request(data: bytes, relay: Relay, **_: Any) -> None:
    """Through a hub's relay (its decoder takes node heartbeats too), then a plain
    daemon's decoder."""
    reply = requests.answer(relay, data)
    assert isinstance(msgspec.to_builtins(reply).get("ok"), bool)
    msgspec.msgpack.encode(reply)  # and it can be sent
    relay.asked = requests.Asked()
    with contextlib.suppress(protocol.BadRequest):
        protocol.REQUESTS.decode(data)


def control_reply(data: bytes, **_: Any) -> None:
    """Every reply's decoder, as a client (or a node daemon) reads it."""
    for kind in set(protocol.REPLIES.values()):
        with contextlib.suppress(ValueError):
            protocol.decode_reply(kind, data)


def node_forward(data: bytes, relay: Relay, **_: Any) -> None:
    relay.take_forward([protocol.NODE_HEADER, data[:3], data[3:]], 0.0)
    relay.take_forward([protocol.NODE_HEADER, data, valid_frames()[0]], 0.0)
    relay.take_forward([data], 0.0)


def hub_reply(data: bytes, **_: Any) -> None:
    forwarder = object.__new__(Forwarder)  # its reply handling, not its sockets
    forwarder.push, forwarder.stop, forwarder.heard = None, None, None
    forwarder._connect = lambda endpoint: None  # type: ignore[method-assign]
    forwarder.take_reply(data)
    assert forwarder.stop is None or forwarder.stop >= 0


def journal_file(data: bytes, run_dir: RunPaths, **_: Any) -> None:
    path = run_dir.root / "fuzz.journal"
    path.write_bytes(struct.pack(">I", len(data)) + data)  # one record: the fuzzed bytes
    journal.replay(path, RUN)
    record = msgspec.msgpack.encode([1, 0.0, data])  # a record whose frame is the fuzzed bytes
    path.write_bytes(struct.pack(">I", len(record)) + record)
    journal.replay(path, RUN)


def run_json(data: bytes, run_dir: RunPaths, **_: Any) -> None:
    run_dir.status.write_bytes(data)
    info = RunInfo.load(run_dir)
    info.summary(timeout_s=0.05)
    run_dir.status.unlink()


def config_json(data: bytes, run_dir: RunPaths, **_: Any) -> None:
    run_dir.config.write_bytes(data)
    RunInfo.load(run_dir)
    with contextlib.suppress(ValueError):
        read_json(run_dir.config)
    run_dir.config.unlink()


def error_report(data: bytes, run_dir: RunPaths, **_: Any) -> None:
    path = run_dir.rank_error(0)
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    blame.read_error_report(path, 0.0)


def hub_file(data: bytes, run_dir: RunPaths, **_: Any) -> None:
    run_dir.hub_file.write_bytes(data)
    read_hub_file(run_dir.hub_file)


def snapshot(data: bytes, **_: Any) -> None:
    with contextlib.suppress(wire.UNTRUSTED_ERRORS):
        decode_snapshot(data)


def key_files(data: bytes, keys: Path, **_: Any) -> None:
    """A damaged copy of each key file: one UsageError naming it, nothing else."""
    for name in ("client.key_secret", "server.key"):
        damaged = keys.parent / "damaged"
        damaged.mkdir(exist_ok=True)
        for other in keys.iterdir():
            (damaged / other.name).write_bytes(other.read_bytes())
        (damaged / name).write_bytes(data)
        with contextlib.suppress(UsageError):
            RunKeys.load(damaged)


DECODERS: dict[str, Callable[..., None]] = {
    "telemetry": telemetry, "relayed": relayed, "control_request": control_request,
    "control_reply": control_reply, "node_forward": node_forward, "hub_reply": hub_reply,
    "journal": journal_file, "run_json": run_json, "config_json": config_json,
    "error_report": error_report, "hub_file": hub_file, "snapshot": snapshot,
    "key_files": key_files}


@pytest.fixture
def context(relay: Relay, run_dir: RunPaths, keys: Path) -> dict[str, Any]:
    return {"relay": relay, "run_dir": run_dir, "keys": keys}


@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize("data", KNOWN, ids=range(len(KNOWN)))
def test_the_frames_that_once_ended_supervision(name: str, data: bytes,
                                                 context: dict[str, Any]) -> None:
    DECODERS[name](data, **context)


@pytest.mark.parametrize("name", DECODERS)
@FIXED
@given(data=untrusted)
def test_every_decoder_takes_anything_fixed_seed(name: str, data: bytes,
                                                 context: dict[str, Any]) -> None:
    DECODERS[name](data, **context)


@pytest.mark.parametrize("name", DECODERS)
@RANDOM
@given(data=untrusted)
def test_every_decoder_takes_anything_random(name: str, data: bytes,
                                             context: dict[str, Any]) -> None:
    DECODERS[name](data, **context)


@FIXED
@given(request=st.fixed_dictionaries({"op": st.sampled_from(
    ["ping", "status", "snapshot", "stop", "stacks", "evidence", "node", "nope"])}, optional={
    "node": values, "host": values, "pid": values, "ranks": values, "status": st.sampled_from(
        ["running", "failed", "succeeded", "x"]) | values, "failure": maps | values,
    "dropped": values, "message": values, "timeout": values, "rank": values}))
def test_requests_of_every_op_with_any_values(request: dict[str, Any], relay: Relay) -> None:
    """Each op's fields of every kind (a node heartbeat's too, as the hub reads them)."""
    try:
        body = msgspec.msgpack.encode(request)
    except (OverflowError, TypeError):
        return
    control_request(body, relay)
    assert relay.hub is not None
    for seen in relay.hub.nodes.values():  # what the hub kept is of its kinds
        assert isinstance(seen.host, str) and isinstance(seen.ranks, list)
        assert seen.failure is None or isinstance(seen.failure.rank, int)


# -- the fold: whatever the wire lets through --------------------------------------------
def _message(cls: type[Any]) -> st.SearchStrategy[Any]:
    fields: dict[str, st.SearchStrategy[Any]] = {
        "run": st.just(RUN), "rank": st.integers(-1, 3), "seq": st.integers(0, 40)}
    if "exited" in cls.__struct_fields__:
        fields["exited"] = st.integers(-2, 4)
    if "world_size" in cls.__struct_fields__:
        fields["world_size"] = st.integers(-1, 5)
    return st.builds(cls, **fields)


typed_messages = st.one_of([_message(cls) for cls in wire.KINDS.values()])


@FIXED
@given(messages=st.lists(typed_messages, max_size=30), now=st.floats(0, 2e9))
def test_the_fold_takes_whatever_the_wire_lets_through(messages: list[Any], now: float) -> None:
    state = RunState(run=RUN)
    for message in messages:
        try:
            frame = wire.encode(message)[0]
            decoded = wire.decode([frame], RUN)
        except (wire.WireError, OverflowError, TypeError, ValueError):
            continue  # not sendable, or refused at the door
        state.apply(decoded, now)
        state.summary(now)
        state.rank_states(now)
        state.hung(now + 60)
        state.stragglers()
    assert decode_snapshot(encode_snapshot(state)).run == RUN
