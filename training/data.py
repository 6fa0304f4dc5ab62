"""Datasets, samplers and loaders.

- `synthetic`: built in, deterministic by seed, learnable; no download.
- `mnist`, `fashion-mnist`, `cifar10`: torchvision's own classes, read from
  --data-dir (and fetched there with --download, by one process per machine).
- Training uses DistributedSampler (set_epoch every epoch); validation uses
  ShardSampler, which gives every sample to exactly one rank: no padding, no drops.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from ddtop.core.config import TrainConfig
from ddtop.core.contract import UsageError
from ddtop.training.distributed import RankEnv

Batch = tuple[torch.Tensor, ...]  # (images, labels)


@dataclass(frozen=True)
class DataSpec:
    """Shape of one sample, which the model is built for."""

    channels: int
    size: int
    classes: int


SYNTHETIC_SPEC = DataSpec(channels=1, size=28, classes=10)
# Pixel noise relative to the class signal: high enough that the task takes a
# few epochs to learn, low enough that the loss falls within the first one.
SYNTHETIC_NOISE = 5.0


def synthetic_dataset(n: int, seed: int, split: str) -> TensorDataset:
    """n images of SYNTHETIC_SPEC: a smooth random pattern per class plus noise.

    The class patterns depend only on the seed, so train and val share them;
    the samples of each split come from their own generator stream.
    """
    spec = SYNTHETIC_SPEC
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(spec.classes, spec.channels, 7, 7, generator=g)
    patterns = F.interpolate(coarse, size=(spec.size, spec.size), mode="bilinear",
                             align_corners=False)
    patterns = patterns / patterns.std(dim=(1, 2, 3), keepdim=True)
    g = torch.Generator().manual_seed(seed * 1_000_003 + (1 if split == "train" else 2))
    labels = torch.randint(spec.classes, (n,), generator=g)
    # Each sample shows its pattern at a random strength, so some are hard.
    strength = torch.rand(n, 1, 1, 1, generator=g) * 0.8 + 0.2
    images = patterns[labels] * strength + SYNTHETIC_NOISE * torch.randn(
        n, spec.channels, spec.size, spec.size, generator=g
    )
    # Scaled to about unit variance per pixel, like normalised real images.
    return TensorDataset(images / (1 + SYNTHETIC_NOISE**2) ** 0.5, labels)


# name -> (torchvision class name, folder it creates under --data-dir, spec, mean, std)
TORCHVISION = {
    "mnist": ("MNIST", "MNIST", DataSpec(1, 28, 10), (0.1307,), (0.3081,)),
    "fashion-mnist": ("FashionMNIST", "FashionMNIST", DataSpec(1, 28, 10), (0.2860,), (0.3530,)),
    "cifar10": ("CIFAR10", "cifar-10-batches-py", DataSpec(3, 32, 10),
                (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}


def torchvision_dataset(name: str, root: Path, train: bool, download: bool) -> Dataset[Batch]:
    import torchvision
    from torchvision import transforms

    cls_name, folder, _, mean, std = TORCHVISION[name]
    cls = getattr(torchvision.datasets, cls_name)
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    try:
        dataset: Dataset[Batch] = cls(root=str(root), train=train, download=download,
                                      transform=transform)
    except (RuntimeError, OSError) as e:
        # torchvision raises RuntimeError both for missing files and for failed
        # downloads (after trying every mirror), OSError for unreadable files.
        if download:
            raise UsageError(
                f"could not download {name} into {root}: {e}; put the files in "
                f"{root / folder} by hand and run again without --download"
            ) from None
        raise UsageError(
            f"{name} not found or unreadable in {root / folder} ({e}): pass --download, "
            f"or point --data-dir at the folder that holds {folder}/"
        ) from None
    return dataset


def build_datasets(config: TrainConfig,
                   env: RankEnv) -> tuple[Dataset[Batch], Dataset[Batch], DataSpec]:
    """(train, val, spec). With --download, local rank 0 fetches and the others wait."""
    if config.dataset == "synthetic":
        train: Dataset[Batch] = synthetic_dataset(config.synthetic_train_samples, config.seed,
                                                  "train")
        val: Dataset[Batch] = synthetic_dataset(config.synthetic_val_samples, config.seed, "val")
        return train, val, SYNTHETIC_SPEC
    root = Path(config.data_dir)
    spec = TORCHVISION[config.dataset][2]
    if config.download:
        if env.local_rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            torchvision_dataset(config.dataset, root, train=True, download=True)
            torchvision_dataset(config.dataset, root, train=False, download=True)
        # Intentional sync point: the other ranks read only once the files are there.
        dist.barrier()
    return (
        torchvision_dataset(config.dataset, root, train=True, download=False),
        torchvision_dataset(config.dataset, root, train=False, download=False),
        spec,
    )


class ShardSampler(Sampler[int]):
    """Every index exactly once across ranks: rank r takes r, r+W, r+2W, ...

    Unlike DistributedSampler it neither pads nor drops, so ranks may get one
    sample more or less; fine for evaluation, which runs no collective per batch.
    """

    def __init__(self, n: int, num_replicas: int, rank: int) -> None:
        self.n, self.num_replicas, self.rank = n, num_replicas, rank

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.n, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.n, self.num_replicas))


class SkipSampler(Sampler[int]):
    """The first `skip` indices of a sampler left out: how a resumed epoch picks up."""

    def __init__(self, sampler: DistributedSampler[int], skip: int) -> None:
        self.sampler, self.skip = sampler, skip

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.sampler)[self.skip:])

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skip)


def train_sampler(dataset: Dataset[Batch], config: TrainConfig,
                  env: RankEnv) -> DistributedSampler[int]:
    return DistributedSampler(dataset, num_replicas=env.world_size, rank=env.rank,
                              shuffle=True, seed=config.seed, drop_last=False)


def steps_per_epoch(sampler: DistributedSampler[int], batch_per_rank: int) -> int:
    return -(-len(sampler) // batch_per_rank)


def train_loader(dataset: Dataset[Batch], sampler: DistributedSampler[int], config: TrainConfig,
                 env: RankEnv, epoch: int, skip_steps: int, pin: bool) -> DataLoader[Batch]:
    """This epoch's loader: `sampler.set_epoch(epoch)` must already have been called."""
    order: Sampler[int] = SkipSampler(sampler, skip_steps * config.batch_per_rank)
    # The loader draws a seed for its workers from this generator, not from the
    # global RNG, so dropout randomness does not depend on how loaders are made
    # (which differs between a resumed run and one that never stopped).
    generator = torch.Generator().manual_seed(config.seed * 7919 + epoch * 131 + env.rank)
    return DataLoader(dataset, batch_size=config.batch_per_rank, sampler=order,
                      num_workers=config.workers_per_rank, pin_memory=pin,
                      generator=generator, drop_last=False)


def val_loader(dataset: Dataset[Batch], config: TrainConfig, env: RankEnv,
               pin: bool) -> DataLoader[Batch]:
    assert isinstance(dataset, Sized)
    sampler = ShardSampler(len(dataset), env.world_size, env.rank)
    return DataLoader(dataset, batch_size=config.batch_per_rank, sampler=sampler,
                      num_workers=config.workers_per_rank, pin_memory=pin,
                      generator=torch.Generator().manual_seed(config.seed))
