"""A rank's process: what runs between the daemon's fork and the training loop.

The daemon's forkserver imports this module (and so torch) once; every rank
is then forked from it, ready to train. `rank_main` is shared with torchrun's
entry point (`python -m ddtop.training`) and turns every way a rank can fail
into an exit code and an error report the daemon can show.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Imported here so that the forkserver pays for torch once, not every rank;
# torch._dynamo too, which DDP's constructor imports (~1 s, 900 modules).
import torch._dynamo  # noqa: F401

from ddtop.core.config import TrainConfig
from ddtop.core.contract import (
    ATTEMPT_ENV,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    STACKS_SIGNAL,
    ErrorReport,
    PortTaken,
    UsageError,
)
from ddtop.core.processes import lead_own_session, pid_alive, set_parent_death_signal
from ddtop.core.rundir import RunPaths, log_stream
from ddtop.training import errorreport, flightrec, profiling, stopping
from ddtop.training.distributed import RankEnv
from ddtop.training.rendezvous import install as install_loopback
from ddtop.training.trainer import train

# Everything loaded so far (torch's and dynamo's few hundred thousand objects) is
# taken out of the garbage collector's sight: the ranks' collections skip it, the
# forkserver's children share its pages (a collection writes to every object it
# walks), and an exit does not walk it again (a second of CPU per process).
gc.freeze()

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
    """Send this process's stdout and stderr (Python's and C's) to its log; lines
    a full disk refuses are dropped, never raised into training (rundir.log_stream)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = log_stream(1)
    sys.stderr = log_stream(2)


def write_error_report(path: Path | None, report: ErrorReport) -> None:
    """The rank's error report, whole or not at all (training/errorreport.py)."""
    errorreport.write(path, report)


def rank_main(config: TrainConfig, env: RankEnv, error_report: Path | None,
              launch_time: float | None = None, prepare: Callable[[], object] = lambda: None
              ) -> int:
    """`prepare()`, then train; return the exit code. Never lets an exception
    escape unreported."""
    def body() -> None:
        prepare()
        train(config, env, launch_time)

    return run_reported(body, env.rank, error_report)


def run_reported(body: Callable[[], object], rank: int, error_report: Path | None,
                 own_frames: Callable[[str], bool] = lambda filename: False) -> int:
    """Run `body`; its exit code: 0, SystemExit's code, 2 for bad input (UsageError),
    1 for an exception, which is printed with its traceback (less the leading
    frames `own_frames` says are ours) and written to the error report the
    daemon reads (into room held for it from the start: a full disk, the likely
    cause, cannot refuse it)."""
    errorreport.reserve(error_report)
    try:
        return _run_reported(body, rank, error_report, own_frames)
    finally:
        errorreport.release(error_report)  # written by now, or not needed


def _run_reported(body: Callable[[], object], rank: int, error_report: Path | None,
                  own_frames: Callable[[str], bool]) -> int:
    try:
        body()
    except PortTaken as e:  # not the user's doing: the daemon starts the ranks again
        print(f"ddtrain: {e}", file=sys.stderr, flush=True)
        write_error_report(error_report, ErrorReport(rank=rank, kind="port_taken",
                                                     message=str(e)))
        return EXIT_FAILED
    except UsageError as e:
        print(f"ddtrain: error: {e}", file=sys.stderr, flush=True)
        write_error_report(error_report, ErrorReport(rank=rank, kind="usage", message=str(e)))
        return EXIT_USAGE
    except SystemExit as e:  # as the interpreter would: an int is the code, else printed
        if e.code is None or isinstance(e.code, int):
            return e.code or EXIT_OK
        print(e.code, file=sys.stderr, flush=True)
        write_error_report(error_report, ErrorReport(rank=rank, message=str(e.code)))
        return EXIT_FAILED
    except BaseException as e:  # noqa: BLE001 - reported below, then the rank exits non-zero
        frames = e.__traceback__
        while frames is not None and own_frames(frames.tb_frame.f_code.co_filename):
            frames = frames.tb_next
        tb = "".join(traceback.format_exception(type(e), e, frames))
        print(tb, file=sys.stderr, flush=True)
        write_error_report(error_report, ErrorReport(rank=rank, kind="exception",
                                                     message=f"{type(e).__name__}: {e}",
                                                     traceback=tb))
        return EXIT_FAILED
    return EXIT_OK


def torchrun_environment(rank: int, world_size: int, master_addr: str, master_port: int,
                         attempt: int) -> dict[str, str]:
    """The variables torchrun gives each rank on one machine, so that code written
    for torchrun (ours, or a user's `init_process_group()`) runs unchanged."""
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size), "ROLE_NAME": "default",
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(attempt), ATTEMPT_ENV: str(attempt),
    }


def enter_rank(rank: int, run_dir: str, daemon_pid: int) -> RunPaths:
    """What every rank the daemon forks does first: lead a session of its own
    (what it starts and leaves running when it exits is found there and ended:
    daemon/leftovers.py), die with the daemon, leave Ctrl-C to it (the daemon
    decides what it means), and write its output to its own log."""
    lead_own_session()
    die_with_daemon(daemon_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    paths = RunPaths(Path(run_dir))
    redirect_output(paths.rank_log(rank))
    dump_stacks_on_signal(paths.rank_stacks(rank))
    return paths


_stacks_file: Any = None  # open for the life of the rank: faulthandler writes to its fd


def dump_stacks_on_signal(path: Path) -> None:
    """On STACKS_SIGNAL, append every thread's Python stack to `path` (`ddtrain
    stacks`), from faulthandler's C handler: also while blocked in a collective."""
    global _stacks_file
    try:
        _stacks_file = path.open("a")
    except OSError as e:
        print(f"ddtrain: stacks will not be available for this rank: {e}", file=sys.stderr)
        return
    faulthandler.register(STACKS_SIGNAL, file=_stacks_file, all_threads=True, chain=False)
    flightrec.watch(path)  # its Flight Recorder dumped beside them, by the sender thread
    profiling.watch(path)  # and profile requests looked for beside them


def leave_rank(code: int) -> None:
    """Flush and exit at once, skipping interpreter teardown (and atexit handlers
    inherited from the forkserver); everything that matters is flushed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launched_rank(rank: int, world_size: int, config_dict: dict[str, Any], run_dir: str,
                  master_addr: str, master_port: int, launch_time: float,
                  daemon_pid: int, attempt: int = 0) -> None:
    """Entry of a rank of the built-in trainer started by ddtrain's daemon (in the
    forked child); `attempt` counts restarts after failures (0: the first start)."""
    stopping.install()
    paths = enter_rank(rank, run_dir, daemon_pid)
    # The same variables torchrun sets, so both launch paths share one code path.
    os.environ.update(torchrun_environment(rank, world_size, master_addr, master_port, attempt))
    config = TrainConfig.from_dict(config_dict)
    leave_rank(rank_main(config, RankEnv.from_environ(), paths.rank_error(rank), launch_time,
                         prepare=lambda: install_loopback(rank, world_size, master_addr,
                                                       master_port)))
