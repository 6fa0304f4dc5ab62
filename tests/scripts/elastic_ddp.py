"""A training script with no ddtop line, for torchrun --max-restarts: gloo DDP on a
linear model; STEPS optimizer steps (default 20), SLEEP seconds after each.
DIE_RANK and DIE_STEP: that rank kills itself with SIGKILL after that step, in
torchrun's first attempt only (TORCHELASTIC_RESTART_COUNT 0), so the restart
trains to the end.

Each attempt's process group keys are kept apart in torchrun's store (a prefix
per attempt): its agent keeps one store across restarts, and a new attempt would
otherwise read the last one's gloo addresses and fail to connect."""

import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
store = dist.PrefixStore(f"attempt-{attempt}", dist.TCPStore(
    os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False))
dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]),
                        world_size=int(os.environ["WORLD_SIZE"]))
rank = dist.get_rank()
model = DistributedDataParallel(torch.nn.Linear(16, 16))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
die_rank, die_step = int(os.environ.get("DIE_RANK", "-1")), int(os.environ.get("DIE_STEP", "0"))
for step in range(1, int(os.environ.get("STEPS", "20")) + 1):
    optimizer.zero_grad()
    model(torch.randn(8, 16)).square().mean().backward()
    optimizer.step()
    if rank == die_rank and step == die_step and attempt == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(float(os.environ.get("SLEEP", "0")))
dist.destroy_process_group()
