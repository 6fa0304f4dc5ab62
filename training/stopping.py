"""Graceful stop: every rank stops after the same step, rank 0 checkpoints.

The daemon sends SIGUSR1 to every rank (`ddtrain stop`, or the first Ctrl-C),
rank 0 last, so that every other rank has its flag before rank 0 picks the target.
The handler only sets a flag; the training loop looks at it once per step (one
attribute read). Ranks must stop after the *same* step, or one would wait
forever in a collective the others skipped, so they agree through the process
group's store, not through a collective:

- rank 0, at the first step boundary after its flag is set, picks the target
  `its completed steps + MARGIN` and writes it to the store;
- every other rank, once its own flag is set, checks the store at each step
  boundary (one round trip, only while a stop is pending) until it finds it.

DDP keeps ranks within one step of each other (each step's all-reduce needs all
of them), so no rank can complete MARGIN steps past rank 0's boundary before the
target is in the store; every rank stops after exactly the target step.
"""

from __future__ import annotations

import math
import os
import signal
import time
from types import FrameType

import torch.distributed as dist

STOP_SIGNAL = signal.SIGUSR1
STORE_KEY = "ddtop/stop_after"
MARGIN = 3
# A multi-node job: the other nodes' ranks get the signal from their own daemon,
# up to about a second later (its heartbeat to the hub), so the target is this
# many seconds of steps ahead (docs/multi-node.md).
NODES_MARGIN_S = 3.0

_requested = False


def install() -> None:
    """Call first thing in a rank: until then SIGUSR1 would kill the process."""
    signal.signal(STOP_SIGNAL, _on_signal)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    global _requested
    _requested = True


class StopAgreement:
    def __init__(self, is_main: bool) -> None:
        self.is_main = is_main
        self.target: int | None = None
        self.nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1") or 1) > 1
        self.since = (time.monotonic(), 0)  # for the step rate of a multi-node job

    def due(self, global_step: int) -> bool:
        """True when this rank should stop now, having completed `global_step` steps."""
        if not _requested:
            return False
        if self.target is None:
            store = dist.distributed_c10d._get_default_store()
            if self.is_main:
                margin = MARGIN
                if self.nodes:
                    t0, step0 = self.since
                    rate = (global_step - step0) / max(time.monotonic() - t0, 1e-3)
                    margin = max(MARGIN, math.ceil(rate * NODES_MARGIN_S))
                self.target = global_step + margin
                store.set(STORE_KEY, str(self.target))
            elif store.check([STORE_KEY]):
                self.target = int(store.get(STORE_KEY))
        return self.target is not None and global_step >= self.target
