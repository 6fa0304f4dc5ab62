"""The process contract: what ddtrain, its daemon, the ranks and ddtop agree on
across process boundaries (environment variables, exit codes, a rank's error
report), and how a process's end is put in words. Imported by training,
daemon and dashboard alike; it imports nothing of ours, so any of them may.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Literal

import msgspec

# -- environment variables ---------------------------------------------------------
# Where ranks send telemetry (a ZeroMQ endpoint, tcp://HOST:PORT); "off" or unset:
# they publish nothing (telemetry_endpoint). The daemon sets it for its ranks unless
# the user did.
TELEMETRY_ENV = "DDTOP_TELEMETRY"
# "off": in a process ddtrain did not start, the start-up hook instruments nothing
# (training/starthook.py); `import ddtop` calls still report.
ZERO_CODE_ENV = "DDTOP_ZERO_CODE"
# The run's config.json, for ranks the daemon starts through torchrun
# (`python -m ddtop.training` reads its settings from there).
CONFIG_ENV = "DDTOP_CONFIG"
# The daemon's pid: ranks watch it and exit at once when it is gone.
DAEMON_PID_ENV = "DDTOP_DAEMON_PID"
# `ddtrain watch`: where a rank it did not start writes its stacks (logs/rank-K.stacks).
STACKS_DIR_ENV = "DDTOP_STACKS_DIR"
# Restarts so far (0: the first start); set by the daemon for every rank.
ATTEMPT_ENV = "DDTOP_ATTEMPT"
# The run id telemetry must carry (the daemon drops other runs' messages); set by
# the daemon for a user's script, whose ranks have no config.json to read it from.
RUN_ID_ENV = "DDTOP_RUN_ID"
# The secret that signs the built-in trainer's stop step in torch's store
# (training/stopping.py): set by the daemon in its ranks' environment only, never
# on a command line; the same on every node of a job (core/keys.py stop_secret).
STOP_SECRET_ENV = "DDTOP_STOP_SECRET"
# Fault drills: how `ddtrain start --inject` hands its specs to the ranks, comma-
# separated in core/inject.py's grammar (1:kill@step=50,0:slow=1.5x); a rank acts
# on its own in training/drills.py. Set from --inject only: `ddtrain start` removes
# one it inherits (daemon/cli.py arm_drills).
FAULT_ENV = "DDTOP_FAULT"
# torch's Flight Recorder: the entries (last collectives) each rank keeps. `ddtrain
# start` sets it for the ranks it starts (--flight-recorder; else the one it
# inherits; else FR_ENTRIES): training/flightrec.py dumps them for the evidence.
FR_ENV = "TORCH_FR_BUFFER_SIZE"
FR_ENTRIES = 2000
# Beside a rank's stacks file (rank-K.stacks): its Flight Recorder's JSON dump.
FR_JSON_SUFFIX = ".fr.json"
MAX_FR_ENTRIES = 1_000_000
# Where runs live when --runs-dir is not given (else ./runs).
RUNS_DIR_ENV = "DDTOP_RUNS_DIR"
# The file mode creation mask the user had (octal), before `ddtrain start` made
# everything of the run owner-only (0o077); a user's program runs with it again.
USER_UMASK_ENV = "DDTOP_USER_UMASK"
OWNER_ONLY_UMASK = 0o077


def telemetry_endpoint() -> str | None:
    """Where this process sends telemetry: DDTOP_TELEMETRY's endpoint, or None when
    it is unset, empty or "off"."""
    endpoint = os.environ.get(TELEMETRY_ENV)
    return None if not endpoint or endpoint == "off" else endpoint


def owner_only_umask() -> None:
    """From here on, files and folders this process (and every process it starts)
    creates are its owner's alone; the mask it had is kept for user programs."""
    previous = os.umask(OWNER_ONLY_UMASK)
    os.environ.setdefault(USER_UMASK_ENV, oct(previous))


def restore_user_umask() -> None:
    """In a rank, before the user's program: the mask the user started ddtrain with."""
    with contextlib.suppress(ValueError):  # not set (started another way), damaged: leave it
        os.umask(int(os.environ.get(USER_UMASK_ENV, ""), 8))

# The signal on which a rank writes every thread's Python stack to its stacks file
# (faulthandler; `ddtrain stacks`). SIGUSR1 is the built-in trainer's graceful stop.
STACKS_SIGNAL = signal.SIGUSR2

# -- exit codes (ddtrain, ddtop --headless and every rank; docs/cli.md) ----------------
EXIT_OK = 0
EXIT_FAILED = 1  # a rank failed (or the daemon was lost)
EXIT_USAGE = 2  # bad input: one line naming the flag to fix
EXIT_INTERRUPTED = 130  # stopped: Ctrl-C or `ddtrain stop`


class UsageError(Exception):
    """Bad input: reported as one line, exit code 2 (EXIT_USAGE), never a traceback."""


class PortTaken(Exception):
    """Rank 0 could not bind MASTER_PORT, which the daemon picked (PORT_PICKED_ENV):
    another process bound it between the daemon's choice and rank 0's bind. Not the
    user's doing: the daemon starts the ranks again on another port."""


# Set (to "1") in the ranks' environment when the daemon picked MASTER_PORT itself
# (no --master-port): a port in use is then the daemon's to pick again, not the user's.
PORT_PICKED_ENV = "DDTOP_MASTER_PORT_PICKED"


# The exit code that tells a run's outcome, by the run's final status.
EXIT_BY_STATUS = {"succeeded": EXIT_OK, "failed": EXIT_FAILED, "lost": EXIT_FAILED,
                  "stopped": EXIT_INTERRUPTED}


def exit_for_status(status: str) -> int:
    """A run's outcome as an exit code; a run that has not ended counts as failed."""
    return EXIT_BY_STATUS.get(status, EXIT_FAILED)


def signal_name(code: int | None) -> str | None:
    """`SIGKILL` for a process exit code of -9 (Python's way of saying "killed by
    a signal"); None for a normal exit or none yet."""
    if code is None or code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def describe_exit(exit_code: int | None, signal: str | None, short: bool = False) -> str:
    """How a process ended, in words: 'was killed by SIGKILL' / 'exited with code 1',
    or with `short` 'killed by SIGKILL' / 'exit code 1'. A negative `exit_code`
    (Python's for a signal) is read as that signal."""
    signal = signal or signal_name(exit_code)
    if signal is not None:
        return f"killed by {signal}" if short else f"was killed by {signal}"
    return f"exit code {exit_code}" if short else f"exited with code {exit_code}"


class ErrorReport(msgspec.Struct, kw_only=True):
    """Why a rank failed, in its own words: logs/rank-<k>.error.json, written by
    the rank (training/worker.py), read by the daemon (core/blame.py)."""

    # usage: bad input, the run exits 2; port_taken: MASTER_PORT, which the daemon
    # picked, was bound by another process first (PortTaken): the daemon starts the
    # ranks again on another port
    kind: Literal["usage", "exception", "port_taken"] = "exception"
    message: str = ""
    traceback: str = ""
    time: float = msgspec.field(default_factory=time.time)  # wall clock when written
    rank: int | None = None
