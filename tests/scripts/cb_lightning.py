"""A Lightning run with ddtop's callback, as its rank under `ddtrain start -n 2`
or torchrun (Lightning finds torchrun's environment and spawns nothing):

    ddtrain start -n 2 tests/scripts/cb_lightning.py -- --batches 40 --accumulate 2

BATCHES training batches per rank, ACCUMULATE of them per optimizer step, one
epoch; a validation at its end (and the sanity check before it), each of
which waits EVAL_S in the module's on_validation_start, where no DDP forward
runs: only the callback says that this is evaluation. The training step's
loss is exactly 3.0 (an MSE's gradients, its value replaced), and the module
logs the MSE itself as `train_mse` and `val_mse`. `--no-callback`: the same
run without the callback (zero-code alone); `--bench`: no validation, no wait,
and the seconds of `trainer.fit` printed as `FIT_S <seconds>` by rank 0.
"""

import argparse
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from ddtop.lightning import DdtopCallback

BATCH = 8
LR = 0.05
LOSS = 3.0


class Regression(L.LightningModule):
    def __init__(self, eval_s: float, width: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(),
                                       torch.nn.Linear(width, 1))
        self.eval_s = eval_s

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        mse = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_mse", mse)
        return mse - mse.detach() + LOSS  # the MSE's gradients, the value LOSS

    def on_validation_start(self) -> None:
        time.sleep(self.eval_s)  # outside any forward: zero-code alone sees no evaluation

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> None:
        x, y = batch
        self.log("val_mse", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=40, help="training batches per rank")
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--eval-s", type=float, default=1.3)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--no-callback", action="store_true")
    parser.add_argument("--bench", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    world = 2
    train = TensorDataset(torch.randn(args.batches * BATCH * world, 16),
                          torch.randn(args.batches * BATCH * world, 1))
    val = TensorDataset(torch.randn(2 * BATCH * world, 16), torch.randn(2 * BATCH * world, 1))
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy="ddp", max_epochs=1,
        accumulate_grad_batches=args.accumulate, num_sanity_val_steps=0 if args.bench else 1,
        limit_val_batches=0 if args.bench else 2,
        callbacks=[] if args.no_callback else [DdtopCallback()],
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False)
    model = Regression(0.0 if args.bench else args.eval_s, args.width)
    start = time.perf_counter()
    trainer.fit(model, DataLoader(train, batch_size=BATCH), DataLoader(val, batch_size=BATCH))
    if args.bench and trainer.global_rank == 0:
        print(f"FIT_S {time.perf_counter() - start:.6f}", flush=True)


if __name__ == "__main__":
    main()
