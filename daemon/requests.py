"""What the daemon answers on its control socket: one request, one reply.

    ping      the run id, the relay's sequence number, the endpoints
    status    the run's summary (daemon/summary.py)
    snapshot  the whole RunState, for a dashboard that just subscribed
    stop      {"timeout": S}: stop gracefully, terminating what is left after S
    stacks    {"rank": K or nil}: the ranks write their stacks (ddtrain stacks)
    node      a node daemon's heartbeat, answered by the hub (daemon/nodes.py)

A request is a msgpack map with a string `op` (control.decode_map); anything
else, and any value of the wrong kind, is answered with {"ok": false, "error":
...} and counted in `RunState.rejected["bad_request"]`. The answer only records
what was asked (a stop's timeout, the ranks asked for stacks): the supervisor
acts on it at its next tick, in its own loop.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from ddtop.daemon import control
from ddtop.daemon.state import encode_snapshot

if TYPE_CHECKING:
    from ddtop.daemon.relay import Relay

MAX_REQUEST_BYTES = 16384  # a node daemon's heartbeat lists its ranks
MAX_STACKS_REQUESTS = 16  # asked between two ticks of the supervisor; more are answered, not kept
OPS = "ping, status, snapshot, stop or stacks"


def answer(relay: Relay, body: bytes) -> dict[str, Any]:
    """The reply to one request `body` received by `relay`."""
    if len(body) > MAX_REQUEST_BYTES:
        relay.reject("bad_request")
        return {"ok": False, "error": "request too large"}
    try:
        request = control.decode_map(body)
    except ValueError:
        request = {}
    op = request.get("op")
    if not isinstance(op, str):
        relay.reject("bad_request")
        return {"ok": False, "error": "expected a msgpack map with a string 'op'"}
    if op == "ping":
        return {"ok": True, "run": relay.run, "seq": relay.seq, "endpoints": relay.endpoints}
    if op == "status":
        return {"ok": True, "seq": relay.seq, "summary": relay.state.summary(time.time())}
    if op == "snapshot":
        return {"ok": True, "seq": relay.seq, "state": encode_snapshot(relay.state)}
    if op == "stop":
        timeout = request.get("timeout", 30.0)
        if (not isinstance(timeout, int | float) or isinstance(timeout, bool)
                or not math.isfinite(timeout) or timeout < 0):
            return {"ok": False, "error": "timeout must be a number of seconds >= 0"}
        if relay.stop_request is None:
            relay.stop_request = float(timeout)
        return {"ok": True, "status": "stopping"}
    if op == "node" and relay.hub is not None:  # a node daemon's heartbeat
        reply: dict[str, Any] = relay.hub.request(request)
        return reply
    if op == "stacks":
        rank = request.get("rank")
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)
                                 or not 0 <= rank < (relay.world_size or 1 << 16)):
            return {"ok": False, "error": "rank must be a rank of this run"}
        if len(relay.stacks_requests) < MAX_STACKS_REQUESTS:
            relay.stacks_requests.append(rank)
        return {"ok": True}
    relay.reject("bad_request")
    return {"ok": False, "error": f"unknown op {op[:40]!r}: {OPS}"}
