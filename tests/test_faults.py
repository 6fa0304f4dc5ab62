"""Faults, named: a stop that times out names the rank that would not stop (and
is still a stop, not a failure); two starts of one run id cannot both win;
a command returns when every process it started has exited."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import DDTRAIN, Together, detached, finish, start, tagged_pids, together

from ddtop.daemon.nativestacks import NATIVE_MARK, py_spy


@pytest.fixture(scope="module")
def twice(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Together]:
    """Two starts of one run id at once (`twice-0`), in one folder: started with
    the module's first test, to run beside it."""
    with together(tmp_path_factory.mktemp("twice")) as runs:
        for k in range(2):
            runs.start(f"start-{k}", [DDTRAIN, "start", "-n", "2", "--epochs", "1", "--run-id",
                                      "twice-0", "--synthetic-train-samples", "256"],
                       folder="twice")
        yield runs


@pytest.mark.usefixtures("twice")  # started now, to run beside this test
@pytest.mark.processes
def test_a_frozen_rank_stacks_and_a_stop_that_times_out(tmp_path: Path) -> None:
    """One run, rank 1 frozen (SIGSTOP): rank 0 waits in its all-reduce and
    `ddtrain stacks` still shows where, from faulthandler's C handler (the dump
    stays in the run); rank 1 cannot answer, which is said. Then a stop that times
    out (rank 1 can neither finish its step nor die of SIGTERM) is still a stop,
    not a failure, and names the rank that would not stop."""
    # --step-delay: it steps while the module's other runs do, without taking their cores.
    with detached("-n", "2", "--epochs", "200", "--run-id", "frozen", "--step-delay", "0.05",
                  cwd=tmp_path) as run:
        assert run.started.returncode == 0, run.started.stderr
        status = run.wait_for("frozen", lambda s: all(r["global_step"] > 0 for r in s["ranks"]))
        stuck = status["ranks"][1]["pid"]
        os.kill(stuck, signal.SIGSTOP)
        try:
            time.sleep(1.5)  # rank 0 reaches the all-reduce rank 1 never joins
            stacks = run.cli("stacks", "frozen", "--rank", "0")
            every = run.cli("stacks", "frozen")
            bad = run.cli("stacks", "frozen", "--rank", "7")
            evidence = run.cli("evidence", "frozen")
            # --timeout 1: the stop times out however long it waits (rank 1 is frozen)
            stopped = run.cli("stop", "frozen", "--timeout", "1")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stuck, signal.SIGCONT)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert run.leftovers() == []
    assert stacks.returncode == 0, stacks.stdout + stacks.stderr
    assert stacks.stdout.startswith("== rank 0 (")
    assert "Thread 0x" in stacks.stdout and "trainer.py" in stacks.stdout, stacks.stdout
    assert "ddtop-telemetry" in stacks.stdout or "sender.py" in stacks.stdout  # all threads
    # Then its native stacks, read by py-spy (or the line saying it is not installed).
    native = stacks.stdout.partition(NATIVE_MARK)[2]
    assert native, stacks.stdout
    if py_spy() is not None:
        assert "(libtorch_cpu.so)" in native or "(libc.so.6)" in native, native
    assert every.returncode == 0 and "== rank 1: no stacks within" in every.stdout
    assert bad.returncode == 2 and bad.stderr.startswith("ddtrain: error: --rank 7:")
    assert bad.stderr.strip().endswith("run frozen has ranks 0-1"), bad.stderr
    root = tmp_path / "runs" / "frozen"
    assert "trainer.py" in (root / "logs" / "rank-0.stacks").read_text()
    # The evidence asked for (daemon/evidence.py): one folder, its index printed; rank 1,
    # frozen, gave no Python stacks, which it says.
    assert evidence.returncode == 0, evidence.stdout + evidence.stderr
    (bundle,) = (root / "evidence").iterdir()
    assert evidence.stdout.startswith(f"runs/frozen/evidence/{bundle.name}: "), evidence.stdout
    index = json.loads((bundle / "index.json").read_text())
    assert index["why"] == "asked" and index["run"] == "frozen", index
    assert "  rank-0.stacks: rank 0's stacks: Python's (every thread)" in evidence.stdout
    assert "  missing: rank 1: no Python stacks (the process is stopped or gone)" \
        in evidence.stdout, evidence.stdout
    assert "trainer.py" in (bundle / "rank-0.stacks").read_text()
    ranks = json.loads((bundle / "ranks.json").read_text())
    assert ranks["1"]["pid"] == stuck and ranks["0"]["global_step"] > 0, ranks

    record = json.loads((root / "run.json").read_text())
    assert (record["status"], record["exit_code"]) == ("stopped", 130)
    assert record["failure"] is None
    ranks = {r["rank"]: r for r in record["ranks"]}
    assert ranks[1]["signal"] == "SIGKILL" and ranks[1]["stopped_by_daemon"] is True
    log = (root / "daemon.log").read_text()
    assert "rank 1 (" in log and "did not stop within 1 s" in log, log
    assert "rank 1 did not stop in time and was killed with SIGKILL" in log, log



@pytest.mark.processes
def test_two_starts_of_one_run_id_at_once_give_one_run(twice: Together) -> None:
    """Started together: one wins, the other is one line, exit 2, and there is
    only ever one daemon (before, two of eight tries both won)."""
    tmp_path = twice.cwd("start-0")
    for attempt in range(1):
        rid = f"twice-{attempt}"
        runs = [twice.result(f"start-{k}") for k in range(2)]
        codes = sorted(r.returncode for r in runs)
        assert codes == [0, 2], [(r.returncode, r.stdout, r.stderr) for r in runs]
        loser = next(r for r in runs if r.returncode == 2)
        assert loser.stderr.startswith(f"ddtrain: error: run {rid} "), loser.stderr
        assert len(loser.stderr.strip().splitlines()) == 1, loser.stderr
        record = json.loads((tmp_path / "runs" / rid / "run.json").read_text())
        assert record["status"] in ("succeeded", "running", "starting")


@pytest.mark.processes
def test_a_foreground_run_returns_when_everything_it_started_has_exited(
        tmp_path: Path) -> None:
    """Not a second later: no forkserver, no resource tracker, no rank left when
    `ddtrain start --foreground` returns (nor after a stop, nor after Ctrl-C)."""
    proc, tag = start([DDTRAIN, "start", "--foreground", "-n", "2", "--epochs", "1",
                       "--run-id", "tidy", "--synthetic-train-samples", "256"], tmp_path)
    try:
        _, err = proc.communicate(timeout=120)
        left = tagged_pids(tag)  # at once: no grace
    finally:
        finish(proc, tag)
    assert proc.returncode == 0, err
    assert left == []


@pytest.mark.processes
def test_ctrl_c_returns_when_everything_it_started_has_exited(tmp_path: Path) -> None:
    proc, tag = start([DDTRAIN, "start", "--foreground", "-n", "2", "--epochs", "200",
                       "--run-id", "interrupted"], tmp_path)
    try:
        journal = tmp_path / "runs" / "interrupted" / "telemetry.journal"
        deadline = time.monotonic() + 60
        while not (journal.exists() and journal.stat().st_size > 2_000):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the terminal's whole group
        proc.communicate(timeout=60)
        left = tagged_pids(tag)
    finally:
        finish(proc, tag)
    assert proc.returncode == 130
    assert left == []
