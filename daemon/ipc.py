"""The relay's ipc sockets on one machine: the owner-only folder they live in, and
which process sent a frame (ZeroMQ says it over ipc: the relay believes a rank's frames
only from that rank's process)."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import zmq

# Room for an ipc socket's path: a unix socket address holds 107 bytes and a NUL.
IPC_PATH_MAX = 100
SOCKET_NAMES = ("telemetry", "publish", "control")


def peer_pid(frame: zmq.Frame) -> int | None:
    """The pid of the process that sent `frame` over ipc (ZeroMQ's Peer-Address
    there ends ':uid:gid:pid'); None where the platform does not say."""
    try:
        address = frame.get("Peer-Address")
    except zmq.ZMQError:
        return None
    if not isinstance(address, str):
        return None
    pid = address.rpartition(":")[2]
    return int(pid) if pid.isdigit() and int(pid) > 0 else None


def peer(frame: zmq.Frame, identity: bytes) -> str:
    """Who sent a request, for per-client limits: its process over ipc (the kernel
    says), its address over TCP, else its connection."""
    pid = peer_pid(frame)
    if pid is not None:
        return f"pid {pid}"
    with contextlib.suppress(zmq.ZMQError):
        address = frame.get("Peer-Address")
        if isinstance(address, str) and address:
            return address
    return identity.hex()


def private_folder(preferred: Path | None) -> tuple[Path, bool]:
    """An owner-only folder for the ipc sockets: `preferred` when a socket path
    in it fits a unix socket address, else a new one under the temp folder;
    True when the folder is new and the relay's own to remove."""
    if preferred is not None:
        preferred = preferred.absolute()
        if len(str(preferred / max(SOCKET_NAMES, key=len)).encode()) <= IPC_PATH_MAX:
            preferred.mkdir(mode=0o700, exist_ok=True)
            preferred.chmod(0o700)
            return preferred, False
    return Path(tempfile.mkdtemp(prefix="ddtop-")), True
