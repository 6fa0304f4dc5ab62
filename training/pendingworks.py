"""Asynchronous collectives whose work gives no future, seen over by the sender
thread.

A wrapped collective called asynchronously is over when its work's future
completes (training/collectives.py). gloo's `isend` and `irecv` works have none
(`Work::getFuture not implemented`), and are complete only once the program's
`wait()` on them has returned. Each such work is kept here with what to do when
it is over, and the sender thread asks each `is_completed()` every pass (0.1 s
at most: it never waits, and takes no lock the program holds). So a rank
waiting on an irecv whose peer never sends is in that irecv, as it waits; and
one that sent and computes before its wait is in its isend meanwhile, as an
asynchronous all_reduce is. Their time is not counted as communication: when
they ended is known only to the sender thread's pass.

Each is held by a weak reference: a work the program has dropped (it will never
wait on it) is over, and its tensors are not kept alive here. At most
MAX_PENDING are kept: the oldest beyond that is let go as over. This module
imports only the standard library.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

MAX_PENDING = 256

_lock = threading.Lock()
_pending: deque[tuple[Any, Callable[[], None]]] = deque()  # (a weak reference, over)


def add(work: Any, over: Callable[[], None]) -> None:
    """Keep `work` until it is completed (or dropped); then `over()` (on the sender
    thread)."""
    try:
        held: Any = weakref.ref(work)
    except TypeError:  # (a work that takes no weak reference: held, up to MAX_PENDING)
        held = _Strong(work)
    with _lock:
        _pending.append((held, over))
        dropped = _pending.popleft() if len(_pending) > MAX_PENDING else None
    if dropped is not None:
        _over(dropped[1])


def poll() -> None:
    """On the sender thread, each pass: the works completed since, over."""
    if not _pending:
        return
    with _lock:
        done = [(w, o) for w, o in _pending if _completed(w)]
        for item in done:
            _pending.remove(item)
    for _, over in done:
        _over(over)


def count() -> int:
    """The works kept now."""
    return len(_pending)


class _Strong:
    def __init__(self, work: Any) -> None:
        self.work = work

    def __call__(self) -> Any:
        return self.work


def _completed(held: Any) -> bool:
    work = held()
    if work is None:  # the program dropped it: it will never wait on it
        return True
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - a work torch can no longer say anything of: over
        return True


def _over(over: Callable[[], None]) -> None:
    with contextlib.suppress(Exception):  # (instrumentation must never break the program)
        over()
