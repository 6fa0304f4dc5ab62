"""A Hugging Face Accelerate loop with ddtop's three lines, as its rank under
`ddtrain start -n 2` or `ddtrain watch -- accelerate launch`, on CPU:

    ddtrain start -n 2 tests/scripts/cb_accelerate.py -- --batches 32 --accumulate 2

BATCHES batches per rank, ACCUMULATE per optimizer step (`accelerator.accumulate`).
The three lines: `ddtop.init` (the totals), `ddtop.step` once per optimizer
step (when `accelerator.sync_gradients`), `ddtop.log`. `--plain`: without them
(zero-code alone). The loss is exactly 3.0 (an MSE's gradients, its value replaced).
"""

import argparse

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import ddtop

BATCH = 8
LOSS = 3.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=32, help="batches per rank")
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--plain", action="store_true", help="no ddtop line")
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulate)
    world = accelerator.num_processes
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(args.batches * BATCH * world, 16),
                         torch.randn(args.batches * BATCH * world, 1))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, DataLoader(data, batch_size=BATCH, shuffle=True))
    if not args.plain:
        ddtop.init(total_steps=len(loader) // args.accumulate)
    for x, y in loader:
        with accelerator.accumulate(model):
            mse = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(mse - mse.detach() + LOSS)
            optimizer.step()
            optimizer.zero_grad()
            if accelerator.sync_gradients and not args.plain:
                ddtop.step(loss=LOSS, samples=len(x) * args.accumulate)
                ddtop.log(mse=mse.detach())
    accelerator.end_training()


if __name__ == "__main__":
    main()
