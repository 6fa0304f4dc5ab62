"""A single-machine run's rendezvous, on loopback only.

torch's env:// rendezvous makes rank 0 host a TCPStore on MASTER_PORT, and it
listens on every interface whatever MASTER_ADDR says; gloo's connections
between ranks listen on the address the host name resolves to. For a run
whose ranks the daemon starts on this machine (MASTER_ADDR a loopback
address) nothing needs to be reachable from elsewhere, so before the program
starts, each rank:

- binds the store's socket itself, on MASTER_ADDR alone (rank 0), and hosts
  the store there through TCPStore's `master_listen_fd`;
- sets TORCHELASTIC_USE_AGENT_STORE, so that `init_process_group()` (ours, or
  a user's script's, unchanged) makes every rank a client of that store, as
  under torchrun's agent;
- sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to the loopback interface
  unless the user set them.

Across machines (`--launcher torchrun`, or the user's own torchrun) torch's
sockets are torch's: docs/security.md says what they expose.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta

from torch.distributed import TCPStore  # type: ignore[attr-defined]  # not in the stubs

AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
LOOPBACK_INTERFACE = "lo"
STORE_TIMEOUT = timedelta(minutes=30)  # the server's; clients wait as init_process_group says

_hosted: TCPStore | None = None  # rank 0's store, alive as long as the rank


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def loopback_only(rank: int, world_size: int, master_addr: str, master_port: int) -> None:
    """Before the program runs in a rank the daemon started: keep the rendezvous
    and the ranks' own connections on loopback (nothing when MASTER_ADDR is not
    a loopback address)."""
    global _hosted
    if not is_loopback(master_addr):
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_INTERFACE)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK_INTERFACE)
    os.environ[AGENT_STORE_ENV] = "True"
    if rank != 0:
        return
    host = "127.0.0.1" if master_addr == "localhost" else master_addr
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, master_port))
    except OSError as e:
        listener.close()
        raise RuntimeError(f"the rendezvous port {host}:{master_port} cannot be bound "
                           f"({e.strerror}): start again, or pick another --master-port"
                           ) from None
    listener.listen(max(128, world_size))
    _hosted = TCPStore(master_addr, master_port, world_size, True, timeout=STORE_TIMEOUT,
                       wait_for_workers=False, master_listen_fd=listener.detach())
