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


def test_watch_on_a_gpu_model_with_a_hook_already_says_so_once(tmp_path: Path) -> None:
    """On a GPU ddtop times DDP with its comm hook (CUDA events), which cannot join
    a hook registered before watch: it says so once, and never raises. (On CPU
    the same model is timed: tests/test_api.py.)"""
    import socket
    import sys
    import time

    from helpers import collecting, finish, start

    from ddtop.daemon import wire

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "train.py"
    script.write_text(
        "import os, torch, torch.distributed as dist, ddtop\n"
        "from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=os.environ['PORT'])\n"
        "dist.init_process_group('nccl', rank=0, world_size=1)\n"
        "torch.cuda.set_device(0)\n"
        "model = DDP(torch.nn.Linear(4, 2).cuda(), device_ids=[0])\n"
        "model.register_comm_hook(None, allreduce_hook)\n"
        "ddtop.watch(model)\n"
        "ddtop.watch(model)\n"
        "ddtop.watch(torch.nn.Linear(2, 2))\n"
        "model(torch.ones(1, 4, device='cuda')).sum().backward()\n"
        "dist.destroy_process_group()\n")
    with collecting() as collector:
        proc, tag = start([sys.executable, str(script)], tmp_path,
                          {"DDTOP_TELEMETRY": collector.endpoint, "PORT": str(port)})
        run = finish(proc, tag, 120)
        assert run.returncode == 0, run.stderr
        deadline = time.monotonic() + 10
        while not collector.of(wire.Bye) and time.monotonic() < deadline:
            time.sleep(0.05)
    warnings = [e.message for e in collector.of(wire.Event) if e.type == "warning"]
    assert len(warnings) == 2, warnings
    assert "comm timing unavailable: the model already has a comm hook (allreduce_hook)" in (
        warnings[0])
    assert "Linear is not DistributedDataParallel" in warnings[1]
