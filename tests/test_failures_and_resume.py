"""Ranks that die, daemons that are stopped, and runs that resume.

Failures are real: `--inject` makes a rank SIGKILL itself (or raise) after a
given step; Ctrl-C and SIGKILL are real signals sent to the daemon (ddtrain start --foreground).
The runs looked at only once they end start together (a module fixture).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    DDTRAIN,
    Together,
    ddtrain,
    finish,
    metric_records,
    start,
    tagged_pids,
    together,
    wait_until_gone,
)

from ddtop.core import journal
from ddtop.core.blame import RankEnd, culprit, read_error_report
from ddtop.core.contract import ErrorReport
from ddtop.training.worker import write_error_report

# CNN has dropout, so resuming also has to restore every rank's RNG state.
RUN_ARGS = (
    "--world-size", "2", "--model", "cnn", "--epochs", "2", "--batch-size", "32",
    "--synthetic-train-samples", "256", "--synthetic-val-samples", "64", "--seed", "7",
)


def final_state(root: Path) -> dict[str, torch.Tensor]:
    newest = sorted((root / "checkpoints").glob("step-*.pt"))[-1]
    state = torch.load(newest, weights_only=True)
    assert state["global_step"] == 16
    weights: dict[str, torch.Tensor] = state["model"]
    return weights


def epochs(root: Path) -> dict[int, dict[str, float]]:
    # A run that resumed may repeat an epoch's record; the last one counts.
    return {r["epoch"]: r for r in metric_records(root)}


# RUN_ARGS train 2 epochs of 8 steps; with --checkpoint-every 3 rank 0 saves after
# steps 3, 6, 9, 12 and 15 (and at each epoch's end, after the drills of its last
# step). A rank killed after step K leaves the newest checkpoint at the multiple
# of 3 below K; K itself a multiple of 3 is left out: rank 0 may or may not finish
# writing that step's checkpoint before the daemon stops it.
KILL_STEPS = [k for k in range(4, 17) if k % 3]
KILL = random.Random(os.urandom(8)).choice(KILL_STEPS)  # the restarted run's, once a module


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Together]:
    """The foreground runs the tests only look at once they end, started together
    (their start-ups overlap), each in a folder of its own."""
    with together(tmp_path_factory.mktemp("runs")) as started:
        fg = [DDTRAIN, "start", "--foreground"]
        started.start("whole", [*fg, *RUN_ARGS, "--run-id", "whole"])
        # Rank 1 is SIGKILLed after global step 11 (epoch 2, step 3); the newest
        # checkpoint is then step 9, mid-epoch.
        started.start("crash", [*fg, *RUN_ARGS, "--run-id", "crash", "--checkpoint-every", "3",
                                "--inject", "1:kill@step=11"])
        started.start("again", [*fg, *RUN_ARGS, "--run-id", "again", "--max-restarts", "1",
                                "--checkpoint-every", "3", "--inject", f"1:kill@step={KILL}"])
        started.start("boom", [*fg, "-n", "2", "--epochs", "1", "--synthetic-train-samples",
                               "256", "--run-id", "boom", "--inject", "0:raise@step=2"])
        started.start("leave", [*fg, "-n", "2", "--epochs", "1", "--batch-size", "16",
                                "--synthetic-train-samples", "640", "--synthetic-val-samples",
                                "32", "--run-id", "leave", "--inject", "1:exit=0@step=20"])
        yield started


@pytest.fixture(scope="module")
def uninterrupted(runs: Together) -> Path:
    run = runs.result("whole")
    assert run.returncode == 0, run.stdout + run.stderr
    return runs.cwd("whole") / "runs" / "whole"


@pytest.mark.processes
def test_killed_rank_fails_the_run_then_resume_matches_uninterrupted(
        runs: Together, uninterrupted: Path) -> None:
    crash, tmp_path = runs.result("crash"), runs.cwd("crash")  # rank 1 killed after step 11
    assert crash.returncode == 1, crash.stdout + crash.stderr
    assert "rank 1" in crash.stderr and "killed by SIGKILL" in crash.stderr
    assert "ddtrain start --resume --run-id crash" in crash.stderr
    assert crash.leftovers == []
    root = tmp_path / "runs" / "crash"
    status = json.loads((root / "run.json").read_text())
    assert status["status"] == "failed"
    assert status["failure"]["rank"] == 1 and status["failure"]["signal"] == "SIGKILL"
    assert sorted(p.name for p in (root / "checkpoints").glob("*.pt"))[-1] == "step-00000009.pt"

    resumed = ddtrain("start", "--foreground", "--resume", "--run-id", "crash", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from step-00000009.pt: epoch 2, step 1" in resumed.stdout
    assert resumed.leftovers == []

    want, got = final_state(uninterrupted), final_state(root)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name  # exactly, not approximately
    want_epochs, got_epochs = epochs(uninterrupted), epochs(root)
    for epoch in (1, 2):
        for key in ("train_loss", "val_loss"):
            assert math.isclose(got_epochs[epoch][key], want_epochs[epoch][key], rel_tol=1e-12)
        for key in ("train_accuracy", "train_samples", "val_accuracy", "val_samples"):
            assert got_epochs[epoch][key] == want_epochs[epoch][key]


@pytest.mark.processes
def test_max_restarts_resumes_from_the_checkpoint_and_matches_uninterrupted(
        runs: Together, uninterrupted: Path) -> None:
    kill = KILL
    print(f"rank 1 killed after step {kill} (--inject 1:kill@step={kill})")
    saved = kill - kill % 3
    saved_as = f"step-{saved:08d}.pt"
    epoch, step = divmod(saved - 1, 8)
    run, tmp_path = runs.result("again"), runs.cwd("again")
    assert run.returncode == 0, (kill, run.stdout + run.stderr)
    assert "restart 1/1: rank 1 was killed by SIGKILL" in run.stderr, (kill, run.stderr)
    assert f"restarting from {saved_as}" in run.stderr, (kill, run.stderr)
    assert f"resumed from {saved_as}: epoch {epoch + 1}, step {step + 1}" in run.stdout, (
        kill, run.stdout)
    assert run.leftovers == []
    root = tmp_path / "runs" / "again"
    status = json.loads((root / "run.json").read_text())
    assert (status["status"], status["restarts"]) == ("succeeded", 1)
    (entry,) = status["timeline"]
    assert (entry["rank"], entry["signal"], entry["checkpoint"]) == (1, "SIGKILL", saved_as), kill
    want, got = final_state(uninterrupted), final_state(root)
    for name in want:
        assert torch.equal(want[name], got[name]), (kill, name)


@pytest.mark.processes
def test_rank_exception_is_reported_with_its_traceback(runs: Together) -> None:
    run, tmp_path = runs.result("boom"), runs.cwd("boom")
    assert run.returncode == 1
    assert "rank 0 (pid" in run.stderr and "exited with code 1" in run.stderr
    assert "RuntimeError: injected failure at step 2" in run.stderr
    assert "  | RuntimeError: injected failure" in run.stderr  # the traceback's tail
    assert run.leftovers == []
    report = json.loads((tmp_path / "runs/boom/logs/rank-0.error.json").read_text())
    assert report["kind"] == "exception" and "after_step" in report["traceback"]
    # Rank 1 fails too (its all-reduce lost rank 0), and may well be reaped
    # first: run.json and the journal a dashboard folds still blame rank 0.
    status = json.loads((tmp_path / "runs/boom/run.json").read_text())
    assert status["failure"]["rank"] == 0
    state, _ = journal.replay(tmp_path / "runs/boom/telemetry.journal", "boom")
    assert state.failure is not None and state.failure.rank == 0
    assert "injected failure" in (state.failure.message or "")


@pytest.mark.processes
def test_a_rank_that_leaves_early_with_exit_0_is_blamed(runs: Together) -> None:
    """Rank 1 exits with code 0 after step 20 of 40, without a goodbye
    (`os._exit(0)`), while rank 0 trains on: rank 0 then loses its peer in its
    next all-reduce and fails. Rank 1 left early: it is the one blamed, in the
    terminal, run.json, `ddtrain status` and the journal a dashboard folds."""
    run, tmp_path = runs.result("leave"), runs.cwd("leave")
    assert run.returncode == 1, run.stderr[-3000:]
    # The step it last reported: its final steps' telemetry (sent every 0.1 s)
    # went down with it (on a loaded machine, all of it: "before it reported a step").
    said = re.search(r"failed: rank 1 \(pid \d+\) left early (at step (\d+)|before it "
                     r"reported a step): exit code 0", run.stderr)
    assert said is not None, run.stderr[-3000:]
    step = int(said[2] or 0)
    assert 0 <= step <= 20, run.stderr[-3000:]
    where = said[1]
    assert run.leftovers == []
    record = json.loads((tmp_path / "runs/leave/run.json").read_text())
    assert record["status"] == "failed"
    assert record["failure"]["rank"] == 1, record["failure"]
    assert record["failure"]["reason"].startswith(f"left early {where}: ")
    assert {r["rank"]: r["state"] for r in record["ranks"]}[1] == "dead"
    status = ddtrain("status", "leave", cwd=tmp_path)
    assert f"failure: rank 1 left early {where}: " in status.stdout, status.stdout
    state, _ = journal.replay(tmp_path / "runs/leave/telemetry.journal", "leave")
    assert state.failure is not None and state.failure.rank == 1
    assert state.failure.how().startswith(f"left early {where}: ")
    print(f"\nrank 1 left at step 20 (os._exit(0)); blamed as having left at step {step}, "
          f"the last it reported")


def blame(tmp_path: Path, ranks: list[tuple[int, bool, dict[str, Any] | None]]) -> int | None:
    """The rank the blame policy picks, given each rank's (exit code, stopped by
    the daemon, error report written by the rank's own writer or None), for an
    attempt that started at time 1000: plain data, no supervisor."""
    exits, reports = {}, {}
    for k, (code, stopped, report) in enumerate(ranks):
        path = tmp_path / f"rank-{k}.error.json"
        if report is not None:
            write_error_report(path, ErrorReport(rank=k, kind="exception", **report))
        exits[k] = RankEnd(code, stopped)
        found = read_error_report(path, since=1000.0)
        if found is not None:
            reports[k] = found
    return culprit(exits, reports)


GLOO_PEER = ("RuntimeError: Got the following error when running the callback: RuntimeError: "
             "[../third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
             "[127.0.0.1]:53483")
NCCL_PEER = "DistBackendError: NCCL communicator was aborted on rank 0"
OWN = "ValueError: bad batch"


@pytest.mark.parametrize(("ranks", "culprit"), [
    # The rank that raised first is still exiting when its peer's gloo error
    # is reaped; the daemon stopped it: it is blamed, not the peer.
    ([(-15, True, {"message": OWN, "time": 1001.0}),
      (1, False, {"message": GLOO_PEER, "time": 1001.02})], 0),
    # A rank killed by a signal beats the peer that then lost it.
    ([(1, False, {"message": NCCL_PEER, "time": 1001.0}), (-9, False, None)], 1),
    # An error of its own beats an earlier peer-loss error.
    ([(1, False, {"message": NCCL_PEER, "time": 1001.0}),
      (1, False, {"message": OWN, "time": 1002.0})], 1),
    # A silent non-zero exit beats a peer-loss error.
    ([(1, False, {"message": GLOO_PEER, "time": 1001.0}), (3, False, None)], 1),
    # Only peer-loss errors: the earliest.
    ([(1, False, {"message": GLOO_PEER, "time": 1001.5}),
      (1, False, {"message": GLOO_PEER, "time": 1001.1})], 1),
    # A report left by an earlier attempt says nothing about this one.
    ([(-15, True, {"message": OWN, "time": 999.0}),
      (1, False, {"message": GLOO_PEER, "time": 1001.0})], 1),
])
def test_blame_goes_to_the_cause_not_to_the_first_reaped(
        tmp_path: Path, ranks: list[tuple[int, bool, dict[str, Any] | None]], culprit: int) -> None:
    assert blame(tmp_path, ranks) == culprit


def wait_for_line(proc_stdout_path: Path, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc_stdout_path.exists() and text in proc_stdout_path.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"{text!r} did not appear in {proc_stdout_path} within {timeout} s")


LONG_RUN = ("start", "--foreground", "-n", "2", "--epochs", "50", "--run-id", "long",
            "--synthetic-train-samples", "4096", "--checkpoint-every", "20")


@pytest.mark.processes
def test_ctrl_c_stops_every_rank_and_keeps_the_checkpoints(tmp_path: Path) -> None:
    proc, tag = start([DDTRAIN, *LONG_RUN], tmp_path)
    log = tmp_path / "runs/long/logs/rank-0.log"
    try:
        wait_for_line(log, "loss")  # a progress line: training is under way
        os.kill(proc.pid, signal.SIGINT)
        run = finish(proc, tag, timeout=30)
    finally:
        wait_until_gone(tag, 0)
    assert run.returncode == 130, run.stdout + run.stderr
    assert "stopping on Ctrl-C: ranks finish their step, rank 0 checkpoints" in run.stderr
    assert "stopped as asked after step" in run.stdout  # graceful: the ranks agreed
    assert "stopped" in run.stderr and "--resume --run-id long" in run.stderr
    assert run.leftovers == []
    status = json.loads((tmp_path / "runs/long/run.json").read_text())
    assert status["status"] == "stopped"


@pytest.mark.processes
def test_killing_the_launcher_leaves_no_rank_behind(tmp_path: Path) -> None:
    proc, tag = start([DDTRAIN, *LONG_RUN], tmp_path)
    try:
        wait_for_line(tmp_path / "runs/long/logs/rank-0.log", "first step done")
        assert len(tagged_pids(tag)) >= 4  # daemon, forkserver, 2 ranks
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        # Gone in a second or two here; 15 s for a machine as loaded as CI's (a rank
        # still tearing torch down once outlived 5 s there).
        leftovers = wait_until_gone(tag, timeout=15)
    finally:
        proc.communicate()
        wait_until_gone(tag, 0)
    assert leftovers == []


@pytest.mark.processes
def test_sigterm_while_the_ranks_start_stops_them_all(tmp_path: Path) -> None:
    """SIGTERM as soon as the first rank exists (before any step): every rank
    the daemon started is stopped, none is left behind, the run is `stopped`."""
    proc, tag = start([DDTRAIN, *LONG_RUN], tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "runs/long/logs/rank-0.log").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "no rank started"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGTERM)
        run = finish(proc, tag, timeout=60)
    finally:
        wait_until_gone(tag, 0)
    assert run.returncode == 128 + signal.SIGTERM, run.stdout + run.stderr
    assert run.leftovers == []
    assert "Traceback" not in run.stderr
    status = json.loads((tmp_path / "runs/long/run.json").read_text())
    assert status["status"] == "stopped" and status["exit_code"] == 143
