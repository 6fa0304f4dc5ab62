"""A training script with no ddtop line: gloo DDP on a linear model.

STEPS optimizer steps (default 20), SLEEP seconds after each; DIE_RANK and
DIE_STEP: that rank kills itself with SIGKILL after that step (a crash);
RAISE_RANK and RAISE_STEP: that rank raises a RuntimeError there instead.
EPOCHS: the STEPS are that many epochs of a DataLoader over a DistributedSampler,
set_epoch'd at each (without it: random batches, no sampler); with it,
LOADER_SLEEP_RANK, LOADER_SLEEP_BATCH and LOADER_SLEEP_S: that rank's dataset
sleeps that long fetching the first item of that batch (counted from 1)."""

import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

dist.init_process_group("gloo")
rank = dist.get_rank()
model = DistributedDataParallel(torch.nn.Linear(16, 16))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
die_rank, die_step = int(os.environ.get("DIE_RANK", "-1")), int(os.environ.get("DIE_STEP", "0"))
steps, epochs = int(os.environ.get("STEPS", "20")), int(os.environ.get("EPOCHS", "0"))


class Data(TensorDataset):
    """A TensorDataset whose LOADER_SLEEP_BATCH-th batch is slow on LOADER_SLEEP_RANK."""

    fetched = 0

    def __getitem__(self, index):
        Data.fetched += 1
        if (rank == int(os.environ.get("LOADER_SLEEP_RANK", "-1"))
                and Data.fetched == 8 * (int(os.environ["LOADER_SLEEP_BATCH"]) - 1) + 1):
            time.sleep(float(os.environ["LOADER_SLEEP_S"]))
        return super().__getitem__(index)


def batches():
    if not epochs:
        for _ in range(steps):
            yield torch.randn(8, 16)
        return
    data = Data(torch.randn(8 * dist.get_world_size() * (steps // epochs), 16))
    sampler = DistributedSampler(data)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for (x,) in DataLoader(data, batch_size=8, sampler=sampler):
            yield x


for step, x in enumerate(batches(), 1):
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()
    if rank == die_rank and step == die_step:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == int(os.environ.get("RAISE_RANK", "-1")) and step == int(os.environ["RAISE_STEP"]):
        raise RuntimeError(f"bad batch at step {step}")
    time.sleep(float(os.environ.get("SLEEP", "0")))
dist.destroy_process_group()
