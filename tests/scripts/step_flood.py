"""A user's script with a thread that calls `ddtop.step()` in a tight loop
while the main thread trains a small DDP model for STEPS steps of about 20 ms.
Each rank prints `TRAINED STEPS steps in S s`.

usage: ddtrain start -n 2 step_flood.py -- STEPS
"""

from __future__ import annotations

import sys
import threading
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddtop


def flood() -> None:
    while True:
        ddtop.step()


def main() -> None:
    steps = int(sys.argv[1])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = ddtop.watch(DDP(torch.nn.Linear(16, 16)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    threading.Thread(target=flood, daemon=True).start()  # runs until the process exits
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
        time.sleep(0.02)
    print(f"TRAINED {steps} steps in {time.perf_counter() - start:.2f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
