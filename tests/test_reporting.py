"""The reporter: each fact, reported once, reaches rank 0's console and
metrics.jsonl and the telemetry (the rank's real `ddtop` reporter, as the
trainer starts it, to a real PULL socket on loopback), with the same numbers
in both; other ranks stay quiet but still send everything."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from helpers import Collector, collecting, metric_records
from torch import nn

from ddtop.core import wire
from ddtop.core.config import TrainConfig
from ddtop.core.contract import TELEMETRY_ENV
from ddtop.core.rundir import RunPaths
from ddtop.training.checkpoint import Position
from ddtop.training.distributed import RankEnv
from ddtop.training.metrics import GlobalMetrics
from ddtop.training.reporting import Reporter
from ddtop.training.telemetry import LiveTelemetry
from ddtop.training.trainer import start_reporting

HELLO = wire.Hello(run="comm", rank=0, local_rank=0, host="h", pid=1, device="cpu",
                   backend="gloo", world_size=2, config_digest="", model="mlp",
                   dataset="synthetic", epochs=1, global_batch=16)
SYNC = GlobalMetrics(loss=1.25, accuracy=0.5, samples=64)
VAL = GlobalMetrics(loss=0.75, accuracy=0.625, samples=24)


def report_resumed_epoch(rank: int, tmp_path: Path,
                         monkeypatch: pytest.MonkeyPatch) -> tuple[RunPaths, Collector]:
    """A rank resumes at step 2 of 4, finishes the epoch, and is stopped right
    after it, as the trainer would report it (checkpoints: rank 0 only there);
    the run directory and what reached the socket."""
    paths = RunPaths(tmp_path / "rep").create()
    with collecting() as got:
        _report(rank, paths, got, monkeypatch)
    return paths, got


def _report(rank: int, paths: RunPaths, got: Collector, monkeypatch: pytest.MonkeyPatch) -> None:
    config = TrainConfig(world_size=2, epochs=1, run_id=paths.run_id)
    monkeypatch.setenv(TELEMETRY_ENV, got.endpoint)
    for name, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", 2)):
        monkeypatch.setenv(name, str(value))
    live = start_reporting(config, torch.device("cpu"), "gloo", total_steps=4)
    assert live is not None
    telemetry = live.telemetry
    report = Reporter.for_rank(config, RankEnv(rank, rank, 2, 2), paths, time.time(), telemetry)
    report.resumed(paths.checkpoints / "step-00000002.pt", Position(0, 2), 2)
    report.started("gloo", torch.device("cpu"), nn.Linear(4, 2), range(128), range(24), 4)
    report.epoch_started(0)
    for step in (3, 4):
        report.step(0, step, 4, step, torch.tensor(0.5 * step), 16)
    report.synced(0, 4, 4, SYNC)
    report.checkpointed(paths.checkpoints / "step-00000004.pt", Position(1, 0), 4)
    report.epoch_done(0, 4, SYNC, VAL)
    report.stopped(Position(1, 0), 4)
    live.close(0)
    deadline = time.monotonic() + 10
    while not got.of(wire.Bye, rank) and time.monotonic() < deadline:
        time.sleep(0.01)


def facts_on_the_wire(got: Collector) -> list[tuple[str, str]]:
    """Every message but steps and heartbeats (their timing is the sender's)."""
    return [(m.__class__.__name__, getattr(m, "type", getattr(m, "scope", "")))
            for m in got.messages if not isinstance(m, wire.Step | wire.Heartbeat)]


EXPECTED_WIRE = [("Hello", ""), ("Event", "resumed"), ("Aggregate", "sync"),
                 ("Event", "checkpoint"), ("Aggregate", "epoch"), ("Event", "epoch_end"),
                 ("Event", "stopped"), ("Bye", "")]
STOPPED = "stopped as asked after step 4 (epoch 2, step 0); checkpoint written"


def test_rank_zero_prints_records_and_sends_each_fact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    paths, got = report_resumed_epoch(0, tmp_path, monkeypatch)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "resumed from step-00000002.pt: epoch 1, step 2"
    assert lines[1].startswith("run rep: 2 ranks, backend gloo on cpu, model mlp")
    assert lines[2].startswith("first step done")
    assert lines[3].startswith("epoch 1/1 step 4/4 (100%) loss 1.7500 (rank 0)")
    assert lines[4] == "epoch 1 step 4: global train loss 1.2500 acc 50.00% over 64 samples"
    assert lines[5].startswith("epoch 1/1 done in")
    assert lines[6:] == [STOPPED]

    assert got.errors == 0 and facts_on_the_wire(got) == EXPECTED_WIRE
    (sync,) = metric_records(paths.root, "sync")
    (epoch,) = metric_records(paths.root, "epoch")
    sync_agg, epoch_agg = got.of(wire.Aggregate)
    assert (sync["global_step"], sync["train_loss"], sync["train_samples"]) == (
        sync_agg.global_step, sync_agg.train_loss, sync_agg.train_samples) == (4, 1.25, 64)
    assert (epoch["val_loss"], epoch["val_accuracy"], epoch["val_samples"]) == (
        epoch_agg.val_loss, epoch_agg.val_accuracy, epoch_agg.val_samples) == (0.75, 0.625, 24)
    events = {e.type: e for e in got.of(wire.Event)}
    assert events["stopped"].message == STOPPED
    assert events["resumed"].data == {"checkpoint": "step-00000002.pt", "epoch": 0, "step": 2,
                                      "global_step": 2}
    steps = got.of(wire.Step)
    assert sum(s.steps for s in steps) == 2 and sum(s.loss_sum for s in steps) == 16 * 3.5


def test_other_ranks_say_only_that_they_resumed_but_send_everything(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    paths, got = report_resumed_epoch(1, tmp_path, monkeypatch)
    assert capsys.readouterr().out == "resumed from step-00000002.pt: epoch 1, step 2\n"
    assert not paths.metrics.exists()
    assert got.errors == 0 and facts_on_the_wire(got) == EXPECTED_WIRE
    assert sum(s.steps for s in got.of(wire.Step)) == 2


def test_a_steps_communication_goes_out_with_that_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The all-reduce of a step finishes in its backward, before the step is counted:
    a Step message sent in between must not take it from the step it belongs to."""
    with collecting() as got:
        monkeypatch.setenv(TELEMETRY_ENV, got.endpoint)
        tel = LiveTelemetry(got.endpoint, HELLO)
        for step in (1, 2, 3):
            tel.comm_done(0.01, 1000)  # this step's all-reduce, during its backward
            time.sleep(0.25)  # the sender sends a window meanwhile (every 0.1 s)
            tel.count_step(0, step, 3, step, 0.1)
            tel.add_loss(torch.tensor(1.0), 8)
        tel.close(0)
        deadline = time.monotonic() + 10
        while not got.of(wire.Bye) and time.monotonic() < deadline:
            time.sleep(0.01)
    steps = got.of(wire.Step)
    assert sum(s.steps for s in steps) == 3
    # One message a step, unless the sender was held off past a step (then two share
    # one); either way every message carries exactly its own steps' all-reduces.
    assert all((s.comm_ops, s.comm_bytes) == (s.steps, 1000 * s.steps) for s in steps), steps
