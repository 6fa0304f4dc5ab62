"""ddtop.log's scalars and a script's hello on the fold: newest value per rank
and key, mean/min/max across ranks, bounds, hostile input; totals for progress."""

from __future__ import annotations

import math

import msgspec
import pytest

from ddtop.core import wire
from ddtop.core.scalars import MAX_RUN_SCALAR_KEYS
from ddtop.core.state import RunState

RUN = "r1"


def scalars(rank: int, seq: int, **values: float) -> wire.Scalars:
    return wire.Scalars(run=RUN, rank=rank, seq=seq, values=values)


def script_hello(rank: int, seq: int = 0, **fields: object) -> wire.Hello:
    base: dict[str, object] = dict(
        run=RUN, rank=rank, seq=seq, local_rank=rank, host="node", pid=1000 + rank,
        device="cpu", backend="", world_size=3, config_digest="", model="", dataset="",
        epochs=0, global_batch=0, program="train.py", total_steps=0)
    return wire.Hello(**{**base, **fields})  # type: ignore[arg-type]


def fold(*messages: wire.Message) -> RunState:
    s = RunState(run=RUN)
    for m in messages:
        s.apply(m, 100.0)
    return s


def stats(s: RunState) -> dict[str, tuple[object, ...]]:
    return {x.name: (x.mean, x.min, x.min_rank, x.max, x.max_rank, x.ranks, x.nonfinite)
            for x in s.summary(100.0).scalars}


def test_newest_value_per_rank_and_key_across_ranks() -> None:
    s = fold(scalars(0, 0, acc=0.5, lr=0.1), scalars(1, 0, acc=0.9),
             scalars(2, 0, acc=0.1), scalars(0, 1, acc=0.2))  # rank 0's newest acc is 0.2
    assert stats(s) == {"acc": (pytest.approx(0.4), 0.1, 2, 0.9, 1, 3, 0),
                        "lr": (0.1, 0.1, 0, 0.1, 0, 1, 0)}


def test_a_late_message_does_not_overwrite_a_newer_value() -> None:
    s = fold(scalars(0, 0, acc=0.5), scalars(0, 2, acc=0.7), scalars(0, 1, acc=0.1))
    assert stats(s)["acc"][0] == pytest.approx(0.7)


def test_nonfinite_values_are_counted_not_averaged() -> None:
    s = fold(scalars(0, 0, loss=math.nan), scalars(1, 0, loss=2.0), scalars(2, 0, x=math.inf))
    assert stats(s) == {"loss": (2.0, 2.0, 1, 2.0, 1, 2, 1), "x": (None, None, None, None,
                                                                 None, 1, 1)}


def test_keys_beyond_the_run_bound_are_dropped_and_counted() -> None:
    messages = [scalars(0, seq, **{f"k{seq}_{i}": 1.0 for i in range(wire.MAX_SCALAR_KEYS)})
                for seq in range(5)]
    s = fold(*messages)
    assert len(s.scalars) == MAX_RUN_SCALAR_KEYS
    assert s.scalars_dropped == 5 * wire.MAX_SCALAR_KEYS - MAX_RUN_SCALAR_KEYS


def frame(**fields: object) -> list[bytes]:
    base = msgspec.to_builtins(scalars(0, 0, a=1.0))
    return [msgspec.msgpack.encode({**base, **fields})]


@pytest.mark.parametrize("values", [
    {f"k{i}": 1.0 for i in range(wire.MAX_SCALAR_KEYS + 1)},  # too many keys
    {"k" * (wire.MAX_SCALAR_KEY_CHARS + 1): 1.0},  # key too long
    {"": 1.0},  # empty key
    {"a": "one"},  # not a number
    {"a": None},
    [1.0, 2.0],  # not a map
    {"loss\x1b[2J": 1.0},  # a terminal escape in a key
    {"two words": 1.0},
])
def test_hostile_scalars_frames_are_refused(values: object) -> None:
    with pytest.raises(wire.Malformed):
        wire.decode(frame(values=values), run=RUN)


def test_scalars_round_trip_and_reach_the_summary_json() -> None:
    message = scalars(1, 3, grad_norm=1.5)
    assert wire.decode(wire.encode(message), run=RUN) == message
    summary = msgspec.json.decode(msgspec.json.encode(fold(message).summary(100.0)))
    assert summary["scalars"][0]["name"] == "grad_norm"


def test_a_scripts_hello_gives_program_and_totals_and_says_join_once() -> None:
    s = fold(script_hello(0), script_hello(0, seq=1, model="GPT", backend="gloo",
                                           total_steps=500, epochs=2))
    assert (s.program, s.total_steps, s.model, s.backend, s.epochs) == (
        "train.py", 500, "GPT", "gloo", 2)
    assert [e.type for e in s.events] == ["join"]
    assert s.progress() == (0, 500)
    assert s.summary(100.0).program == "train.py"


def test_the_builtin_trainers_hello_is_unchanged_on_the_wire() -> None:
    hello = wire.Hello(run=RUN, rank=0, local_rank=0, host="h", pid=1, device="cpu",
                       backend="gloo", world_size=1, config_digest="d", model="mlp",
                       dataset="synthetic", epochs=1, global_batch=8)
    fields = msgspec.msgpack.decode(wire.encode(hello)[0])
    assert "program" not in fields and "total_steps" not in fields


def test_a_step_with_a_loss_weight_divides_by_it() -> None:
    step = wire.Step(run=RUN, rank=0, seq=1, t=101.0, epoch=0, step=0, steps_per_epoch=0,
                     global_step=3, steps=3, samples=0, loss_sum=6.0, lr=0.1, step_s=0.3,
                     data_s=0, forward_s=0, backward_s=0, optimizer_s=0, comm_s=0,
                     comm_bytes=0, comm_ops=0, algbw_gbps=0, busbw_gbps=0, sync_wait_s=0,
                     loss_weight=3.0)
    assert fold(script_hello(0), step).ranks[0].loss == pytest.approx(2.0)
    unweighted = msgspec.structs.replace(step, loss_weight=0.0)
    assert fold(script_hello(0), unweighted).ranks[0].loss is None


@pytest.mark.parametrize("fields", [
    {"program": "x" * (wire.MAX_PROGRAM_CHARS + 1)}, {"program": "train.py\n[rank 0] fake"},
    {"total_steps": -1},
])
def test_hostile_hello_fields_are_refused(fields: dict[str, object]) -> None:
    raw = msgspec.msgpack.decode(wire.encode(script_hello(0))[0])
    with pytest.raises(wire.Malformed):
        wire.decode([msgspec.msgpack.encode({**raw, **fields})], run=RUN)
