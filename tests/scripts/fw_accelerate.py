"""A plain Hugging Face Accelerate loop (no ddtop line): `Accelerator(cpu=True,
gradient_accumulation_steps=2)`, a small MLP on random data, STEPS optimizer
steps (default 8) of two batches each. Run by torchrun or `ddtrain start -n 2`,
each rank is one process of Accelerate's multi-CPU set-up (a gloo group, DDP);
between two optimizer steps a rank enters no collective before the second
batch's gradient all-reduce.

    ddtrain start -n 2 tests/scripts/fw_accelerate.py
"""

import os

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

ACCUMULATE = 2
BATCH = 8

if __name__ == "__main__":
    steps = int(os.environ.get("STEPS", "8"))
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    rows = steps * ACCUMULATE * BATCH * accelerator.num_processes
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(rows, 16), torch.randn(rows, 1))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, DataLoader(data, batch_size=BATCH, shuffle=True))
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    accelerator.end_training()
