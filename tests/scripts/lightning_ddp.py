"""A Lightning script with no ddtop line: Trainer(devices=2, strategy="ddp") run
as `python lightning_ddp.py`, which spawns its second rank itself. STEPS
optimizer steps (default 6)."""

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
    steps = int(os.environ.get("STEPS", "6"))
    data = TensorDataset(torch.randn(64 * steps, 16), torch.randn(64 * steps, 1))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Regression(), DataLoader(data, batch_size=32))
