"""How a run ended, and why each failure happened, as a short cause for counting.

A run's failures are its restarts (each names the rank that failed and how:
RunState.timeline) and, where the run failed, its last one (RunState.failure). Each
is put in one of CAUSES, so that /metrics counts them by cause
(`ddtop_run_failures_total{cause=...}`) and says how the run ended
(`ddtop_run_outcome_info{outcome=..., cause=...}`): an alert needs the label, not
the words.

The cause is read from what the daemon said of the failure: its words (the reason
ddtrain wrote: the hang timeout's, the OOM killer's, "left early", a lost node's),
then the signal and the exit code. Pure: tested without a run.
"""

from __future__ import annotations

from typing import Literal, get_args

from ddtop.core import wire
from ddtop.core.summary import Failure

Cause = Literal[
    "hang",  # --hang-timeout: the ranks stalled in a collective
    "desync",  # --hang-timeout, on ranks inside different collectives of one group
    "oom",  # the kernel's OOM killer
    "cuda_oom",  # torch.OutOfMemoryError, raised by the rank
    "left_early",  # exit code 0 while the others trained
    "no_goodbye",  # a watched rank ended without saying so (its launcher has its status)
    "lost",  # a node's daemon stopped answering the hub
    "no_ranks",  # a watched command that started no rank
    "signal",  # killed by any other signal
    "error",  # a non-zero exit code
    "unknown",
]
CAUSES: tuple[Cause, ...] = get_args(Cause)
Outcome = Literal["succeeded", "failed", "stopped"]
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)

# The daemon's words that name a cause (daemon/hangtimeout.py, daemon/oomkill.py,
# core/blame.py, daemon/watching.py, daemon/noderole.py, daemon/runloop.py), looked for in
# this order.
WORDS: tuple[tuple[str, Cause], ...] = (
    ("(--hang-timeout", "hang"),  # desync's words say "entered": told apart below
    ("OOM killer", "oom"),
    ("left early", "left_early"),
    ("without saying goodbye", "no_goodbye"),
    ("without a goodbye", "no_goodbye"),
    ("lost:", "lost"),
    ("no rank seen", "no_ranks"),
)
CUDA_OOM = ("OutOfMemoryError", "CUDA out of memory")


def cause(reason: str | None, exit_code: int | None, signal: str | None,
          message: str | None = None) -> Cause:
    """One failure's cause: from the daemon's `reason`, the rank's own error `message`,
    then the signal that killed it or its exit code."""
    for words, found in WORDS:
        if reason and words in reason:
            if found == "hang" and reason.startswith("entered"):
                return "desync"
            return found
    if message and any(words in message for words in CUDA_OOM):
        return "cuda_oom"
    if signal:
        return "signal"
    if exit_code is not None and exit_code != 0:
        return "error"
    return "unknown"


def of_restart(entry: wire.Restart) -> Cause:
    return cause(entry.reason, entry.exit_code, entry.signal)


def of_failure(failure: Failure) -> Cause:
    return cause(failure.reason, failure.exit_code, failure.signal, failure.message)


def failures(timeline: list[wire.Restart], status: str,
             failure: Failure | None) -> dict[Cause, int]:
    """Each cause's failures so far: every restart's, and the run's last where it failed."""
    counted: dict[Cause, int] = {}
    for entry in timeline:
        found = of_restart(entry)
        counted[found] = counted.get(found, 0) + 1
    if status == "failed":
        found = of_failure(failure) if failure is not None else "unknown"
        counted[found] = counted.get(found, 0) + 1
    return counted


def outcome(status: str, failure: Failure | None) -> tuple[Outcome, Cause | None] | None:
    """How the run ended, and a failed run's cause; None while it has not ended."""
    if status not in OUTCOMES:
        return None
    ended: Outcome = "succeeded" if status == "succeeded" else (
        "failed" if status == "failed" else "stopped")
    if ended != "failed":
        return ended, None
    return ended, of_failure(failure) if failure is not None else "unknown"
