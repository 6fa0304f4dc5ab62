"""A plain 2-rank DDP loop that, like Lightning, all-reduces a flag tensor before
every batch (Lightning broadcasts its SIGTERM flag there): the collective a rank
waits in when another is slow between its optimizer step and the next batch.

    ddtrain start -n 2 tests/scripts/flag_loop.py --steps 300
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(args.steps):
        stop = torch.zeros(1)
        dist.all_reduce(stop)  # does any rank want to stop?
        if stop.item():
            break
        x, y = torch.randn(16, 32, generator=generator), torch.randn(16, 4, generator=generator)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.barrier()  # leave together: gloo can abort a rank whose peer is already gone
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
