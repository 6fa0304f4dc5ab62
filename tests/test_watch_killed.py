"""A `ddtrain watch -- COMMAND` whose daemon is killed: the command and its ranks
end with it (PDEATHSIG, the command's own session, the guard of
daemon/watchguard.py), and `ddtrain stop` of the lost run finds and ends what
is left, by the run's environment, never by a recorded pid alone. Real
processes: torchrun's 2 gloo ranks, and a command that ignores SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import DDTRAIN, TORCHRUN, finish, start, tagged_env, tagged_pids

SCRIPT = Path(__file__).parent / "scripts" / "plain_ddp.py"
# A command that ignores SIGTERM, and a child of it that does too: only a guard's
# SIGKILL, or `ddtrain stop`'s, ends them.
STUBBORN = ("import signal, subprocess, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
            "time.sleep(600)\n")
GONE_WITHIN_S = 12.0  # the guard's SIGTERM, its 5 s of grace, then SIGKILL


def wait_for(what: str, check, timeout: float = 60.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (got := check()):
            return got
        time.sleep(0.2)
    raise AssertionError(f"never: {what}")


def record(root: Path, run: str) -> dict:  # type: ignore[type-arg]
    path = root / "runs" / run / "run.json"
    return json.loads(path.read_text()) if path.exists() else {}


def live_status(root: Path, run: str) -> dict:  # type: ignore[type-arg]
    done = ddtrain_here(root, "status", run, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def others(tag: str, daemon: int) -> list[int]:
    """The run's processes but its daemon (and the ddtrain that is it)."""
    return [p for p in tagged_pids(tag) if p != daemon]


def ddtrain_here(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DDTRAIN, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60, env=tagged_env("ctl"))


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_killed_watch_of_torchrun_takes_torchrun_and_its_ranks_with_it(tmp_path: Path) -> None:
    proc, tag = start([DDTRAIN, "watch", "--run-id", "kw", "--", TORCHRUN, "--standalone",
                       "--nproc-per-node", "2", str(SCRIPT)], tmp_path,
                      {"STEPS": "100000", "SLEEP": "0.05"})
    try:
        wait_for("both ranks stepping", lambda: record(tmp_path, "kw") and len([
            r for r in live_status(tmp_path, "kw")["ranks"] if r["global_step"] > 2]) == 2)
        daemon = record(tmp_path, "kw")["daemon_pid"]
        assert len(others(tag, daemon)) >= 4  # torchrun, 2 ranks, the guard
        os.kill(daemon, signal.SIGKILL)
        t0 = time.monotonic()
        wait_for("torchrun and its ranks gone", lambda: not others(tag, daemon),
                 GONE_WITHIN_S)
        print(f"\nthe watched torchrun and its ranks ended {time.monotonic() - t0:.1f} s "
              "after the daemon's SIGKILL")
    finally:
        run = finish(proc, tag, timeout=30)
    assert run.returncode == -signal.SIGKILL
    assert run.leftovers == []
    stop = ddtrain_here(tmp_path, "stop", "kw")
    assert stop.returncode == 0, stop.stderr
    assert "is not running (lost" in stop.stdout and "stopping" not in stop.stdout, stop.stdout


@pytest.mark.processes
@pytest.mark.timeout(90)
def test_the_guard_ends_a_command_that_ignores_sigterm_and_its_child(tmp_path: Path) -> None:
    proc, tag = start([DDTRAIN, "watch", "--run-id", "stubborn", "--", sys.executable, "-c",
                       STUBBORN], tmp_path)
    try:
        daemon = wait_for("run.json", lambda: record(tmp_path, "stubborn").get("daemon_pid"))
        wait_for("the command, its child and the guard",
                 lambda: len(others(tag, daemon)) == 3)
        os.kill(daemon, signal.SIGKILL)
        wait_for("the command and its child ended", lambda: not others(tag, daemon),
                 GONE_WITHIN_S)
    finally:
        run = finish(proc, tag, timeout=30)
    assert run.leftovers == []
    log = (tmp_path / "runs/stubborn/logs/command.log").read_text()
    assert f"the watch's daemon (pid {daemon}) is gone: ended what it started" in log, log
    assert "2 needed SIGKILL" in log, log


@pytest.mark.processes
@pytest.mark.timeout(90)
def test_ddtrain_stop_of_a_lost_watch_ends_what_it_started_and_nothing_else(
        tmp_path: Path) -> None:
    proc, tag = start([DDTRAIN, "watch", "--run-id", "lost", "--", sys.executable, "-c",
                       STUBBORN], tmp_path)
    decoy = None
    try:
        daemon = wait_for("run.json", lambda: record(tmp_path, "lost").get("daemon_pid"))
        wait_for("the command, its child and the guard",
                 lambda: len(others(tag, daemon)) == 3)
        guard = next(p for p in others(tag, daemon) if "watchguard" in cmdline(p))
        # Another of the owner's processes that names the daemon's pid, but not the
        # run: never signalled.
        decoy = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)"],
            env={**tagged_env("decoy"), "DDTOP_DAEMON_PID": str(daemon),
                 "DDTOP_RUN_ID": "another"})
        os.kill(guard, signal.SIGKILL)  # the guard gone first: nothing ends them
        os.kill(daemon, signal.SIGKILL)
        time.sleep(1.0)  # the command's PDEATHSIG SIGTERM, ignored
        left = others(tag, daemon)
        assert len(left) == 2, [cmdline(p) for p in left]
        status = ddtrain_here(tmp_path, "status", "lost")
        assert "daemon gone" in status.stdout, status.stdout
        stop = ddtrain_here(tmp_path, "stop", "lost", "--timeout", "1")
        assert stop.returncode == 0, stop.stderr
        assert "is not running (lost)" in stop.stdout, stop.stdout
        assert f"its daemon (pid {daemon}) is gone, but what it started is not" in stop.stdout
        assert "ended 2 processes, 2 with SIGKILL" in stop.stdout, stop.stdout
        assert not others(tag, daemon)
        assert decoy.poll() is None  # left alone
    finally:
        if decoy is not None:
            decoy.kill()
            decoy.wait()
        run = finish(proc, tag, timeout=30)
    assert run.leftovers == []
