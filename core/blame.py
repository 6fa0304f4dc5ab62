"""Whom a failed run is blamed on: a pure policy over plain data.

One rank's failure makes its peers fail within milliseconds (gloo's
"Connection closed by peer", NCCL's aborted communicator, a collective
timeout), and which process the OS reaps first is a race. So the blame is
decided from what each rank's exit and its own error report say, never from
the order of the exits. `culprit(exits, reports)` is the policy;
`read_error_report` reads what a rank wrote (training/worker.py writes it).

An exit code of 0 is not always a clean end: a rank that leaves while the
others still train (`os._exit(0)`, a `sys.exit(0)` in the wrong branch) makes
them fail with "Connection reset by peer" in their next collective, and is
their cause. `left_early(Leaving(...))` tells it from a rank that finished:
the ranks say goodbye (wire.Bye) as they end, the built-in trainer's and a
script's alike (training/api.py, at exit), and `os._exit` skips it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Literal

import msgspec

from ddtop.core import wire
from ddtop.core.contract import ErrorReport

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
    # It exited 0 before its work was done while the others still ran (left_early).
    left_early: bool = False
    ended: float | None = None  # wall clock of its exit, where known


@dataclass(frozen=True)
class Leaving:
    """What is known of a rank that exited with code 0."""

    said_hello: bool  # its telemetry spoke: a goodbye from it could have been heard
    said_bye: bool  # it said goodbye (wire.Bye): it ended its work itself
    others_running: bool  # other ranks of the attempt still ran when it exited
    stopping: bool  # the run was being stopped (a stop asks every rank to end)
    global_step: int  # the last global step it reported
    total_steps: int  # the run's total (0: unknown)


def left_early(leaving: Leaving) -> bool:
    """A rank that exited 0 left early: it exited while other ranks still ran,
    no stop was asked for, it never said goodbye although its telemetry
    spoke, and it had not reached the run's last step (where that is known).
    A rank whose telemetry never spoke, or that reached the last step, is
    given the benefit of the doubt: finished."""
    if leaving.stopping or not leaving.others_running:
        return False
    if not leaving.said_hello or leaving.said_bye:
        return False
    return leaving.total_steps <= 0 or leaving.global_step < leaving.total_steps


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


def left_early_words(step: int) -> str:
    """How a rank that left early ended, as the headline, run.json and status say it."""
    where = f"at step {step}" if step > 0 else "before it reported a step"
    return (f"left early {where}: exit code 0 while the other ranks still trained, "
            "without a goodbye")


class Cause(IntEnum):
    """Why a rank ended, as blame weighs it: the lower, the likelier the cause."""

    SIGNAL_OR_USAGE = 0  # killed by a signal (not the daemon's), or stopped by bad input
    OWN_ERROR = 1  # raised an error of its own, or left early
    SILENT_EXIT = 2  # exited non-zero without a word
    LOST_PEER = 3  # its error says only that a peer went away
    STOPPED = 4  # the daemon stopped it, and it said nothing of its own
    CLEAN = 5  # exited 0 when it was done
    NONE = 6  # no rank to weigh (a node that blamed none)


def blame_order(end: RankEnd, report: ErrorReport | None) -> tuple[Cause, float]:
    """Among ranks that failed together, the likely cause comes first: one
    killed by a signal or stopped by bad input (0); then one that raised an
    error of its own, or left early (1: exited 0 while the others ran, see
    `left_early`); then one that exited non-zero without a word (2); then
    those that only lost a peer (3). Ranks the daemon stopped without a
    report of their own come after (4), clean exits last (5). Within a class,
    the earliest error report (or exit, for one that left early) first."""
    when = report.time if report is not None else math.inf
    if end.exit_code == 0:
        cause = Cause.OWN_ERROR if end.left_early else Cause.CLEAN
        if end.left_early and end.ended is not None:
            when = end.ended
    elif (report is not None and report.kind == "usage") or (
            end.exit_code < 0 and not end.stopped_by_daemon):
        cause = Cause.SIGNAL_OR_USAGE
    elif report is not None and not PEER_LOSS.search(report.message):
        cause = Cause.OWN_ERROR
    elif report is None and not end.stopped_by_daemon:
        cause = Cause.SILENT_EXIT
    elif report is not None:
        cause = Cause.LOST_PEER
    else:
        cause = Cause.STOPPED
    return cause, when


def culprit(exits: Mapping[int, RankEnd], reports: Mapping[int, ErrorReport]) -> int | None:
    """The rank to blame among those that exited non-zero or left early (None:
    none did); ties go to the lowest rank."""
    failed = [rank for rank, end in exits.items() if end.exit_code != 0 or end.left_early]
    if not failed:
        return None
    return min(failed, key=lambda rank: (*blame_order(exits[rank], reports.get(rank)), rank))


@dataclass(frozen=True)
class NodeEnd:
    """How another node of a multi-node job ended, as the hub heard it."""

    node: int
    status: str  # its daemon's final run status ("" if it never said)
    lost: bool = False  # its daemon stopped answering before it said how it ended
    # The cause its daemon blamed its own culprit rank on (None: it blamed no rank).
    cause: Cause | None = None


@dataclass(frozen=True)
class JobVerdict:
    """Whom a multi-node job's outcome names: `kind` is "ours" (the hub's own
    outcome stands), "their_rank" (a rank of node `node`, as its daemon blamed
    it), "lost" (the nodes in `lost`, the first to blame) or "node" (node `node`
    as a whole: it failed or stopped with no rank to blame)."""

    kind: Literal["ours", "their_rank", "lost", "node"]
    node: int = 0
    lost: tuple[int, ...] = ()


def job_verdict(status: str, our_cause: Cause, others: list[NodeEnd]) -> JobVerdict:
    """The job's one outcome from the hub's own (`status`, and the cause of its
    culprit rank: Cause.NONE when it blamed none) and how every other node ended:
    a rank another node blamed on a likelier cause than ours comes first (ties
    to us, then to the node first in `others`); then lost nodes, unless the job
    was stopped or our own culprit failed of its own (a cause below LOST_PEER);
    then, where we succeeded, the first node that failed or stopped."""
    theirs = [e for e in others if not e.lost and e.status == "failed" and e.cause is not None]
    first = min(theirs, key=lambda e: e.cause or 0, default=None)
    if first is not None and first.cause is not None and first.cause < our_cause:
        return JobVerdict("their_rank", node=first.node)
    lost = tuple(e.node for e in others if e.lost)
    if lost and status != "stopped" and our_cause >= Cause.LOST_PEER:
        return JobVerdict("lost", lost=lost)
    if status == "succeeded":
        worst = next((e for e in others if e.status in ("failed", "stopped")), None)
        if worst is not None:
            return JobVerdict("node", node=worst.node)
    return JobVerdict("ours")
