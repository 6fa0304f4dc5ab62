"""Ranks the daemon did not start: `ddtrain watch -- COMMAND` and `ddtrain watch`.

With a command, the daemon runs it (torchrun, srun, accelerate launch,
`python train.py` that spawns its own ranks, a company's wrapper) with the
watch environment (DDTOP_TELEMETRY, DDTOP_RUN_ID, DDTOP_DAEMON_PID, and the
run's keys over TCP), and supervises it as it supervises torchrun's agent. The
package's start-up hook turns every process below it that initialises a
process group into a watched rank (training/starthook.py). A rank is believed
when its hello comes from a process of this machine, started after the command,
whose starting environment carries this daemon's pid (below the command, or
wherever its launcher started it with the command's environment); over TCP,
ranks on other machines are let in by the run's keys. The processes verified
here, and only those, are what `ddtrain stop` signals. Once the command exits,
how each rank ended is read from its goodbye, else from what the launcher said
in the command's output (torchrun's failure summary, srun's task ends:
daemon/launcherwords.py), else it ended without a word. Ranks SLURM stopped
(scancel, a time limit) were stopped, not failed.

Without a command, nothing is started: the ranks were given the environment by
other means (a pod spec, an sbatch file). They are judged by what they send;
the run ends when every rank has said goodbye, or after `--idle` seconds
without a message (ranks that went quiet are lost).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from ddtop.core.config import TrainConfig
from ddtop.core.contract import (
    DAEMON_PID_ENV,
    RUN_ID_ENV,
    STACKS_DIR_ENV,
    TELEMETRY_ENV,
    UsageError,
    describe_exit,
)
from ddtop.core.keys import KEYS_ENV
from ddtop.core.processes import (
    AgentProcess,
    ExitedProcess,
    LogTail,
    ProcessId,
    boot_id,
    environ_value,
    read_stat,
    same_process,
    set_parent_death_signal,
)
from ddtop.core.rundir import RunPaths
from ddtop.core.state import RunState
from ddtop.daemon import launcherwords
from ddtop.daemon.leftovers import Leftover, with_environment
from ddtop.daemon.relaunches import ATTEMPT_ENV, Lives, Relaunch
from ddtop.daemon.starters import COMMAND, WATCH, Rank, stopped_by_launcher
from ddtop.daemon.torchrun import FAILURE_SUMMARY, REFUSED_MAX
from ddtop.daemon.watchguard import start_guard

COMMAND_LOG = "command.log"
# The variables that number a launcher's tasks: how its words of a task name its rank.
TASK_ENVS = (launcherwords.SRUN_TASK_ENV, launcherwords.MPI_TASK_ENV)
NO_GOODBYE = "ended without saying goodbye (its launcher has its exit status)"
# A failed command's last line of output, as its failure says it: at most this long.
LAST_WORDS_CHARS = 300


def last_words(log: str) -> str:
    """The last line of a command's output with something printable in it, cut to
    LAST_WORDS_CHARS (control characters dropped: it is shown, never obeyed)."""
    for line in reversed(log[-64 * LAST_WORDS_CHARS:].splitlines()):
        shown = "".join(c for c in line if c.isprintable()).strip()
        if shown:
            return shown[:LAST_WORDS_CHARS] + ("..." if len(shown) > LAST_WORDS_CHARS else "")
    return ""


def _term_with_parent() -> None:
    set_parent_death_signal(signal.SIGTERM)


def watch_environment(paths: RunPaths) -> dict[str, str]:
    """What the watched command's processes are given besides DDTOP_TELEMETRY
    (and the keys over TCP): the run's id and this daemon's pid, by which its
    ranks are recognised in /proc."""
    return {RUN_ID_ENV: paths.run_id, DAEMON_PID_ENV: str(os.getpid()),
            STACKS_DIR_ENV: str(paths.logs.resolve())}


class _Ranks:
    """What both ways of watching know of the ranks: the processes verified as
    ranks, by rank number, and how each ended once the run is over."""

    # Its ranks write no error report file: what they said in telemetry stands for it.
    reports_in_telemetry = True

    def __init__(self, paths: RunPaths, port: int, launch_time: float) -> None:
        self.paths, self.port = paths, port
        self.log = paths.logs / COMMAND_LOG
        self.tails: list[tuple[str, LogTail]] = []
        self.seen: dict[int, ProcessId] = {}  # rank -> its process, verified
        self.refused: dict[tuple[int, int], int] = {}  # (rank, pid) -> start ticks
        self.tasks: dict[tuple[str, int], int] = {}  # (launcher's variable, task) -> rank
        self.lives = Lives()  # every process verified as a rank, and its launcher's restarts
        self.log_start = 0  # where this run's part of the command's output begins
        self.exit_code: int | None = None  # the command's, once it exited

    def relaunched(self) -> list[Relaunch]:
        return self.lives.take(self.log, self.log_start)

    def rank_processes(self) -> list[ProcessId]:
        return [p for p in self.seen.values() if same_process(p)]

    def numbered(self) -> dict[int, ProcessId]:
        return {rank: p for rank, p in self.seen.items() if same_process(p)}

    def local_ranks(self) -> list[int]:
        return sorted(self.seen)

    def _ends(self, state: RunState, launcher_code: int,
              summary: dict[int, tuple[int, int | None]], quiet_is_lost: bool,
              stop: str | None = None) -> list[Rank]:
        """Each rank heard from (or named in a failure summary): its goodbye's code,
        else the summary's, else it ended without a word. `stop`: who stopped the
        ranks, where not the daemon (SLURM's scancel): they were stopped."""
        ranks = []
        for k in sorted(set(state.ranks) | set(self.seen) | set(summary)):
            view = state.ranks.get(k)
            seen = self.seen.get(k)
            pid = seen.pid if seen is not None else view.pid if view is not None else None
            reason = None
            stopped = False
            if k in summary:  # SIGTERM: the launcher stopped it when another failed
                code, said_pid = summary[k]
                pid = said_pid or pid
                stopped = code == -signal.SIGTERM
            elif view is not None and view.bye_code is not None:
                code = view.bye_code
            elif launcher_code == 0 and not quiet_is_lost:
                code = 0
            elif summary:  # the launcher stopped it when another rank failed
                code, stopped = -signal.SIGTERM, True
            else:
                code, reason = launcher_code or 1, NO_GOODBYE
            said_bye = view is not None and view.bye_code is not None
            if stop is not None and code and not said_bye:  # ended by the stop, not by itself
                stopped, reason = True, f"was stopped {stop}"
            ranks.append(Rank(k, ExitedProcess(pid, code), exitcode=code,
                              stopped_by_us=stopped, noted=True, reason=reason,
                              stopped_by=stop if stopped else None))
        return ranks

    def _launcher_said(self, log: str) -> dict[int, tuple[int, int | None]]:
        """How the launcher's output says ranks ended, by rank: torchrun's failure
        summary (code, pid), srun's and mpirun's task ends (code), each task taken
        for the rank whose process carried its number (SLURM_PROCID,
        OMPI_COMM_WORLD_RANK; else the rank of its number, where no rank seen here
        carried it: ranks on other nodes)."""
        said: dict[int, tuple[int, int | None]] = {
            int(m[1]): (int(m[2]), int(m[3])) for m in FAILURE_SUMMARY.finditer(log)}
        mapped = set(self.tasks.values())
        for (var, task), code in launcherwords.task_ends(log).items():
            rank = self.tasks.get((var, task), task if task not in mapped else None)
            if rank is not None:
                said.setdefault(rank, (code, None))
        current = {rank: p.pid for rank, p in self.seen.items()}
        for rank, (code, pid) in self.lives.stopped(log, current).items():
            said.setdefault(rank, (code, pid))
        return said


class WatchedCommand(_Ranks):
    """`ddtrain watch -- COMMAND`: the command is the supervised process."""

    def __init__(self, paths: RunPaths, port: int, launch_time: float) -> None:
        super().__init__(paths, port, launch_time)
        self.agent: ProcessId | None = None
        self.over_tcp = False  # --bind: ranks on other machines may report
        self.guard: subprocess.Popen[bytes] | None = None  # ends them all if the daemon dies

    def start(self, config: TrainConfig, attempt: int, started: list[Rank]) -> None:
        assert config.watch
        self.over_tcp = bool(config.bind)
        env = {**os.environ, **watch_environment(self.paths)}
        try:
            with self.log.open("ab") as log:
                # Its own session, and SIGTERM when the daemon dies; the guard ends
                # whatever outlives both (daemon/watchguard.py).
                popen = subprocess.Popen(config.watch, env=env, cwd=config.workdir,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True, preexec_fn=_term_with_parent)
        except OSError as e:
            raise UsageError(f"cannot run {config.watch[0]!r}: {e.strerror}; check the "
                             "command after --") from None
        tail = LogTail(self.log, from_end=True)
        self.log_start = tail.offset
        self.tails = [("", tail)]
        agent = AgentProcess(popen)
        self.agent, self.seen, self.refused, self.tasks = agent.identity, {}, {}, {}
        if self.guard is None and agent.identity is not None:
            self.guard = start_guard(self.paths.run_id, agent.identity, self.log)
        started.append(Rank(COMMAND, agent))

    def is_rank(self, rank: int, pid: int) -> bool:
        """A process of this machine whose starting environment holds this
        daemon's pid: the command itself, a process below it, or one its launcher
        started elsewhere in the process tree with its environment (srun's tasks
        are slurmstepd's children). Over TCP (--bind), ranks on other machines
        are let in by the run's CURVE keys: their claims are believed, but only
        processes verified here are signalled."""
        seen = self.seen.get(rank)
        if seen is not None and seen.pid == pid:
            return True
        stat = read_stat(pid)
        if self.agent is None or (stat is not None
                                  and self.refused.get((rank, pid)) == stat.start):
            return False
        if stat is None:
            return self.over_tcp  # not a process of this machine
        if environ_value(pid, DAEMON_PID_ENV) == str(os.getpid()) and stat.start >= (
                self.agent.start or 0):  # started with the command's environment
            replaced = rank in self.seen  # its launcher started it again: a new life
            self.seen[rank] = ProcessId(pid, stat.start, boot_id())
            self.lives.verified(rank, pid, replaced, environ_value(pid, ATTEMPT_ENV))
            for var in TASK_ENVS:  # srun's (mpirun's) words of task N are of this rank
                task = environ_value(pid, var)
                if task is not None and task.isdigit() and len(task) < 9:
                    self.tasks[(var, int(task))] = rank
            return True
        if len(self.refused) >= REFUSED_MAX:
            self.refused.clear()
        self.refused[(rank, pid)] = stat.start
        return False

    def rank_exits(self, exited: Rank, state: RunState) -> list[Rank]:
        assert exited.exitcode is not None
        self.exit_code = exited.exitcode
        with self.log.open("rb") as f:
            f.seek(self.log_start)
            log = f.read().decode(errors="replace")
        stop = launcherwords.cancelled(log)
        ranks = self._ends(state, exited.exitcode, self._launcher_said(log),
                           quiet_is_lost=False, stop=stop)
        if not exited.stopped_by_us and stop is None:  # the launcher's doing, not a stop
            stopped_by_launcher(ranks, launcherwords.launcher_name(log))
        if (exited.exitcode and not exited.stopped_by_us and stop is None
                and not any(r.exitcode and not r.stopped_by_us for r in ranks)):
            # No rank failed, yet the command did: the command is the culprit, said
            # with its exit and its last words (torchrun's own error, a wrapper's).
            words = last_words(log)
            how = describe_exit(exited.exitcode, None) + (f", saying: {words}" if words else "")
            ranks.append(Rank(COMMAND, ExitedProcess(exited.process.pid, exited.exitcode),
                              exitcode=exited.exitcode, noted=True, reason=how))
        return ranks

    def left_behind(self) -> list[Leftover]:
        if self.agent is None or same_process(self.agent):
            return []
        ranks = set(self.seen.values())  # a rank's own process is said as the rank's
        return [dataclasses.replace(f, own=f.process in ranks)
                for f in with_environment(DAEMON_PID_ENV, str(os.getpid()), self.agent)]

    def close(self) -> None:
        """The command has exited; the guard exits once the daemon has (and finds
        nothing left). Its pipe-less Popen is let go without a wait."""


@dataclass
class Waiting:
    """The process a commandless watch supervises: none, standing for the ranks.
    It 'exits' when they have all said goodbye, or have been quiet for `idle` s."""

    state: RunState
    idle: float
    since: float
    seen: dict[int, ProcessId]  # the ranks verified as processes of this machine
    code: int | None = None
    pid: int | None = None
    identity: ProcessId | None = None
    why: str = ""

    def __post_init__(self) -> None:
        self._read, self._write = os.pipe()  # never written: a sentinel that never fires
        self.sentinel = self._read

    @property
    def exitcode(self) -> int | None:
        if self.code is None:
            self.code = self._over(time.time())
        return self.code

    def _over(self, now: float) -> int | None:
        ranks = self.state.ranks
        world = self.state.world_size
        said = [v.bye_code for v in ranks.values() if v.bye_code is not None]
        gone = [k for k, v in ranks.items() if v.bye_code is None and k in self.seen
                and not same_process(self.seen[k])]  # ended here without a goodbye
        if world and len(ranks) >= world and len(said) + len(gone) == len(ranks):
            self.why = "every rank has ended"
            return next((c for c in said if c), 1 if gone else 0)
        last = max([self.since, *(v.last_seen for v in ranks.values() if v.last_seen)])
        if self.idle and now - last > self.idle:
            self.why = (f"heard from no rank within {self.idle:g} s (--idle)" if not ranks
                        else f"no message for {self.idle:g} s (--idle)")
            return 1
        return None

    def terminate(self) -> None:
        if self.code is None:
            self.code, self.why = -signal.SIGTERM, "stopped"

    def kill(self) -> None:
        self.terminate()

    def join(self, timeout: float | None = None) -> None:
        """Nothing to wait for."""

    def close(self) -> None:
        for fd in (self._read, self._write):
            os.close(fd)


class WatchedRanks(_Ranks):
    """`ddtrain watch` without a command: ranks started by other means."""

    def __init__(self, paths: RunPaths, port: int, launch_time: float) -> None:
        super().__init__(paths, port, launch_time)
        self.waiting: Waiting | None = None
        self.idle = 0.0
        self.state: RunState | None = None  # given by the supervisor

    def start(self, config: TrainConfig, attempt: int, started: list[Rank]) -> None:
        assert self.state is not None, "the supervisor gives a commandless watch its state"
        self.waiting = Waiting(self.state, config.idle, time.time(), self.seen)
        lines = [f"export {TELEMETRY_ENV}={shlex.quote(os.environ[TELEMETRY_ENV])}",
                 f"export {RUN_ID_ENV}={shlex.quote(self.paths.run_id)}"]
        if os.environ.get(KEYS_ENV):  # what a rank needs, without the daemon's secret
            peers = self.paths.peer_keys.resolve()
            lines.append(f"export {KEYS_ENV}={shlex.quote(str(peers))}"
                         "   # a copy of this folder where each rank runs")
        ends = (f"or after {config.idle:g} s without a message" if config.idle
                else "(Ctrl-C ends the watch)")
        print("ddtrain: waiting for ranks; start them (ddtop installed where they run) "
              "with:\n" + "\n".join(f"  {line}" for line in lines) +
              f"\nddtrain: the watch ends when every rank has said goodbye {ends}",
              file=sys.stderr, flush=True)
        started.append(Rank(WATCH, self.waiting))

    def is_rank(self, rank: int, pid: int) -> bool:
        """Judged by what they send (the socket lets only the owner, or holders of
        the run's keys, in). A local process carrying the run's id in its starting
        environment is remembered, so that `ddtrain stop` can signal it."""
        stat = read_stat(pid)
        if stat is not None and environ_value(pid, RUN_ID_ENV) == self.paths.run_id:
            self.seen[rank] = ProcessId(pid, stat.start, boot_id())
        return True

    def rank_exits(self, exited: Rank, state: RunState) -> list[Rank]:
        assert exited.exitcode is not None
        self.exit_code = exited.exitcode
        stopped = exited.stopped_by_us or exited.exitcode == -signal.SIGTERM
        ranks = self._ends(state, -signal.SIGTERM if stopped else exited.exitcode, {},
                           quiet_is_lost=True)
        if stopped:
            for r in ranks:  # no goodbye: the stop ended it
                if r.reason is not None:
                    r.stopped_by_us, r.reason = True, None
        elif not ranks and self.waiting is not None and exited.exitcode:
            ranks.append(Rank(WATCH, ExitedProcess(None, exited.exitcode),
                              exitcode=exited.exitcode, noted=True, reason=self.waiting.why))
        elif self.waiting is not None and "--idle" in self.waiting.why:
            for r in ranks:  # quiet for --idle seconds: lost
                if r.reason == NO_GOODBYE:
                    r.reason = f"went quiet without a goodbye: {self.waiting.why}"
        return ranks

    def left_behind(self) -> list[Leftover]:
        return []

    def close(self) -> None:
        if self.waiting is not None:
            self.waiting.close()
