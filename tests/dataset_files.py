"""Tiny datasets written in the real on-disk formats torchvision reads."""

from __future__ import annotations

import hashlib
import pickle
import struct
from pathlib import Path

import torch


def write_idx(path: Path, array: torch.Tensor) -> None:
    """The IDX format of MNIST: magic (0, 0, dtype 0x08 = ubyte, ndim), dims, data."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = struct.pack(">BBBB", 0, 0, 0x08, array.dim()) + b"".join(
        struct.pack(">I", d) for d in array.shape)
    path.write_bytes(header + array.to(torch.uint8).numpy().tobytes())


def write_mnist_like(root: Path, folder: str, n_train: int = 20, n_test: int = 10) -> None:
    g = torch.Generator().manual_seed(0)
    raw = root / folder / "raw"
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        write_idx(raw / f"{prefix}-images-idx3-ubyte",
                  torch.randint(0, 256, (n, 28, 28), generator=g))
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", torch.arange(n) % 10)



def write_cifar(root: Path, n: int = 4) -> dict[str, str]:
    """CIFAR-10's python pickles (data: N x 3072 uint8, labels: list); returns md5s."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    md5 = {}
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for i, name in enumerate(names):
        batch = {"data": torch.full((n, 3072), i * 10, dtype=torch.uint8).numpy(),
                 "labels": [(i + j) % 10 for j in range(n)]}
        (folder / name).write_bytes(pickle.dumps(batch))
        md5[name] = hashlib.md5((folder / name).read_bytes()).hexdigest()
    meta = {"label_names": [f"class{i}" for i in range(10)]}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta))
    md5["batches.meta"] = hashlib.md5((folder / "batches.meta").read_bytes()).hexdigest()
    return md5
