"""What the daemon answers on its control socket: one request, one reply.

    ping      the run id, the relay's sequence number, the endpoints
    status    the run's summary (core/summary.py)
    snapshot  the whole RunState, for a dashboard that just subscribed
    stop      {"timeout": S}: stop gracefully, terminating what is left after S
    stacks    {"rank": K or nil}: the ranks write their stacks (ddtrain stacks)
    node      a node daemon's heartbeat, answered by the hub (daemon/nodes.py)

The requests and replies are typed (core/protocol.py), decoded by the socket's
one decoder (a hub's also takes `node`). What is not a request of a kind the
socket takes is answered with {"ok": false, "error": ...} and counted in
`RunState.rejected["bad_request"]`; a known request with an argument of the wrong
kind or out of range is answered so too, not counted. The answer only records
what was asked (a stop's timeout, the ranks asked for stacks): the supervisor
acts on it at its next tick, in its own loop.
"""

from __future__ import annotations

import time
from typing import Protocol, assert_never

from ddtop.core import protocol
from ddtop.core.state import RunState, encode_snapshot

MAX_STACKS_REQUESTS = 16  # asked between two ticks of the supervisor; more are answered, not kept


class Answering(Protocol):
    """What a request is answered from and may change: the relay (daemon/relay.py)."""

    run: str
    seq: int
    state: RunState
    world_size: int | None
    stop_request: float | None
    stacks_requests: list[int | None]
    focus_requests: dict[int, float]  # rank -> monotonic time its focus ends
    hub: protocol.NodeHub | None

    @property
    def endpoints(self) -> dict[str, str]: ...

    def reject(self, reason: str) -> None: ...


def answer(relay: Answering, body: bytes) -> protocol.Reply:
    """The reply to one request `body` received by `relay`."""
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
        case protocol.Stop(timeout=timeout):
            if relay.stop_request is None:
                relay.stop_request = timeout
            return protocol.StopReply(ok=True, status="stopping")
        case protocol.Stacks(rank=rank):
            if rank is not None and relay.world_size and rank >= relay.world_size:
                return protocol.refused(protocol.Stacks.refusal)
            if len(relay.stacks_requests) < MAX_STACKS_REQUESTS:
                relay.stacks_requests.append(rank)
            return protocol.Reply(ok=True)
        case protocol.Focus(rank=rank):
            if relay.world_size and rank >= relay.world_size:
                return protocol.refused(protocol.Focus.refusal)
            now = time.monotonic()
            for old in [r for r, until in relay.focus_requests.items() if until <= now]:
                del relay.focus_requests[old]
            if rank in relay.focus_requests or len(relay.focus_requests) < protocol.MAX_FOCUS:
                relay.focus_requests[rank] = now + protocol.FOCUS_S
            return protocol.Reply(ok=True)
        case protocol.NodeHeartbeat():
            assert relay.hub is not None  # only a hub's decoder takes it
            return relay.hub.request(request)
        case _:
            assert_never(request)
