"""Multi-GPU training with DDP, written the way the PyTorch tutorial teaches it:
torchrun starts one process per device, each process joins the group from the
environment torchrun sets, a DistributedSampler gives each rank its share of the
data, and rank 0 saves a snapshot every few epochs that a restarted job resumes
from. On a machine without CUDA it trains on the CPU over gloo.

    torchrun --standalone --nproc-per-node 2 examples/ddp_tutorial.py --epochs 10
    ddtrain start -n 2 --max-restarts 2 examples/ddp_tutorial.py -- --epochs 10

The four lines marked `# ddtop` add the loss, progress and the checkpoint
phase to ddtop's dashboard; without DDTOP_TELEMETRY they do nothing.
"""

import argparse
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import ddtop  # ddtop


class SyntheticRegression(Dataset):
    """`size` pairs (x, y) with y a fixed linear function of x plus noise: the same
    data on every rank (one seed), so the sampler's split is what differs."""

    def __init__(self, size: int, in_features: int = 20) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, in_features, generator=generator)
        weight = torch.randn(in_features, 1, generator=generator)
        self.y = self.x @ weight + 0.1 * torch.randn(size, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader,
        optimizer: torch.optim.Optimizer,
        save_every: int,
        snapshot_path: str,
    ) -> None:
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        if torch.cuda.is_available():
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cpu")
        self.model = model.to(self.device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = Path(snapshot_path)
        if self.snapshot_path.exists():
            print(f"[rank{self.global_rank}] Loading snapshot")
            self._load_snapshot(self.snapshot_path)
        device_ids = [self.local_rank] if self.device.type == "cuda" else None
        self.model = DDP(self.model, device_ids=device_ids)

    def _load_snapshot(self, snapshot_path: Path) -> None:
        snapshot = torch.load(snapshot_path, map_location=self.device)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"[rank{self.global_rank}] Resuming training from snapshot at Epoch "
              f"{self.epochs_run}")

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        ddtop.step(loss=loss, samples=len(source))  # ddtop
        return loss.detach()

    def _run_epoch(self, epoch: int) -> None:
        print(f"[rank{self.global_rank}] Epoch {epoch} | Batchsize: "
              f"{self.train_data.batch_size} | Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        total = torch.zeros((), device=self.device)
        for source, targets in self.train_data:
            source = source.to(self.device)
            targets = targets.to(self.device)
            total += self._run_batch(source, targets)
        # This rank's mean loss: not synchronised with the other ranks.
        mean = total.item() / len(self.train_data)
        print(f"[rank{self.global_rank}] Epoch {epoch} | Loss {mean:.6f}")

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {
            "MODEL_STATE": self.model.module.state_dict(),
            "OPTIMIZER_STATE": self.optimizer.state_dict(),
            "EPOCHS_RUN": epoch + 1,
        }
        # Written aside and renamed: a rank killed while saving leaves the old snapshot.
        partial = self.snapshot_path.with_name(self.snapshot_path.name + ".tmp")
        torch.save(snapshot, partial)
        partial.replace(self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int) -> None:
        ddtop.init(total_steps=max_epochs * len(self.train_data), epochs=max_epochs)  # ddtop
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.global_rank == 0 and (epoch + 1) % self.save_every == 0:
                with ddtop.phase("checkpoint"):  # ddtop
                    self._save_snapshot(epoch)


def ddp_setup() -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        init_process_group(backend="nccl")
    else:
        init_process_group(backend="gloo")


def load_train_objs(dataset_size: int) -> tuple[Dataset, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial weights everywhere (DDP broadcasts rank 0's anyway)
    train_set = SyntheticRegression(dataset_size)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        pin_memory=torch.cuda.is_available(),
        shuffle=False,
        sampler=DistributedSampler(dataset),
    )


def main(save_every: int, total_epochs: int, batch_size: int, dataset_size: int,
         snapshot_path: str) -> None:
    ddp_setup()
    dataset, model, optimizer = load_train_objs(dataset_size)
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("--epochs", type=int, default=10, help="total epochs to train the model")
    parser.add_argument("--save-every", type=int, default=2,
                        help="how often (in epochs) to save a snapshot")
    parser.add_argument("--batch-size", type=int, default=32,
                        help="input batch size on each device (default: 32)")
    parser.add_argument("--dataset-size", type=int, default=2048,
                        help="samples in the synthetic dataset, all ranks together")
    parser.add_argument("--snapshot-path", default="snapshot.pt",
                        help="where rank 0 saves snapshots, and every rank resumes from")
    args = parser.parse_args()
    main(args.save_every, args.epochs, args.batch_size, args.dataset_size, args.snapshot_path)
