"""How a run ended, kept on /metrics: its outcome, its failures by cause, and the
final state served a while after the end (`--metrics-linger`).

In process (fast): each failure the daemon words is put in its cause
(core/endings.py), with the words its own code writes where a function makes them;
a reading of an ended run carries the end's time, its outcome and the failures counted.

With processes: a 2-rank run whose rank 1 kills itself at step 3, restarted once and
killed again (so it fails), serving /metrics with a linger: after the end, scrapes
(parsed by prometheus_client) read the status `failed`, the outcome
`failed`/`signal`, two failures by `signal` and rank 1's restart, while `ddtrain
status` says the run failed; a real Prometheus loaded with the shipped alerting rules
fires DdtopRunFailed with the cause; `ddtrain stop` then ends the lingering daemon at
once.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from helpers import detached
from prometheus_client.parser import text_string_to_metric_families
from promserver import prometheus, quick_rules, served

from ddtop.core import blame, endings, wire
from ddtop.core.rundir import RunPaths, run_held
from ddtop.core.state import RunState
from ddtop.core.summary import Failure
from ddtop.daemon.metricreading import read
from ddtop.daemon.supervisor import end_lingering
from ddtop.daemon.watching import NO_GOODBYE

LINGER_S = 60.0  # long enough that only `ddtrain stop` can end it within the test


@pytest.mark.parametrize(("reason", "exit_code", "killed_by", "message", "expected"), [
    ("hung for 30 s (--hang-timeout 30) and was stopped", None, "SIGTERM", None, "hang"),
    ("entered another collective than its group's (--hang-timeout 5) and was stopped",
     None, "SIGTERM", None, "desync"),
    ("entered a send or recv its peer's cannot meet (--hang-timeout 5) and was stopped",
     None, "SIGTERM", None, "desync"),
    ("was killed by the kernel's OOM killer (SIGKILL)", None, "SIGKILL", None, "oom"),
    ("was killed by SIGKILL, most likely by the kernel's OOM killer (its memory cgroup "
     "counted a kill as it died)", None, "SIGKILL", None, "oom"),
    (blame.left_early_words(20), 0, None, None, "left_early"),
    (NO_GOODBYE, 1, None, None, "no_goodbye"),
    ("lost: its daemon (pid 7) stopped answering the hub; ...", 1, None, None, "lost"),
    ("ended (exit 0) with no rank seen: none of its processes ...", 0, None, None, "no_ranks"),
    (None, 1, None, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
     "cuda_oom"),
    (None, None, "SIGKILL", None, "signal"),
    (None, 1, None, "RuntimeError: injected failure at step 3", "error"),
    (None, 0, None, None, "unknown"),
])
def test_each_failure_is_put_in_its_cause(reason: str | None, exit_code: int | None,
                                          killed_by: str | None, message: str | None,
                                          expected: str) -> None:
    assert endings.cause(reason, exit_code, killed_by, message) == expected
    assert expected in endings.CAUSES


def _ended(status: str, failure: Failure | None, restarts: int) -> RunState:
    state = RunState(run="r")
    for n in range(1, restarts + 1):
        state.apply(wire.Restarting(run="r", rank=-1, seq=n, t=100.0 + n, message="again",
                                    restart=wire.Restart(restart=n, rank=1, reason="was "
                                                         "killed by SIGKILL", signal="SIGKILL")),
                    100.0 + n)
    state.failure = failure
    state.apply(wire.RunStatus(run="r", rank=-1, seq=restarts + 1, t=200.0, status=status,
                               world_size=2, restarts=restarts, exit_code=1), 200.0)
    return state


def test_a_reading_of_an_ended_run_says_when_how_and_why() -> None:
    failure = Failure(rank=1, exit_code=None, signal="SIGKILL")
    reading = read(_ended("failed", failure, restarts=1), 201.0)
    assert (reading.ended, reading.outcome) == (200.0, ("failed", "signal"))
    assert reading.failures == {"signal": 2}  # the restart's, and the last's
    stopped = read(_ended("stopped", None, restarts=0), 201.0)
    assert (stopped.outcome, stopped.failures) == (("stopped", ""), {})
    running = RunState(run="r")
    running.apply(wire.RunStatus(run="r", rank=-1, seq=1, t=50.0, status="running",
                                 world_size=2), 50.0)
    live = read(running, 51.0)
    assert (live.ended, live.outcome, live.failures) == (None, None, {})
    # Served: no end and no outcome sample while it runs, every cause counted from 0.
    found = served(live)
    assert found["ddtop_run_end_timestamp_seconds"] == []
    assert found["ddtop_run_outcome"] == []
    assert {s.labels["cause"]: s.value for s in found["ddtop_run_failures"]} == {
        c: 0.0 for c in endings.CAUSES}


def test_a_rank_series_is_the_same_from_its_start_and_across_restarts() -> None:
    state = RunState(run="r")
    state.apply(wire.RunStatus(run="r", rank=-1, seq=1, t=50.0, status="starting",
                               world_size=2), 50.0)
    state.apply(wire.Hello(run="r", rank=0, seq=0, t=51.0, host="here", pid=100, local_rank=0,
                           world_size=2, device="cpu", backend="gloo", model="mlp",
                           dataset="synthetic", epochs=1, global_batch=64,
                           config_digest=""), 51.0)
    before = {r.labels[1]: r for r in read(state, 52.0, host="here").ranks}
    # Rank 1 has not said hello: its node's host (the daemon's) labels it already.
    assert before["1"].labels == ("r", "1", "0", "here") and before["1"].pid == ""
    assert before["0"].labels == ("r", "0", "0", "here") and before["0"].pid == "100"
    found = served(read(state, 52.0, host="here"))
    assert [s.labels for s in found["ddtop_rank"]] == [
        {"run": "r", "rank": "0", "node": "0", "host": "here", "pid": "100",
         "local_rank": "0", "device": "cpu"}]  # rank 1's process is not known yet: no sample
    assert all(set(s.labels) == {"run", "rank", "node", "host"}
               for s in found["ddtop_rank_global_step"])


def test_a_rank_of_a_node_not_known_yet_gets_no_node_or_host() -> None:
    """A multi-node job's hub: a rank whose node has not been heard of is not labelled
    node 0 and the hub's host (a series that would stay wrong once its node says)."""
    state = RunState(run="r")
    state.apply(wire.RunStatus(run="r", rank=-1, seq=1, t=50.0, status="starting",
                               world_size=4), 50.0)
    state.node_states = {0: "up"}  # a multi-node job, node 0 heard of
    state.rank_nodes = {0: 0, 1: 0}
    labels = {r.labels[1]: r.labels for r in read(state, 51.0, host="hub").ranks}
    assert labels["0"] == ("r", "0", "0", "hub") and labels["1"] == ("r", "1", "0", "hub")
    assert labels["2"] == ("r", "2", "", "") and labels["3"] == ("r", "3", "", "")


def scrape(url: str) -> dict[str, list[Any]]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_a_failed_run_is_served_as_failed_until_stop_ends_the_linger(tmp_path: Path) -> None:
    with detached("-n", "2", "--epochs", "20", "--step-delay", "0.05", "--max-restarts", "1",
                  "--inject", "1:kill@step=3", "--metrics", "0", "--metrics-linger",
                  f"{LINGER_S:g}", "--run-id", "end", cwd=tmp_path) as run:
        assert run.started.returncode == 0, run.started.stdout + run.started.stderr
        record = tmp_path / "runs" / "end" / "run.json"
        url = json.loads(record.read_text())["endpoints"]["metrics"]
        # Drills act in the first attempt only: the restarted rank 1 is killed from here.
        again = run.wait_for("end", lambda s: s["restarts"] == 1 and s["status"] == "running"
                             and s["ranks"][1]["pid"] != s["timeline"][0]["pid"]
                             and all(r["global_step"] > 0 for r in s["ranks"]), timeout=90)
        os.kill(again["ranks"][1]["pid"], signal.SIGKILL)
        status = run.wait_for("end", lambda s: s["status"] == "failed", timeout=60)
        assert status["restarts"] == 1
        found = scrape(url)  # the daemon lingers: the final state is still served
        ended = time.monotonic()
        assert {s.labels["status"]: s.value for s in found["ddtop_run_status"]}["failed"] == 1
        [outcome] = found["ddtop_run_outcome_info"]
        assert (outcome.labels["outcome"], outcome.labels["cause"]) == ("failed", "signal")
        failures = {s.labels["cause"]: s.value for s in found["ddtop_run_failures"]}
        assert failures["signal"] == 2 and sum(failures.values()) == 2, failures
        [end] = found["ddtop_run_end_timestamp_seconds"]
        assert abs(end.value - time.time()) < 60
        restarts = {s.labels["rank"]: s.value for s in found["ddtop_rank_restarts"]}
        assert restarts["1"] == 1, restarts
        # One series per rank, its process on ddtop_rank_info: the restarted one's pid.
        assert sorted(s.labels["rank"] for s in found["ddtop_rank_global_step"]) == ["0", "1"]
        pids = {s.labels["rank"]: s.labels["pid"] for s in found["ddtop_rank_info"]}
        assert pids["1"] == str(again["ranks"][1]["pid"]), pids
        # The shipped alert fires on it, in a real Prometheus (its rules evaluated every s).
        with prometheus(tmp_path, [urllib.parse.urlsplit(url).netloc],
                        quick_rules(tmp_path)) as server:
            deadline = time.monotonic() + 30
            while not (fired := [a for a in server.firing() if a["alertname"] ==
                                 "DdtopRunFailed"]) and time.monotonic() < deadline:
                time.sleep(0.2)
        assert [(a["run"], a["cause"]) for a in fired] == [("end", "signal")], fired
        stopped = run.cli("stop", "end")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert "kept serving its final metrics (--metrics-linger), is ended" in stopped.stdout
        assert run.leftovers() == []
        assert time.monotonic() - ended < LINGER_S / 2  # ended by the stop, not the time
        log = (tmp_path / "runs" / "end" / "daemon.log").read_text()
        assert f"kept for {LINGER_S:g} s more, for the last scrapes" in log


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_start_of_the_same_run_ends_its_lingering_daemon_first(tmp_path: Path) -> None:
    """A resume right after the end listens where the ended run's daemon still serves
    its final metrics: that daemon (its lock let go, its run ended) is ended first."""
    import io

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with detached("-n", "1", "--epochs", "1", "--synthetic-train-samples", "256",
                  "--metrics", str(port), "--metrics-linger", f"{LINGER_S:g}",
                  "--run-id", "again", cwd=tmp_path) as run:
        assert run.started.returncode == 0, run.started.stdout + run.started.stderr
        paths = RunPaths(tmp_path / "runs" / "again")
        status = run.wait_for("again", lambda s: s["status"] == "succeeded", timeout=90)
        deadline = time.monotonic() + 30
        while run_held(paths) and time.monotonic() < deadline:  # the daemon ends the run
            time.sleep(0.1)
        assert not run_held(paths) and status["status"] == "succeeded"
        assert scrape(f"http://127.0.0.1:{port}/metrics")["ddtop_run_outcome_info"]
        said = io.StringIO()
        started = time.monotonic()
        end_lingering(paths, said)
        assert "ended the run's previous daemon" in said.getvalue()
        assert time.monotonic() - started < LINGER_S / 4
        assert run.leftovers() == []
