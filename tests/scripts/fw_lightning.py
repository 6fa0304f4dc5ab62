"""A plain Lightning script (no ddtop line): Trainer(accelerator="cpu", devices=2,
strategy="ddp"), a linear regression on random data, STEPS optimizer steps
(default 8). Under `ddtrain start -n 2` (or torchrun) Lightning sees LOCAL_RANK
and spawns nothing; run as `python fw_lightning.py` it spawns its second rank.
Lightning broadcasts its SIGTERM flag before every batch: a collective of its own.

    ddtrain start -n 2 tests/scripts/fw_lightning.py
"""

import os

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


if __name__ == "__main__":
    steps = int(os.environ.get("STEPS", "8"))
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64 * steps, 16), torch.randn(64 * steps, 1))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Regression(), DataLoader(data, batch_size=32))
