"""The run's events, as RunState keeps them: one typed record each.

The fold (core/state.py) records an event for what a person follows a run by:
a rank joined, an epoch ended, a checkpoint, a warning, an error, an exit, a
restart, a change of the run's status, a node's news. It keeps the newest
MAX_EVENTS and counts every one (`RunState.event_count`), so that a reader that
prints them as they come knows which it has not printed yet. The dashboard's
events panel, the headless printer and a replay read these same records, from
the state or from a snapshot (decoded, and so checked, with the state).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from ddtop.core import wire

MAX_EVENTS = 500  # the newest kept in the state (and in a snapshot)
# A daemon's event naming the evidence it gathered carries its folder under this key
# (daemon/evidence.py); the state keeps the newest MAX_EVIDENCE (RunState.evidence).
EVIDENCE_KEY = "evidence"
MAX_EVIDENCE = 16


def shown(m: wire.Event) -> bool:
    """Whether a rank's event is recorded. Not an epoch's end (shown from the
    aggregate, with the global metrics), nor what every rank says the same of
    the run (a checkpoint, a resume, a stop) from a rank other than 0, which
    speaks for the run."""
    if m.type == "epoch_end":
        return False
    return m.rank == 0 or m.type not in ("checkpoint", "resumed", "stopped")
# What an event is about: a rank's or the daemon's own Event types, and those the
# fold says itself (a rank joined, a rank exited, the run's status changed).
EventKind = wire.EventType | Literal["join", "exit", "status"]
# What concerns every rank: shown in each rank's detail beside its own events.
RUN_WIDE: tuple[str, ...] = ("epoch_end", "status", "restart")


def epoch_words(m: wire.Aggregate) -> str:
    """An epoch's end in words: its global train (and validation) metrics."""
    val = (f"; val loss {m.val_loss:.4f} acc {100 * m.val_accuracy:.2f}%"
           if m.val_loss is not None and m.val_accuracy is not None else "")
    return (f"epoch {m.epoch + 1} done: train loss {m.train_loss:.4f} acc "
            f"{100 * m.train_accuracy:.2f}%{val}")
EventData = dict[str, str | int | float | bool | None]


class RunEvent(msgspec.Struct, kw_only=True):
    """One event of the run, as shown (the headless printer's JSON lines carry its
    fields as they are)."""

    t: float  # the sender's clock
    rank: int  # the rank it is about, or the daemon's (wire.DAEMON_RANK) for the run's
    type: EventKind
    message: str  # one line for people
    data: EventData = {}  # details (a checkpoint's path, a restart, a node)
    traceback: str | None = None  # an error's

    def source(self) -> str:
        """Who says it: 'rank 3', 'daemon', or 'global' for an epoch's metrics."""
        if self.type == "epoch_end":
            return "global"  # every rank derived the same metrics; one of them is shown
        return "daemon" if self.rank < 0 else f"rank {self.rank}"
