"""The detached daemon with real processes and real sockets: start, status,
list, logs, snapshots, hostile input, stop; a killed rank; a killed daemon.

The tests of the `live` run share one 2-rank run and go in file order; the
last of them stops it. The torchrun launcher's restart runs beside them.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from helpers import DDTRAIN, Detached, Together, detached, together

from ddtop.core import blame, control, journal, protocol, state, wire

pytestmark = pytest.mark.processes  # every test here starts processes, or shares a run that does

# It trains until the module ends, while its tests look at it: --step-delay keeps it
# stepping (20 steps/s a rank at most) without taking the cores from the other tests.
STEP_DELAY_S = 0.05
LONG_RUN = ("-n", "2", "--epochs", "50", "--run-id", "live", "--step-delay", str(STEP_DELAY_S))


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Detached]:
    with detached(*LONG_RUN, cwd=tmp_path_factory.mktemp("daemon")) as run:
        yield run


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Together]:
    """The torchrun launcher's run with rank 1 killed once, in the foreground:
    started with the module's first test, to run beside the `live` run's tests."""
    with together(tmp_path_factory.mktemp("restarted")) as runs:
        runs.start("tr", [DDTRAIN, "start", "--foreground", "--launcher", "torchrun", "-n", "2",
                          "--epochs", "2", "--synthetic-train-samples", "4096",
                          "--checkpoint-every", "20", "--max-restarts", "1", "--run-id", "tr",
                          "--inject", "1:kill@step=40"])
        yield runs


def run_json(run: Detached, rid: str = "live") -> dict:  # type: ignore[type-arg]
    return run_json_at(run.cwd / "runs" / rid)


@pytest.mark.usefixtures("restarted")  # started now, to run beside the tests up to its own
def test_start_detaches_and_says_how_to_watch_and_stop(live: Detached) -> None:
    out = live.started
    assert out.returncode == 0, out.stdout + out.stderr
    assert "started run live: 2 ranks (all ranks up)" in out.stdout
    assert "ddtrain stop live" in out.stdout and "ddtrain status live" in out.stdout
    record = run_json(live)
    assert record["status"] == "running"
    assert os.getpgid(record["daemon_pid"]) == record["daemon_pid"]  # its own process group
    assert set(record["endpoints"]) == {"telemetry", "publish", "control"}
    # Local sockets in an owner-only folder (was: tcp://127.0.0.1, open to every local user).
    sockets = live.cwd / "runs" / "live" / "sock"
    assert record["endpoints"] == {name: f"ipc://{sockets / name}"
                                   for name in ("telemetry", "publish", "control")}
    assert stat.S_IMODE(sockets.stat().st_mode) == 0o700
    assert stat.S_IMODE(sockets.parent.stat().st_mode) == 0o700


def test_status_json_has_every_rank_live(live: Detached) -> None:
    status = live.wait_for("live", lambda s: all(r["global_step"] > 0 for r in s["ranks"]))
    assert status["status"] == "running" and status["daemon_alive"] is True
    assert [r["rank"] for r in status["ranks"]] == [0, 1]
    for r in status["ranks"]:
        assert r["state"] == "running" and r["pid"] > 0 and r["exit_code"] is None
        assert r["loss"] is not None and r["samples_per_s"] > 0
        assert r["step_time_s"] >= STEP_DELAY_S  # --step-delay: each step waits for it
    assert status["model"] == "mlp" and status["world_size"] == 2
    table = live.cli("status")  # the newest run, for people
    assert table.returncode == 0
    assert "run live: running" in table.stdout and "RANK" in table.stdout


def test_list_shows_the_run(live: Detached) -> None:
    listed = live.cli("list", "--json")
    assert listed.returncode == 0
    (row,) = json.loads(listed.stdout)
    assert (row["run_id"], row["status"], row["world_size"]) == ("live", "running", 2)
    human = live.cli("list")
    assert "live" in human.stdout and "running" in human.stdout


def test_logs_are_prefixed_with_rank_and_host(live: Detached) -> None:
    logs = live.cli("logs", "live", "--rank", "0")
    assert logs.returncode == 0
    lines = logs.stdout.splitlines()
    assert lines and all(line.startswith("[rank 0 ") for line in lines)
    assert any("first step done" in line for line in lines)
    bad = live.cli("logs", "live", "--rank", "5")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "--rank 5 is not a rank of run live (ranks 0..1)" in bad.stderr


def test_a_late_subscriber_gets_a_snapshot_that_agrees_with_the_journal(live: Detached
                                                                        ) -> None:
    endpoints = run_json(live)["endpoints"]
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoints["publish"])
    try:
        # Subscribed once a first message came (the live run sends ten a second).
        assert sub.poll(30_000), "nothing published in 30 s"
        live_messages = [wire.decode_relayed(sub.recv_multipart(), "live")]
        reply = control.request(endpoints["control"], protocol.Snapshot(), 5.0)
        assert reply.ok
        seen, snapshot = reply.seq, state.decode_snapshot(reply.state)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            if sub.poll(100):
                live_messages.append(wire.decode_relayed(sub.recv_multipart(), "live"))
    finally:
        sub.close()
        context.term()
    seqs = [s for s, _ in live_messages]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # nothing lost on the way
    assert seqs[0] <= seen + 1 < seqs[-1]  # subscribed before the snapshot; more came after
    for seq, message in live_messages:
        if seq > seen:
            snapshot.apply(message, time.time())
    # The daemon flushes its journal every loop (0.1 s): wait until it holds the last.
    path, deadline = live.cwd / "runs" / "live" / "telemetry.journal", time.monotonic() + 10.0
    replayed, last = journal.replay(path, "live", upto=seqs[-1])
    while last < seqs[-1] and time.monotonic() < deadline:
        time.sleep(0.05)
        replayed, last = journal.replay(path, "live", upto=seqs[-1])
    assert last == seqs[-1]
    assert sorted(snapshot.ranks) == sorted(replayed.ranks) == [0, 1]
    for rank in (0, 1):
        a, b = snapshot.ranks[rank], replayed.ranks[rank]
        fields = ("global_step", "samples", "received", "lost", "max_seq", "loss", "phase")
        assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
        assert [p.global_step for p in a.history] == [p.global_step for p in b.history]
    assert [e.message for e in snapshot.events] == [e.message for e in replayed.events]
    assert snapshot.aggregate == replayed.aggregate


def test_hostile_input_is_counted_and_dropped_and_the_daemon_keeps_serving(live: Detached
                                                                           ) -> None:
    endpoints = run_json(live)["endpoints"]
    before = live.status("live")["ranks"][0]["global_step"]
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    dealer = context.socket(zmq.DEALER)
    try:
        push.connect(endpoints["telemetry"])
        good = msgspec.to_builtins(wire.Bye(run="live", rank=0, seq=10**9, exit_code=0))
        flood = 20_000
        for _ in range(flood):
            push.send(b"\xc1 not msgpack")
        # The sender stays open until the daemon has counted everything it sent: libzmq
        # may drop what is still in flight over ipc when a sender under back-pressure
        # closes, whatever its linger (zeromq/libzmq#4660); twice in CI that cost the
        # frames at the end of this stream, though the daemon counted all it received.
        live.wait_for("live", lambda s: s["rejected"].get("malformed") == flood, timeout=60)
        push.send(b"x" * (wire.MAX_FRAME_BYTES + 1), copy=True)
        push.send(msgspec.msgpack.encode({**good, "v": 99}))
        push.send(msgspec.msgpack.encode({**good, "run": "another-run"}))
        push.send_multipart([b"two", b"frames"])
        push.send(msgspec.msgpack.encode({**good, "rank": -1, "kind": "run_status",
                                          "status": "failed", "world_size": 2}))
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoints["control"])
        dealer.send(b"\x00garbage")
        assert dealer.poll(5000), "the daemon stopped answering requests"
        assert msgspec.msgpack.decode(dealer.recv())["ok"] is False
        dealer.send(msgspec.msgpack.encode({"op": "reboot"}))
        assert dealer.poll(5000)
        assert "unknown op" in msgspec.msgpack.decode(dealer.recv())["error"]
        expected = {"malformed": flood + 1, "oversized": 1, "wrong_version": 1, "wrong_run": 1,
                    "forged": 1, "bad_request": 2}
        status = live.wait_for("live", lambda s: s["rejected"] == expected, timeout=30)
    finally:
        push.close(linger=0)
        dealer.close(linger=0)
        context.term()
    assert status["status"] == "running"  # the forged "failed" was not believed
    after = live.wait_for("live", lambda s: s["ranks"][0]["global_step"] > before)
    assert all(r["state"] == "running" for r in after["ranks"])


def test_stop_is_graceful_and_leaves_nothing(live: Detached) -> None:
    stopped = live.cli("stop", "live", "--timeout", "30")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "run live stopped; resume with: ddtrain start --resume --run-id live" in stopped.stdout
    assert live.leftovers() == []
    status = live.status("live")
    assert status["status"] == "stopped" and status["daemon_alive"] is False
    assert [(r["state"], r["exit_code"]) for r in status["ranks"]] == [("finished", 0)] * 2
    root = live.cwd / "runs" / "live"
    log = (root / "logs" / "rank-0.log").read_text()
    assert "stopped as asked after step" in log
    step = int(log.split("stopped as asked after step ")[1].split()[0])
    assert (root / "checkpoints" / f"step-{step:08d}.pt").is_file()  # both ranks agreed on it
    again = live.cli("stop", "live")
    assert again.returncode == 0 and "is not running (stopped)" in again.stdout


def test_a_killed_rank_fails_the_run_and_is_named(tmp_path: Path) -> None:
    with detached("-n", "2", "--epochs", "1", "--run-id", "kill", "--inject", "1:kill@step=20",
                  cwd=tmp_path) as run:
        status = run.wait_for("kill", lambda s: s["status"] != "running")
        assert run.leftovers() == []
    assert status["status"] == "failed"
    failure = status["failure"]
    assert (failure["rank"], failure["signal"]) == (1, "SIGKILL")
    assert status["ranks"][1]["state"] == "dead" and status["ranks"][1]["signal"] == "SIGKILL"
    # Rank 0 is stopped by the daemon, or (a race the daemon nearly always wins; lost
    # once in CI) it dies of the lost peer first, gloo's error: a victim, not blamed.
    exits = [m for m in (wire.decode([r.frame]) for r in journal.read(
        tmp_path / "runs" / "kill" / "telemetry.journal")) if isinstance(m, wire.RankExit)]
    rank0 = next(m for m in exits if m.exited == 0)
    assert not rank0.culprit and (rank0.stopped_by_daemon or blame.PEER_LOSS.search(
        rank0.message or "")), rank0
    assert status["ranks"][0]["stopped_by_daemon"] is rank0.stopped_by_daemon
    table = run.cli("status", "kill")
    assert "failure: rank 1 killed by SIGKILL" in table.stdout
    replayed, _ = journal.replay(tmp_path / "runs" / "kill" / "telemetry.journal", "kill")
    assert replayed.status == "failed" and replayed.failure is not None
    # The last step it reported (steps go out every 0.1 s, so it may lag the fault).
    assert replayed.failure.signal == "SIGKILL" and replayed.failure.global_step <= 20


def test_killing_the_daemon_leaves_no_rank_behind(tmp_path: Path) -> None:
    with detached("-n", "2", "--epochs", "50",
                  "--step-delay", "0.05", "--run-id", "orphans", cwd=tmp_path) as run:
        assert run.started.returncode == 0, run.started.stderr
        pid = run_json(run, "orphans")["daemon_pid"]
        os.kill(pid, signal.SIGKILL)
        assert run.leftovers(timeout=5.0) == []
        status = run.status("orphans")
        listed = run.cli("list")
    assert status["status"] == "lost"
    assert {r["state"] for r in status["ranks"]} == {"lost"}
    assert "orphans" in listed.stdout and "lost" in listed.stdout


def test_torchrun_launcher_restarts_a_killed_rank(restarted: Together) -> None:
    run, tmp_path = restarted.result("tr"), restarted.cwd("tr")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.leftovers == []
    assert "restart 1/1: rank 1 was killed by SIGKILL" in run.stderr
    assert "restarting from step-00000040.pt" in run.stderr
    assert "[rank 0] resumed from step-00000040.pt" in run.stdout  # the ranks' logs, echoed
    record = run_json_at(tmp_path / "runs" / "tr")
    assert (record["status"], record["restarts"]) == ("succeeded", 1)
    assert [(r["rank"], r["exit_code"]) for r in record["ranks"]] == [(0, 0), (1, 0)]
    (entry,) = record["timeline"]
    assert (entry["rank"], entry["signal"]) == (1, "SIGKILL")
    # torchrun, not the daemon, ended rank 0 once rank 1 died, and it is said so (or,
    # a race, rank 0 died of the lost peer first): a victim either way, not blamed.
    exits = [m for m in (wire.decode([r.frame]) for r in journal.read(
        tmp_path / "runs" / "tr" / "telemetry.journal")) if isinstance(m, wire.RankExit)]
    rank0 = next(m for m in exits if m.exited == 0)
    assert not rank0.culprit
    if rank0.signal == "SIGTERM":
        assert rank0.stopped_by_daemon, rank0
        assert rank0.reason == "was stopped by torchrun (SIGTERM) after rank 1 failed", rank0
    else:
        assert blame.PEER_LOSS.search(rank0.message or ""), rank0


def test_torchrun_launcher_stops_gracefully(tmp_path: Path) -> None:
    with detached("--launcher", "torchrun", "-n", "2", "--epochs", "50",
                  "--step-delay", "0.05", "--run-id", "trs",
                  cwd=tmp_path) as run:
        assert run.started.returncode == 0, run.started.stderr
        run.wait_for("trs", lambda s: all(r["global_step"] > 0 for r in s["ranks"]))
        stopped = run.cli("stop", "trs")
        assert stopped.returncode == 0 and "run trs stopped" in stopped.stdout
        assert run.leftovers() == []
    record = run_json_at(tmp_path / "runs" / "trs")
    assert record["status"] == "stopped"
    assert [r["exit_code"] for r in record["ranks"]] == [0, 0]
    assert "stopped as asked" in (tmp_path / "runs/trs/logs/rank-0.log").read_text()


def run_json_at(root: Path) -> dict:  # type: ignore[type-arg]
    data: dict = json.loads((root / "run.json").read_text())  # type: ignore[type-arg]
    return data
