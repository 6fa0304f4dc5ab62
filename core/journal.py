"""The telemetry journal: every message the daemon accepted, in relay order.

    runs/<id>/telemetry.journal

Append-only. Each record is a 4-byte big-endian length, then a msgpack array
`[relay_seq, received, frame]`: the relay sequence number (1, 2, 3, ...), the
daemon's wall-clock time when it received the message (s), and the message
frame exactly as it arrived (see docs/telemetry.md). Replaying the records into
a RunState rebuilds what the daemon knew; a torn last record (the daemon was
killed mid-write) ends the replay without error.

A disk that fills up never stops the daemon: a write the file system refuses
(`No space left on device`, a quota) is cut back to the last whole record, the
records it held are dropped and counted (`JournalWriter.dropped`), and for
RETRY_S after that what comes is dropped and counted without touching the disk;
then writing is tried again. Dropped records leave gaps in the relay sequence
numbers, so a replay counts what is missing (`RunState.journal_dropped`).

The writer tells of its own health (`JournalWriter.news`, `final_line`); the
relay only says it. Each outage (from a refused write to the next one that
works) is counted: its start is warned about (not again within WARN_EVERY_S of
the last warning: a disk hovering at full), its end always says what that
outage cost and, after the first, what all of them did; the final line, once
the journal is closed, the total.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec

from ddtop.core import wire
from ddtop.core.state import RunState
from ddtop.core.text import count_of

LENGTH = struct.Struct(">I")
MAX_RECORD_BYTES = wire.MAX_FRAME_BYTES + 64
# Bytes of records held before they are written without waiting for flush().
FLUSH_BYTES = 64 * 1024
# Seconds after a failed write during which records are dropped unwritten.
RETRY_S = 1.0
# An outage that begins this soon after the last warning is not warned about (its
# end is still said, with its count).
WARN_EVERY_S = 60.0


class Record(msgspec.Struct, array_like=True):
    seq: int
    received: float
    frame: bytes


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


class News(msgspec.Struct, frozen=True):
    """One thing to say about the journal: an event's type, message and data."""

    type: wire.EventType
    message: str
    data: dict[str, str | int]


class JournalWriter:
    """Appends records; never raises for a write the disk refuses (see above)."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.clock = clock
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
        self._end = os.fstat(self._fd).st_size  # where the last whole record ends
        self._pending = bytearray()
        self._ends: list[int] = []  # where each pending record ends, in _pending
        self.dropped = 0  # records not written
        self.dropped_bytes = 0
        self.error: OSError | None = None  # why the newest write failed; None once one works
        self._retry_at = 0.0
        self._broken = False  # a torn record could not be cut off: nothing more is written
        self.outages = 0  # times the disk began refusing writes
        self._outage_from: tuple[int, int] | None = None  # (dropped, bytes) as this one began
        self._begun = False  # an outage began, not yet told
        self._ended: tuple[int, int] | None = None  # an outage's (records, bytes), not yet told
        self._warned_at: float | None = None

    def append(self, seq: int, received: float, frame: bytes) -> None:
        data = _encoder.encode(Record(seq, received, frame))
        if self._broken or (self.error is not None and self.clock() < self._retry_at):
            self._drop(1, LENGTH.size + len(data))
            return
        self._pending += LENGTH.pack(len(data))
        self._pending += data
        self._ends.append(len(self._pending))
        if len(self._pending) >= FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        written = 0
        try:
            with memoryview(self._pending) as view:
                while written < len(view):
                    written += os.write(self._fd, view[written:])
        except OSError as e:  # ENOSPC, EDQUOT, EFBIG, EIO: whatever it is, the run goes on
            self._failed(e, written)
        else:
            self._end += written
            self.error = None
            if self._outage_from is not None:  # an outage ends
                records, size = self._outage_from
                self._ended = (self.dropped - records, self.dropped_bytes - size)
                self._outage_from = None
        self._pending.clear()
        self._ends.clear()

    def _failed(self, error: OSError, written: int) -> None:
        """Keep the whole records among the first `written` bytes, cut off the
        rest, count what is lost, and leave the disk alone for RETRY_S."""
        if self._outage_from is None:  # an outage begins
            self._outage_from = (self.dropped, self.dropped_bytes)
            self.outages += 1
            self._begun = True
        kept = sum(1 for end in self._ends if end <= written)
        whole = self._ends[kept - 1] if kept else 0
        if written > whole:  # a torn record would hide every record after it from a replay
            try:
                os.ftruncate(self._fd, self._end + whole)
            except OSError:
                self._broken = True
        self._end += whole
        self._drop(len(self._ends) - kept, len(self._pending) - whole)
        self.error = error
        self._retry_at = self.clock() + RETRY_S

    def _drop(self, records: int, size: int) -> None:
        self.dropped += records
        self.dropped_bytes += size

    def news(self) -> News | None:
        """What to say about the journal now, each thing once (call until None):
        an outage begun (a warning, unless one was said within WARN_EVERY_S), an
        outage ended (always, with its count)."""
        if self._begun:
            self._begun = False
            now = self.clock()
            if self._warned_at is None or now - self._warned_at >= WARN_EVERY_S:
                self._warned_at = now
                assert self.error is not None and self._outage_from is not None
                why = self.error.strerror or str(self.error)
                lost = self.dropped - self._outage_from[0]
                return News("warning", (
                    f"journal: {why} on {self.path}: {count_of(lost, 'record')} not written"
                    f"{self._in_all()}; the run goes on, and the journal is written again "
                    "when there is room"), {"error": why, **self._counts()})
        if self._ended is not None:
            (records, size), self._ended = self._ended, None
            return News("info", (
                f"journal: writing again to {self.path}; {count_of(records, 'record')} "
                f"({_bytes(size)}) {'was' if records == 1 else 'were'} not written"
                f"{self._in_all()}"), self._counts())
        return None

    def final_line(self) -> str | None:
        """The count of every record not written, for the end (None: none)."""
        if not self.dropped:
            return None
        return (f"journal: {count_of(self.dropped, 'record')} "
                f"({_bytes(self.dropped_bytes)}) not written to {self.path} in all "
                f"({count_of(self.outages, 'outage')}); a replay misses them")

    def _in_all(self) -> str:
        return (f" ({count_of(self.dropped, 'record')} in all, "
                f"{count_of(self.outages, 'outage')})" if self.outages > 1 else "")

    def _counts(self) -> dict[str, str | int]:
        return {"path": str(self.path), "dropped": self.dropped,
                "dropped_bytes": self.dropped_bytes, "outages": self.outages}

    def close(self) -> None:
        self.flush()
        os.close(self._fd)


def _bytes(n: int) -> str:
    return f"{n:,} {'byte' if n == 1 else 'bytes'}"


def read(path: Path) -> Iterator[Record]:
    """Every complete record; stops quietly at a torn or damaged tail."""
    return iter(Reading(path))


class Reading:
    """The records of a journal, as read() gives them; once they are read, `unread`
    is the bytes after the last one that could not be read (a torn or damaged
    tail), for a reader that says what it skipped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0  # where the last whole record read ends
        self.size = 0  # the file's size when its end was reached

    @property
    def unread(self) -> int:
        return max(0, self.size - self.offset)

    def __iter__(self) -> Iterator[Record]:
        with self.path.open("rb") as f:
            while True:
                head = f.read(LENGTH.size)
                if len(head) < LENGTH.size:
                    break
                (size,) = LENGTH.unpack(head)
                if size > MAX_RECORD_BYTES:
                    break
                data = f.read(size)
                if len(data) < size:
                    break
                try:
                    record = _decoder.decode(data)
                except wire.UNTRUSTED_ERRORS:
                    break
                self.offset += LENGTH.size + size
                yield record
            self.size = os.fstat(f.fileno()).st_size


def replay(path: Path, run: str, upto: int | None = None) -> tuple[RunState, int]:
    """The RunState of run `run` after folding the journal (up to relay seq
    `upto`), and the last relay sequence number folded. Every record is folded
    whatever run id it carries: the journal holds only what the daemon accepted
    for its run, and the run's folder may have been renamed since (see
    recorded_run). Gaps in the relay sequence (records the daemon could not
    write) are counted in the state's `journal_dropped`; a sequence starting
    over is a later daemon of the same run (a resume)."""
    state, last, previous = RunState(run=run), 0, 0
    for record in read(path):
        if upto is not None and record.seq > upto:
            break
        state.journal_dropped += record.seq - (previous + 1 if record.seq > previous else 1)
        previous = record.seq
        try:
            state.apply(wire.decode([record.frame]), record.received)
        except wire.WireError:
            continue
        last = record.seq
    return state, last


def recorded_run(path: Path) -> str | None:
    """The run id the journal's first readable record carries (a folder renamed
    after its run keeps the old id in its records); None when there is none."""
    for record in read(path):
        try:
            return wire.decode([record.frame]).run
        except wire.WireError:
            continue
    return None
