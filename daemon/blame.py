"""Whom a failed run is blamed on: a pure policy over plain data.

One rank's failure makes its peers fail within milliseconds (gloo's
"Connection closed by peer", NCCL's aborted communicator, a collective
timeout), and which process the OS reaps first is a race. So the blame is
decided from what each rank's exit and its own error report say, never from
the order of the exits. `culprit(exits, reports)` is the policy;
`read_error_report` reads what a rank wrote (training/worker.py writes it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec

from ddtop.daemon import wire
from ddtop.daemon.contract import ErrorReport

# Errors a rank raises because a peer went away (gloo, NCCL, the TCPStore): such a
# rank is a victim of the failure, not its cause.
PEER_LOSS = re.compile(
    r"Connection (?:closed|reset) by peer|remote process exited|Broken pipe|"
    r"communicator was aborted|DistNetworkError|DistBackendError|DistStoreError|"
    r"NCCL error|ncclRemoteError|timed out|Timeout", re.IGNORECASE)


@dataclass(frozen=True)
class RankEnd:
    """How a rank's process ended."""

    exit_code: int  # negative: killed by that signal (Python's convention)
    stopped_by_daemon: bool = False  # the daemon terminated it (it was not the cause)


def read_error_report(path: Path, since: float) -> ErrorReport | None:
    """The rank's report if it wrote one at or after `since` (the attempt's start:
    a report left by an earlier attempt says nothing about this one)."""
    try:
        report = msgspec.json.decode(path.read_bytes(), type=ErrorReport)
    except OSError:  # missing
        return None
    except wire.UNTRUSTED_ERRORS:  # half-written or not a report
        return None
    return report if report.time >= since else None


def blame_order(end: RankEnd, report: ErrorReport | None) -> tuple[int, float]:
    """Among ranks that failed together, the likely cause comes first: one
    killed by a signal or stopped by bad input (0); then one that raised an
    error of its own (1); then one that exited non-zero without a word (2);
    then those that only lost a peer (3). Ranks the daemon stopped without a
    report of their own come after (4), clean exits last (5). Within a class,
    the earliest error report first."""
    when = report.time if report is not None else math.inf
    if end.exit_code == 0:
        cause = 5
    elif (report is not None and report.kind == "usage") or (
            end.exit_code < 0 and not end.stopped_by_daemon):
        cause = 0
    elif report is not None and not PEER_LOSS.search(report.message):
        cause = 1
    elif report is None and not end.stopped_by_daemon:
        cause = 2
    elif report is not None:
        cause = 3
    else:
        cause = 4
    return cause, when


def culprit(exits: Mapping[int, RankEnd], reports: Mapping[int, ErrorReport]) -> int | None:
    """The rank to blame among those that exited non-zero (None: none did);
    ties go to the lowest rank."""
    failed = [rank for rank, end in exits.items() if end.exit_code != 0]
    if not failed:
        return None
    return min(failed, key=lambda rank: (*blame_order(exits[rank], reports.get(rank)), rank))
