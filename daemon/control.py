"""Asking a run's daemon something: `status`, `snapshot`, `stop`, `ping`.

One REQ socket per request, a deadline, and no linger: a daemon that is gone
or wedged costs the caller `timeout_s`, never a hang. A reply that is not a
msgpack map counts as no answer; its fields are the caller's to validate.
`decode_map` is the one decoder of what a control socket carries, both ways.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import zmq

from ddtop.daemon import wire
from ddtop.daemon.keys import KEYS_ENV, RunKeys, needs_keys, peer_keys

# How long `ddtrain stop` and ddtop's `x` wait for the daemon to accept a stop.
STOP_REQUEST_TIMEOUT_S = 5.0


_map_decoder = msgspec.msgpack.Decoder(dict[str, Any])


def decode_map(body: bytes) -> dict[str, Any]:
    """A request or a reply off a control socket: a msgpack map with string keys.
    Raises ValueError for anything else (bad UTF-8, nesting too deep, ...)."""
    try:
        return _map_decoder.decode(body)
    except wire.UNTRUSTED_ERRORS as e:
        raise ValueError(wire.why_refused(e)) from None


class Unreachable(Exception):
    """The daemon did not answer in time (it is gone, or not yet listening)."""


def request(endpoint: str, op: str, timeout_s: float = 2.0, *,
            keys: RunKeys | Path | None = None, **args: Any) -> dict[str, Any]:
    """`op` with `args` to the daemon at `endpoint`: its reply. Over TCP the run's
    CURVE keys are needed: `keys` (loaded, or a keys folder), else DDTOP_KEYS; a
    damaged key file is a UsageError naming it, raised before any socket is made."""
    run_keys = peer_keys(endpoint, keys)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = context.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        if run_keys is not None:
            run_keys.client(sock)
        sock.connect(endpoint)
        sock.send(msgspec.msgpack.encode({"op": op, **args}))
        reply = decode_map(sock.recv())
    except zmq.Again:
        hint = ""
        if needs_keys(endpoint) and keys is None and not os.environ.get(KEYS_ENV):
            hint = (" (a daemon on TCP answers only peers holding the run's keys: set "
                    f"{KEYS_ENV} to a copy of the run's keys folder)")
        raise Unreachable(f"no answer from {endpoint} within {timeout_s:g} s{hint}") from None
    except zmq.ZMQError as e:
        raise Unreachable(f"{endpoint}: {e}") from None
    except ValueError:
        raise Unreachable(f"{endpoint} answered something that is not a ddtrain reply"
                          ) from None
    finally:
        sock.close()
    return reply
