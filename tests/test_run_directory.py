"""What a successful run leaves behind, and what it prints."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ReferenceRun


@pytest.mark.processes
def test_exit_code_output_and_nothing_left_behind(reference_run: ReferenceRun) -> None:
    run = reference_run.run
    assert run.returncode == 0
    assert run.leftovers == []
    assert "ddtrain: run ref succeeded" in run.stdout
    assert "[rank 0] epoch 2/2 done" in run.stdout
    assert "first step done" in run.stdout
    assert "Traceback" not in run.stdout + run.stderr


@pytest.mark.processes
def test_run_directory_layout(reference_run: ReferenceRun) -> None:
    root = reference_run.root
    config = json.loads((root / "config.json").read_text())
    assert config["world_size"] == 2 and config["run_id"] == "ref"
    status = json.loads((root / "run.json").read_text())
    assert status["status"] == "succeeded" and status["exit_code"] == 0
    assert [r["exit_code"] for r in status["ranks"]] == [0, 0]
    assert all(r["pid"] > 0 for r in status["ranks"])
    for rank in (0, 1):
        assert (root / "logs" / f"rank-{rank}.log").is_file()
        assert not (root / "logs" / f"rank-{rank}.error.json").exists()
    assert "epoch 1/2 done" in (root / "logs" / "rank-0.log").read_text()
    # 16 steps with a checkpoint after each; the epoch-end checkpoints share the
    # global step of the epoch's last step and replace it.
    names = sorted(p.name for p in (root / "checkpoints").iterdir())
    assert names == [f"step-{s:08d}.pt" for s in range(1, 17)]


@pytest.mark.processes
def test_checkpoint_contents(reference_run: ReferenceRun) -> None:
    state = torch.load(reference_run.root / "checkpoints" / "step-00000008.pt", weights_only=True)
    # Written at the end of epoch 1: resume starts epoch 2 at its first step.
    assert (state["epoch"], state["step"], state["global_step"]) == (1, 0, 8)
    assert state["sampler_epoch"] == 1
    assert len(state["rng"]) == 2  # one RNG state per rank
    assert state["config"]["model"] == "mlp"
    assert set(state["optimizer"]) == {"state", "param_groups"}
    mid = torch.load(reference_run.root / "checkpoints" / "step-00000011.pt", weights_only=True)
    assert (mid["epoch"], mid["step"]) == (1, 3)
    assert mid["train_totals"]["samples"] == 3 * 32
