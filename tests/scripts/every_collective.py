"""Two gloo ranks that enter every collective zero-code mode sees, once each, then
a few asynchronous ones, then a barrier that rank 1 comes to WAIT_S late.
One optimizer step after each part (3 steps). `all_reduce` is also taken by
name before the process group exists, as a script may.

    torchrun --nproc-per-node 2 tests/scripts/every_collective.py
"""

import os
import time

import torch
import torch.distributed as dist
from torch.distributed import all_reduce as all_reduce_by_name

WAIT_S = float(os.environ.get("WAIT_S", "3"))


def f32(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.float32)  # 4 bytes each


def every_collective(rank: int) -> None:
    """17 collectives, 272 bytes (the object collectives' own tensor collectives
    are part of them)."""
    dist.all_reduce(f32(4))  # 16 bytes
    dist.broadcast(f32(4), src=0)  # 16
    dist.reduce(f32(4), dst=0)  # 16
    dist.all_gather([f32(4), f32(4)], f32(4))  # 32
    dist.all_gather_into_tensor(f32(8), f32(4))  # 32
    dist.reduce_scatter(f32(4), [f32(4), f32(4)])  # 32
    dist.reduce_scatter_tensor(f32(4), f32(8))  # 32
    dist.gather(f32(4), [f32(4), f32(4)] if rank == 0 else None, dst=0)  # 16
    dist.scatter(f32(4), [f32(4), f32(4)] if rank == 0 else None, src=0)  # 16
    dist.all_to_all([f32(4), f32(4)], [f32(4), f32(4)])  # 32
    dist.all_to_all_single(f32(8), f32(8))  # 32
    dist.barrier()
    dist.monitored_barrier()
    dist.all_gather_object([None, None], {"rank": rank})
    dist.broadcast_object_list([rank], src=0)
    dist.gather_object(rank, [None, None] if rank == 0 else None, dst=0)
    out: list[object] = [None]
    dist.scatter_object_list(out, [1, 2] if rank == 0 else None, src=0)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    every_collective(rank)
    step()
    works = [dist.all_reduce(f32(4), async_op=True), dist.broadcast(f32(4), 0, async_op=True),
             dist.barrier(async_op=True)]  # 32 bytes
    for work in works:
        work.wait()
    all_reduce_by_name(f32(4))  # 16
    step()
    if rank == 1:
        time.sleep(WAIT_S)  # rank 0 waits in the barrier meanwhile
    dist.barrier()
    step()
    dist.barrier()  # leave together
    dist.destroy_process_group()
