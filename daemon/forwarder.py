"""Node K's side of a multi-node job (daemon/hub.py): its ranks' summaries and its
own messages forwarded to the hub, and a heartbeat once a second.
"""

from __future__ import annotations

import collections
import contextlib
import os
import socket
import time
from collections.abc import Callable

import zmq

from ddtop.core import protocol, wire
from ddtop.core.config import TrainConfig
from ddtop.core.keys import RunKeys
from ddtop.core.rankview import RankView
from ddtop.core.summary import Status
from ddtop.daemon import summariser
from ddtop.daemon.hub import FORWARD_HWM, HEARTBEAT_S, at_host_of


class Forwarder:
    """Node K's side: its ranks' messages summed up for the hub, a summary every
    SUMMARY_S (daemon/summariser.py), its own messages as they are (bounded,
    never blocking), plus a heartbeat with this node's ranks and status.
    `accounts()`: the node's RankViews (their telemetry accounting)."""

    # The hub's newest bundle of evidence as last heard (None: not yet; one from
    # before this node heard the hub is not gathered), and one to gather now.
    evidence_heard: str | None = None
    evidence_asked = ""

    def __init__(self, config: TrainConfig, control: str, keys: RunKeys, run: str,
                 accounts: Callable[[], dict[int, RankView]]) -> None:
        self.node = config.node_rank
        self.summariser = summariser.Summariser(run, self.node,
                                                 summariser.every_s(config.nnodes))
        self.accounts = accounts
        self.context = zmq.Context()
        self.control = self.context.socket(zmq.DEALER)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.setsockopt(zmq.SNDHWM, 4)
        keys.client(self.control)
        self.control.connect(control)
        self.control_endpoint = control
        self.push: zmq.Socket[bytes] | None = None
        self.keys = keys
        self.waiting: collections.deque[bytes] = collections.deque(maxlen=FORWARD_HWM)
        self.dropped = 0
        self.last_beat = 0.0
        self.stop: float | None = None  # the hub asked every node to stop
        self.heard: float | None = None  # monotonic time of the hub's last reply
        self.started = time.monotonic()
        self.host = socket.gethostname()[:protocol.MAX_HOST_CHARS]

    def forward(self, message: wire.Message, frame: bytes, received: float) -> None:
        """A message the node's relay folded: the node's own at once, a rank's
        summed up (what cannot wait, at once too)."""
        if message.rank == wire.DAEMON_RANK:
            if isinstance(message, wire.RankExit) and message.exited >= 0:
                self.summariser.hurry(message.exited, received)  # its last readings first
                self.summarise()
            self.send(frame)
        elif self.summariser.take(message, received):
            self.summarise()

    def summarise(self) -> None:
        """What the summariser has due, sent."""
        for frame in self.summariser.frames(self.accounts(), time.monotonic(), time.time()):
            self.send(frame)

    def send(self, frame: bytes) -> None:
        if self.push is None:
            if len(self.waiting) == self.waiting.maxlen:
                self.dropped += 1
            self.waiting.append(frame)
            return
        try:
            self.push.send_multipart(protocol.forward_frames(self.node, frame), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1

    def tick(self, ranks: list[int], status: Status,
             final: protocol.NodeFinal | None = None) -> None:
        """Answers from the hub; a summary, a heartbeat when one is due (or
        `final`: at once, after the last summary)."""
        if final is not None or self.summariser.due(time.monotonic()):
            if final is not None:
                self.summariser.last = 0.0
            self.summarise()
        for _ in range(100):
            try:
                body = self.control.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.take_reply(body)
        now = time.monotonic()
        if final is None and now - self.last_beat < HEARTBEAT_S:
            return
        self.last_beat = now
        said = final or protocol.NodeFinal(status=status)  # not over: its status alone
        beat = protocol.NodeHeartbeat(node=self.node, host=self.host, pid=os.getpid(),
                                      ranks=ranks, dropped=self.dropped + self.summariser.dropped,
                                      status=said.status,
                                      message=said.message, failure=said.failure)
        with contextlib.suppress(zmq.ZMQError):
            self.control.send(protocol.encode(beat), zmq.NOBLOCK)

    def take_reply(self, body: bytes) -> None:
        """One of the hub's replies: a stop for every node, where to forward to."""
        try:
            reply = protocol.decode_reply(protocol.NodeReply, body)
        except protocol.ProtocolError:  # not the hub's reply
            return
        self.heard = time.monotonic()
        self.summariser.focus = set(reply.focus)
        if reply.stop is not None:
            self.stop = reply.stop
        if self.evidence_heard is not None and reply.evidence != self.evidence_heard:
            self.evidence_asked = reply.evidence
        self.evidence_heard = reply.evidence
        if self.push is None and reply.nodes:
            # The hub names itself as its host is called there; this node reached its
            # control endpoint at an address that works from here (--hub, hub.json):
            # the nodes endpoint is the same daemon's, at that address.
            self._connect(at_host_of(reply.nodes, self.control_endpoint))

    def _connect(self, endpoint: str) -> None:
        self.push = self.context.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 2000)  # the last words (exits, final status) get out
        self.push.setsockopt(zmq.SNDHWM, FORWARD_HWM)
        self.keys.client(self.push)
        self.push.connect(endpoint)
        while self.waiting:
            self.send(self.waiting.popleft())

    def close(self, ranks: list[int], final: protocol.NodeFinal) -> None:
        """The last summary, then how this node ended (the hub settles on that: the
        summary goes first, on its own connection), then the last messages go
        (bounded)."""
        self.summariser.last = 0.0
        self.summarise()
        time.sleep(0.2)
        self.tick(ranks, final.status, final)
        time.sleep(0.3)
        self.control.close(linger=1000)
        if self.push is not None:
            self.push.close()
        self.context.term()
