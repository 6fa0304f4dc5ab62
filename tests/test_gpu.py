"""The CUDA paths: nccl on one GPU, and gloo with CUDA tensors on 2 ranks.
Skipped where no GPU is visible (CI has none)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import ddtrain

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
SMALL = ("--epochs", "1", "--synthetic-train-samples", "1024", "--batch-size", "64")


def test_nccl_one_rank_on_the_gpu(tmp_path: Path) -> None:
    run = ddtrain("start", "--foreground", "-n", "1", "--backend", "nccl", *SMALL, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "backend nccl on cuda" in run.stdout
    assert run.leftovers == []


def test_gloo_with_cuda_tensors_two_ranks(tmp_path: Path) -> None:
    run = ddtrain("start", "--foreground", "-n", "2", "--backend", "gloo", "--device", "cuda",
                  *SMALL, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "backend gloo on cuda" in run.stdout
    assert run.leftovers == []


def test_auto_picks_nccl_when_every_rank_has_a_gpu(tmp_path: Path) -> None:
    ranks = str(torch.cuda.device_count())
    run = ddtrain("start", "--foreground", "-n", ranks, "--batch-size", "64",
                  "--epochs", "1", "--synthetic-train-samples", "1024", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "backend nccl on cuda" in run.stdout
