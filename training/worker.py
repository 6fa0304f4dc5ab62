"""A rank's process: what runs between the daemon's fork and the training loop.

The daemon's forkserver imports this module (and so torch) once; every rank
is then forked from it, ready to train. `rank_main` is shared with torchrun's
entry point (`python -m ddtop.training`) and turns every way a rank can fail
into an exit code and an error report the daemon can show.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

# Imported here so that the forkserver pays for torch once, not every rank;
# torch._dynamo too, which DDP's constructor imports (~1 s, 900 modules).
import msgspec
import torch._dynamo  # noqa: F401

from ddtop.daemon.config import TrainConfig, UsageError
from ddtop.daemon.contract import ATTEMPT_ENV, EXIT_FAILED, EXIT_OK, EXIT_USAGE, ErrorReport
from ddtop.daemon.processes import pid_alive, set_parent_death_signal
from ddtop.daemon.runs import RunPaths
from ddtop.training import stopping
from ddtop.training.distributed import RankEnv
from ddtop.training.trainer import train

# Seconds between liveness checks of the daemon where pidfds are unavailable.
DAEMON_POLL_S = 1.0


def die_with_daemon(daemon_pid: int) -> None:
    """Exit at once (SIGKILL) when the daemon dies, so that a killed daemon
    never leaves ranks behind.

    The daemon is not this process's parent under forkserver (the forkserver
    is, and it outlives the daemon while ranks hold its pipe), so a daemon
    thread waits on a pidfd of the daemon itself; PDEATHSIG covers the parent.
    """
    set_parent_death_signal()
    try:
        pidfd = os.pidfd_open(daemon_pid)
    except ProcessLookupError:  # already gone
        os._exit(EXIT_FAILED)
    except (AttributeError, OSError):
        pidfd = None
    threading.Thread(target=_wait_for_exit, args=(daemon_pid, pidfd), daemon=True,
                     name="ddtrain-daemon-watch").start()


def _wait_for_exit(pid: int, pidfd: int | None) -> None:
    if pidfd is not None:
        select.select([pidfd], [], [])  # readable once the process has exited
    else:
        while pid_alive(pid):
            time.sleep(DAEMON_POLL_S)
    os.kill(os.getpid(), signal.SIGKILL)


def redirect_output(log: Path) -> None:
    """Send this process's stdout and stderr (Python's and C's) to its log."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives as long as the process
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def write_error_report(path: Path | None, report: ErrorReport) -> None:
    if path is None:
        return
    try:
        path.write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=2) + b"\n")
    except OSError as e:
        print(f"could not write error report {path}: {e}", file=sys.stderr)


def rank_main(config: TrainConfig, env: RankEnv, error_report: Path | None,
              launch_time: float | None = None) -> int:
    """Train; return the exit code. Never lets an exception escape unreported."""
    try:
        train(config, env, launch_time)
    except UsageError as e:
        print(f"ddtrain: error: {e}", file=sys.stderr, flush=True)
        write_error_report(error_report, ErrorReport(rank=env.rank, kind="usage",
                                                     message=str(e)))
        return EXIT_USAGE
    except BaseException as e:  # noqa: BLE001 - reported below, then the rank exits non-zero
        if isinstance(e, SystemExit) and e.code in (None, 0):
            return EXIT_OK
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        write_error_report(error_report, ErrorReport(rank=env.rank, kind="exception",
                                                     message=f"{type(e).__name__}: {e}",
                                                     traceback=tb))
        return EXIT_FAILED
    return EXIT_OK


def launched_rank(rank: int, world_size: int, config_dict: dict[str, Any], run_dir: str,
                  master_addr: str, master_port: int, launch_time: float,
                  daemon_pid: int, attempt: int = 0) -> None:
    """Entry of a rank started by ddtrain's daemon (in the forked child);
    `attempt` counts restarts after failures (0: the first start)."""
    stopping.install()
    die_with_daemon(daemon_pid)
    # Ctrl-C reaches the whole terminal's process group; the daemon decides
    # what it means and stops the ranks itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    paths = RunPaths(Path(run_dir))
    redirect_output(paths.rank_log(rank))
    # The same variables torchrun sets, so both launch paths share one code path.
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0",
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        ATTEMPT_ENV: str(attempt),
    })
    config = TrainConfig.from_dict(config_dict)
    code = rank_main(config, RankEnv.from_environ(), paths.rank_error(rank), launch_time)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown (and atexit handlers inherited from the
    # forkserver); everything that matters is flushed and closed.
    os._exit(code)
