"""What the daemon answers on its control socket: one request, one reply.

    ping      the run id, the relay's sequence number, the endpoints
    status    the run's summary (core/summary.py)
    snapshot  the whole RunState, for a dashboard that just subscribed
    stop      {"timeout": S}: stop gracefully, terminating what is left after S
    stacks    {"rank": K or nil}: the ranks write their stacks (ddtrain stacks)
    evidence  the daemon gathers the evidence now (ddtrain evidence: daemon/evidence.py)
    node      a node daemon's heartbeat, answered by the hub (daemon/hub.py)

The requests and replies are typed (core/protocol.py), decoded by the socket's
one decoder (a hub's also takes `node`). What is not a request of a kind the
socket takes is answered with {"ok": false, "error": ...} and counted in
`RunState.rejected["bad_request"]`; a known request with an argument of the wrong
kind or out of range is answered so too, not counted. The answer only hands what
was asked, as the typed request, to `Asked`: the supervisor takes the stop,
stacks and evidence requests at its next tick, in its own loop (`Asked.take`), and a hub passes
the ranks open on a dashboard to the nodes (`Asked.focused`).
"""

from __future__ import annotations

import time
from typing import Protocol, assert_never

from ddtop.core import protocol
from ddtop.core.state import RunState, encode_snapshot

MAX_STACKS_REQUESTS = 16  # asked between two ticks of the supervisor; more are answered, not kept
# Focus, per peer (a process over ipc, an address over TCP): at most FOCUS_RATE requests
# a second (FOCUS_BURST at once; a dashboard asks every few seconds while a rank's
# detail is open), and at most FOCUS_PER_PEER ranks held, its newest; so that one
# client can neither hold every slot nor keep the daemon answering it.
FOCUS_RATE = 4.0
FOCUS_BURST = 8.0
FOCUS_PER_PEER = 4
MAX_PEERS = 1024  # peers remembered (the least recently heard from is forgotten)
FOCUS_FLOOD = "focus_rate"  # rejected: a focus request over its peer's rate

Taken = protocol.Stop | protocol.Stacks | protocol.Evidence


class Asked:
    """The requests the daemon acts on, kept for their owners as they came: a stop
    (the first one asked holds; later ones are answered, not kept), stacks (at most
    MAX_STACKS_REQUESTS between two takes), and focus (a rank's detail open on a
    dashboard, for FOCUS_S from its last request: `focus` maps each rank to the
    monotonic time it ends; each peer holds at most FOCUS_PER_PEER, asked at most
    FOCUS_RATE a second)."""

    def __init__(self) -> None:
        self._pending: list[Taken] = []
        self._stopped = False  # a stop was asked: the first holds
        self.focus: dict[int, float] = {}
        self.focus_by: dict[int, str] = {}  # rank -> the peer that holds it
        # peer -> (tokens, monotonic time they were counted), least recent first
        self._buckets: dict[str, tuple[float, float]] = {}

    def allowed(self, peer: str, now: float) -> bool:
        """Whether `peer` may ask for focus now (a token bucket of FOCUS_RATE a second,
        FOCUS_BURST deep); one token taken if so."""
        tokens, at = self._buckets.pop(peer, (FOCUS_BURST, now))
        tokens = min(FOCUS_BURST, tokens + (now - at) * FOCUS_RATE)
        if len(self._buckets) >= MAX_PEERS:
            del self._buckets[next(iter(self._buckets))]
        self._buckets[peer] = (tokens - 1 if tokens >= 1 else tokens, now)
        return tokens >= 1

    def put(self, request: Taken | protocol.Focus, now: float, peer: str = "") -> None:
        """Keep `request`, received at monotonic time `now` from `peer`."""
        match request:
            case protocol.Stop():
                if not self._stopped:
                    self._stopped = True
                    self._pending.append(request)
            case protocol.Stacks():
                if sum(isinstance(r, protocol.Stacks) for r in self._pending) < MAX_STACKS_REQUESTS:
                    self._pending.append(request)
            case protocol.Evidence():  # one between two takes: the next asker shares it
                if not any(isinstance(r, protocol.Evidence) for r in self._pending):
                    self._pending.append(request)
            case protocol.Focus(rank=rank):
                for old in [r for r, until in self.focus.items() if until <= now]:
                    del self.focus[old]
                    self.focus_by.pop(old, None)
                held = sorted((until, r) for r, until in self.focus.items()
                              if self.focus_by.get(r) == peer and r != rank)
                if len(held) >= FOCUS_PER_PEER:  # its oldest makes room
                    del self.focus[held[0][1]], self.focus_by[held[0][1]]
                if rank in self.focus or len(self.focus) < protocol.MAX_FOCUS:
                    self.focus[rank] = now + protocol.FOCUS_S
                    self.focus_by[rank] = peer

    def interrupt(self, timeout: float) -> None:
        """The daemon's own Ctrl-C: a stop with `timeout`, whatever was asked before."""
        self._pending = [r for r in self._pending if not isinstance(r, protocol.Stop)]
        self._stopped = True
        self._pending.append(protocol.Stop(timeout=timeout))

    def take(self) -> list[Taken]:
        """The stop, stacks and evidence requests kept since the last take, in order."""
        taken, self._pending = self._pending, []
        return taken

    def focused(self, now: float) -> list[int]:
        """The ranks open on a dashboard at monotonic time `now`, at most MAX_FOCUS."""
        return sorted(r for r, until in self.focus.items() if until > now)[:protocol.MAX_FOCUS]


class Answering(Protocol):
    """What a request is answered from and may change: the relay (daemon/relay.py)."""

    run: str
    seq: int
    state: RunState
    world_size: int | None
    asked: Asked
    hub: protocol.NodeHub | None

    @property
    def endpoints(self) -> dict[str, str]: ...

    def reject(self, reason: str) -> None: ...


def answer(relay: Answering, body: bytes, peer: str = "") -> protocol.Reply:
    """The reply to one request `body` received by `relay` from `peer` (its process
    or address, as the socket tells it)."""
    decoder = protocol.REQUESTS if relay.hub is None else protocol.HUB_REQUESTS
    try:
        request = decoder.decode(body)
    except protocol.BadRequest as e:
        if e.counted:
            relay.reject("bad_request")
        return protocol.refused(e.error)
    match request:
        case protocol.Ping():
            return protocol.PingReply(ok=True, run=relay.run, seq=relay.seq,
                                      endpoints=relay.endpoints)
        case protocol.Status():
            return protocol.StatusReply(ok=True, seq=relay.seq,
                                        summary=relay.state.summary(time.time()))
        case protocol.Snapshot():
            return protocol.SnapshotReply(ok=True, seq=relay.seq,
                                          state=encode_snapshot(relay.state))
        case protocol.Stop():
            relay.asked.put(request, time.monotonic())
            return protocol.StopReply(ok=True, status="stopping")
        case protocol.Stacks(rank=rank):
            if rank is not None and relay.world_size and rank >= relay.world_size:
                return protocol.refused(protocol.Stacks.refusal)
            relay.asked.put(request, time.monotonic())
            return protocol.Reply(ok=True)
        case protocol.Evidence():
            relay.asked.put(request, time.monotonic())
            return protocol.Reply(ok=True)
        case protocol.Focus(rank=rank):
            if relay.world_size and rank >= relay.world_size:
                return protocol.refused(protocol.Focus.refusal)
            now = time.monotonic()
            if not relay.asked.allowed(peer, now):
                relay.reject(FOCUS_FLOOD)
                return protocol.refused(f"focus asked too often: at most {FOCUS_RATE:g} a "
                                        "second from one client")
            relay.asked.put(request, now, peer)
            return protocol.Reply(ok=True)
        case protocol.NodeHeartbeat():
            assert relay.hub is not None  # only a hub's decoder takes it
            return relay.hub.request(request)
        case _:
            assert_never(request)
