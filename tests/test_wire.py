"""The wire format: every kind round-trips; nothing malformed gets through."""

from __future__ import annotations

import collections
import random

import msgspec
import pytest

from ddtop.core import wire

RUN = "20261122-000000-abcd"


def examples() -> list[wire.Message]:
    coll = wire.Collective(seq=7, op="allreduce", bytes=1024)
    return [
        wire.Hello(run=RUN, rank=1, local_rank=1, host="h", pid=42, device="cpu",
                   backend="gloo", world_size=2, config_digest="abc", model="mlp",
                   dataset="synthetic", epochs=3, global_batch=64),
        wire.Step(run=RUN, rank=0, epoch=0, step=3, steps_per_epoch=8, global_step=3, steps=3,
                  samples=96, loss_sum=200.5, lr=0.1, step_s=0.3, data_s=0.01, forward_s=0.1,
                  backward_s=0.15, optimizer_s=0.04, comm_s=0.1, comm_bytes=3000, comm_ops=3,
                  algbw_gbps=0.00003, busbw_gbps=0.00003, sync_wait_s=0.0, rss=10**9),
        wire.Heartbeat(run=RUN, rank=0, phase="backward", epoch=0, global_step=3, phase_s=2.5,
                       coll_started=coll, coll_completed=None),
        wire.Aggregate(run=RUN, rank=0, scope="epoch", epoch=0, global_step=8, train_loss=1.5,
                       train_accuracy=0.5, train_samples=256, val_loss=1.2, val_accuracy=0.6,
                       val_samples=101),
        wire.Event(run=RUN, rank=0, type="error", message="RuntimeError: x",
                   traceback="Traceback...", data={"global_step": 3, "phase": "forward"}),
        wire.Restarting(run=RUN, rank=wire.DAEMON_RANK, message="restart 1/2: rank 1 ...",
                        restart=wire.Restart(restart=1, rank=1, reason="was killed by SIGKILL",
                                             pid=42, signal="SIGKILL", global_step=20,
                                             checkpoint="step-00000020.pt", time=1.7e9)),
        wire.Bye(run=RUN, rank=0, exit_code=0, dropped=3),
    ]


@pytest.mark.parametrize("message", examples(), ids=lambda m: type(m).__name__)
def test_round_trip(message: wire.Message) -> None:
    frames = wire.encode(message)
    assert len(frames) == 1 and isinstance(frames[0], bytes)
    assert wire.decode(frames, run=RUN) == message


def test_every_kind_is_documented() -> None:
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "telemetry.md").read_text()
    for kind, cls in wire.KINDS.items():
        assert f"### {kind}" in doc, kind
        for name in cls.__struct_fields__:
            assert f"`{name}`" in doc, f"{kind}.{name} is not in docs/telemetry.md"


def encoded(**fields: object) -> bytes:
    base = msgspec.to_builtins(examples()[-1])
    return msgspec.msgpack.encode({**base, **fields})


@pytest.mark.parametrize(("frames", "error"), [
    ([b"\xff\x00garbage"], wire.Malformed),
    ([msgspec.msgpack.encode(12)], wire.Malformed),
    ([msgspec.msgpack.encode([1, 2, 3])], wire.Malformed),
    ([], wire.Malformed),
    ([encoded(), b"extra"], wire.Malformed),
    ([encoded(kind="nonsense")], wire.Malformed),
    ([encoded(exit_code="zero")], wire.Malformed),
    ([encoded(rank=None)], wire.Malformed),
    ([encoded(v=2)], wire.WrongVersion),
    ([encoded(v="1")], wire.WrongVersion),
    ([encoded(run="another-run")], wire.WrongRun),
    ([b"\x00" * (wire.MAX_FRAME_BYTES + 1)], wire.Oversized),
])
def test_bad_frames_raise_typed_errors(frames: list[bytes], error: type[wire.WireError]) -> None:
    with pytest.raises(error):
        wire.decode(frames, run=RUN)


def test_random_bytes_never_escape_as_other_errors() -> None:
    rng = random.Random(0)
    valid = wire.encode(examples()[1])[0]
    outcomes: collections.Counter[str] = collections.Counter()
    for _ in range(3000):
        if rng.random() < 0.5:
            frame = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
        else:  # a valid frame with a few bytes flipped
            data = bytearray(valid)
            for _ in range(rng.randrange(1, 5)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            frame = bytes(data)
        try:
            outcomes[type(wire.decode([frame], run=RUN)).__name__] += 1
        except wire.WireError as e:
            outcomes[e.reason] += 1
    # Anything else would have escaped above; most damaged frames are refused.
    assert outcomes["malformed"] > 2000, outcomes


def test_bandwidth_follows_nccl_tests() -> None:
    algbw, busbw = wire.algbw_busbw(4 * 10**9, 2.0, world_size=8)
    assert algbw == 2.0 and busbw == pytest.approx(2.0 * 2 * 7 / 8)
    assert wire.algbw_busbw(100, 0.0, 2) == (0.0, 0.0)


def test_an_epoch_not_known_is_null_and_a_bad_one_is_refused() -> None:
    """A step's or heartbeat's epoch: from 0, or null where the rank does not
    know it (a script's sampler never set_epoch'd); a negative or oversized one
    (or one not a whole number) is a malformed frame, never shown."""
    step, beat = examples()[1], examples()[2]
    for message in (step, beat):
        unknown = msgspec.structs.replace(message, epoch=None)
        assert wire.decode(wire.encode(unknown), run=RUN) == unknown
        base = msgspec.to_builtins(message)
        for bad in (-1, wire.MAX_EPOCH + 1, 1.5, "1"):
            with pytest.raises(wire.Malformed):
                wire.decode([msgspec.msgpack.encode({**base, "epoch": bad})], run=RUN)
        # What senders before the null sent (0 where not known) still reads.
        assert wire.decode([msgspec.msgpack.encode({**base, "epoch": 0})], run=RUN) == message
