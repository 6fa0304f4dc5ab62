"""A loss that goes NaN or infinite is an event, not a quiet success: each rank
warns once (its log, the wire, so the headless lines and the dashboard's
events), naming the first such step; with --fail-on-nan the rank fails with an
error naming that step, and so the run. The test costs no device sync: a CPU
loss is a number already, a GPU loss is tested on the device and read where
the loop reads the device anyway (the device path is checked here on CPU
tensors)."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ddtrain

from ddtop.core import wire
from ddtop.training.reporting import LossWatch, NonFiniteLoss
from ddtop.training.telemetry import Telemetry
from ddtop.training.trainer import plus

# SGD at this rate diverges within a few steps, the same way every time (seeded).
DIVERGING = ("-n", "2", "--epochs", "1", "--synthetic-train-samples", "512", "--lr", "1e30")


class Events(Telemetry):
    def __init__(self) -> None:
        self.sent: list[tuple[str, str, dict[str, Any]]] = []

    def event(self, type: wire.EventType, message: str, traceback: str | None = None,
              **data: str | int | float | bool | None) -> None:
        self.sent.append((type, message, data))


def losses(*values: float) -> list[torch.Tensor]:
    return [torch.tensor(v) for v in values]


def test_a_cpu_loss_is_told_once_at_its_first_non_finite_step(
        capsys: pytest.CaptureFixture[str]) -> None:
    events = Events()
    watch = LossWatch(fail=False, telemetry=events)
    for step, loss in enumerate(losses(2.3, 1.9, math.inf, math.nan, math.nan), start=1):
        watch.step(loss, step)
    assert [(t, d["global_step"]) for t, _, d in events.sent] == [("warning", 3)]
    assert "the loss is inf at step 3" in events.sent[0][1]
    assert "warning: the loss is inf at step 3" in capsys.readouterr().err  # the rank's log


def test_with_fail_on_nan_the_first_non_finite_step_raises() -> None:
    watch = LossWatch(fail=True, telemetry=Events())
    watch.step(torch.tensor(1.0), 1)
    with pytest.raises(NonFiniteLoss, match=r"the loss is nan at step 2 \(--fail-on-nan\)"):
        watch.step(torch.tensor(math.nan), 2)


def test_on_a_device_the_first_step_is_kept_there_and_told_at_the_next_check() -> None:
    events = Events()
    watch = LossWatch(fail=False, telemetry=events)
    watch.check()  # nothing kept yet
    for step, loss in enumerate(losses(2.0, math.nan, math.inf, 1.0), start=10):
        watch._keep_first(loss, step)  # what step() does with a GPU loss
    assert events.sent == []  # nothing read until a sync point
    watch.check()
    watch.check()
    assert [(d["global_step"], d["loss"]) for _, _, d in events.sent] == [(11, "nan")]


def test_a_finite_loss_on_a_device_is_never_told() -> None:
    events = Events()
    watch = LossWatch(fail=True, telemetry=events)
    for step, loss in enumerate(losses(2.0, 1.0), start=1):
        watch._keep_first(loss, step)
    watch.check()
    assert events.sent == []


def test_epoch_totals_keep_a_nan() -> None:
    """Counter's `+` drops what is not positive: a NaN loss sum became 0."""
    total = plus(Counter({"loss_sum": math.nan, "samples": 64}), Counter({"samples": 64}))
    assert math.isnan(total["loss_sum"]) and total["samples"] == 128


def jsonl(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.mark.processes
def test_a_diverging_run_warns_once_per_rank_and_says_nan(tmp_path: Path) -> None:
    run = ddtrain("start", "--foreground", "--headless", "--format", "jsonl", *DIVERGING,
                  "--run-id", "nan", cwd=tmp_path)
    assert run.returncode == 0, run.stderr  # it trains on: the warning is the news
    lines = jsonl(run.stdout)
    warnings = [e for e in lines if e.get("kind") == "event" and e["type"] == "warning"]
    assert sorted(e["rank"] for e in warnings) == [0, 1], warnings  # once per rank
    step = warnings[0]["data"]["global_step"]
    assert all(re.search(rf"the loss is (nan|inf) at step {step};", e["message"])
               for e in warnings)
    summary = lines[-1]
    assert summary["kind"] == "summary" and math.isnan(summary["metrics"]["train_loss"])
    status = ddtrain("status", "nan", cwd=tmp_path, timeout=30)
    assert "unreadable" not in status.stderr  # run.json holds the NaN (as null)
    assert "train loss nan" in status.stdout, status.stdout
    log = (tmp_path / "runs/nan/logs/rank-1.log").read_text()
    assert log.count("warning: the loss is") == 1
    logs = ddtrain("logs", "nan", "--rank", "0", cwd=tmp_path, timeout=30)
    assert "warning: the loss is" in logs.stdout


@pytest.mark.processes
def test_fail_on_nan_fails_the_run_naming_the_step(tmp_path: Path) -> None:
    run = ddtrain("start", "--foreground", "--headless", "--format", "jsonl", *DIVERGING,
                  "--fail-on-nan", "--run-id", "nan", cwd=tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    summary = jsonl(run.stdout)[-1]
    message = summary["failure"]["message"]
    assert re.fullmatch(r"NonFiniteLoss: the loss is (nan|inf) at step \d+ \(--fail-on-nan\)",
                        message), message
    assert f"exited with code 1: {message}" in run.stderr
    assert summary["global_step"] < summary["total_steps"]  # stopped there, not at the end
    assert run.leftovers == []
