"""Two ranks that never communicate: each trains its own copy of a small model
and never initialises a process group (what Accelerate does without `cpu=True`
on a machine with no GPU). STEPS optimizer steps (default 30).

    ddtrain start -n 2 tests/scripts/train_alone.py
"""

import os

import torch
from torch import nn

if __name__ == "__main__":
    steps = int(os.environ.get("STEPS", "30"))
    torch.manual_seed(int(os.environ.get("RANK", "0")))
    model = nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        x, y = torch.randn(32, 16), torch.randn(32, 1)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
