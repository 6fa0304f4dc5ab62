"""Process-group set-up and tear-down: which device, which backend, and a context
manager that always destroys the group."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ddtop.core import inject
from ddtop.core.config import TrainConfig
from ddtop.core.contract import (
    ATTEMPT_ENV,
    FAULT_ENV,
    PORT_PICKED_ENV,
    PortTaken,
    UsageError,
)

# How long a collective (and the rendezvous) may wait for a missing peer before
# raising. The daemon stops the other ranks as soon as one dies, so this only
# bounds a hang that nobody noticed.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class RankEnv:
    """Where this process sits in the job, read from torchrun's variables."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> RankEnv:
        required = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        missing = [k for k in required if k not in environ]
        if missing:
            raise UsageError(
                f"{', '.join(missing)} not set: run `python -m ddtop.training` under torchrun, "
                "or use `ddtrain start`"
            )
        world_size = int(environ["WORLD_SIZE"])
        return cls(
            rank=int(environ["RANK"]),
            local_rank=int(environ.get("LOCAL_RANK", environ["RANK"])),
            world_size=world_size,
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", world_size)),
        )

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(config: TrainConfig, env: RankEnv) -> torch.device:
    """cuda:<local rank> when every local rank can have its own GPU, else cpu.

    nccl needs a GPU per local rank; gloo can share GPUs (`--device cuda` with
    fewer GPUs than ranks puts rank k on GPU k mod count).
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if config.backend == "nccl" and gpus < env.local_world_size:
        raise UsageError(
            f"--backend nccl needs one GPU per local rank, but {gpus} GPU(s) are visible for "
            f"{env.local_world_size} local rank(s): use --backend gloo, or fewer ranks"
        )
    if config.device == "cuda" and gpus == 0:
        raise UsageError("--device cuda, but no GPU is visible: use --device cpu")
    if config.device == "cpu" or (config.device == "auto" and gpus < env.local_world_size):
        return torch.device("cpu")
    return torch.device("cuda", env.local_rank % gpus)


def resolve_backend(config: TrainConfig, device: torch.device) -> str:
    if config.backend != "auto":
        return config.backend
    return "nccl" if device.type == "cuda" else "gloo"


@contextmanager
def process_group(env: RankEnv, backend: str, device: torch.device) -> Iterator[None]:
    """Initialise the default group from MASTER_ADDR/MASTER_PORT; always destroy it."""
    if device.type == "cuda":
        # Before init: NCCL binds its communicator to the current device.
        torch.cuda.set_device(device)
    taken = _port_taken_drill(env.rank)  # --inject 0:take-port: held until init fails
    try:
        dist.init_process_group(
            backend,
            rank=env.rank,
            world_size=env.world_size,
            timeout=COLLECTIVE_TIMEOUT,
            device_id=device if device.type == "cuda" else None,
        )
    except dist.DistNetworkError as e:
        if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
            port = os.environ.get("MASTER_PORT")
            if os.environ.get(PORT_PICKED_ENV) == "1":  # the daemon's choice: its to redo
                raise PortTaken(f"port {port} (MASTER_PORT), which the daemon picked, was "
                                "bound by another process before rank 0 could bind it") from None
            raise UsageError(
                f"port {port} (MASTER_PORT) is already in use: pick another --master-port, "
                "or leave it out to use a free one"
            ) from None
        raise
    finally:
        if taken is not None:
            taken.close()
    try:
        yield
    finally:
        dist.destroy_process_group()


def _port_taken_drill(rank: int) -> socket.socket | None:
    """`--inject 0:take-port` (the first attempt, rank 0): MASTER_PORT bound here,
    first, as another process would, so that rank 0's own bind fails."""
    value = os.environ.get(FAULT_ENV)
    if not value or os.environ.get(ATTEMPT_ENV, "0") != "0" or not any(
            d.action == "take-port" for d in inject.for_rank(inject.parse_environ(value), rank)):
        return None
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
    holder.listen(1)
    print(f"ddtop drill 0:take-port: port {os.environ['MASTER_PORT']} bound before rank 0's "
          "rendezvous", file=sys.stderr, flush=True)
    return holder
