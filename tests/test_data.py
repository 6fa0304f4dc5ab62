"""Datasets and samplers, in one process: the built-in dataset, torchvision's
real on-disk formats, and how samples are shared out between ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchvision
from dataset_files import write_cifar, write_mnist_like
from torch import nn
from torch.utils.data import DistributedSampler

from ddtop.core.config import TrainConfig
from ddtop.core.contract import UsageError
from ddtop.training.data import (
    SYNTHETIC_SPEC,
    ShardSampler,
    SkipSampler,
    build_datasets,
    synthetic_dataset,
)
from ddtop.training.distributed import RankEnv
from ddtop.training.models import build_model

ONE_RANK = RankEnv(rank=0, local_rank=0, world_size=1, local_world_size=1)


# -- the built-in dataset ---------------------------------------------------------

def test_synthetic_is_deterministic_by_seed() -> None:
    a, b, c = (synthetic_dataset(64, s, "train").tensors for s in (1, 1, 2))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    train, val = synthetic_dataset(64, 1, "train"), synthetic_dataset(64, 1, "val")
    assert not torch.equal(train.tensors[0], val.tensors[0])
    assert train.tensors[0].shape == (64, 1, 28, 28)


def test_synthetic_loss_falls_within_the_first_epoch() -> None:
    config = TrainConfig()
    torch.manual_seed(0)
    x, y = synthetic_dataset(config.synthetic_train_samples, 0, "train").tensors  # one epoch
    model = build_model("mlp", SYNTHETIC_SPEC)
    opt = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9)
    losses = []
    for start in range(0, len(y), config.batch_size):
        loss = nn.functional.cross_entropy(model(x[start:start + 64]), y[start:start + 64])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    quarter = len(losses) // 4
    first, last = sum(losses[:quarter]) / quarter, sum(losses[-quarter:]) / quarter
    assert last < 0.7 * first, (first, last)
    vx, vy = synthetic_dataset(1024, 0, "val").tensors
    with torch.no_grad():
        accuracy = (model(vx).argmax(1) == vy).float().mean().item()
    assert 0.3 < accuracy < 0.99, accuracy  # learnable, not trivial


# -- samplers -----------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3, 8])
def test_training_partitions_are_disjoint_and_cover(world: int) -> None:
    data = list(range(96))
    parts = [list(DistributedSampler(data, num_replicas=world, rank=r, seed=5))  # type: ignore[arg-type]
             for r in range(world)]
    assert sorted(i for p in parts for i in p) == data
    assert len({len(p) for p in parts}) == 1  # equal step counts: no rank waits for another


def test_training_order_changes_between_epochs() -> None:
    sampler = DistributedSampler(list(range(64)), num_replicas=2, rank=0, seed=5)  # type: ignore[arg-type]
    sampler.set_epoch(0)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first
    sampler.set_epoch(0)
    assert list(sampler) == first


@pytest.mark.parametrize(("n", "world"), [(101, 2), (101, 8), (7, 8), (64, 4)])
def test_validation_sees_every_sample_exactly_once(n: int, world: int) -> None:
    seen = [i for r in range(world) for i in ShardSampler(n, world, r)]
    assert sorted(seen) == list(range(n))
    assert sum(len(ShardSampler(n, world, r)) for r in range(world)) == n


def test_skip_sampler_resumes_mid_epoch() -> None:
    sampler = DistributedSampler(list(range(40)), num_replicas=2, rank=1, seed=0)  # type: ignore[arg-type]
    sampler.set_epoch(3)
    full = list(sampler)
    skipped = SkipSampler(sampler, 6)
    assert list(skipped) == full[6:] and len(skipped) == len(full) - 6


# -- torchvision datasets in their real on-disk formats ------------------------------

@pytest.mark.parametrize(("dataset", "folder"), [("mnist", "MNIST"),
                                                 ("fashion-mnist", "FashionMNIST")])
def test_mnist_formats_load_through_torchvision(tmp_path: Path, dataset: str, folder: str) -> None:
    write_mnist_like(tmp_path, folder)
    config = TrainConfig(dataset=dataset, data_dir=str(tmp_path))  # type: ignore[arg-type]
    train, val, spec = build_datasets(config, ONE_RANK)
    assert (len(train), len(val)) == (20, 10)  # type: ignore[arg-type]
    image, label = train[3]
    assert image.shape == (1, 28, 28) and image.dtype == torch.float32
    assert label == 3 and spec.channels == 1
    assert image.min() < 0  # normalised with the dataset's mean and std


def test_cifar10_format_loads_through_torchvision(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    md5 = write_cifar(tmp_path)
    cifar = torchvision.datasets.CIFAR10
    # torchvision verifies the official files' checksums; point it at ours.
    monkeypatch.setattr(cifar, "train_list", [[n, md5[n]] for n, _ in cifar.train_list])
    monkeypatch.setattr(cifar, "test_list", [[n, md5[n]] for n, _ in cifar.test_list])
    monkeypatch.setitem(cifar.meta, "md5", md5["batches.meta"])
    config = TrainConfig(dataset="cifar10", data_dir=str(tmp_path))
    train, val, spec = build_datasets(config, ONE_RANK)
    assert (len(train), len(val)) == (20, 4)  # type: ignore[arg-type]
    image, label = train[5]
    assert image.shape == (3, 32, 32) and (spec.channels, spec.size) == (3, 32)
    assert label == (1 + 1) % 10


def test_missing_dataset_files_are_a_usage_error(tmp_path: Path) -> None:
    config = TrainConfig(dataset="mnist", data_dir=str(tmp_path))
    with pytest.raises(UsageError, match=r"mnist not found .*--download"):
        build_datasets(config, ONE_RANK)


@pytest.mark.parametrize("model", ["mlp", "cnn", "resnet18"])
@pytest.mark.parametrize("spec", [SYNTHETIC_SPEC, SYNTHETIC_SPEC.__class__(3, 32, 10)])
def test_models_fit_each_dataset_shape(model: str, spec) -> None:  # type: ignore[no-untyped-def]
    net = build_model(model, spec)
    out = net(torch.zeros(2, spec.channels, spec.size, spec.size))
    assert out.shape == (2, spec.classes)
