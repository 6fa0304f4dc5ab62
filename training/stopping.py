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

A multi-node job: the other nodes' ranks get the signal from their own daemon,
which hears of the stop from the hub (its next heartbeat's reply, a second or
more: longer if that daemon is descheduled). So rank 0's target is
NODES_MARGIN_S of steps ahead (at the faster of its average and its recent step
rate), and every other rank also looks in the store every STORE_POLL_S whether
or not its own signal has come: it finds the target within that, a step, and a
round trip to the store, however late its daemon is (docs/multi-node.md).

torch's store has no authentication: whoever reaches its port can list, read
and write its keys. So what a rank reads there is signed: the daemon gives its
ranks a secret in their environment only (DDTOP_STOP_SECRET; a multi-node job's
is derived from its keys, the same on every node), and rank 0 writes
`TARGET:MAC`, an HMAC-SHA256 over the key, this launch (attempt, the step it
started from, MASTER_PORT) and the target. A value that does not verify is
ignored, and said once in the rank's log. The key's name is derived from the
secret too (no fixed name to aim at). A rank started without the secret (a
user's own torchrun) looks in the store only once its own signal has come, and
trusts what it finds there.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import signal
import sys
import time
from types import FrameType

import torch.distributed as dist

from ddtop.core.contract import ATTEMPT_ENV, STOP_SECRET_ENV

STOP_SIGNAL = signal.SIGUSR1
STORE_KEY = "ddtop/stop_after"  # without a secret; with one, a name derived from it
TARGET_DIGITS = 18  # a longer target in the store is not one rank 0 wrote
MARGIN = 3
# A multi-node job (above): the target this many seconds of steps ahead; the
# ranks other than 0 look in the store this often; the recent step rate is
# measured over windows of this length.
NODES_MARGIN_S = 3.0
STORE_POLL_S = 0.5
RATE_WINDOW_S = 2.0

_requested = False


def install() -> None:
    """Call first thing in a rank: until then SIGUSR1 would kill the process."""
    signal.signal(STOP_SIGNAL, _on_signal)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    global _requested
    _requested = True


class StopAgreement:
    def __init__(self, is_main: bool, start_step: int = 0) -> None:
        self.is_main = is_main
        self.target: int | None = None
        self.nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1") or 1) > 1
        secret = os.environ.get(STOP_SECRET_ENV, "")
        self.secret = secret.encode() if secret else None
        self.key = STORE_KEY if self.secret is None else f"ddtop/stop/{self._mac('key')[:16]}"
        # this launch: a value signed for another (a stop of an earlier one) is refused
        self.launch = (f"{os.environ.get(ATTEMPT_ENV, '')}:{start_step}:"
                       f"{os.environ.get('MASTER_PORT', '')}")
        self.refused = False  # a value that did not verify, said once
        now = time.monotonic()
        self.since = (now, start_step)  # for the average step rate of a multi-node job
        self.window = (now, start_step)  # the current rate window's start
        self.recent = 0.0  # steps/s over the last whole window
        self.polled = now  # the last look in the store (ranks other than 0)

    def due(self, global_step: int) -> bool:
        """True when this rank should stop now, having completed `global_step` steps."""
        if self.target is None:
            look = _requested
            if self.nodes:  # one clock read a step; a store round trip every STORE_POLL_S
                now = time.monotonic()
                self._measure(now, global_step)
                if (not self.is_main and self.secret is not None
                        and now - self.polled >= STORE_POLL_S):
                    self.polled, look = now, True
            if not look:
                return False
            store = dist.distributed_c10d._get_default_store()
            if self.is_main:
                if not _requested:
                    return False
                self.target = global_step + self._margin(global_step)
                store.set(self.key, self._signed(self.target))
            elif store.check([self.key]):
                self.target = self._verified(store.get(self.key))
        return self.target is not None and global_step >= self.target

    def _mac(self, text: str) -> str:
        assert self.secret is not None
        return hmac.new(self.secret, text.encode(), hashlib.sha256).hexdigest()

    def _signed(self, target: int) -> str:
        if self.secret is None:
            return str(target)
        return f"{target}:{self._mac(f'{self.key}|{self.launch}|{target}')}"

    def _verified(self, value: bytes) -> int | None:
        """The target in a value from the store, if rank 0 of this launch wrote it."""
        target, _, mac = value.decode(errors="replace").partition(":")
        if target.isdigit() and len(target) <= TARGET_DIGITS and (
                self.secret is None or hmac.compare_digest(
                    mac, self._mac(f"{self.key}|{self.launch}|{target}"))):
            return int(target)
        if not self.refused:
            self.refused = True
            print(f"ddtop: ignored a stop step in torch's store at {self.key!r} that is not "
                  "this run's (not signed with its secret): someone who can reach the store "
                  "wrote it", file=sys.stderr, flush=True)
        return None

    def _measure(self, now: float, global_step: int) -> None:
        t0, step0 = self.window
        if now - t0 >= RATE_WINDOW_S:
            self.recent = (global_step - step0) / (now - t0)
            self.window = (now, global_step)

    def _margin(self, global_step: int) -> int:
        """Steps from rank 0's boundary to the target: MARGIN, or in a multi-node
        job NODES_MARGIN_S of steps at the faster of the average and recent rates."""
        if not self.nodes:
            return MARGIN
        t0, step0 = self.since
        average = (global_step - step0) / max(time.monotonic() - t0, 1e-3)
        return max(MARGIN, math.ceil(max(average, self.recent) * NODES_MARGIN_S))
