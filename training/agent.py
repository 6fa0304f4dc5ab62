"""torchrun's agent as ddtrain's daemon starts it (`--launcher torchrun`, and every
node of a multi-node job): `torch.distributed.run`, with the stores the agent hosts
listening on the rendezvous address alone when that address is loopback.

torch's TCPStore server listens on every interface whatever host it is given, and
the agent hosts two: the c10d rendezvous store (at --rdzv-endpoint, on the node
that hosts it) and the store it shares with its workers (MASTER_ADDR and
MASTER_PORT, at --local-addr of the node whose ranks come first). The daemon
starts this module in place of `python -m torch.distributed.run`, with the same
arguments; when the rendezvous is on loopback it also gives `--local-addr` that
loopback address (every node is on this machine then), and each store this agent
hosts at a loopback address listens there alone, on a socket bound here and
handed to TCPStore (`master_listen_fd`), as rank 0's store of a single-machine
run does (rendezvous.py). Any other address: as torch makes it.
"""

from __future__ import annotations

import sys
from typing import Any

from torch.distributed import TCPStore  # type: ignore[attr-defined]  # not in the stubs
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous

from ddtop.core.config import is_loopback
from ddtop.training.rendezvous import listen_on


def store(host_name: str, port: int, *, is_master: bool = False, **kwargs: Any) -> Any:
    """TCPStore(...) as torch's rendezvous calls it (the rest by keyword); a server
    at a loopback address listens on that address alone."""
    if not is_master or not is_loopback(host_name) or "master_listen_fd" in kwargs:
        return TCPStore(host_name, port, is_master=is_master, **kwargs)
    listener = listen_on(host_name, port)
    return TCPStore(host_name, listener.getsockname()[1], is_master=True,
                    master_listen_fd=listener.detach(), **kwargs)


def _shared_store(self: Any, master_addr: str, master_port: int) -> Any:
    """DynamicRendezvousHandler._create_tcp_store_server: the store the workers share."""
    return store(host_name=master_addr, port=master_port, is_master=True, multi_tenant=True)


def install() -> None:
    """Route the agent's store servers through `store` (both places torch makes them)."""
    handler = dynamic_rendezvous.DynamicRendezvousHandler
    if not (hasattr(c10d_rendezvous_backend, "TCPStore")
            and hasattr(handler, "_create_tcp_store_server")):
        raise SystemExit("ddtop: this torch's rendezvous makes its stores where ddtop cannot "
                         "keep them on loopback: use torch 2.4 or later")
    c10d_rendezvous_backend.TCPStore = store
    handler._create_tcp_store_server = _shared_store  # type: ignore[method-assign]


def main() -> None:
    install()
    from torch.distributed.run import main as torchrun_main

    sys.argv[0] = "torchrun"
    torchrun_main()


if __name__ == "__main__":
    main()
