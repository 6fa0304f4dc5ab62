"""Process-group set-up and tear-down: which device, which backend, and a context
manager that always destroys the group."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ddtop.core.config import TrainConfig
from ddtop.core.contract import UsageError
from ddtop.training.rendezvous import in_use, port_drill, port_taken

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
    taken = port_drill(env.rank)  # --inject 0:take-port: held until init fails
    try:
        dist.init_process_group(
            backend,
            rank=env.rank,
            world_size=env.world_size,
            timeout=COLLECTIVE_TIMEOUT,
            device_id=device if device.type == "cuda" else None,
        )
    except dist.DistNetworkError as e:
        if in_use(e):
            raise port_taken(os.environ.get("MASTER_PORT")) from None
        raise
    finally:
        if taken is not None:
            taken.close()
    try:
        yield
    finally:
        dist.destroy_process_group()
