"""The CUDA paths: nccl on one GPU, and gloo with CUDA tensors on 2 ranks; the
all-reduce timed with CUDA events, for the built-in trainer and a user's own
script; a loss left on the GPU. Skipped where no GPU is visible (CI has none)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ddtrain

from ddtop.core import journal, wire

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
SMALL = ("--epochs", "1", "--synthetic-train-samples", "1024", "--batch-size", "64")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def headless_one_rank(tmp_path: Path, run_id: str, *args: str) -> dict[str, Any]:
    """`ddtrain start --foreground --headless --format jsonl -n 1 ARGS`: its summary,
    after checking that it succeeded and left no process."""
    run = ddtrain("start", "--foreground", "--headless", "--format", "jsonl", "-n", "1",
                  "--run-id", run_id, *args, cwd=tmp_path, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.leftovers == []
    summary = json.loads(run.stdout.splitlines()[-1])
    assert (summary["kind"], summary["status"]) == ("summary", "succeeded"), summary
    return summary


def sent_steps(run_root: Path) -> list[wire.Step]:
    return [m for r in journal.read(run_root / "telemetry.journal")
            if isinstance(m := wire.decode([r.frame]), wire.Step)]


def assert_timed_on_the_gpu(summary: dict[str, Any], steps: list[wire.Step]) -> None:
    """The all-reduce was timed (CUDA events on the comm hook's stream), in the
    last window and in the run's Step messages, and memory was read off the GPU."""
    (rank,) = summary["ranks"]
    assert rank["comm_share"] and rank["comm_share"] > 0, rank
    assert sum(s.comm_ops for s in steps) >= summary["global_step"] > 0
    assert sum(s.comm_s for s in steps) > 0
    assert all(s.comm_s <= s.step_s for s in steps), steps
    assert any(s.cuda_allocated for s in steps), steps


def test_nccl_one_rank_on_the_gpu(tmp_path: Path) -> None:
    run = ddtrain("start", "--foreground", "-n", "1", "--backend", "nccl", *SMALL, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "backend nccl on cuda" in run.stdout
    assert "starting run" in run.stdout and " with 1 rank in " in run.stdout
    assert run.leftovers == []


def test_nccl_built_in_trainer_times_its_all_reduce_with_cuda_events(tmp_path: Path) -> None:
    summary = headless_one_rank(tmp_path, "nccl", "--backend", "nccl", *SMALL)
    assert summary["global_step"] == 1024 // 64
    assert_timed_on_the_gpu(summary, sent_steps(tmp_path / "runs/nccl"))


def test_a_users_script_on_the_gpu_counts_steps_times_comm_and_reads_a_gpu_loss(
        tmp_path: Path) -> None:
    """examples/gpt_accum.py picks nccl and cuda:LOCAL_RANK itself; its loss is a
    CUDA tensor handed to ddtop.step, summed on the GPU and read by the sender
    thread."""
    iters = 20
    summary = headless_one_rank(
        tmp_path, "gpt", str(EXAMPLES / "gpt_accum.py"), "--", "--max-iters", str(iters),
        "--grad-accum", "4", "--eval-interval", "10", "--eval-iters", "20")
    assert summary["global_step"] == iters
    (rank,) = summary["ranks"]
    assert rank["loss"] is not None and rank["loss"] > 0, rank
    steps = sent_steps(tmp_path / "runs/gpt")
    assert sum(s.steps for s in steps) == iters
    assert all(s.loss_weight and s.loss_sum > 0 for s in steps if s.steps), steps
    assert_timed_on_the_gpu(summary, steps)


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
    the same model is timed: tests/test_api.py.) The API alone (DDTOP_ZERO_CODE=off):
    zero-code mode attaches the timer as the model is built, before any hook."""
    import socket
    import sys
    import time

    from helpers import collecting, finish, start

    from ddtop.core import wire

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
                          {"DDTOP_TELEMETRY": collector.endpoint, "PORT": str(port),
                           "DDTOP_ZERO_CODE": "off"})
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
