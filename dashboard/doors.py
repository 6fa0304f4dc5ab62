"""The doors of `ddtop --serve`'s server: every connection bounded, timed, and what
is turned away counted (dashboard/sessions.py serves through them).

    Limits, make_room   how many connections, per address and in all, within the
                        open-files limit; which one closes for a newcomer
    Door, Doors         each connection, in front of aiohttp's protocol: admitted,
                        closed unless it completes a request's headers in time
    Refusals            what was turned away, one counted line on stderr now and then
    counted_errors      aiohttp's and the loop's own error logs counted, not printed

Nothing here imports aiohttp: it sees connections as asyncio protocols.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import math
import resource
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

# A connection is closed unless it completes a request's headers this soon after it
# opens: a browser sends them at once, a connection held half-sent only holds a
# descriptor (the owner was locked out by 1,100 of them).
HEADER_TIMEOUT_S = 3.0
# An idle keep-alive connection (one that carried the token) is closed after this;
# longer than HEADER_TIMEOUT_S, which closes a connection without a request first.
KEEPALIVE_S = 5.0
MAX_CONNECTIONS = 512  # held at once, and well within the open-files limit (Limits)
MAX_PER_ADDRESS = 128  # ... from one address (on loopback: every user of the machine)
# Connections the kernel queues until the server accepts them, and the most it accepts
# at one turn of its loop: in a flood, a short queue drops the owner's SYN, which is
# sent again only a second later.
ACCEPT_BACKLOG = 128
REPORT_AFTER_S = 1.0  # what was refused is said this long after the first refusal ...
REPORT_EVERY_S = 10.0  # ... and then at most once this often: a flood costs a line
ERROR_CHARS = 200  # of the latest error's words in that line
# Why a connection or a request was turned away, as the counted line says it.
REFUSED = {
    "evicted": "closed for a newer connection before sending a request",
    "late": f"without a request within {HEADER_TIMEOUT_S:g} s",
    "full": "not let in (every connection carried the token)",
    "token": "without the token (403)",
    "files": "not accepted (out of open files)",
    "error": "bad requests or errors",
}
Key = TypeVar("Key")


def raise_open_files_limit() -> int:
    """The soft limit on open descriptors up to the hard one, as the daemon does (each
    connection holds one); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


@dataclass(frozen=True)
class Limits:
    total: int  # connections held at once
    per_address: int  # ... from one address

    @classmethod
    def for_open_files(cls, soft: int) -> Limits:
        """Within the soft limit: what one turn of the loop may accept before any is
        admitted (ACCEPT_BACKLOG), then half the rest; the other half for the sessions
        (three pipes each), the files served, and the server's own."""
        total = MAX_CONNECTIONS if soft == resource.RLIM_INFINITY else min(
            MAX_CONNECTIONS, max(1, (soft - ACCEPT_BACKLOG) // 2))
        return cls(total, min(MAX_PER_ADDRESS, total))


def make_room(waiting: Iterable[tuple[Key, str]], address: str, from_address: int,
              held: int, limits: Limits) -> tuple[bool, Key | None]:
    """Whether a newcomer from `address` is let in, and which connection closes for
    it. `waiting`: those without a request yet, (key, address), oldest first;
    `from_address`, `held`: the connections held from that address, and in all.
    Beyond a bound the oldest waiting one goes (from that address, when its share is
    full): a newcomer is refused only when every connection it could replace carried
    the token."""
    if from_address >= limits.per_address:
        oldest = next((key for key, where in waiting if where == address), None)
    elif held >= limits.total:
        oldest = next((key for key, _ in waiting), None)
    else:
        return True, None
    return oldest is not None, oldest


class Door(asyncio.Protocol):
    """One connection, in front of aiohttp's protocol: admitted (or not) when it
    opens, forgotten when it closes; everything else passes through."""

    def __init__(self, doors: Doors, inner: asyncio.Protocol) -> None:
        self.doors, self.inner = doors, inner
        self.transport: asyncio.BaseTransport | None = None
        self.address = ""
        self.counted = False  # in Doors.held
        self.deadline: asyncio.TimerHandle | None = None  # while without a request

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.address = str(peer[0] if isinstance(peer, tuple) else peer)
        if self.doors.admit(self):
            self.inner.connection_made(transport)
        else:
            transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.doors.forget(self):
            self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class Doors:
    """The server's connections: at most `limits`, each closed unless it completes a
    request's headers within HEADER_TIMEOUT_S; one that carried the token stays
    (aiohttp closes it when idle, after KEEPALIVE_S)."""

    def __init__(self, limits: Limits, refusals: Refusals) -> None:
        self.limits, self.refusals = limits, refusals
        self.waiting: dict[Door, None] = {}  # without a request yet, oldest first
        self.held: Counter[str] = Counter()  # connections held, by address
        self.by_protocol: dict[object, Door] = {}  # by aiohttp's protocol, for the guard

    def wrap(self, protocol_factory: Callable[[], asyncio.Protocol]) -> Callable[[], Door]:
        """What the listening socket makes for each connection: a Door."""
        return lambda: Door(self, protocol_factory())

    def admit(self, door: Door) -> bool:
        held = sum(self.held.values())
        admitted, oldest = make_room(((waiting, waiting.address) for waiting in self.waiting),
                                     door.address, self.held[door.address], held, self.limits)
        if oldest is not None:
            self.close(oldest, "evicted")
        if not admitted:
            self.refusals.count("full", door.address)
            return False
        self.waiting[door] = None
        self.held[door.address] += 1
        door.counted = True
        self.by_protocol[door.inner] = door
        door.deadline = asyncio.get_running_loop().call_later(
            HEADER_TIMEOUT_S, self.close, door, "late")
        return True

    def answered(self, protocol: object, trusted: bool) -> None:
        """A request's headers came: the door stays if it carried the token (until
        idle), else it is counted (and aiohttp closes it after its 403)."""
        door = self.by_protocol.get(protocol)
        if door is None or door not in self.waiting:
            return
        self._unwait(door)
        if not trusted:
            self.refusals.count("token", door.address)

    def close(self, door: Door, reason: str) -> None:
        """Close a connection still without a request, counted with `reason`."""
        if door not in self.waiting:
            return
        self._unwait(door)
        self._release(door)
        self.refusals.count(reason, door.address)
        assert door.transport is not None
        door.transport.close()  # connection_lost follows, at the loop's next turn

    def forget(self, door: Door) -> bool:
        """The connection closed: whether it was admitted (aiohttp's to tell)."""
        admitted = door.inner in self.by_protocol
        if door in self.waiting:
            self._unwait(door)
        self._release(door)
        self.by_protocol.pop(door.inner, None)
        return admitted

    def _unwait(self, door: Door) -> None:
        del self.waiting[door]
        if door.deadline is not None:
            door.deadline.cancel()
            door.deadline = None

    def _release(self, door: Door) -> None:
        if door.counted:
            door.counted = False
            self.held[door.address] -= 1
            if not self.held[door.address]:
                del self.held[door.address]


class Refusals:
    """What the server turned away, counted by reason and said on stderr in one line
    REPORT_AFTER_S after the first, then at most every REPORT_EVERY_S (and once more
    when the server ends): a flood of connections costs a line, never a traceback
    each (1,100 held connections once wrote 197 MB of them in a minute)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.counts: Counter[str] = Counter()
        self.address = self.error = ""  # the latest of each, said with the counts
        self.said_at = -math.inf
        self.pending: asyncio.TimerHandle | None = None

    def count(self, reason: str, address: str = "", error: str = "") -> None:
        self.counts[reason] += 1
        self.address, self.error = address or self.address, error or self.error
        if self.pending is None:
            at = max(self.loop.time() + REPORT_AFTER_S, self.said_at + REPORT_EVERY_S)
            self.pending = self.loop.call_at(at, self.say)

    def say(self) -> None:
        if self.pending is not None:
            self.pending.cancel()
            self.pending = None
        if self.counts:
            print(refusal_line(self.counts, self.address, self.error), file=sys.stderr,
                  flush=True)
            self.counts.clear()
            self.address = self.error = ""
            self.said_at = self.loop.time()


def refusal_line(counts: Counter[str], address: str, error: str) -> str:
    """`ddtop: turned away 1,100: 973 closed for a newer connection ..., 127 without a
    request within 3 s; the latest from 127.0.0.1`, the reasons in REFUSED's order,
    and the latest error (whose text may come from the request: only printable
    characters, no terminal escapes)."""
    parts = [f"{counts[reason]:,} {words}" for reason, words in REFUSED.items()
             if counts[reason]]
    line = f"ddtop: turned away {counts.total():,}: {', '.join(parts)}"
    if address:
        line += f"; the latest from {address}"
    if error:
        line += f"; the latest error: {error}"
    return line


class _CountedLog(logging.Handler):
    """aiohttp's log records (a traceback for each bad request: a 60 KB header, a
    broken request line) counted instead, the latest said in one line."""

    def __init__(self, refusals: Refusals) -> None:
        super().__init__(logging.WARNING)
        self.refusals = refusals

    def emit(self, record: logging.LogRecord) -> None:
        error = record.exc_info[1] if record.exc_info else None
        self.refusals.count("error", error=_one_line(record.getMessage(), error))


@contextlib.contextmanager
def counted_errors(loop: asyncio.AbstractEventLoop, refusals: Refusals) -> Iterator[None]:
    """While serving, aiohttp's loggers (aiohttp.server, .access, .web: all under
    "aiohttp") and the loop's own errors ("socket.accept() out of system resource",
    once per attempt) are counted by `refusals`, not printed."""
    handler = _CountedLog(refusals)
    aiohttp_log = logging.getLogger("aiohttp")
    aiohttp_log.addHandler(handler)
    propagate, aiohttp_log.propagate = aiohttp_log.propagate, False

    def loop_error(_: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        error = context.get("exception")
        files = isinstance(error, OSError) and error.errno in (errno.EMFILE, errno.ENFILE)
        refusals.count("files" if files else "error", error=_one_line(context["message"], error))

    loop.set_exception_handler(loop_error)
    try:
        yield
    finally:
        loop.set_exception_handler(None)
        aiohttp_log.removeHandler(handler)
        aiohttp_log.propagate = propagate


def _one_line(message: str, error: BaseException | None) -> str:
    """A log record's words in one line of printable characters, at most ERROR_CHARS."""
    text = f"{message}: {type(error).__name__}: {error}" if error is not None else message
    text = "".join(c if c.isprintable() else " " for c in text)
    return " ".join(text.split())[:ERROR_CHARS]
