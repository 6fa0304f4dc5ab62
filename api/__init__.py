"""ddtop: watch your own PyTorch training script in the ddtop dashboard.

    import ddtop

    ddtop.init(total_steps=len(loader) * epochs, epochs=epochs)  # optional
    model = ddtop.watch(DDP(model))          # comm time and bytes per step
    for batch in loader:
        loss = train_step(batch)
        ddtop.step(loss=loss, samples=len(batch))  # once per optimizer step
        ddtop.log(grad_norm=norm)                  # per-rank scalars, any time
        if rank == 0 and step % 1000 == 0:
            with ddtop.phase("eval"):               # not a hang, not a straggler
                evaluate()

Run it with `ddtrain start train.py -- ARGS` (or under torchrun with
DDTOP_TELEMETRY set to a receiver). Without DDTOP_TELEMETRY every call does
nothing and returns at once: plain `python train.py` or `torchrun train.py`
behave exactly as without ddtop. No call ever adds a collective to your
program. docs/own-scripts.md is the manual.

This module is imported by every `ddtop.*` import, so it stays tiny: it
imports neither torch, zmq nor textual. The live implementation
(ddtop.training.api, which owns the process's one live rank) is imported on
the first call that finds an endpoint; from then on it tells this module of
each rank it starts (`follow`), and every call here forwards to that rank.
"""

from __future__ import annotations

import contextlib
import sys
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddtop.training.api import LiveRank

__all__ = ["TelemetryUnavailable", "init", "log", "phase", "step", "watch"]

# The phase names `ddtop.phase` accepts, and the wire phase each one is shown as.
PHASES = {"data": "data", "forward": "forward", "backward": "backward",
          "optimizer": "optimizer", "eval": "evaluation", "evaluation": "evaluation",
          "validation": "evaluation", "checkpoint": "checkpoint", "save": "checkpoint",
          "sync": "metric_sync", "setup": "setup"}


class TelemetryUnavailable(RuntimeError):
    """`ddtop.init(strict=True)` found no endpoint, or nobody answering there."""


_NULL_PHASE: AbstractContextManager[None] = contextlib.nullcontext()
_UNRESOLVED: Any = object()
_LIVE_SIDE = "ddtop.training.api"
# The live rank as ddtop.training.api last told (None: telemetry off in this
# process); asked for on the first call, written only here.
_live: LiveRank | None = _UNRESOLVED


def _resolve() -> LiveRank | None:
    """The live rank, asked for once: when DDTOP_TELEMETRY names an endpoint
    (imported and started on the first call that needs it), or when the live
    side is loaded already (the built-in trainer, a test: it may start a rank
    later); else None, for good."""
    global _live
    if _live is _UNRESOLVED:
        from ddtop.core.contract import telemetry_endpoint

        if telemetry_endpoint() is None and _LIVE_SIDE not in sys.modules:
            _live = None
        else:
            from ddtop.training.api import follow

            _live = follow(_told)
    return _live


def _told(rank: LiveRank) -> None:
    """ddtop.training.api started `rank`: the calls here go to it from now on."""
    global _live
    _live = rank


def init(*, total_steps: int | None = None, epochs: int | None = None,
         start_step: int | None = None, strict: bool = False) -> bool:
    """Start reporting this rank (rank, local rank and world size from torchrun's
    RANK, LOCAL_RANK, WORLD_SIZE; the run id from DDTOP_RUN_ID). Optional: the
    optimizer steps the run will take and its epochs, for progress and ETA, and
    the steps already done when it resumes from a checkpoint (`start_step`:
    counting goes on from there). Any other call starts reporting by itself;
    calling init later only adds totals.

    True when telemetry is live. With `strict` (CI): raises TelemetryUnavailable
    when DDTOP_TELEMETRY is not set or no ddtop receiver answers at it within a
    few seconds, instead of running silently unwatched.
    """
    live = _live if _live is not _UNRESOLVED else _resolve()
    if live is None:
        if strict:
            raise TelemetryUnavailable(
                "ddtop.init(strict=True): DDTOP_TELEMETRY is not set (or is 'off'): run the "
                "script with `ddtrain start SCRIPT`, or set DDTOP_TELEMETRY to a receiver")
        return False
    problem = live.init(total_steps=total_steps, epochs=epochs, strict=strict,
                        start_step=start_step)
    if problem is not None:
        raise TelemetryUnavailable(f"ddtop.init(strict=True): {problem}")
    return True


def watch(model: Any) -> Any:
    """Time the gradient communication of a DistributedDataParallel `model` (comm
    time, bytes, ops per step) through its comm hook, and return the model. A
    model that already has a comm hook keeps it; timing is then reported as
    unavailable, once. Given an optimizer: its learning rate is shown, and under
    `ddtrain start` its steps are the ones counted (else the first optimizer
    that steps). Never raises."""
    live = _live if _live is not _UNRESOLVED else _resolve()
    if live is not None:
        live.watch(model)
    return model


def step(loss: Any = None, samples: int | None = None) -> None:
    """One optimizer step done; `loss` (a float or a tensor, read without a
    device synchronisation) and `samples` (this rank's, in the step) optional.
    Under `ddtrain start` optimizer steps are also counted by themselves: a call
    here then goes with the optimizer step it follows (or precedes), never
    counting it twice."""
    live = _live if _live is not _UNRESOLVED else _resolve()
    if live is not None:
        live.step(loss, samples)


def phase(name: str) -> AbstractContextManager[None]:
    """`with ddtop.phase("eval"):` the rank is in that phase (data, forward,
    backward, optimizer, sync: parts of a step; eval, checkpoint, setup: work
    that only some ranks may do, whose time is not step time). An unknown name
    raises ValueError, with or without telemetry, so a script behaves the same
    both ways."""
    if name not in PHASES:
        raise ValueError(f"ddtop.phase({name!r}): not a phase; use one of "
                         f"{', '.join(sorted(PHASES))}")
    live = _live if _live is not _UNRESOLVED else _resolve()
    if live is None:
        return _NULL_PHASE
    return _Phase(live, PHASES[name])


class _Phase:
    """In phase `name` inside the block, back to the phase before after it (a
    class, not a generator: this runs several times per step in the trainer)."""

    __slots__ = ("live", "name", "previous")

    def __init__(self, live: LiveRank, name: str) -> None:
        self.live, self.name, self.previous = live, name, ""

    def __enter__(self) -> None:
        self.previous = self.live.enter_phase(self.name)

    def __exit__(self, *exc: object) -> None:
        self.live.enter_phase(self.previous, leaving=True)


def log(**scalars: Any) -> None:
    """Per-rank scalars (numbers, or one-element tensors read without a device
    synchronisation) that the daemon aggregates across ranks: mean, min and max,
    and which rank holds the min and max. Ranks may log different keys at
    different times; nothing waits for another rank."""
    live = _live if _live is not _UNRESOLVED else _resolve()
    if live is not None:
        live.log(scalars)
