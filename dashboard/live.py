"""A live run's daemon as a dashboard's feed (feed.py says what every feed offers).

    LiveFeed     SUB to the daemon's PUB, then a snapshot from its ROUTER (the
                 Clone pattern): apply only relayed messages newer than the
                 snapshot; a gap in the relay sequence (the PUB dropped messages
                 for a slow reader) asks for a fresh snapshot. When the daemon
                 goes quiet it is pinged (and a relay sequence number ahead of
                 ours asks for a snapshot too); when it is gone the run directory
                 says how the run ended (its journal is replayed), or that it was lost.

`open_feed` gives the feed for what `ddtop` was asked to watch: a live run's
daemon, or, once the daemon is gone, the run's journal (replay.py).
"""

from __future__ import annotations

import time
from urllib.parse import urlsplit

import zmq

from ddtop.core import control, journal, protocol, wire
from ddtop.core.keys import peer_keys, secure
from ddtop.core.rundir import RunPaths
from ddtop.core.runinfo import RunInfo, merged_counts
from ddtop.core.state import RunState, decode_snapshot
from ddtop.core.summary import LOST
from ddtop.dashboard.feed import BATCH, CONNECTING, ENDED, GONE, LIVE, Feed, conclude
from ddtop.dashboard.replay import ReplayFeed

PING_AFTER_S = 3.0  # no relayed message for this long: ask the daemon whether it is there
RETRY_S = 1.0  # between attempts to reach a daemon that does not answer
REQUEST_TIMEOUT_S = 2.0
RCVHWM = 200_000  # relayed messages queued for this reader before ZeroMQ drops (then resync)
# After a live run's final status, how long to wait for its daemon's last run.json.
FINAL_RECORD_WAIT_S = 2.0


class LiveFeed(Feed):
    """A live run's daemon, found through its run directory or a control endpoint."""

    def __init__(self, paths: RunPaths | None = None, connect: str | None = None) -> None:
        super().__init__(paths.run_id if paths else "?")
        if paths is None and connect is None:
            raise ValueError("LiveFeed needs a run directory or an endpoint")
        self.paths, self.connect_to = paths, connect
        self.paced = True
        # The run's CURVE keys (a run served over TCP: its keys folder, else DDTOP_KEYS),
        # read and checked here, before any socket: a damaged key file is a UsageError.
        endpoint = connect or (RunInfo.load(paths).control if paths is not None else None)
        folder = paths.keys if paths is not None and paths.keys.is_dir() else None
        self.keys = peer_keys(endpoint, folder)
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sub: zmq.Socket[bytes] | None = None
        self.control: str | None = None
        self.seq = 0  # relay sequence number of the newest message folded
        self.resyncs = 0
        self.last_heard = time.monotonic()
        self.next_try = 0.0

    # -- connecting ------------------------------------------------------------------
    def _endpoints(self) -> tuple[str, str] | None:
        """(control, publish) endpoints, or None when they cannot be known yet."""
        if self.connect_to is not None:
            reply = control.request(self.connect_to, protocol.Ping(), REQUEST_TIMEOUT_S,
                                    keys=self.keys)
            publish = reply.endpoints.get("publish", "")
            if self.connect_to.startswith("ipc://") and publish.startswith("ipc:///"):
                found: str | None = publish  # a socket in the same owner-only folder
            else:  # the publish port, on the host the control endpoint was reached at
                host, port = urlsplit(self.connect_to).hostname, _port(publish)
                found = f"tcp://{host}:{port}" if host and port else None
            if not reply.ok or found is None:
                raise control.Unreachable(f"{self.connect_to} is not a ddtrain daemon")
            if reply.run:
                self.state.run = reply.run[:200]
            return self.connect_to, found
        assert self.paths is not None
        info = RunInfo.load(self.paths)
        if not info.live:
            self._end()
            return None
        endpoints = info.record.endpoints
        if not endpoints.get("control") or not endpoints.get("publish"):
            self.detail = f"waiting for the daemon of run {self.paths.run_id} to start"
            return None
        return endpoints["control"], endpoints["publish"]

    def _connect(self) -> None:
        self.next_try = time.monotonic() + RETRY_S
        try:
            found = self._endpoints()
            if found is None:
                return
            self.control, publish = found
            self._close_sub()
            # Held by the feed at once, so that close() closes it whatever happens next.
            self.sub = sub = self.context.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, RCVHWM)
            sub.setsockopt(zmq.SUBSCRIBE, wire.RELAY_TOPIC)
            if self.keys is not None:
                secure(sub, publish, self.keys)
            sub.connect(publish)  # subscribed before the snapshot: nothing falls between
            self._snapshot()
        except (control.Unreachable, zmq.ZMQError) as e:
            self._close_sub()
            self.connection = CONNECTING if self.connection == CONNECTING else GONE
            self.detail = f"the daemon does not answer ({e}); retrying"

    def _snapshot(self) -> None:
        assert self.control is not None
        reply = control.request(self.control, protocol.Snapshot(), REQUEST_TIMEOUT_S,
                                keys=self.keys)
        if not reply.ok:
            raise control.Unreachable(reply.error)
        try:
            state = decode_snapshot(reply.state)
        except wire.UNTRUSTED_ERRORS:
            raise control.Unreachable("its snapshot is not one this ddtop can read") from None
        seq = reply.seq
        if seq is None:
            raise control.Unreachable("its snapshot has no sequence number")
        with self.lock:
            self.state, self.seq = state, seq
        self.connection, self.detail = LIVE, ""
        self.last_heard = time.monotonic()
        self.finished = state.status in wire.FINAL_STATUSES

    def _end(self) -> None:
        """The daemon is gone: the run directory has the rest of the story."""
        assert self.paths is not None
        state = RunState(run=self.paths.run_id)
        if self.paths.journal.exists():
            state, _ = journal.replay(self.paths.journal, self.paths.run_id)
        with self.lock:
            self.state = conclude(state, self.paths)
        self.connection, self.finished = ENDED, True
        self.detail = state.status_message if state.status == LOST else ""
        self._close_sub()

    # -- receiving -------------------------------------------------------------------
    def pump(self, timeout_s: float) -> int:
        if self.finished:
            time.sleep(timeout_s)
            return 0
        if self.sub is None:
            if time.monotonic() >= self.next_try:
                self._connect()
            if self.sub is None:
                time.sleep(min(timeout_s, max(0.0, self.next_try - time.monotonic())))
                return 0
        assert self.sub is not None
        folded = 0
        if self.sub.poll(int(timeout_s * 1000)):
            folded = self._drain()
        if self.state.status in wire.FINAL_STATUSES:
            self.finished = True
            self._close_sub()
            self._final_counts()
        elif time.monotonic() - self.last_heard > PING_AFTER_S:
            self._check_daemon()
        return folded

    def _drain(self) -> int:
        assert self.sub is not None
        folded = 0
        with self.lock:
            for _ in range(BATCH):
                try:
                    frames = self.sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    seq, message = wire.decode_relayed(frames, self.state.run)
                except wire.WireError:
                    continue  # counted by nobody: the daemon sends only what it accepted
                if seq <= self.seq:
                    continue  # already in the snapshot
                if seq != self.seq + 1:
                    self.resyncs += 1
                    self.lock.release()
                    try:
                        self._snapshot()  # the PUB dropped messages for us: start over
                    except control.Unreachable:
                        pass
                    finally:
                        self.lock.acquire()
                    continue
                self.seq = seq
                self.state.apply(message, time.time())
                folded += 1
        self.last_heard = time.monotonic()
        return folded

    def _final_counts(self) -> None:
        """The rejected counts as the daemon wrote them last: they are not relayed,
        so the snapshot's may be older."""
        if self.paths is None:
            return
        record = final_record(self.paths).record
        with self.lock:
            self.state.rejected = merged_counts(self.state.rejected, record.rejected)

    def _check_daemon(self) -> None:
        assert self.control is not None
        try:
            reply = control.request(self.control, protocol.Ping(), REQUEST_TIMEOUT_S,
                                    keys=self.keys)
            self.last_heard = time.monotonic()
            # Back after a while, or the relay published more than came: the PUB
            # drops what it sends before our subscription reaches it, and a quiet
            # run sends nothing after that would show the gap. The snapshot has it.
            if self.connection == GONE or not reply.ok or reply.seq > self.seq:
                self._snapshot()
        except control.Unreachable as e:
            if self.paths is not None and not RunInfo.load(self.paths).live:
                self._end()
                return
            self.connection = GONE
            self.detail = f"the daemon does not answer ({e}); retrying"

    def now(self) -> float:
        if self.finished:
            return self.state.updated or time.time()
        return time.time()

    @property
    def stop_endpoint(self) -> str | None:
        return None if self.finished else self.control

    def _close_sub(self) -> None:
        if self.sub is not None:
            self.sub.close(linger=0)
            self.sub = None

    def close(self) -> None:
        """Every socket of the feed closed with linger 0, then the context: never a
        hang, however the feed was left (a socket made just before an error too)."""
        self._close_sub()
        self.context.destroy(linger=0)


def final_record(paths: RunPaths, wait_s: float = FINAL_RECORD_WAIT_S) -> RunInfo:
    """The run's run.json once it holds a final status (the daemon publishes the
    status first, then writes the file), or as it is after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        info = RunInfo.load(paths)
        if info.record.status in wire.FINAL_STATUSES or time.monotonic() >= deadline:
            return info
        time.sleep(0.02)


def _port(endpoint: str) -> int | None:
    try:
        return urlsplit(endpoint).port
    except ValueError:  # not a port number: not a daemon's answer
        return None


def open_feed(target: RunPaths | str, replay: bool = False, speed: float = 1.0) -> Feed:
    """The feed for a run directory (live daemon, or its journal once finished),
    a replay of it, or a control endpoint (ipc://PATH or tcp://HOST:PORT)."""
    if isinstance(target, str):
        return LiveFeed(connect=target)
    if replay:
        return ReplayFeed(target, speed)
    if RunInfo.load(target).live:
        return LiveFeed(paths=target)
    # A finished run: its journal at once.
    return ReplayFeed(target, speed=0, instant_step_s=float("inf"), replaying=False)
