"""Where a dashboard's RunState comes from: a live daemon, a journal, or in-process.

    LiveFeed     SUB to the daemon's PUB, then a snapshot from its ROUTER (the
                 Clone pattern): apply only relayed messages newer than the
                 snapshot; a gap in the relay sequence (the PUB dropped messages
                 for a slow reader) asks for a fresh snapshot. When the daemon
                 goes quiet it is pinged (and a relay sequence number ahead of
                 ours asks for a snapshot too); when it is gone the run directory
                 says how the run ended (its journal is replayed), or that it was lost.
    ReplayFeed   a run's journal played back at a chosen speed (0: at once); a run
                 folder renamed since is played all the same (its records carry
                 the old run id: `note` says so).
    StateFeed    a RunState someone else folds, in the same thread (tests, benchmarks).

Every feed folds into `feed.state` under `feed.lock` and tells the time with
`feed.now()`: wall-clock time while a run is live, the journal's time in a
replay, and the time of the last message once a run is over (so that a finished
run does not age into "silent"). `pump()` is called in a loop by one thread (a
Textual worker, or the headless printer); readers in other threads hold the lock.

What a reader may do with a feed, the feed says (readers never test its class):
`replay_controls` (speed and pause: `set_speed`, `set_paused`), `stop_endpoint`
(where to send `stop`), `note` (a line to show once: where the state comes
from, when that is not what was asked for), and `close()`, safe to call on any feed.

What the journal cannot tell (frames the daemon refused: `rejected`) comes from
run.json once the run is over.

A watcher's loop pumps through a `Pacer`: a feed whose messages trickle in (a
live run of a few ranks: `paced`) is pumped at most once per period, what comes
meanwhile waiting in the socket to be folded together.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import zmq

from ddtop.daemon import control, journal, wire
from ddtop.daemon.keys import RunKeys, peer_keys, secure
from ddtop.daemon.runinfo import RunInfo, merged_counts
from ddtop.daemon.runs import RunPaths
from ddtop.daemon.state import RunState, decode_snapshot
from ddtop.daemon.summary import LOST

BATCH = 5000  # messages folded per pump() at most, so a flood never starves the reader
PACE_BELOW = 2000  # messages/s under which a paced feed is pumped once per period (Pacer)
PING_AFTER_S = 3.0  # no relayed message for this long: ask the daemon whether it is there
RETRY_S = 1.0  # between attempts to reach a daemon that does not answer
REQUEST_TIMEOUT_S = 2.0
INSTANT_STEP_S = 0.1  # journal time folded per pump() of a replay at speed 0
RCVHWM = 200_000  # relayed messages queued for this reader before ZeroMQ drops (then resync)
# After a live run's final status, how long to wait for its daemon's last run.json.
FINAL_RECORD_WAIT_S = 2.0

CONNECTING, LIVE, GONE, ENDED, REPLAY = "connecting", "live", "gone", "ended", "replay"


class Feed:
    """What every feed offers; see the module docstring."""

    def __init__(self, run: str) -> None:
        self.state = RunState(run=run)
        self.lock = threading.Lock()
        self.connection = CONNECTING  # connecting | live | gone | ended | replay
        self.detail = ""  # a line for the banner: what is wrong, what is being tried
        self.note = ""  # a line to show once, e.g. a renamed run folder replayed
        self.finished = False  # nothing more will come: the run is over or its journal played
        self.keys: RunKeys | None = None  # the run's CURVE keys, for a daemon over TCP
        self.paths: RunPaths | None = None
        self.speed = 1.0  # run seconds per wall second: 1 live; a replay's own (0: at once)
        # Whether a watcher should gather this feed's messages (Pacer): a live run's
        # come one by one as ranks send them; a replay's or a StateFeed's do not.
        self.paced = False

    def pump(self, timeout_s: float) -> int:
        """Fold what arrives within `timeout_s`; the number of messages folded."""
        raise NotImplementedError

    def now(self) -> float:
        return time.time()

    @property
    def replay_controls(self) -> bool:
        """Whether `set_speed` and `set_paused` steer this feed (a journal played back)."""
        return False

    def set_speed(self, speed: float) -> None:
        """Play at `speed` times real time (0: at once); only where `replay_controls`."""
        raise NotImplementedError(f"{type(self).__name__} has no speed to set")

    def set_paused(self, paused: bool) -> None:
        """Stop (or restart) the feed's clock; only where `replay_controls`."""
        raise NotImplementedError(f"{type(self).__name__} cannot pause")

    @property
    def stop_endpoint(self) -> str | None:
        """The control endpoint to send `stop` to: a live run's daemon while the run
        is unfinished; None when there is nothing this feed can stop."""
        return None

    def close(self) -> None:
        pass


class StateFeed(Feed):
    """A RunState folded by its owner (the daemon's Supervisor) in the same thread."""

    def __init__(self, state: RunState) -> None:
        super().__init__(state.run)
        self.state = state
        self.connection = LIVE

    def pump(self, timeout_s: float) -> int:
        self.finished = self.state.status in wire.FINAL_STATUSES
        return 0

    def now(self) -> float:
        return (self.state.updated or time.time()) if self.finished else time.time()


def conclude(state: RunState, paths: RunPaths) -> RunState:
    """Complete a state folded from a run's journal with what run.json knows once
    the daemon is gone: a run whose journal never reached a final status was lost."""
    info = RunInfo.load(paths)
    if state.status not in wire.FINAL_STATUSES:
        record = info.record
        state.status = record.status if record.status in wire.FINAL_STATUSES else LOST
        state.exit_code = record.exit_code
        if state.status == LOST:
            state.status_message = (f"the daemon (pid {info.daemon_pid}) is gone and the run "
                                    "did not finish: it was killed")
    state.failure = state.failure or info.record.failure
    state.world_size = state.world_size or info.world_size
    state.rejected = merged_counts(state.rejected, info.record.rejected)
    return state


def final_record(paths: RunPaths, wait_s: float = FINAL_RECORD_WAIT_S) -> RunInfo:
    """The run's run.json once it holds a final status (the daemon publishes the
    status first, then writes the file), or as it is after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        info = RunInfo.load(paths)
        if info.record.status in wire.FINAL_STATUSES or time.monotonic() >= deadline:
            return info
        time.sleep(0.02)


class Pacer:
    """One watcher's loop over a feed: `pump()`, the watcher's own work, `rest()`.

    After a pump of a paced feed that folded a few messages (fewer than BATCH),
    `rest()` sleeps out the rest of `period_s`: what comes meanwhile waits in the
    socket and is folded together, one wakeup per period instead of one per
    message (a few ranks send a few dozen a second; each would wake the
    watcher). A feed that brought PACE_BELOW messages a second or more over the
    last second (hundreds of ranks) is not held back: its messages come in
    bursts that wake the watcher once each anyway, and each burst is folded as
    it comes. Nor is a flood (a pump that folded BATCH), nor a quiet feed (a
    pump that folded nothing already waited its period)."""

    def __init__(self, feed: Feed, period_s: float) -> None:
        self.feed, self.period_s = feed, period_s
        self.busy = False  # PACE_BELOW messages a second or more, over the last second
        self._start = self._since = time.monotonic()
        self._folded = self._count = 0  # the last pump's; the last second's so far

    def pump(self) -> int:
        """The feed's pump, waiting up to a period; the number of messages folded."""
        self._start = time.monotonic()
        self._folded = self.feed.pump(self.period_s)
        self._count += self._folded
        if self._start - self._since >= 1.0:
            self.busy = self._count >= PACE_BELOW * (self._start - self._since)
            self._count, self._since = 0, self._start
        return self._folded

    def rest(self) -> None:
        """Sleep out the period the last pump began, where that is worth it."""
        if self.feed.paced and not self.busy and 0 < self._folded < BATCH:
            time.sleep(max(0.0, self._start + self.period_s - time.monotonic()))


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
            reply = control.request(self.connect_to, "ping", REQUEST_TIMEOUT_S, keys=self.keys)
            endpoints = reply.get("endpoints")
            publish = str(endpoints.get("publish", "")) if isinstance(endpoints, dict) else ""
            if self.connect_to.startswith("ipc://") and publish.startswith("ipc:///"):
                found: str | None = publish  # a socket in the same owner-only folder
            else:  # the publish port, on the host the control endpoint was reached at
                host, port = urlsplit(self.connect_to).hostname, _port(publish)
                found = f"tcp://{host}:{port}" if host and port else None
            if not reply.get("ok") or found is None:
                raise control.Unreachable(f"{self.connect_to} is not a ddtrain daemon")
            run = reply.get("run")
            if isinstance(run, str):
                self.state.run = run[:200]
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
        reply = control.request(self.control, "snapshot", REQUEST_TIMEOUT_S, keys=self.keys)
        if not reply.get("ok"):
            raise control.Unreachable(str(reply.get("error")))
        unreadable = control.Unreachable("its snapshot is not one this ddtop can read")
        try:
            state, seq = decode_snapshot(reply["state"]), reply["seq"]
        except (KeyError, TypeError):
            raise unreadable from None
        except wire.UNTRUSTED_ERRORS:
            raise unreadable from None
        if not isinstance(seq, int) or isinstance(seq, bool):
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
            reply = control.request(self.control, "ping", REQUEST_TIMEOUT_S, keys=self.keys)
            self.last_heard = time.monotonic()
            # Back after a while, or the relay published more than came: the PUB
            # drops what it sends before our subscription reaches it, and a quiet
            # run sends nothing after that would show the gap. The snapshot has it.
            seq = reply.get("seq")
            if self.connection == GONE or not isinstance(seq, int) or seq > self.seq:
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


class ReplayFeed(Feed):
    """A journal played back: `speed` times real time; 0 folds it all at once."""

    def __init__(self, paths: RunPaths, speed: float = 1.0,
                 instant_step_s: float = INSTANT_STEP_S, replaying: bool = True) -> None:
        super().__init__(paths.run_id)
        self.instant_step_s = instant_step_s
        self.replaying = replaying  # False: a finished run read at once, not played back
        self.paths = paths
        recorded = journal.recorded_run(paths.journal) if paths.journal.exists() else None
        if recorded not in (None, paths.run_id):
            self.note = (f"{paths.root}'s telemetry journal is of run {recorded!r}: the folder "
                         "was renamed since; replaying it all the same")
        self.records: Iterator[journal.Record] = (
            journal.read(paths.journal) if paths.journal.exists() else iter(()))
        self.pending: journal.Record | None = next(self.records, None)
        self.speed = speed
        self.paused = False
        self.connection = REPLAY
        first = self.pending.received if self.pending is not None else time.time()
        self._anchor(first)
        if self.pending is None:
            self._finish()

    def _anchor(self, replay_t: float) -> None:
        self.anchor_replay, self.anchor_wall = replay_t, time.monotonic()

    def now(self) -> float:
        if self.finished:
            return self.state.updated or self.anchor_replay
        if self.paused or self.speed == 0:
            return self.anchor_replay
        return self.anchor_replay + (time.monotonic() - self.anchor_wall) * self.speed

    @property
    def replay_controls(self) -> bool:
        return self.replaying

    def set_speed(self, speed: float) -> None:
        self._anchor(self.now())
        self.speed = max(0.0, speed)

    def set_paused(self, paused: bool) -> None:
        self._anchor(self.now())
        self.paused = paused

    def pump(self, timeout_s: float) -> int:
        if self.finished or self.paused:
            time.sleep(timeout_s)
            return 0
        # At speed 0 each pump folds the next INSTANT_STEP_S of the journal's time, so
        # that readers that print per interval of run time still see every interval.
        horizon = (self.anchor_replay + self.instant_step_s if self.speed == 0
                   else self.now())
        folded = 0
        with self.lock:
            while self.pending is not None and folded < BATCH:
                record = self.pending
                if record.received > horizon:
                    break
                try:
                    # Any run id: the journal holds only what its daemon accepted.
                    self.state.apply(wire.decode([record.frame]), record.received)
                    folded += 1
                except wire.WireError:
                    pass  # the journal holds only accepted frames; a damaged one is skipped
                self.pending = next(self.records, None)
            if self.speed == 0:
                self.anchor_replay = horizon
        if self.pending is None:
            self._finish()
        elif not folded and self.speed:
            wait = (self.pending.received - self.now()) / self.speed
            time.sleep(max(0.0, min(timeout_s, wait)))
        return folded

    def _finish(self) -> None:
        assert self.paths is not None
        with self.lock:
            state = conclude(self.state, self.paths)
        self.finished = True
        self.detail = state.status_message if state.status == LOST else ""


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

