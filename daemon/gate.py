"""Who may complete a CURVE handshake with the relay's TCP sockets (`--bind`,
a multi-node hub), and the count of those refused.

ZeroMQ asks a ZAP handler (RFC 27) before any CURVE handshake completes; the
gate is that handler, bound before the relay's sockets are, so that no
handshake can complete unasked. It admits exactly the run's client key. Every
refusal is counted from the sockets' monitors, under the reason it happened
for: `unauthenticated` (a CURVE peer whose key is not this run's) and
`handshake_failed` (no CURVE, or not this daemon's server key).
"""

from __future__ import annotations

import contextlib
import functools
import resource
from collections.abc import Callable, Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from ddtop.core.keys import ZAP_DOMAIN, RunKeys

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks who may complete a handshake
HANDSHAKE_TIMEOUT_MS = 3000  # a TCP peer that has not completed CURVE by then is dropped
# Handshake failures on a CURVE socket, by the reason they are counted under.
HANDSHAKE_FAILURES: dict[int, str] = {
    int(zmq.EVENT_HANDSHAKE_FAILED_AUTH): "unauthenticated",
    int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL): "handshake_failed",
    int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL): "handshake_failed"}
BATCH = 2000  # requests or events handled per call, so no socket starves another


class Gate:
    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], keys: RunKeys,
                 reject: Callable[[str], None]) -> None:
        """Bound at once: before the sockets it guards are."""
        self.keys, self.reject = keys, reject
        self.zap: zmq.Socket[bytes] = context.socket(zmq.REP)
        self.zap.setsockopt(zmq.LINGER, 0)
        self.zap.bind(ZAP_ENDPOINT)
        self.monitors: list[zmq.Socket[bytes]] = []
        self.watched: list[zmq.Socket[bytes]] = []
        _raise_open_files_limit()  # every peer that tries holds a descriptor a while

    @staticmethod
    def serve(sock: zmq.Socket[bytes], keys: RunKeys) -> None:
        """Make `sock` (before it binds) a CURVE server of the run, whose peers
        must finish their handshake within HANDSHAKE_TIMEOUT_MS."""
        keys.serve(sock)
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_TIMEOUT_MS)

    def watch(self, sockets: Sequence[zmq.Socket[bytes]], poller: zmq.Poller) -> None:
        """Count the refused handshakes of `sockets`; the gate's own sockets join `poller`."""
        poller.register(self.zap, zmq.POLLIN)
        events = 0
        for event in HANDSHAKE_FAILURES:
            events |= event
        for sock in sockets:
            monitor = sock.get_monitor_socket(events)
            poller.register(monitor, zmq.POLLIN)
            self.monitors.append(monitor)
            self.watched.append(sock)

    def handlers(self, ready: dict[zmq.Socket[bytes], int]
                 ) -> list[tuple[str, Callable[[], None]]]:
        """What to handle of what a poll found ready, by the name it is guarded under."""
        found: list[tuple[str, Callable[[], None]]] = []
        if self.zap in ready:
            found.append(("zap", self._answer))
        for monitor in self.monitors:
            if monitor in ready:
                found.append(("monitor", functools.partial(self._count, monitor)))
        return found

    def _answer(self) -> None:
        """Who may complete a CURVE handshake: the run's client key, and no one else
        (ZAP, RFC 27: version, request id, domain, address, identity, mechanism,
        credentials)."""
        for _ in range(BATCH):
            try:
                frames = self.zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            request_id = frames[1] if len(frames) > 1 else b""
            admitted = (len(frames) >= 7 and frames[0] == b"1.0" and frames[2] == ZAP_DOMAIN
                        and frames[5] == b"CURVE" and frames[6] == self.keys.client_public_raw)
            status = (b"200", b"OK") if admitted else (b"400", b"not a key of this run")
            with contextlib.suppress(zmq.ZMQError):
                self.zap.send_multipart([b"1.0", request_id, *status, b"", b""])

    def _count(self, monitor: zmq.Socket[bytes]) -> None:
        for _ in range(BATCH):
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            reason = HANDSHAKE_FAILURES.get(int(event["event"]))
            if reason is not None:
                self.reject(reason)

    def close(self) -> None:
        """Before the watched sockets close: their monitors first, then the handler."""
        for sock in self.watched:
            sock.disable_monitor()
        for sock in [*self.monitors, self.zap]:
            sock.close(linger=0)


def _raise_open_files_limit() -> None:
    """The soft limit on open descriptors up to the hard one (peers on TCP each
    hold one until their handshake ends)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
