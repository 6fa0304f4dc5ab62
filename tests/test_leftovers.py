"""What a rank leaves running when it exits (daemon/leftovers.py): ended once
the ranks have ended, named, and never what the run waits for.

Real runs of tests/scripts/leaves_children.py, whose every rank leaves a
`sleep 300` (Popen, never waited for) and a forked "prefetcher" (which holds
multiprocessing's pipes) behind; and, in-process, a real session whose leader
has exited. The foreground runs start together (a module fixture)."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import DDTRAIN, Together, detached, together

from ddtop.core.processes import ProcessId, same_process, send_signal
from ddtop.daemon import leftovers

SCRIPT = Path(__file__).parent / "scripts" / "leaves_children.py"
TIMEOUT_S = 90  # a run takes a few seconds; before the fix, the command waited for 300


def left_pids(root: Path) -> set[int]:
    return {int(m) for rank in (0, 1) for m in re.findall(
        r"^LEFT (\d+)$", (root / "logs" / f"rank-{rank}.log").read_text(), re.M)}


def escaped(root: Path) -> set[int]:
    """What the ranks said they left (none before they said it): the escaped
    stay, not waited for."""
    try:
        return left_pids(root)
    except OSError:
        return set()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Together]:
    """The foreground runs, started together (their start-ups and waits overlap):
    `lc` with either launcher, and `le`, whose escaped processes stay."""
    with together(tmp_path_factory.mktemp("leftovers")) as started:
        for launch, args in (("local", []), ("torchrun", ["--launcher", "torchrun"])):
            started.start(launch, [DDTRAIN, "start", "--foreground", "--headless", "-n", "2",
                                   *args, "--run-id", "lc", str(SCRIPT)], timeout=TIMEOUT_S)
        le = started.cwd("le") / "runs" / "le"
        started.start("le", [DDTRAIN, "start", "--foreground", "-n", "2", "--run-id", "le",
                             str(SCRIPT), "--", "escape"], timeout=TIMEOUT_S,
                      staying=lambda: escaped(le))
        yield started


@pytest.mark.parametrize("launch", ["local", "torchrun"])  # and --launcher torchrun
@pytest.mark.processes
def test_what_the_ranks_leave_running_is_ended_and_named(runs: Together, launch: str) -> None:
    run, tmp_path = runs.result(launch), runs.cwd(launch)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "run lc succeeded" in run.stderr
    assert "rank   1 finished" in run.stdout  # the headless summary, after the end
    for rank in (0, 1):
        named = [line for line in run.stderr.splitlines() if f"rank {rank} left" in line]
        assert len(named) == 1, run.stderr
        line = named[0]
        assert line.startswith(f"ddtrain: rank {rank} left 2 processes behind (pid ")
        assert "sleep" in line and line.endswith("): terminated"), line
    assert len(left_pids(tmp_path / "runs" / "lc")) == 4
    assert run.leftovers == []


@pytest.mark.processes
def test_a_detached_daemon_ends_what_the_ranks_left_and_exits(tmp_path: Path) -> None:
    with detached("-n", "2", "--run-id", "ld", str(SCRIPT), cwd=tmp_path) as run:
        assert run.started.returncode == 0, run.started.stderr
        run.wait_for("ld", lambda s: s["status"] == "succeeded", timeout=TIMEOUT_S)
        assert run.leftovers() == []  # the daemon too: it waited for the sleepers before
    log = (tmp_path / "runs" / "ld" / "daemon.log").read_text()
    assert "rank 0 left 2 processes behind" in log and "rank 1 left 2 processes behind" in log


@pytest.mark.processes
def test_a_process_that_left_the_ranks_session_does_not_hold_the_run(runs: Together) -> None:
    """Forked, then its own session: not found, so not ended (it is its own); the
    forkserver and resource tracker whose pipes it holds are killed after 5 s
    rather than waited for."""
    run, tmp_path, started = runs.result("le"), runs.cwd("le"), runs.began["le"]
    assert run.returncode == 0, run.stdout + run.stderr
    assert time.monotonic() - started < TIMEOUT_S
    assert "multiprocessing's forkserver did not exit within 5 s" in run.stderr
    for rank in (0, 1):  # the sleep, still in the session
        assert f"rank {rank} left 1 process behind" in run.stderr
    # The escaped ones were left running (the test's clean-up has killed them).
    assert len(run.leftovers) == 2 and set(run.leftovers) <= left_pids(tmp_path / "runs/le")


@pytest.mark.processes
def test_a_sessions_members_are_found_once_its_leader_has_exited() -> None:
    child: ProcessId | None = None
    leader = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; read line"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        assert leader.stdout is not None and leader.stdin is not None
        child = ProcessId.of(int(leader.stdout.readline()))
        assert child is not None
        # The shell forks, then its child execs sleep: named `sleep` only from then on.
        comm = Path(f"/proc/{child.pid}/comm")
        deadline = time.monotonic() + 10
        while comm.read_text().strip() != "sleep":
            assert time.monotonic() < deadline, comm.read_text()
            time.sleep(0.01)
        identity = ProcessId.of(leader.pid)
        assert identity is not None
        # The leader runs: what it started is its own business.
        assert leftovers.in_sessions({3: identity}) == []
        leader.stdin.close()  # it exits; its sleep stays in its session
        leader.wait(10)
        found = leftovers.in_sessions({3: identity})
        assert [(f.rank, f.process, f.name) for f in found] == [(3, child, "sleep")]
        ended, killed = leftovers.end(lambda: leftovers.in_sessions({3: identity}))
        assert [f.process for f in ended] == [found[0].process] and killed == set()
        assert not same_process(found[0].process)
        assert leftovers.describe(ended, killed) == [
            f"rank 3 left 1 process behind (pid {child.pid} sleep): terminated"]
    finally:
        leader.kill()
        leader.wait()
        send_signal(child, signal.SIGKILL)


def test_the_line_counts_names_and_says_how_each_ended() -> None:
    found = [leftovers.Leftover(0, ProcessId(100 + k, 1), "python") for k in range(6)]
    lines = leftovers.describe([*found, leftovers.Leftover(None, ProcessId(7, 1), "sh")],
                               {ProcessId(100, 1)})
    assert lines == [
        "rank 0 left 6 processes behind (pid 100 python, pid 101 python, pid 102 python, "
        "pid 103 python and 2 more): 5 terminated, 1 killed with SIGKILL",
        "a rank left 1 process behind (pid 7 sh): terminated"]


def test_a_ranks_own_process_outliving_its_launcher_is_said_once_as_the_rank() -> None:
    """Before: a lost node's headline said "rank 0 (pid N) ..." and then "rank 0 left
    1 process behind (pid N)", rank 0's own pid taken for something it started."""
    own = leftovers.Leftover(0, ProcessId(4242, 1), "python", own=True)
    child = leftovers.Leftover(0, ProcessId(4250, 1), "sleep")
    assert leftovers.describe([own, child], {ProcessId(4242, 1)}) == [
        "rank 0 (pid 4242) was still running after its launcher exited: killed with SIGKILL",
        "rank 0 left 1 process behind (pid 4250 sleep): terminated"]
    assert leftovers.describe([own], set()) == [
        "rank 0 (pid 4242) was still running after its launcher exited: terminated"]


@pytest.mark.processes
def test_a_helper_is_killed_as_idle_only_while_it_sleeps(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """The forkserver or resource tracker told to exit: one asleep with no CPU run
    (waiting on a pipe a stray process holds) is killed once HELPER_IDLE_S shows it
    idle; one not asleep (here stopped, state T; on a loaded machine runnable, R, or
    reading the disk, D) is not idle, and is killed only at HELPER_EXIT_MAX_S. Real
    processes; the limits shortened."""
    import threading

    from ddtop.daemon import local

    monkeypatch.setattr(local, "HELPER_EXIT_S", 0.2)
    monkeypatch.setattr(local, "HELPER_IDLE_S", 0.2)
    monkeypatch.setattr(local, "HELPER_EXIT_MAX_S", 3.0)
    for stop, least, most in ((False, 0.4, 2.5), (True, 3.0, 6.0)):
        helper = subprocess.Popen(["sleep", "60"])
        try:
            if stop:
                helper.send_signal(signal.SIGSTOP)
            killed: dict[str, bool] = {}
            started = time.monotonic()
            watch = threading.Thread(target=local._kill_when_idle,
                                     args=("forkserver", helper.pid, killed, threading.Event()))
            watch.start()
            watch.join(10)
            took = time.monotonic() - started
            assert killed == {"forkserver": True}
            assert helper.wait(5) == -signal.SIGKILL
            assert least <= took < most, (stop, took)
        finally:
            helper.kill()
            helper.wait()
