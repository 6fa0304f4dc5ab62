"""A Lightning script with no ddtop line, whose steps take a known time in each
phase: the model's forward FORWARD_S, its backward BACKWARD_S, and the
optimizer's update UPDATE_S (SGD's, stretched by a step post-hook of the
optimizer's own: a stand-in for a large model's update). Lightning steps its
optimizer as `optimizer.step(closure)`, forward and backward inside the step.

    ddtrain start -n 2 tests/scripts/closure_lightning.py --steps 8
    ddtrain start -n 2 tests/scripts/closure_lightning.py --steps 8 --plain

Under ddtrain start (torchrun's environment) Lightning joins the ranks it is
given: Trainer(accelerator="cpu", devices=2, strategy="ddp"). --plain: the
same model and optimizer in a plain DDP loop, without Lightning (--closure:
stepped as `optimizer.step(closure)` too).
"""

import argparse
import time
from typing import Any

import torch
from torch import nn

FORWARD_S, BACKWARD_S, UPDATE_S = 0.03, 0.03, 0.008


class Slow(torch.autograd.Function):
    """The identity, taking FORWARD_S forward and BACKWARD_S backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        time.sleep(FORWARD_S)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(BACKWARD_S)
        return grad


class SlowLayer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = Slow.apply(x)
        return out


def network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1), SlowLayer())


def optimizer_of(parameters: Any) -> torch.optim.Optimizer:
    optimizer = torch.optim.SGD(parameters, lr=0.01)
    optimizer.register_step_post_hook(lambda *_: time.sleep(UPDATE_S))
    return optimizer


def loss_of(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(net(x), y)


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 16, generator=generator), torch.randn(32, 1, generator=generator))
            for _ in range(steps)]


def plain(steps: int, closure: bool) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    model = DDP(network())
    optimizer = optimizer_of(model.parameters())
    for x, y in batches(steps):

        def step(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            optimizer.zero_grad()
            loss = loss_of(model, x, y)
            loss.backward()
            return loss

        if closure:
            optimizer.step(step)  # (positionally)
        else:
            step()
            optimizer.step()
    dist.destroy_process_group()


def lightning(steps: int) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = network()

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor],
                          index: int) -> torch.Tensor:
            return loss_of(self.net, *batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return optimizer_of(self.parameters())

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Regression(), DataLoader(batches(steps), batch_size=None))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--closure", action="store_true",
                        help="--plain: optimizer.step(closure), as Lightning steps")
    args = parser.parse_args()
    if args.plain:
        plain(args.steps, args.closure)
    else:
        lightning(args.steps)
