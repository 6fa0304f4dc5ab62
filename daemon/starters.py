"""How a run's ranks get started: what the supervisor asks of each way.

What each rank runs (the built-in trainer, or the user's own script) is a
`RankProgram`; how ranks are started is a `RankStarter`'s business. The
run's loop (daemon/runloop.py) does not know how ranks come to be: it
asks a `RankStarter` to start them, waits on the processes it returns, and
asks it again, once those exited, how each rank ended. Two starters exist:

    LocalRanks     (daemon/local.py)     forked from the daemon's forkserver (torch
                                         imported once), or spawned
    TorchrunRanks  (daemon/torchrun.py)  `torchrun --standalone` runs them; the daemon
                                         supervises torchrun's agent

A third (a user's own script as every rank) is one more class with these
three methods and two attributes, and one more entry in the supervisor's
STARTERS table.
"""

from __future__ import annotations

import errno
import signal
import socket
from dataclasses import dataclass
from typing import Protocol

from ddtop.core import wire
from ddtop.core.blame import RankEnd
from ddtop.core.config import TrainConfig
from ddtop.core.contract import UsageError
from ddtop.core.processes import LogTail, Process, ProcessId
from ddtop.core.state import RunState
from ddtop.core.text import rank_list
from ddtop.daemon.leftovers import Leftover
from ddtop.daemon.relaunches import Relaunch

AGENT = -1  # the `rank` of a process that is not a rank itself (torchrun's agent)
COMMAND = wire.COMMAND_RANK  # ... of the command `ddtrain watch` runs
WATCH = wire.WATCH_RANK  # ... and of a watch without a command, waiting for its ranks


def process_name(rank: int) -> str:
    """'rank 3', "torchrun's agent" or 'the command'."""
    return f"rank {rank}" if rank >= 0 else wire.launcher_name(rank)


@dataclass(frozen=True)
class RankProgram:
    """What every rank runs, whichever way it is started."""

    module: str  # imported in each rank (and by the forkserver, ahead of the forks)
    entry: str  # the module's function a forked or spawned rank calls
    torchrun_module: str  # what torchrun runs: python -m ...
    # How the daemon asks a rank to stop: the built-in trainer stops gracefully on
    # SIGUSR1 (its ranks agree on a step and checkpoint); a user's program gets
    # SIGTERM, as torchrun would send it.
    stop_signal: int


BUILT_IN = RankProgram("ddtop.training.worker", "launched_rank", "ddtop.training",
                       signal.SIGUSR1)
USER_PROGRAM = RankProgram("ddtop.training.script", "launched_script",
                           "ddtop.training.script", signal.SIGTERM)


def rank_program(config: TrainConfig) -> RankProgram:
    return USER_PROGRAM if config.runs_user_code else BUILT_IN


@dataclass
class Rank:
    """A supervised process: a rank, or an agent that runs ranks (rank AGENT)."""

    rank: int
    process: Process
    exitcode: int | None = None  # negative: killed by that signal
    stopped_by_us: bool = False  # the daemon terminated it
    noted: bool = False  # its exit was reported to the relay
    ended: float | None = None  # wall clock when the daemon saw it exit
    others_running: bool = False  # other ranks of the attempt still ran when it exited
    left_early_at: int | None = None  # exited 0 before its work was done, at this step
    reason: str | None = None  # how it ended, where its exit code cannot say (watched ranks)
    # Who stopped it, where not the daemon: "by SLURM (scancel of job step 42.0)".
    stopped_by: str | None = None

    def end(self) -> RankEnd:
        """Its exit as the blame policy takes it."""
        return RankEnd(self.exitcode or 0, self.stopped_by_us,
                       left_early=self.left_early_at is not None, ended=self.ended)


def stopped_by_launcher(ranks: list[Rank], launcher: str) -> None:
    """The ranks a launcher (torchrun: `launcher`) ended with SIGTERM after another
    rank failed, while the daemon stopped nothing: victims, as a daemon's stop
    makes them, but said as the launcher's doing ("was stopped by torchrun
    (SIGTERM) after rank 1 failed"), not the daemon's."""
    failed = sorted(r.rank for r in ranks if r.rank >= 0 and r.exitcode and not r.stopped_by_us)
    if not failed:
        return
    after = rank_list(failed)
    for r in ranks:
        if r.stopped_by_us and r.exitcode == -signal.SIGTERM and r.reason is None:
            r.reason = f"was stopped by {launcher} (SIGTERM) after {after} failed"


class RankStarter(Protocol):
    # The rendezvous port the ranks use (run.json shows it).
    port: int
    # Log files to echo in the foreground, each with its line prefix ("[rank 0]").
    tails: list[tuple[str, LogTail]]

    def start(self, config: TrainConfig, attempt: int, started: list[Rank]) -> None:
        """Start every rank (attempt 0, or a restart), appending each process to
        supervise to `started` as soon as it exists: a signal that arrives
        half-way must find the ones already started."""
        ...

    def rank_processes(self) -> list[ProcessId]:
        """The live ranks, to ask them to stop (the program's stop signal): only
        processes this starter started, or its agent did (never a pid that
        telemetry names), each known by its start time too (processes.py)."""
        ...

    def rank_exits(self, exited: Rank, state: RunState) -> list[Rank]:
        """How each rank ended, once the supervised process `exited` has: itself
        for a rank, the ranks it ran for an agent."""
        ...

    def is_rank(self, rank: int, pid: int) -> bool:
        """Whether `pid` is the process this starter (or its agent) started as
        `rank`: a hello's claim, checked before it is believed."""
        ...

    def numbered(self) -> dict[int, ProcessId]:
        """The live ranks this starter (or its agent) started, by rank number."""
        ...

    def relaunched(self) -> list[Relaunch]:
        """The restarts the ranks' own launcher made since the last look (a watched
        torchrun's --max-restarts: daemon/relaunches.py); none where the daemon
        restarts the ranks itself."""
        ...

    def local_ranks(self) -> list[int]:
        """This node's ranks as a multi-node job's node says them: the ranks this
        starter found by their processes (torchrun's agent's, a watch's); none for
        ranks it forks itself."""
        ...

    def left_behind(self) -> list[Leftover]:
        """The processes this attempt's exited ranks started that are still running
        (daemon/leftovers.py): never a live rank's, nor one whose identity cannot
        be checked."""
        ...

    def close(self) -> None:
        """The run is over: end every helper process this starter started, and
        wait for it (a command returns when everything it started has exited)."""
        ...


def choose_port(addr: str, port: int) -> int:
    """`port` if it can be bound on `addr`, a free one if `port` is 0."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, port))
        except socket.gaierror:
            raise UsageError(f"--master-addr {addr} is not a valid address") from None
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UsageError(f"--master-port {port} is already in use on {addr}: pick "
                                 "another, or leave --master-port out to use a free one") from None
            if e.errno == errno.EADDRNOTAVAIL:
                raise UsageError(f"--master-addr {addr} is not an address of this machine"
                                 ) from None
            raise
        chosen: int = s.getsockname()[1]
        return chosen
