"""Asking a run's daemon something: `status`, `snapshot`, `stop`, `ping`.

One REQ socket per request, a deadline, and no linger: a daemon that is gone
or wedged costs the caller `timeout_s`, never a hang.
"""

from __future__ import annotations

from typing import Any

import msgspec
import zmq


class Unreachable(Exception):
    """The daemon did not answer in time (it is gone, or not yet listening)."""


def request(endpoint: str, op: str, timeout_s: float = 2.0, **args: Any) -> dict[str, Any]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = context.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(endpoint)
        sock.send(msgspec.msgpack.encode({"op": op, **args}))
        reply: dict[str, Any] = msgspec.msgpack.decode(sock.recv())
    except zmq.Again:
        raise Unreachable(f"no answer from {endpoint} within {timeout_s:g} s") from None
    except zmq.ZMQError as e:
        raise Unreachable(f"{endpoint}: {e}") from None
    finally:
        sock.close()
    return reply
