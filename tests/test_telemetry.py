"""Telemetry from real gloo ranks to a real PULL socket on loopback."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import REFERENCE_ARGS, ReferenceRun
from helpers import Collector, Run, collecting, ddtrain, metric_records

from ddtop.core import wire

pytestmark = pytest.mark.processes  # every test here starts processes, or shares a run that does


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path, Collector]:
    """The reference run's settings again, this time with telemetry on."""
    cwd = tmp_path_factory.mktemp("telemetry")
    with collecting() as collector:
        run = ddtrain("start", "--foreground", *REFERENCE_ARGS, "--run-id", "tel", cwd=cwd,
                      env={"DDTOP_TELEMETRY": collector.endpoint})
    assert run.returncode == 0, run.stdout + run.stderr
    return run, cwd / "runs" / "tel", collector


def test_every_rank_says_hello_steps_heartbeats_and_bye(observed: tuple[Run, Path, Collector]
                                                        ) -> None:
    run, root, got = observed
    assert got.errors == 0 and run.leftovers == []
    status = (root / "run.json").read_text()
    for rank in (0, 1):
        (hello,) = got.of(wire.Hello, rank)
        assert (hello.world_size, hello.backend, hello.device) == (2, "gloo", "cpu")
        assert f'"pid": {hello.pid}' in status
        assert got.of(wire.Heartbeat, rank)
        (bye,) = got.of(wire.Bye, rank)
        assert bye.exit_code == 0
        own = [m for m in got.messages if m.rank == rank]
        assert [m.seq for m in own] == list(range(len(own)))  # gap-free, in order
        assert all(m.dropped == 0 and m.run == "tel" for m in own)
        assert own[0] is hello and own[-1] is bye


def test_steps_cover_every_step_exactly_once(observed: tuple[Run, Path, Collector]) -> None:
    _, root, got = observed
    epochs = metric_records(root)
    for rank in (0, 1):
        steps = got.of(wire.Step, rank)
        assert sum(s.steps for s in steps) == 16
        assert sum(s.samples for s in steps) == 2 * 128  # 128 samples per rank per epoch
        assert steps[-1].global_step == 16 and steps[-1].steps_per_epoch == 8
        # A message's phase and comm times may include a part of the step that
        # the next message counts (the sender takes a window between the two);
        # over all messages nothing is lost or counted twice.
        assert sum(s.comm_ops for s in steps) >= 16 and sum(s.comm_s for s in steps) > 0
        # One MLP's gradients (float32) all-reduced per step.
        params = 784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10
        assert sum(s.comm_bytes for s in steps) == 16 * params * 4
        assert sum(s.step_s for s in steps) >= sum(
            s.forward_s + s.backward_s + s.optimizer_s for s in steps)
        assert all(s.rss and s.rss > 10**8 for s in steps)
        # Per step, the time outside the all-reduce without the longest step: from 3
        # steps a message, never more than the mean step time.
        for s in steps:
            if s.steps < 3:
                assert s.compute_trim_s is None, s
            else:
                assert s.compute_trim_s is not None
                assert 0 <= s.compute_trim_s <= s.step_s / s.steps + 1e-9, s
    # Loss sums from both ranks, per epoch, give the global training loss.
    for epoch, record in enumerate(epochs):
        total = sum(s.loss_sum for s in got.of(wire.Step) if s.epoch == epoch)
        assert math.isclose(total / 256, record["train_loss"], rel_tol=1e-5)


def test_aggregates_and_events(observed: tuple[Run, Path, Collector]) -> None:
    _, root, got = observed
    epochs = metric_records(root)
    for rank in (0, 1):
        agg = [a for a in got.of(wire.Aggregate, rank) if a.scope == "epoch"]
        assert [(a.epoch, a.val_samples) for a in agg] == [(0, 101), (1, 101)]
        for a, record in zip(agg, epochs, strict=True):
            assert a.val_loss == pytest.approx(record["val_loss"], rel=1e-12)
        assert [a.global_step for a in got.of(wire.Aggregate, rank) if a.scope == "sync"] == [
            4, 8, 12, 16]
    checkpoints = [e for e in got.of(wire.Event) if e.type == "checkpoint"]
    assert {e.rank for e in checkpoints} == {0}  # rank 0 writes them
    assert len(checkpoints) == 18  # after every step, and at both epoch ends
    assert [e.data["epoch"] for e in got.of(wire.Event, 1) if e.type == "epoch_end"] == [0, 1]


def test_comm_hook_keeps_ddp_results_exact(observed: tuple[Run, Path, Collector],
                                           reference_run: ReferenceRun) -> None:
    _, root, _ = observed
    last = "checkpoints/step-00000016.pt"
    with_hook = torch.load(root / last, weights_only=True)["model"]
    without = torch.load(reference_run.root / last, weights_only=True)["model"]
    for name, tensor in without.items():
        assert torch.equal(with_hook[name], tensor), name


def test_a_blocked_rank_still_heartbeats_and_names_its_collective(tmp_path: Path) -> None:
    # Rank 1's data loading for step 4 stalls for 4 s; rank 0 goes on into step 4
    # and waits in that step's gradient all-reduce.
    with collecting() as got:
        run = ddtrain("start", "--foreground", "-n", "2", "--epochs", "1",
                      "--synthetic-train-samples", "512",
                      "--inject", "1:stall-data=4s@step=3", cwd=tmp_path,
                      env={"DDTOP_TELEMETRY": got.endpoint})
    assert run.returncode == 0, run.stdout + run.stderr
    waiting = [h for h in got.of(wire.Heartbeat, 0)
               if h.global_step == 3 and h.phase == "backward" and h.coll_started
               and h.coll_started.op == "allreduce"
               and (h.coll_completed is None or h.coll_completed.seq < h.coll_started.seq)]
    assert len(waiting) >= 2, got.of(wire.Heartbeat, 0)
    assert waiting[-1].phase_s > 2.0
    stalled = [h for h in got.of(wire.Heartbeat, 1) if h.global_step == 3]
    assert len(stalled) >= 3  # the stalled rank keeps reporting from its own thread


def test_error_event_carries_the_traceback(tmp_path: Path) -> None:
    with collecting() as got:
        run = ddtrain("start", "--foreground", "-n", "2", "--epochs", "1",
                      "--synthetic-train-samples", "256", "--inject", "1:raise@step=2",
                      cwd=tmp_path, env={"DDTOP_TELEMETRY": got.endpoint})
    assert run.returncode == 1
    (error,) = [e for e in got.of(wire.Event, 1) if e.type == "error"]
    assert "RuntimeError: injected failure at step 2" in error.message
    assert "Traceback" in (error.traceback or "") and error.data["global_step"] == 2
    (bye,) = got.of(wire.Bye, 1)
    assert bye.exit_code == 1


def test_no_listener_changes_nothing(tmp_path: Path) -> None:
    with collecting() as closed:  # a port that nobody listens on once this block ends
        endpoint = closed.endpoint
    run = ddtrain("start", "--foreground", "-n", "2", "--epochs", "1",
                  "--synthetic-train-samples", "1024", "--run-id", "deaf", cwd=tmp_path,
                  env={"DDTOP_TELEMETRY": endpoint})
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.leftovers == []
    assert "warning" not in run.stdout
    assert len(metric_records(tmp_path / "runs" / "deaf")) == 1

