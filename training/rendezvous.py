"""A single-machine run's rendezvous, on loopback only.

torch's env:// rendezvous makes rank 0 host a TCPStore on MASTER_PORT, and it
listens on every interface whatever MASTER_ADDR says; gloo's connections
between ranks listen on the address the host name resolves to. For a run
whose ranks the daemon starts on this machine (MASTER_ADDR a loopback
address) nothing needs to be reachable from elsewhere, so each such rank,
before the program starts (`install`):

- sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to the loopback interface
  unless the user set them;
- wraps `torch.distributed.init_process_group`: a call that rendezvouses
  through env:// at the MASTER_ADDR and MASTER_PORT the daemon gave (the
  program has not changed them) finds the store hosted by rank 0 on
  MASTER_ADDR alone (rank 0 binds the socket itself and hands it to TCPStore
  as `master_listen_fd`), every rank a client of it, as under torchrun's agent
  (TORCHELASTIC_USE_AGENT_STORE, for that call only). A port the daemon picked
  that another process bound first is PortTaken (`port_taken`): the daemon
  picks another and starts the ranks again; a port the user gave is bad input.

A program that sets MASTER_ADDR or MASTER_PORT itself (tutorial scripts do),
or passes its own init_method or store, rendezvouses as it would without
ddtop (rank 0's store then listens as torch makes it): the same decision in
every rank, since every rank runs the same code.
Across machines (`--launcher torchrun`, or the user's own torchrun) torch's
sockets are torch's: docs/security.md says what they expose.
"""

from __future__ import annotations

import errno
import functools
import os
import socket
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # not in the stubs

from ddtop.core import inject
from ddtop.core.config import is_loopback
from ddtop.core.contract import ATTEMPT_ENV, FAULT_ENV, PORT_PICKED_ENV, PortTaken, UsageError

AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
LOOPBACK_INTERFACE = "lo"
STORE_TIMEOUT = timedelta(minutes=30)  # the server's; clients wait as init_process_group says

_hosted: TCPStore | None = None  # rank 0's store, alive as long as the rank
_drilled = False  # --inject 0:take-port acted in this process
_original_init = dist.init_process_group


def install(rank: int, world_size: int, master_addr: str, master_port: int) -> None:
    """Before the program runs in a rank the daemon started: keep the rendezvous
    and the ranks' own connections on loopback (nothing when MASTER_ADDR is not
    a loopback address)."""
    if not is_loopback(master_addr):
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_INTERFACE)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK_INTERFACE)
    wrapped = _on_loopback(_original_init, rank, world_size, master_addr, master_port)
    dist.init_process_group = wrapped
    dist.distributed_c10d.init_process_group = wrapped


def _on_loopback(init: Callable[..., Any], rank: int, world_size: int, master_addr: str,
                 master_port: int) -> Callable[..., Any]:
    @functools.wraps(init)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        init_method = kwargs.get("init_method", args[1] if len(args) > 1 else None)
        ours = (init_method in (None, "env://") and kwargs.get("store") is None
                and os.environ.get("MASTER_ADDR") == master_addr
                and os.environ.get("MASTER_PORT") == str(master_port)
                and AGENT_STORE_ENV not in os.environ)
        if not ours:
            return init(*args, **kwargs)  # the program's own rendezvous, untouched
        if rank == 0:
            taken = port_drill(rank)  # --inject 0:take-port: held until the bind fails
            try:
                host_store(master_addr, master_port, world_size)
            except dist.DistNetworkError as e:
                if in_use(e):  # the daemon's pick starts the ranks again; the user's is said
                    raise port_taken(master_port) from None
                raise
            finally:
                if taken is not None:
                    taken.close()
        os.environ[AGENT_STORE_ENV] = "True"
        try:
            return init(*args, **kwargs)
        finally:
            del os.environ[AGENT_STORE_ENV]

    return init_process_group


def host_store(master_addr: str, master_port: int, world_size: int) -> None:
    """Rank 0: the rendezvous store, listening on `master_addr` alone (once)."""
    global _hosted
    if _hosted is not None:
        return
    listener = listen_on(master_addr, master_port, world_size)
    _hosted = TCPStore(master_addr, master_port, world_size, True, timeout=STORE_TIMEOUT,
                       wait_for_workers=False, master_listen_fd=listener.detach())


def listen_on(address: str, port: int, backlog: int = 128) -> socket.socket:
    """A TCP socket listening on `address` alone (`localhost`: 127.0.0.1) at `port`
    (0: one the system picks), for a TCPStore to serve on (`master_listen_fd`)."""
    host = "127.0.0.1" if address == "localhost" else address
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as e:
        listener.close()
        raise dist.DistNetworkError(
            f"the rendezvous port {host}:{port} cannot be bound: {e.strerror}") from None
    listener.listen(max(128, backlog))
    return listener


def in_use(error: Exception) -> bool:
    """Whether a rendezvous error says its port is bound by another process."""
    text = str(error)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def port_taken(port: str | int | None) -> Exception:
    """Rank 0 found MASTER_PORT in use: PortTaken where the daemon picked it
    (PORT_PICKED_ENV: it picks another and starts the ranks again, not the user's
    doing), else bad input naming the fix."""
    if os.environ.get(PORT_PICKED_ENV) == "1":
        return PortTaken(f"port {port} (MASTER_PORT), which the daemon picked, was bound by "
                         "another process before rank 0 could bind it")
    return UsageError(f"port {port} (MASTER_PORT) is already in use: pick another "
                      "--master-port, or leave it out to use a free one")


def port_drill(rank: int) -> socket.socket | None:
    """`--inject 0:take-port` (the first attempt, rank 0): MASTER_PORT bound here,
    first, as another process would, so that rank 0's own bind fails. Once a
    process: the built-in trainer's process group and the loopback rendezvous
    under it both ask."""
    global _drilled
    value = os.environ.get(FAULT_ENV)
    if _drilled or not value or os.environ.get(ATTEMPT_ENV, "0") != "0" or not any(
            d.action == "take-port" for d in inject.for_rank(inject.parse_environ(value), rank)):
        return None
    _drilled = True
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        holder.bind((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
    except OSError as e:
        holder.close()
        if e.errno != errno.EADDRINUSE:
            raise
        # Another process took it first: the drill's end, without the drill.
        print(f"ddtop drill 0:take-port: port {os.environ['MASTER_PORT']} was already "
              "taken by another process", file=sys.stderr, flush=True)
        return None
    holder.listen(1)
    print(f"ddtop drill 0:take-port: port {os.environ['MASTER_PORT']} bound before rank 0's "
          "rendezvous", file=sys.stderr, flush=True)
    return holder
