"""DDP on 2 real gloo ranks against an independent single-process reference.

The reference below is written from scratch (plain loop, no DDP, no samplers of
ours): global batch B in one process must give the same weights after every
step, and the same global metrics, as 2 ranks with B/2 each.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ReferenceRun
from helpers import metric_records
from torch import nn

from ddtop.training.data import SYNTHETIC_SPEC, synthetic_dataset
from ddtop.training.models import build_model

pytestmark = pytest.mark.processes  # every test here starts processes, or shares a run that does

SEED, LR, BATCH, EPOCHS, TRAIN_N, VAL_N, SYNC_EVERY = 3, 0.05, 32, 2, 256, 101, 4


def load_weights(root: Path, global_step: int) -> dict[str, torch.Tensor]:
    state = torch.load(root / "checkpoints" / f"step-{global_step:08d}.pt", weights_only=True)
    weights: dict[str, torch.Tensor] = state["model"]
    return weights


class SingleProcess:
    """What one process with the whole batch computes, step by step."""

    def __init__(self) -> None:
        torch.manual_seed(SEED)
        self.model = build_model("mlp", SYNTHETIC_SPEC)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=0.9)
        self.train = synthetic_dataset(TRAIN_N, SEED, "train").tensors
        self.val = synthetic_dataset(VAL_N, SEED, "val").tensors
        self.syncs: list[dict[str, float]] = []  # what --sync-every should report
        self.per_epoch: list[dict[str, float]] = []

    def epoch_order(self, epoch: int) -> torch.Tensor:
        # The shuffle DistributedSampler documents: randperm seeded by seed + epoch.
        g = torch.Generator().manual_seed(SEED + epoch)
        return torch.randperm(TRAIN_N, generator=g)

    def run(self, on_step: Any) -> list[dict[str, float]]:
        per_epoch = []
        step = 0
        for epoch in range(EPOCHS):
            loss_sum, correct = 0.0, 0
            order = self.epoch_order(epoch)
            for start in range(0, TRAIN_N, BATCH):
                idx = order[start:start + BATCH]
                x, y = self.train[0][idx], self.train[1][idx]
                logits = self.model(x)
                loss = nn.functional.cross_entropy(logits, y)
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()
                loss_sum += loss.item() * len(y)
                correct += int((logits.argmax(1) == y).sum())
                step += 1
                on_step(step, self.model.state_dict())
                if step % SYNC_EVERY == 0:
                    seen = start + len(y)
                    self.syncs.append({"global_step": step, "train_loss": loss_sum / seen,
                                       "train_accuracy": correct / seen, "train_samples": seen})
            with torch.no_grad():
                logits = self.model(self.val[0])
                val_loss = nn.functional.cross_entropy(logits, self.val[1], reduction="sum").item()
                val_correct = int((logits.argmax(1) == self.val[1]).sum())
            per_epoch.append({
                "train_loss": loss_sum / TRAIN_N, "train_accuracy": correct / TRAIN_N,
                "val_loss": val_loss / VAL_N, "val_accuracy": val_correct / VAL_N,
            })
        return per_epoch


@pytest.fixture(scope="module")
def compared(reference_run: ReferenceRun) -> tuple[int, SingleProcess]:
    steps_checked = 0

    def check(step: int, expected: dict[str, torch.Tensor]) -> None:
        nonlocal steps_checked
        got = load_weights(reference_run.root, step)
        for name, tensor in expected.items():
            torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name: f"step {step}, {n}: {m}")
        steps_checked += 1

    single = SingleProcess()
    single.per_epoch = single.run(check)
    return steps_checked, single


def test_two_ranks_equal_one_process_step_for_step(compared: tuple[int, SingleProcess]) -> None:
    # check() raised on any mismatch; make sure it saw every step of both epochs.
    steps_checked, _ = compared
    assert steps_checked == EPOCHS * TRAIN_N // BATCH


def assert_metrics_close(got: dict[str, Any], want: dict[str, float]) -> None:
    for key, value in want.items():
        assert math.isclose(got[key], value, rel_tol=1e-5, abs_tol=1e-7), (key, got, want)


def test_global_metrics_equal_single_process(reference_run: ReferenceRun,
                                             compared: tuple[int, SingleProcess]) -> None:
    expected = compared[1].per_epoch
    records = metric_records(reference_run.root)
    assert [r["epoch"] for r in records] == list(range(1, EPOCHS + 1))
    for got, want in zip(records, expected, strict=True):
        assert got["train_samples"] == TRAIN_N
        assert got["val_samples"] == VAL_N  # every validation sample exactly once
        assert_metrics_close(got, want)


def test_sync_every_reports_the_epoch_so_far(reference_run: ReferenceRun,
                                             compared: tuple[int, SingleProcess]) -> None:
    expected = compared[1].syncs
    records = metric_records(reference_run.root, kind="sync")
    assert [r["global_step"] for r in records] == [4, 8, 12, 16]
    for got, want in zip(records, expected, strict=True):
        assert_metrics_close(got, want)

