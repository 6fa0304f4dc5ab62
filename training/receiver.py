"""Whether a ddtop receiver answers at an endpoint: what `ddtop.init(strict=True)`
asks before a script trains unwatched (training/api.py)."""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message

from ddtop.core.keys import secure


def receiver_answers(endpoint: str, timeout_s: float) -> str | None:
    """None when a ZeroMQ PULL socket at `endpoint` completes a handshake with a
    PUSH within `timeout_s` (that is what "a daemon answers" means: no
    collective, no request); else why not, in one line."""
    context = zmq.Context()
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        try:
            secure(sock, endpoint, None)
            sock.connect(endpoint)
        except zmq.ZMQError as e:
            return f"DDTOP_TELEMETRY={endpoint!r} is not a ZeroMQ endpoint ({e})"
        if monitor.poll(int(timeout_s * 1000)):
            event = recv_monitor_message(monitor)
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return None
        return f"no ddtop receiver answered at {endpoint} within {timeout_s:g} s"
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        context.term()
