"""The daemon's sockets: ranks in, dashboards out, requests answered.

    PULL   bound, ranks PUSH their telemetry here (DDTOP_TELEMETRY)
    PUB    bound, every accepted message re-published with its relay sequence number
    ROUTER bound, requests (core/protocol.py): status, snapshot, stop, stacks, ping

All three are ZeroMQ ipc sockets (unix domain sockets) in a folder only the run's owner
can enter: the run directory's `sock/`, or, where that path is too long for a unix socket,
a private folder made for the daemon (mkdtemp, 0700) and removed when it closes. Another
user cannot connect, so cannot send, subscribe or ask anything (docs/security.md).

With `--bind ADDR` they listen on TCP at ADDR instead, each a CURVE server with the run's
keys (core/keys.py); the relay's gate (daemon/gate.py) answers ZeroMQ's ZAP requests,
admitting only the run's client key, and counts every refused handshake:
`rejected.unauthenticated` (a CURVE peer with a key not of this run),
`rejected.handshake_failed` (no CURVE, or not this daemon's server key).

Every accepted message is folded into the RunState, appended to the journal and
re-published, in that order, under one relay sequence number (and, with --tensorboard,
written as TensorBoard files: core/tbwriter.py). A journal the disk cannot take (full)
drops and counts records instead of stopping the daemon (core/journal.py decides what
to say of it); the relay says it, as events and lines on stderr, and keeps the count in
`RunState.journal_dropped` (status, run.json). A dashboard subscribes first, then asks for
a snapshot (the state and the relay sequence number it includes) and applies only the
live messages newer than that.

Nothing a socket receives can stop the daemon: undecodable, oversized, wrong-version and
wrong-run frames are counted in `RunState.rejected` and dropped; so are messages for a
rank outside the world size the daemon launched (so what senders claim cannot grow its
memory), hellos whose pid is not the process the daemon started as that rank (`rank_pid`)
and, over ipc, any message sent by a process that is not that rank's (the kernel says
which process sent each frame). A flood is read in bounded batches so requests are still
answered. All three sockets belong to the thread that calls `serve` (the daemon's main
thread); ZeroMQ sockets are not thread-safe.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import zmq

from ddtop.core import protocol, wire
from ddtop.core.contract import UsageError
from ddtop.core.journal import JournalWriter
from ddtop.core.keys import RunKeys
from ddtop.core.state import RunState
from ddtop.core.tbwriter import TensorBoardTap
from ddtop.daemon import ipc, requests
from ddtop.daemon.gate import Gate
from ddtop.daemon.ipc import SOCKET_NAMES, peer_pid, private_folder

# Frames larger than this make ZeroMQ drop the connection unread (memory bound);
# frames over wire.MAX_FRAME_BYTES but under it are read and counted as oversized.
SOCKET_MAX_BYTES = 1 << 20
BATCH = 2000  # messages read per socket per serve() call, so no socket starves another
FOCUS_OP = b"\xa5focus"  # "focus" in msgpack: a focus request's op, near its start
# An internal error in one handler is said (stderr, a warning event) at most this often;
# every one is counted.
INTERNAL_ERROR_EVERY_S = 60.0
# Once the ranks' processes have exited: how long their last messages (the final Step,
# the bye) may still take to be read. They were sent before the exit, but on a loaded
# machine this daemon's sockets can hand them over after it has seen the exit.
LAST_WORDS_S = 2.0  # (a clean rank that never says bye, os._exit(0), holds the end this long)
LAST_WORDS_POLL_S = 0.05


# What the daemon says in its own name (as rank -1).
DaemonSays = (type[wire.RankExit] | type[wire.Restarting] | type[wire.RunStatus]
              | type[wire.Event])


class Relay:
    def __init__(self, run: str, journal: Path, sockets: Path | None = None,
                 world_size: int | None = None, rank_pid: Callable[[int, int], bool] | None = None,
                 bind: str | None = None, keys: RunKeys | None = None,
                 nodes: bool = False, tensorboard: str = "") -> None:
        """`sockets`: the owner-only folder for the ipc sockets (None, or a path too
        long for a unix socket: a private folder of the daemon's own). `world_size`:
        the ranks there are (None: any, up to the state's bound). `rank_pid(rank,
        pid)`: whether a pid is that rank's process, asked of a hello's pid and,
        over ipc, of the process that sent each message (None: not checked).
        `bind`: listen on TCP at this address instead, CURVE with `keys`. `nodes`: a
        multi-node job's hub: a fourth socket (PULL, TCP) for node daemons' forwards;
        `tensorboard`: a folder for TensorBoard files (core/tbwriter.py)."""
        assert bind is None or keys is not None, "TCP only with the run's keys"
        self.run = run
        self.world_size = world_size
        self.rank_pid = rank_pid
        self._senders: dict[int, int] = {}  # rank -> the pid its frames last came from
        self._retired: set[tuple[int, int]] = set()  # (rank, pid) of ranks' earlier processes
        self.state = RunState(run=run)
        self.seq = 0  # relay sequence number of the newest accepted message
        self.daemon_seq = 0
        # What the control socket was asked, for its owners (daemon/requests.py): the
        # supervisor takes the stop and stacks requests, the hub reads the focus.
        self.asked = requests.Asked()
        self.bind, self.keys = bind, keys
        # A multi-node job (daemon/hub.py, daemon/forwarder.py): the hub's node table, or a node
        # daemon's forwarder, fed every message this relay folds.
        self.hub: protocol.NodeHub | None = None
        self.forward: Callable[[wire.Message, bytes, float], None] | None = None
        self.nodes: zmq.Socket[bytes] | None = None
        self.sockets: Path | None = None  # the ipc sockets' folder (None over TCP)
        self._own_folder = False
        if bind is None:
            self.sockets, self._own_folder = private_folder(sockets)
        self.context = zmq.Context()
        # Over TCP, who may complete a handshake (daemon/gate.py): bound first, so
        # that no handshake completes unasked.
        self.gate = Gate(self.context, keys, self.reject) if keys is not None and bind else None
        try:
            self.pull, self.pub, self.router = self._bind_all()
        except zmq.ZMQError as e:
            if bind is not None:
                self._abandon()
                raise UsageError(f"--bind {bind}: cannot listen there ({e}): give an address "
                                 "of this machine") from None
            if self._own_folder:
                self._abandon()
                raise UsageError(f"cannot create the daemon's sockets in {self.sockets} ({e})"
                                 ) from None
            # The run directory's file system takes no unix sockets: a private folder.
            self.sockets, self._own_folder = private_folder(None)
            try:
                self.pull, self.pub, self.router = self._bind_all()
            except zmq.ZMQError as again:
                self._abandon()
                raise UsageError(f"cannot create the daemon's sockets in {self.sockets} "
                                 f"({again})") from None
        self.pull.setsockopt(zmq.MAXMSGSIZE, SOCKET_MAX_BYTES)
        self.router.setsockopt(zmq.MAXMSGSIZE, SOCKET_MAX_BYTES)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.poller = zmq.Poller()
        if nodes and bind is not None:
            try:
                self.nodes = self._bind(zmq.PULL, "nodes")
            except zmq.ZMQError as e:
                self._abandon()
                raise UsageError(f"--bind {bind}: cannot listen there ({e})") from None
            self.nodes.setsockopt(zmq.MAXMSGSIZE, SOCKET_MAX_BYTES)
            self.poller.register(self.nodes, zmq.POLLIN)
        self.poller.register(self.pull, zmq.POLLIN)
        self.poller.register(self.router, zmq.POLLIN)
        if self.gate is not None:
            self.gate.watch([self.pull, self.pub, self.router,
                             *([self.nodes] if self.nodes else [])], self.poller)
        self.journal = JournalWriter(journal)
        self.tensorboard = TensorBoardTap(Path(tensorboard) / run) if tensorboard else None
        self._errors_said: dict[str, float] = {}  # handler -> monotonic time it was last said

    def _bind_all(self) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes], zmq.Socket[bytes]]:
        bound: list[zmq.Socket[bytes]] = []
        try:
            for kind, name in ((zmq.PULL, "telemetry"), (zmq.PUB, "publish"),
                               (zmq.ROUTER, "control")):
                bound.append(self._bind(kind, name))
        except zmq.ZMQError:
            for sock in bound:
                sock.close(linger=0)
            raise
        return bound[0], bound[1], bound[2]

    def _bind(self, kind: int, name: str) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            if self.bind is not None:
                assert self.keys is not None
                Gate.serve(sock, self.keys)
                ipv6 = ":" in self.bind
                sock.setsockopt(zmq.IPV6, int(ipv6))
                sock.bind(f"tcp://{f'[{self.bind}]' if ipv6 else self.bind}:*")
            else:
                assert self.sockets is not None
                sock.bind(f"ipc://{self.sockets / name}")
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        return sock

    def _abandon(self) -> None:
        """After a failed start: nothing left open or behind."""
        if self.gate is not None:
            self.gate.close()
        self.context.term()
        if self._own_folder and self.sockets is not None:
            shutil.rmtree(self.sockets, ignore_errors=True)

    @property
    def endpoints(self) -> dict[str, str]:
        socks = {"telemetry": self.pull, "publish": self.pub, "control": self.router,
                 **({"nodes": self.nodes} if self.nodes is not None else {})}
        return {name: s.getsockopt_string(zmq.LAST_ENDPOINT) for name, s in socks.items()}

    # -- the loop --------------------------------------------------------------------
    def serve(self, timeout_s: float, fds: Sequence[int] = ()) -> list[int]:
        """Wait up to `timeout_s` for the sockets or `fds` (e.g. process
        sentinels); handle what arrived; return the fds that are ready."""
        for fd in fds:
            self.poller.register(fd, zmq.POLLIN)
        try:
            ready = dict(self.poller.poll(int(timeout_s * 1000)))
        finally:
            for fd in fds:
                self.poller.unregister(fd)
        if self.gate is not None:
            for where, handler in self.gate.handlers(ready):
                self.guarded(where, handler)
        if self.pull in ready:
            self.guarded("telemetry", self._drain_pull)
        if self.nodes is not None and self.nodes in ready:
            self.guarded("nodes", self._drain_nodes)
        if self.router in ready:
            self.guarded("control", self._drain_router)
        self.guarded("journal", self._flush_journal)
        return [fd for fd in fds if fd in ready]

    def last_words(self, timeout_s: float = LAST_WORDS_S) -> None:
        """The ranks have exited: serve until every rank that spoke to this daemon and
        exited cleanly (exit code 0, told by the daemon) has said bye, or `timeout_s`
        has passed. What it sent last is on its way still. A rank never heard from
        (its telemetry went elsewhere, or it died first), one that failed or was
        stopped, and another node's rank (a hub's; no exit told here) are not waited for."""
        deadline = time.monotonic() + timeout_s
        while any(v.exited and v.exit_code == 0 and v.bye_code is None
                  and v.last_seen is not None for v in self.state.ranks.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.serve(min(left, LAST_WORDS_POLL_S))

    def _flush_journal(self) -> None:
        self.journal.flush()
        self._watch_journal()

    # -- what the relay is told, once, by the part that owns it ------------------------
    def believe(self, rank_pid: Callable[[int, int], bool]) -> None:
        """Who may speak as which rank: asked of a hello's pid and, over ipc, of the
        process that sent each frame (the starter's `is_rank`, once it exists)."""
        self.rank_pid = rank_pid

    def serve_hub(self, hub: protocol.NodeHub) -> None:
        """A multi-node job's hub: node heartbeats answered, node frames taken."""
        self.hub = hub

    def forward_to(self, forward: Callable[[wire.Message, bytes, float], None]) -> None:
        """Node K: every message this relay folds goes on to the hub too."""
        self.forward = forward

    def focused(self, now: float) -> list[int]:
        """The ranks open on a dashboard at monotonic time `now` (requests.Asked)."""
        return self.asked.focused(now)

    def guarded(self, where: str, handler: Callable[[], None]) -> None:
        """Run one handler of the daemon's loop; an exception it raises is said and
        counted (internal_error), and the loop goes on: no input, however odd, may
        end the supervision of the ranks."""
        try:
            handler()
        except Exception as e:  # noqa: BLE001 -- deliberate: said and counted, never fatal
            self.internal_error(where, e)

    def internal_error(self, where: str, error: BaseException) -> None:
        """An exception in the handler `where`: counted in `rejected` as
        `internal_error`, its traceback on stderr (the daemon's log) and a warning
        event the first time for each handler; then once a minute at most."""
        self.reject("internal_error")
        now = time.monotonic()
        last = self._errors_said.get(where)
        if last is not None and now - last < INTERNAL_ERROR_EVERY_S:
            return
        self._errors_said[where] = now
        what = f"{type(error).__name__}: {str(error)[:200]}"
        text = "".join(traceback.format_exception(error))
        with contextlib.suppress(OSError):
            print(f"ddtrain: internal error in the {where} handler (the daemon goes on): "
                  f"{what}\n{text}", file=sys.stderr, flush=True)
        if where != "journal":  # a warning about the journal could fail the same way
            with contextlib.suppress(Exception):  # saying it must not raise in turn
                self.emit(wire.Event, type="warning", message=(
                    f"daemon: internal error in the {where} handler, counted and skipped "
                    f"(the run goes on): {what}"), traceback=text[-wire.MAX_TRACEBACK_CHARS:])

    def _drain_pull(self) -> None:
        # Over ipc the kernel names the process that sent each frame (SO_PEERCRED,
        # ZeroMQ's Peer-Address): only a rank's own process may speak for it.
        by_sender = self.rank_pid is not None and self.bind is None
        for _ in range(BATCH):
            sender: int | None = None
            try:
                if by_sender:
                    parts = self.pull.recv_multipart(zmq.NOBLOCK, copy=False)
                    sender = peer_pid(parts[0])
                    frames = [part.bytes for part in parts]
                else:
                    frames = self.pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            received = time.time()
            try:
                message = wire.decode(frames, self.run)
            except wire.WireError as e:
                self.reject(e.reason)
                continue
            if message.rank == wire.DAEMON_RANK or isinstance(message, wire.NodeSummary):
                self.reject("forged")  # only the daemon speaks as the daemon, or for a node
                continue
            if self.world_size is not None and not 0 <= message.rank < self.world_size:
                self.reject("rank_out_of_range")
                continue
            if sender is not None and not self._sent_by_rank(message.rank, sender):
                if (message.rank, sender) not in self._retired:  # else: left by a restart
                    self.reject("foreign_pid")  # sent by a process that is not that rank
                continue
            if (isinstance(message, wire.Hello) and self.rank_pid is not None
                    and not self.rank_pid(message.rank, message.pid)):
                self.reject("foreign_pid")  # not the process started as that rank
                continue
            self._accept(message, frames[0], received)

    def retire_senders(self) -> None:
        """The ranks are started again: their earlier processes speak for them no
        more. What those left queued is dropped without being counted as foreign
        (it is theirs, only late), and their pids are not believed again unless the
        starter says a new rank has that pid."""
        self._retired.update(self._senders.items())
        self._senders.clear()

    def _sent_by_rank(self, rank: int, pid: int) -> bool:
        """Whether `pid` is rank `rank`'s process: the last one found so, else asked
        of the starter (a restarted rank's new process is found there)."""
        if self._senders.get(rank) == pid:
            return True
        assert self.rank_pid is not None
        if not self.rank_pid(rank, pid):
            return False
        self._senders[rank] = pid
        return True

    def _drain_nodes(self) -> None:
        """What node daemons forward: [header, node, frame], from CURVE-authenticated
        peers only; trusted for display (daemon/hub.py)."""
        assert self.nodes is not None
        for _ in range(BATCH):
            try:
                frames = self.nodes.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.take_forward(frames, time.time())

    def take_forward(self, frames: list[bytes], received: float) -> None:
        """One forward off the `nodes` socket, handed to the hub or counted."""
        node = protocol.forward_node(frames)
        if node is None or self.hub is None:
            self.reject("bad_forward")
            return
        try:
            message = wire.decode(frames[2:], self.run)
        except wire.WireError as e:
            self.reject(e.reason)
            return
        self.hub.forwarded(node, message, frames[2], received)

    def accept_forwarded(self, message: wire.Message, frame: bytes, received: float) -> None:
        """A rank's message from a node daemon: its rank in range, its pid for display
        (or a node's summary, which its hub checked: daemon/summariser.problem)."""
        if (self.world_size is not None and not 0 <= message.rank < self.world_size
                and not isinstance(message, wire.NodeSummary)):
            self.reject("rank_out_of_range")
            return
        self._accept(message, frame, received)

    def reject(self, reason: str) -> None:
        self.state.rejected[reason] = self.state.rejected.get(reason, 0) + 1

    def _accept(self, message: wire.Message, frame: bytes, received: float) -> None:
        if not self.state.apply(message, received):
            return  # a duplicate (counted by the state), or a rank out of range
        self.seq += 1
        self.journal.append(self.seq, received, frame)
        self.pub.send_multipart(wire.relay_frames(self.seq, frame), zmq.NOBLOCK)
        if self.forward is not None:
            self.forward(message, frame, received)
        if self.tensorboard and (said := self.tensorboard.take(message, self.state, received)):
            self._emit(wire.Event, type="warning", message=said)  # an outage, or its end
            _say("warning", said)

    def emit(self, kind: DaemonSays, **fields: Any) -> None:
        """Fold, journal and publish a message of the daemon's own: it speaks as
        rank -1 (wire.DAEMON_RANK) with a sequence of its own."""
        self._emit(kind, **fields)
        self._watch_journal()

    def _emit(self, kind: DaemonSays, **fields: Any) -> None:
        message = kind(run=self.run, rank=wire.DAEMON_RANK, seq=self.daemon_seq, t=time.time(),
                       **fields)
        self.daemon_seq += 1
        self._accept(message, wire.encode(message)[0], message.t)
        self.journal.flush()

    def _watch_journal(self) -> None:
        """Keep the journal's dropped count in the state; emit what the journal
        writer says of itself (an outage begun, an outage ended: core/journal.py),
        each thing once. Its own events may be refused by the disk in turn: that is
        more news for the loop, never a call back into it."""
        while (news := self.journal.news()) is not None:
            self._emit(wire.Event, type=news.type, message=news.message, data=dict(news.data))
            _say(news.type, news.message)
        self.state.journal_dropped = self.journal.dropped

    # -- requests --------------------------------------------------------------------
    def _drain_router(self) -> None:
        """Up to BATCH requests, answered in the order they came, except that
        focus requests (a flood of which one client could send) are answered after
        the others: a status never waits behind them."""
        later: list[tuple[list[bytes], bytes, str]] = []
        for _ in range(BATCH):
            try:
                parts = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            # [identity, b"", request] from REQ; [identity, request] from DEALER.
            if len(parts) < 2:
                self.reject("bad_request")
                continue
            envelope, body = [p.bytes for p in parts[:-1]], parts[-1].bytes
            peer = ipc.peer(parts[-1], envelope[0])
            if FOCUS_OP in body[:16]:
                later.append((envelope, body, peer))
            else:
                self._answer(envelope, body, peer)
        for envelope, body, peer in later:
            self._answer(envelope, body, peer)

    def _answer(self, envelope: list[bytes], body: bytes, peer: str) -> None:
        try:
            reply = requests.answer(self, body, peer)
        except Exception as e:  # noqa: BLE001 -- a request must not stop the daemon: said, counted
            self.internal_error("control", e)
            reply = protocol.refused(f"the daemon could not answer ({type(e).__name__})")
        with contextlib.suppress(zmq.ZMQError):  # the asker is gone
            self.router.send_multipart([*envelope, protocol.encode(reply)], zmq.NOBLOCK)

    def close(self) -> None:
        self.journal.close()
        if self.tensorboard and (said := self.tensorboard.close()):
            _say("warning", said)
        if (line := self.journal.final_line()) is not None:
            _say("warning", line)  # the count once nothing more can be dropped
        if self.gate is not None:
            self.gate.close()
        for sock in [self.pull, self.pub, self.router, *([self.nodes] if self.nodes else [])]:
            sock.close(linger=0)
        self.context.term()
        if self.sockets is not None:
            for name in SOCKET_NAMES:
                (self.sockets / name).unlink(missing_ok=True)
            if self._own_folder:
                shutil.rmtree(self.sockets, ignore_errors=True)


def _say(type: wire.EventType, message: str) -> None:
    with contextlib.suppress(OSError):  # stderr on the same full disk: the event said it
        print(f"ddtrain: {'warning: ' if type == 'warning' else ''}{message}",
              file=sys.stderr, flush=True)
