"""A failing rank's error report, logs/rank-<k>.error.json (core/contract.py
ErrorReport; read by core/blame.py), written whole or not at all.

A full disk is a likely reason for a rank to fail (a checkpoint that does not
fit), and the same disk then refuses the report. So the room for it is held
from the rank's start: `reserve` allocates RESERVE_BYTES in a hidden file
beside the report (removed by the daemon when the run ends, for ranks that
were stopped or killed); `write` puts the report into that room (already allocated:
a full disk cannot refuse it), cuts the file to the report's size and renames
it over the report. Without a reserve (a disk full from the start) the report
goes to a temporary file renamed in place. Either way a reader finds a whole
report or none, never an empty or half-written one; where neither works the
report is said on stderr (the rank's log) and nothing is left behind.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import msgspec

from ddtop.core.contract import ErrorReport
from ddtop.core.rundir import atomic_file, error_report_reserve

# Room held for the report: its message and the tail of its traceback.
RESERVE_BYTES = 64 * 1024
MAX_MESSAGE_CHARS = 4096


def reserve(path: Path | None) -> None:
    """Hold RESERVE_BYTES of the disk for the report at `path` (none where the
    disk has not that much: `write` then does without)."""
    if path is None:
        return
    room = error_report_reserve(path)
    try:
        fd = os.open(room, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, RESERVE_BYTES)
        finally:
            os.close(fd)
    except OSError:
        release(path)


def release(path: Path | None) -> None:
    """Give the reserve's room back (a rank that ends without a report)."""
    if path is not None:
        with contextlib.suppress(OSError):
            error_report_reserve(path).unlink(missing_ok=True)


def encode(report: ErrorReport) -> bytes:
    """The report as JSON, within RESERVE_BYTES: a long message is cut, a long
    traceback keeps its tail (where the error was raised)."""
    report = msgspec.structs.replace(report, message=report.message[:MAX_MESSAGE_CHARS])
    data = msgspec.json.format(msgspec.json.encode(report), indent=2) + b"\n"
    keep = len(report.traceback)
    while len(data) > RESERVE_BYTES and keep:
        keep //= 2
        data = msgspec.json.format(msgspec.json.encode(msgspec.structs.replace(
            report, traceback=report.traceback[-keep:] if keep else "")), indent=2) + b"\n"
    return data


def write(path: Path | None, report: ErrorReport) -> None:
    """Write `report` to `path`, whole or not at all (see above); owner-only,
    whatever mask the user's program runs with."""
    if path is None:
        return
    data = encode(report)
    room = error_report_reserve(path)
    try:
        fd = os.open(room, os.O_WRONLY)  # no O_CREAT: the reserve, or nothing
    except OSError:
        pass
    else:
        try:
            try:
                written = 0
                while written < len(data):
                    written += os.pwrite(fd, data[written:], written)
                os.ftruncate(fd, len(data))
                os.fsync(fd)
            finally:
                os.close(fd)
            room.replace(path)
            return
        except OSError:
            release(path)  # its room back, for the temporary file below
    try:
        with atomic_file(path, "wb") as f:  # a temporary file of mode 0600, renamed
            f.write(data)
    except OSError as e:
        with contextlib.suppress(OSError):  # the log on the same full disk
            print(f"could not write error report {path}: {e.strerror or e}; the report was: "
                  f"{report.message}", file=sys.stderr, flush=True)
