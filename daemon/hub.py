"""Multi-node jobs: node daemons forward to node 0's daemon, the hub.

    node K's daemon ── PUSH (CURVE) ──► hub's `nodes` PULL    its ranks' summaries (2 a second,
                                                               daemon/summariser.py), its own
                                                               messages (exits, events) at once
                    ── DEALER (CURVE) ─► hub's control ROUTER  a NodeHeartbeat once a second;
                                                               the NodeReply carries a stop
(the messages and their bounds: core/protocol.py)

Node 0's daemon (the hub) serves its sockets on TCP with the job's CURVE keys
(runs/<id>/keys): only a peer holding the job's client key completes a
handshake; every other attempt is counted under `rejected` as for any TCP
socket of a run (daemon/relay.py). What node daemons forward is trusted for
display only: the ranks' pids are never signalled, a rank number must be in
the job's world size, and a node daemon's own messages (a rank's exit, its
events) are re-said by the hub under the node's name.

Liveness: a node daemon's heartbeat (its `node` request) comes every second;
none for NODE_TIMEOUT_S makes the node `unreachable` (its ranks are shown so,
not as dead). When the job ends (the hub's own ranks exited, or one failed)
while a node is unreachable, that node is `lost` and the outcome names it.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from ddtop.core import protocol, wire
from ddtop.core.config import TrainConfig
from ddtop.daemon import summariser

HEARTBEAT_S = 1.0  # a node daemon's `node` request, this often
NODE_TIMEOUT_S = 5.0  # no heartbeat for this long: the node is unreachable
CHECK_EVERY_S = 0.2  # the hub looks for silent nodes this often
# Frames (summaries, its own messages) a node daemon holds for the hub before it
# drops (counted): 1,000 s of a node of 8 ranks' summaries, a few MB.
FORWARD_HWM = 2_000
HUB_WAIT_S = 120.0  # how long node K waits for the hub's hub.json (shared file system)
NODE_FINAL_WAIT_S = 10.0  # how long the hub waits, at the end, for nodes to say how they ended

# A node's state, as the hub sees it (wire.NodeState).
UP: Final = "up"
UNREACHABLE: Final = "unreachable"
LOST: Final = "lost"
NOT_ITS_RANK = "not_its_rank"  # rejected: a node spoke for a rank that is not its own
DONE: Final = "done"


def hub_bind_address(config: TrainConfig) -> str:
    """Where node 0 listens: --bind, else the rendezvous host when it is an address
    of this machine (loopback on one machine), else every interface."""
    if config.bind:
        return config.bind
    host = config.rdzv_host
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
        return host
    except OSError:
        return "0.0.0.0"


def reachable(endpoint: str) -> str:
    """An endpoint as ranks on other machines reach it: a wildcard address
    (tcp://0.0.0.0:PORT) becomes this machine's host name."""
    if endpoint.startswith(("tcp://0.0.0.0:", "tcp://[::]:", "tcp://*:")):
        return public(endpoint, socket.gethostname())
    return endpoint


def public(endpoint: str, host: str) -> str:
    """tcp://0.0.0.0:PORT as other nodes reach it: tcp://HOST:PORT."""
    port = endpoint.rpartition(":")[2]
    return f"tcp://{f'[{host}]' if ':' in host else host}:{port}"


def at_host_of(endpoint: str, reached: str) -> str:
    """`endpoint` (tcp://HOST:PORT) at the host of `reached`, another endpoint of the
    same daemon that this machine reached: the hub names itself as its host is
    called there, which may not be how it is reached from here."""
    if not (endpoint.startswith("tcp://") and reached.startswith("tcp://")):
        return endpoint
    host = reached.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    return public(endpoint, host) if host else endpoint


@dataclass
class NodeSeen:
    node: int
    host: str = ""
    pid: int | None = None
    ranks: list[int] = field(default_factory=list)
    beat: float = 0.0  # monotonic time of the last heartbeat
    state: wire.NodeState = UP
    status: str = ""  # the node daemon's own run status (running, failed, ...)
    message: str = ""  # its final headline
    failure: protocol.NodeFailure | None = None  # the rank it blamed, if it failed
    dropped: int = 0  # messages it could not forward (its high-water mark)


class Hub:
    """Node 0's side: the node table, fed by the relay (forwarded frames, `node`
    requests); `check` turns silences into `unreachable` events."""

    def __init__(self, config: TrainConfig, relay: protocol.HubRelay,
                 local_ranks: Callable[[], list[int]] = list) -> None:
        self.config, self.relay = config, relay
        self.local_ranks = local_ranks  # node 0's own ranks: no other node speaks for them
        self.nodes: dict[int, NodeSeen] = {}
        # rank -> the node that speaks for it: the first to claim it, until its
        # heartbeat no longer does (an elastic restart may move a rank).
        self.owner: dict[int, int] = {}
        self.warned: set[int] = set()  # nodes told once that they spoke for another's rank
        self.nodes_endpoint = ""  # where node daemons push (public address)
        self.stop: float | None = None  # a stop for every node (its timeout)
        self.evidence = ""  # the hub's newest bundle: every node gathers its own ranks'
        self.checked = 0.0  # monotonic time of the last look for silent nodes

    # -- from the relay ------------------------------------------------------------
    def request(self, beat: protocol.NodeHeartbeat) -> protocol.Reply:
        """A node daemon's heartbeat (its fields' kinds and bounds checked by the
        decoder): the node table updated; the reply carries a stop for every node.
        Ranks outside the job's world size are left out, as is a blamed one."""
        node, world_size = beat.node, self.config.world_size
        if not node < self.config.nnodes:
            return protocol.refused(f"node must be 1 to {self.config.nnodes - 1}")
        seen = self.nodes.get(node)
        if seen is None:
            seen = self.nodes[node] = NodeSeen(node)
        was = seen.state
        seen.beat = time.monotonic()
        seen.host, seen.pid, seen.status, seen.dropped = (beat.host, beat.pid, beat.status,
                                                          beat.dropped)
        claimed = sorted({r for r in beat.ranks if r < world_size})
        ranks = self._claim(node, claimed, all_or_none=False) or []
        for gone in set(seen.ranks) - set(ranks):
            if self.owner.get(gone) == node:
                del self.owner[gone]
        if ranks != seen.ranks:
            seen.ranks = ranks
            self._say(node, "info", f"node {node} ({seen.host}): ranks "
                      f"{', '.join(map(str, ranks)) or 'none yet'}")
        if beat.status in wire.FINAL_STATUSES:
            seen.state = DONE
            seen.message = beat.message
            failure = beat.failure
            seen.failure = failure if failure is not None and failure.rank < world_size else None
        elif was != UP and seen.state != DONE:
            seen.state = UP
            self._say(node, "info", f"node {node} ({seen.host}) is reachable again")
        return protocol.NodeReply(ok=True, stop=self.stop, nodes=self.nodes_endpoint,
                                  focus=self.relay.focused(time.monotonic()),
                                  evidence=self.evidence)

    def forwarded(self, node: int, message: wire.Message, frame: bytes, received: float) -> None:
        """What node `node` sent: its ranks' summary (daemon/summariser.py),
        journalled and relayed as it came, or its own message, said by the hub."""
        if not 0 < node < self.config.nnodes:
            self.relay.reject("bad_forward")
            return
        if isinstance(message, wire.NodeSummary):
            why = summariser.problem(message, node, self.relay.run, self.config.world_size)
            if why is None and self._claim(
                    node, {m.rank for m in message.messages} | {a.rank for a in message.accounts}
            ) is None:
                why = NOT_ITS_RANK
            if why is None:
                self.relay.accept_forwarded(message, frame, received)
            else:
                self.relay.reject(why)
            return
        if message.rank != wire.DAEMON_RANK:
            if self._claim(node, {message.rank}) is not None:
                self.relay.accept_forwarded(message, frame, received)
            else:
                self.relay.reject(NOT_ITS_RANK)
            return
        if isinstance(message, wire.RankExit):
            if not 0 <= message.exited < self.config.world_size:
                pass
            elif self._claim(node, {message.exited}) is None:
                self.relay.reject(NOT_ITS_RANK)
            else:
                fields = {f: getattr(message, f) for f in message.__struct_fields__
                          if f not in ("run", "rank", "seq", "t", "kind")}
                self.relay.emit(wire.RankExit, **fields)
        elif isinstance(message, wire.Event) and (message.node is None
                                                  or not message.node.local):
            self._say(node, message.type if message.type != "restart" else "info",
                      f"node {node}: {message.message}", traceback=message.traceback)
        # A node's RunStatus is its own: the hub learns it from its heartbeat.

    def _claim(self, node: int, ranks: Iterable[int], all_or_none: bool = True
               ) -> list[int] | None:
        """The ranks of `ranks` node `node` may speak for: its own, or nobody's yet
        (then its own from now on); never node 0's, nor another node's. With
        `all_or_none`, None unless all (a summary is refused whole). A refused
        claim is counted (rejected `not_its_rank`) and said once per node."""
        local = set(self.local_ranks())
        ranks = sorted(ranks)
        mine = [r for r in ranks if r not in local and self.owner.get(r, node) == node]
        if len(mine) < len(ranks):
            taken = [r for r in ranks if r not in mine]
            if not all_or_none:  # a heartbeat's refused ranks are counted here
                self.relay.reject(NOT_ITS_RANK)
            if node not in self.warned:
                self.warned.add(node)
                whose = ", ".join(f"rank {r} (node {0 if r in local else self.owner[r]}'s)"
                                  for r in taken[:4])
                self._say(node, "warning", f"node {node} spoke for {whose}: refused, a node "
                          "speaks only for its own ranks (counted: rejected.not_its_rank)")
            if all_or_none:
                return None
        for r in mine:
            self.owner[r] = node
        return mine

    # -- the hub's loop ------------------------------------------------------------
    def check(self) -> None:
        """Nodes silent for NODE_TIMEOUT_S made unreachable; looked at most every
        CHECK_EVERY_S (a loop pass per message, thousands of nodes each time, was
        a third of a core at 2,048 nodes)."""
        now = time.monotonic()
        if now - self.checked < CHECK_EVERY_S:
            return
        self.checked = now
        for seen in self.nodes.values():
            if seen.state == UP and now - seen.beat > NODE_TIMEOUT_S:
                seen.state = UNREACHABLE
                self._say(seen.node, "warning",
                          f"node {seen.node} ({seen.host or '?'}) unreachable: no heartbeat "
                          f"for {NODE_TIMEOUT_S:g} s (ranks {self._ranks(seen)})")

    def missing(self) -> list[int]:
        """Nodes never heard from."""
        return [k for k in range(1, self.config.nnodes) if k not in self.nodes]

    def settled(self) -> bool:
        """Every node has said how it ended, or is unreachable."""
        return not self.missing() and all(
            s.state in (DONE, UNREACHABLE, LOST) for s in self.nodes.values())

    def lose_unreachable(self) -> list[NodeSeen]:
        lost = []
        for seen in self.nodes.values():
            if seen.state == UNREACHABLE:
                seen.state = LOST
                self._say(seen.node, "error", f"node {seen.node} ({seen.host or '?'}) lost: "
                          f"its daemon stopped answering (ranks {self._ranks(seen)})")
                lost.append(seen)
        return lost

    def ranks_of(self, seen: NodeSeen) -> list[int]:
        """Node `seen`'s ranks: its heartbeat's, and those it has spoken for (a node
        lost before a heartbeat listed its ranks has forwarded their messages)."""
        return sorted(set(seen.ranks) | {r for r, n in self.owner.items() if n == seen.node})

    def _ranks(self, seen: NodeSeen) -> str:
        return ", ".join(map(str, self.ranks_of(seen))) or "unknown"

    def _say(self, node: int, type: Any, message: str, traceback: str | None = None) -> None:
        seen = self.nodes.get(node)
        news = (wire.node_news(node, seen.state, self.ranks_of(seen), seen.host) if seen
                else wire.node_news(node, UP, [], ""))
        self.relay.emit(wire.Event, type=type, message=message, node=news, traceback=traceback)
