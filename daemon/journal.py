"""The telemetry journal: every message the daemon accepted, in relay order.

    runs/<id>/telemetry.journal

Append-only. Each record is a 4-byte big-endian length, then a msgpack array
`[relay_seq, received, frame]`: the relay sequence number (1, 2, 3, ...), the
daemon's wall-clock time when it received the message (s), and the message
frame exactly as it arrived (see docs/telemetry.md). Replaying the records into
a RunState rebuilds what the daemon knew; a torn last record (the daemon was
killed mid-write) ends the replay without error.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import msgspec

from ddtop.daemon import wire
from ddtop.daemon.state import RunState

LENGTH = struct.Struct(">I")
MAX_RECORD_BYTES = wire.MAX_FRAME_BYTES + 64


class Record(msgspec.Struct, array_like=True):
    seq: int
    received: float
    frame: bytes


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


class JournalWriter:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: BinaryIO = path.open("ab")

    def append(self, seq: int, received: float, frame: bytes) -> None:
        data = _encoder.encode(Record(seq, received, frame))
        self._file.write(LENGTH.pack(len(data)) + data)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read(path: Path) -> Iterator[Record]:
    """Every complete record; stops quietly at a torn or damaged tail."""
    with path.open("rb") as f:
        while True:
            head = f.read(LENGTH.size)
            if len(head) < LENGTH.size:
                return
            (size,) = LENGTH.unpack(head)
            if size > MAX_RECORD_BYTES:
                return
            data = f.read(size)
            if len(data) < size:
                return
            try:
                yield _decoder.decode(data)
            except msgspec.DecodeError:
                return


def replay(path: Path, run: str, upto: int | None = None) -> tuple[RunState, int]:
    """The RunState after folding the journal (up to relay seq `upto`), and the
    last relay sequence number folded."""
    state, last = RunState(run=run), 0
    for record in read(path):
        if upto is not None and record.seq > upto:
            break
        try:
            state.apply(wire.decode([record.frame], run), record.received)
        except wire.WireError:
            continue
        last = record.seq
    return state, last
