"""Asking a run's daemon something: `status`, `snapshot`, `stop`, `ping`, `stacks`.

One REQ socket per request, a deadline, and no linger: a daemon that is gone
or wedged costs the caller `timeout_s`, never a hang. The request and its reply
are typed (core/protocol.py); a reply that is not the one the request
expects counts as no answer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import overload

import zmq

from ddtop.core import protocol
from ddtop.core.keys import KEYS_ENV, RunKeys, needs_keys, peer_keys

# How long `ddtrain stop` and ddtop's `x` wait for the daemon to accept a stop.
STOP_REQUEST_TIMEOUT_S = 5.0


class Unreachable(Exception):
    """The daemon did not answer in time (it is gone, or not yet listening)."""


Keys = RunKeys | Path | None


@overload
def request(endpoint: str, message: protocol.Ping, timeout_s: float = ..., *,
            keys: Keys = ...) -> protocol.PingReply: ...
@overload
def request(endpoint: str, message: protocol.Status, timeout_s: float = ..., *,
            keys: Keys = ...) -> protocol.StatusReply: ...
@overload
def request(endpoint: str, message: protocol.Snapshot, timeout_s: float = ..., *,
            keys: Keys = ...) -> protocol.SnapshotReply: ...
@overload
def request(endpoint: str, message: protocol.Stop, timeout_s: float = ..., *,
            keys: Keys = ...) -> protocol.StopReply: ...
@overload
def request(endpoint: str, message: protocol.Stacks | protocol.Evidence | protocol.Focus,
            timeout_s: float = ..., *, keys: Keys = ...) -> protocol.Reply: ...
def request(endpoint: str, message: protocol.AnyRequest, timeout_s: float = 2.0, *,
            keys: Keys = None) -> protocol.Reply:
    """`message` to the daemon at `endpoint`: its reply, of the kind the request
    expects (protocol.REPLIES). Over TCP the run's CURVE keys are needed: `keys`
    (loaded, or a keys folder), else DDTOP_KEYS; a damaged key file is a UsageError
    naming it, raised before any socket is made."""
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
        sock.send(protocol.encode(message))
        reply = protocol.decode_reply(protocol.REPLIES[type(message)], sock.recv())
    except zmq.Again:
        hint = ""
        if needs_keys(endpoint) and keys is None and not os.environ.get(KEYS_ENV):
            hint = (" (a daemon on TCP answers only peers holding the run's keys: set "
                    f"{KEYS_ENV} to a copy of the run's keys folder)")
        raise Unreachable(f"no answer from {endpoint} within {timeout_s:g} s{hint}") from None
    except zmq.ZMQError as e:
        raise Unreachable(f"{endpoint}: {e}") from None
    except protocol.ProtocolError:
        raise Unreachable(f"{endpoint} answered something that is not a ddtrain reply"
                          ) from None
    finally:
        sock.close()
    return reply
