"""A watched command ends with its watch, however the watch ends.

`ddtrain watch -- COMMAND` runs COMMAND as the daemon's child. When the daemon
is killed (SIGKILL, the OOM killer, a node's reboot of the job step), the
command must not train on unwatched and out of `ddtrain stop`'s reach. Three
means, each covering what the one before cannot:

- the kernel sends the command SIGTERM when the daemon dies (PDEATHSIG, set
  between fork and exec): torchrun, accelerate and srun stop their ranks on it;
- the command leads a session and process group of its own, so what it starts
  can be told from everything else the owner runs;
- a guard (this module, `python -m ddtop.daemon.watchguard`), a small process
  in a session of its own, waits on a pidfd of the daemon. When the daemon is
  gone it ends every process the watch started that is still there: those
  whose starting environment names the daemon's pid and the run's id (the
  watch environment, daemon/watching.py), started no earlier than the
  command. SIGTERM, then SIGKILL after GRACE_S (daemon/leftovers.end). A
  command that died without ending its ranks, or a rank that ignores SIGTERM,
  is ended too. After a normal end the daemon has ended them already, and the
  guard finds nothing.

`ddtrain stop` of a run whose daemon is gone (lost) uses `started_by` too, from
run.json's record of the daemon's pid and start time: a process that merely
got a recorded pid again never carries the run's environment, so it is never
signalled.

    python -m ddtop.daemon.watchguard DAEMON_PID DAEMON_START RUN_ID SINCE_START LOG
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import time
from pathlib import Path

from ddtop.core.contract import DAEMON_PID_ENV, RUN_ID_ENV
from ddtop.core.processes import ProcessId, boot_id, environ_value, same_process
from ddtop.daemon.leftovers import Leftover, end, with_environment

GRACE_S = 5.0  # SIGTERM, then this long before SIGKILL
POLL_S = 0.5  # without pidfds: how often the daemon is looked for


def started_by(daemon_pid: int, run_id: str, since: ProcessId) -> list[Leftover]:
    """The processes of this run's watch environment still alive: their starting
    environment names `daemon_pid` and `run_id`, and they started no earlier
    than `since` (the command, or the daemon). A later process given one of
    their pids carries neither."""
    if since.boot and since.boot != boot_id():
        return []  # recorded during another boot: nothing of it is left
    return [p for p in with_environment(DAEMON_PID_ENV, str(daemon_pid), since)
            if environ_value(p.process.pid, RUN_ID_ENV) == run_id]


def describe(found: list[Leftover]) -> str:
    return ", ".join(f"pid {p.process.pid} ({p.name})" for p in found)


def wait_gone(daemon: ProcessId) -> None:
    """Return once `daemon` has exited (at once, if it has already)."""
    try:
        pidfd = os.pidfd_open(daemon.pid)
    except ProcessLookupError:
        return
    except OSError:  # no pidfds here: look every POLL_S
        while same_process(daemon):
            time.sleep(POLL_S)
        return
    try:
        if same_process(daemon):  # the pidfd names it from now on: it cannot be reused
            select.select([pidfd], [], [])
    finally:
        os.close(pidfd)


def start_guard(run_id: str, command: ProcessId, log: Path) -> subprocess.Popen[bytes]:
    """The guard of this daemon's watched commands (daemon side): started once,
    in a session of its own, writing to the command's log."""
    me = ProcessId.of(os.getpid())
    assert me is not None and me.start is not None
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", __spec__.name if __spec__ else "ddtop.daemon.watchguard",
             str(me.pid), str(me.start), run_id, str(command.start or me.start), str(log)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)


def main(argv: list[str]) -> int:
    daemon_pid, daemon_start, run_id, since_start, log = argv
    daemon = ProcessId(int(daemon_pid), int(daemon_start), boot_id())
    wait_gone(daemon)
    since = ProcessId(daemon.pid, int(since_start), daemon.boot)
    found, killed = end(lambda: started_by(daemon.pid, run_id, since), GRACE_S)
    if found:
        with contextlib.suppress(OSError), Path(log).open("a") as out:
            hard = f"; {len(killed)} needed SIGKILL" if killed else ""
            out.write(f"ddtrain: the watch's daemon (pid {daemon.pid}) is gone: ended what "
                      f"it started: {describe(found)}{hard}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
