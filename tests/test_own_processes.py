"""The daemon signals only processes it started itself, known by pid *and*
start time: /proc parsing (a command name with spaces and parentheses), a
reused pid is never signalled, a run.json whose daemon pid now names another
process is lost, an old run.json without start times (naming pid 1, or a
`sleep`) gets nothing signalled, and a forged hello cannot turn `stop` against
a stranger.

Every process a test starts here is a child of the test, killed at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
from helpers import DDTRAIN, ddtrain, detached, finish, start

from ddtop.core import wire
from ddtop.core.processes import (
    ProcessId,
    boot_id,
    descendants,
    environ_value,
    lineage,
    parse_stat,
    read_stat,
    same_process,
    send_signal,
)
from ddtop.core.rundir import RunPaths, write_json_atomic
from ddtop.core.summary import ProcessRecord, RunRecord, encode_record

# A command name that defeats splitting /proc/<pid>/stat on spaces, and on the first ')'.
TRICKY = "x) (y z) 1"
SLEEP_S = "60"


@contextlib.contextmanager
def sleeper(argv: list[str] | None = None, **popen: object) -> Iterator[subprocess.Popen[bytes]]:
    """An unrelated process (`sleep 60` unless told), killed and reaped at the end."""
    proc = subprocess.Popen(argv or ["sleep", SLEEP_S], stdin=subprocess.DEVNULL,
                            **popen)  # type: ignore[call-overload]
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# -- /proc ------------------------------------------------------------------------------
def test_parse_stat_counts_fields_from_the_last_parenthesis() -> None:
    tail = " ".join(str(n) for n in range(23, 53))
    text = f"4242 ({TRICKY}) S 17 4242 4242 0 -1 4194560 1 2 3 4 5 6 7 8 20 0 1 0 987654 {tail}"
    assert parse_stat(text).state == "S"
    assert (parse_stat(text).ppid, parse_stat(text).start) == (17, 987654)
    assert text.split()[21] != "987654"  # what splitting on spaces would have read
    for broken in ("", "4242 no parentheses S 1", "4242 (cut) S 1 2"):
        with pytest.raises(ValueError):
            parse_stat(broken)


@pytest.mark.processes
def test_a_real_process_named_with_spaces_and_parentheses(tmp_path: Path) -> None:
    # The command name is the executable's file name: a link to sleep named TRICKY.
    (tmp_path / TRICKY).symlink_to(Path(subprocess.check_output(
        ["sh", "-c", "command -v sleep"], text=True).strip()))
    with sleeper([str(tmp_path / TRICKY), SLEEP_S]) as proc:
        wait_for(lambda: (Path(f"/proc/{proc.pid}/comm").read_text().strip() == TRICKY))
        text = Path(f"/proc/{proc.pid}/stat").read_text()
        # Read independently: the known name in its parentheses, then fields 3.. on.
        expected = text.split(f"({TRICKY}) ", 1)[1].split()
        stat = read_stat(proc.pid)
        assert stat is not None
        assert (stat.state, stat.ppid, stat.start) == (expected[0], os.getpid(), int(expected[19]))
        me = ProcessId.of(proc.pid)
        assert me == ProcessId(proc.pid, stat.start, boot_id()) and same_process(me)


@pytest.mark.processes
def test_a_pid_is_signalled_only_while_it_names_the_same_process() -> None:
    with sleeper() as proc:
        me = ProcessId.of(proc.pid)
        assert me is not None and me.start is not None
        later = ProcessId(proc.pid, me.start + 1, me.boot)  # as if the pid had been reused
        other_boot = ProcessId(proc.pid, me.start, "another-boot")
        legacy = ProcessId(proc.pid)  # a record without a start time: the pid alone
        assert [same_process(p) for p in (me, later, other_boot, legacy)] == [
            True, False, False, True]
        assert not send_signal(legacy, signal.SIGTERM)  # which process it is cannot be checked
        assert not send_signal(later, signal.SIGTERM)
        assert not send_signal(other_boot, signal.SIGTERM)
        assert not send_signal(None, signal.SIGTERM)
        assert proc.poll() is None  # not signalled
        assert send_signal(me, signal.SIGTERM)
        assert proc.wait(timeout=10) == -signal.SIGTERM
        assert not same_process(me) and not send_signal(me, signal.SIGTERM)  # gone, reaped
        assert ProcessId.of(proc.pid) is None


@pytest.mark.processes
def test_descendants_and_their_environment() -> None:
    script = f"sleep {SLEEP_S} & sleep {SLEEP_S} & wait"
    with sleeper(["sh", "-c", script], env={**os.environ, "RANK": "7"},
                 start_new_session=True) as proc:
        try:
            root = ProcessId.of(proc.pid)
            assert root is not None
            wait_for(lambda: len(descendants(root)) == 2)
            found = descendants(root)
            assert {depth for _, depth in found} == {1}
            for child, _ in found:
                assert environ_value(child.pid, "RANK") == "7"
                assert environ_value(child.pid, "NO_SUCH_VARIABLE") is None
                assert same_process(child)
            # A root that is no longer itself has no descendants.
            assert descendants(ProcessId(proc.pid, (root.start or 0) + 1, root.boot)) == []
        finally:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.processes
def test_a_senders_lineage_and_torchruns_rank_check(tmp_path: Path) -> None:
    """torchrun's workers are checked on the claimed process itself: its parents
    up to the agent (lineage), RANK in its environment, and no process between it
    and the agent with a RANK (a worker's own children inherit it). Here a shell
    stands for the agent, a shell with RANK=1 for the worker, and its two `sleep`s
    for a data loader (RANK=1, inherited) and a child claiming RANK=0."""
    from ddtop.daemon.torchrun import TorchrunRanks

    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    script = f"RANK=1 sh -c 'sleep {SLEEP_S} & RANK=0 sleep {SLEEP_S} & wait' & wait"
    with sleeper(["sh", "-c", script], env=env, start_new_session=True) as proc:
        try:
            agent = ProcessId.of(proc.pid)
            assert agent is not None
            wait_for(lambda: len(descendants(agent)) == 3
                     and all(environ_value(p.pid, "RANK") for p, _ in descendants(agent)))
            (worker, _), = [(p, d) for p, d in descendants(agent) if d == 1]
            loaders = {environ_value(p.pid, "RANK"): p for p, d in descendants(agent) if d == 2}
            loader, other = loaders["1"], loaders["0"]
            assert lineage(loader.pid, agent) == [loader.pid, worker.pid]
            assert lineage(worker.pid, agent) == [worker.pid]
            mine = ProcessId.of(os.getpid())
            assert mine is not None
            assert lineage(loader.pid, mine) == [loader.pid, worker.pid, proc.pid]
            assert lineage(os.getpid(), agent) is None  # not below the agent
            assert lineage(loader.pid, ProcessId(proc.pid, (agent.start or 0) + 1, agent.boot)) \
                is None  # the agent's pid, but not the agent: a later process

            ranks = TorchrunRanks(RunPaths(tmp_path / "run"), 0, time.time())
            ranks.agent, ranks.world_size = agent, 2
            assert not ranks.is_rank(1, os.getpid())  # RANK unset, not below the agent
            assert not ranks.is_rank(1, loader.pid)  # the worker's child
            assert not ranks.is_rank(0, other.pid)  # RANK=0, but below rank 1's worker
            assert not ranks.is_rank(0, worker.pid)  # the worker of another rank
            assert not ranks.is_rank(2, worker.pid)  # no such rank
            assert (0, other.pid) in ranks.refused and (1, loader.pid) in ranks.refused
            assert not ranks.is_rank(0, other.pid)  # asked again: refused from memory
            assert ranks.is_rank(1, worker.pid) and ranks.seen[1].pid == worker.pid
            assert ranks.seen[1] == ProcessId.of(worker.pid)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)


# -- run.json names a daemon pid that is another process now --------------------------------
def recorded_run(root: Path, daemon_pid: int, start_ticks: int | None) -> None:
    """A run.json as a daemon killed mid-run would leave it."""
    root.mkdir(parents=True)
    write_json_atomic(root / "config.json", {"world_size": 2})
    record = RunRecord(run_id=root.name, status="running", world_size=2, daemon_pid=daemon_pid,
                       daemon_start_ticks=start_ticks, boot_id=boot_id() if start_ticks else "",
                       processes=[ProcessRecord(rank=0, pid=daemon_pid, start_ticks=start_ticks)])
    (root / "run.json").write_bytes(encode_record(record))


@pytest.mark.processes
def test_a_reused_daemon_pid_is_lost_and_never_signalled(tmp_path: Path) -> None:
    with sleeper() as stranger:
        me = ProcessId.of(stranger.pid)
        assert me is not None and me.start is not None
        # The daemon had this pid, but started at another time: it is gone, the
        # sleep got its pid.
        recorded_run(tmp_path / "runs" / "reused", stranger.pid, me.start - 1)
        status = ddtrain("status", "reused", "--json", cwd=tmp_path, timeout=60)
        assert status.returncode == 0, status.stderr
        doc = json.loads(status.stdout)
        assert (doc["status"], doc["daemon_alive"]) == ("lost", False)
        table = ddtrain("status", "reused", cwd=tmp_path, timeout=60)
        assert f"run reused: lost (daemon gone; pid {stranger.pid} is another process now" in (
            table.stdout)
        stop = ddtrain("stop", "reused", "--timeout", "1", cwd=tmp_path, timeout=60)
        assert stop.returncode == 0, stop.stderr
        assert "run reused is not running (lost" in stop.stdout
        assert f"pid {stranger.pid} is another process now, left alone" in stop.stdout
        time.sleep(0.2)
        assert stranger.poll() is None and same_process(me)  # still there, untouched


def daemon_lookalike(tmp_path: Path) -> list[str]:
    """argv of a `sleep` whose command line is a ddtrain daemon's (a link named ddtrain)."""
    link = tmp_path / "bin" / "ddtrain"
    link.parent.mkdir()
    link.symlink_to(Path(subprocess.check_output(["sh", "-c", "command -v sleep"],
                                                 text=True).strip()))
    return [str(link), SLEEP_S]


@pytest.mark.processes
def test_a_record_without_start_times_is_never_signalled(tmp_path: Path) -> None:
    """run.json written by an earlier version: the daemon's pid without its start
    time. A live pid whose command line is not a ddtrain daemon's is not the
    daemon (lost); one that looks like a daemon is taken for it, but neither is
    ever signalled: the pid alone cannot say which process it names now."""
    with sleeper() as stranger, sleeper(daemon_lookalike(tmp_path)) as lookalike:
        recorded_run(tmp_path / "runs" / "older", stranger.pid, None)
        status = ddtrain("status", "older", "--json", cwd=tmp_path, timeout=60)
        assert status.returncode == 0, status.stderr
        doc = json.loads(status.stdout)
        assert (doc["status"], doc["daemon_alive"]) == ("lost", False)
        stop = ddtrain("stop", "older", "--timeout", "1", cwd=tmp_path, timeout=60)
        assert (stop.returncode, stop.stdout, stop.stderr) == (0, (
            f"ddtrain: run older is not running (lost); run.json names pid {stranger.pid} "
            "without its start time; not signalling a process whose identity cannot be "
            "checked\n"), "")

        recorded_run(tmp_path / "runs" / "looks", lookalike.pid, None)  # no control endpoint
        doc = json.loads(ddtrain("status", "looks", "--json", cwd=tmp_path, timeout=60).stdout)
        assert (doc["status"], doc["daemon_alive"]) == ("running", True)
        stop = ddtrain("stop", "looks", "--timeout", "1", cwd=tmp_path, timeout=60)
        assert stop.returncode == 1, stop.stdout + stop.stderr
        assert stop.stdout.splitlines() == [
            f"ddtrain: run looks: the daemon (pid {lookalike.pid}) does not answer (no control "
            f"endpoint in run.json); run.json names pid {lookalike.pid} without its start time; "
            "not signalling a process whose identity cannot be checked (stop it yourself if "
            "it is the run's daemon)"]
        time.sleep(0.2)  # a SIGTERM sent would have ended either by now
        assert stranger.poll() is None and lookalike.poll() is None  # neither signalled


UNSHARE = subprocess.run(["sh", "-c", "command -v unshare"], capture_output=True,
                         text=True).stdout.strip()


@pytest.mark.skipif(os.geteuid() != 0 or not UNSHARE, reason="a pid namespace needs root")
@pytest.mark.processes
def test_a_record_naming_pid_1_never_signals_it(tmp_path: Path) -> None:
    """An old run.json naming pid 1: `ddtrain stop` runs in a pid namespace of
    its own, whose pid 1 is a shell that notes any SIGTERM (this machine's pid 1
    is never named), and leaves it alone."""
    recorded_run(tmp_path / "runs" / "init", 1, None)
    marker = tmp_path / "pid-1-signalled"
    script = (f'trap "echo TERM > {marker}" TERM; "$0" stop init --timeout 1; '
              'echo "exit $?"; sleep 0.2')  # the trap runs once the command is done
    proc, tag = start([UNSHARE, "--pid", "--fork", "--mount-proc", "sh", "-c", script,
                       DDTRAIN], cwd=tmp_path)
    run = finish(proc, tag, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert not marker.exists(), run.stdout
    assert run.stdout == ("ddtrain: run init is not running (lost); run.json names pid 1 "
                          "without its start time; not signalling a process whose identity "
                          "cannot be checked\nexit 0\n"), run.stderr
    assert run.leftovers == []


@pytest.mark.processes
def test_the_daemon_records_its_own_start_time(tmp_path: Path) -> None:
    run = ddtrain("start", "--foreground", "-n", "2", "--epochs", "1",
                  "--synthetic-train-samples", "256", "--run-id", "own", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.leftovers == []
    record = json.loads((tmp_path / "runs" / "own" / "run.json").read_text())
    assert record["boot_id"] == boot_id()
    assert isinstance(record["daemon_start_ticks"], int) and record["daemon_start_ticks"] > 0
    assert [p["rank"] for p in record["processes"]] == [0, 1]
    assert all(isinstance(p["start_ticks"], int) for p in record["processes"])


# -- a forged hello under --launcher torchrun -------------------------------------------
def forged_hello(run: str, rank: int, pid: int) -> list[bytes]:
    return wire.encode(wire.Hello(
        run=run, rank=rank, seq=0, t=time.time(), local_rank=rank, host="forged", pid=pid,
        device="cpu", backend="gloo", world_size=2, config_digest="forged", model="mlp",
        dataset="synthetic", epochs=50, global_batch=64))


def send(endpoint: str, frames_list: list[list[bytes]]) -> None:
    context = zmq.Context()
    try:
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 2000)  # delivered before the socket closes
        push.connect(endpoint)
        for frames in frames_list:
            push.send_multipart(frames)
        push.close()
    finally:
        context.term()


@pytest.mark.processes
def test_a_forged_hello_cannot_make_stop_signal_a_stranger(tmp_path: Path) -> None:
    """Hellos claiming rank 9 and rank 1 with an unrelated process's pid, then a
    stop: the daemon asks only the ranks torchrun's agent started; the stranger
    (which SIGUSR1 would kill) lives on."""
    with detached("--launcher", "torchrun", "-n", "2", "--epochs", "50",
                  "--step-delay", "0.05", "--run-id", "forged",
                  cwd=tmp_path) as run, sleeper() as stranger:
        assert run.started.returncode == 0, run.started.stderr
        run.wait_for("forged", lambda s: all(r["global_step"] > 0 for r in s["ranks"]))
        record = json.loads((tmp_path / "runs" / "forged" / "run.json").read_text())
        send(record["endpoints"]["telemetry"],
             [forged_hello("forged", 9, stranger.pid), forged_hello("forged", 1, stranger.pid)])
        # Dropped by the daemon before the stop: rank 9 is no rank of the run, and the
        # hello for rank 1 came from a process that is not rank 1.
        run.wait_for("forged", lambda s: {"rank_out_of_range", "foreign_pid"} <= set(
            s["rejected"]), timeout=30)
        stopped = run.cli("stop", "forged")
        assert stopped.returncode == 0 and "run forged stopped" in stopped.stdout, (
            stopped.stdout + stopped.stderr)
        assert stranger.poll() is None  # SIGUSR1 would have killed it
        assert run.leftovers() == []
    record = json.loads((tmp_path / "runs" / "forged" / "run.json").read_text())
    assert record["status"] == "stopped"
    assert [r["exit_code"] for r in record["ranks"][:2]] == [0, 0]  # both asked, both stopped
    assert "stopped as asked" in (tmp_path / "runs/forged/logs/rank-0.log").read_text()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
