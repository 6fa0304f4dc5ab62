"""Ranks started on this machine by the daemon itself.

With the default start method, forkserver, multiprocessing's forkserver
imports the rank's module (`ddtop.training.worker`, or `ddtop.training.script`
for a user's program; torch with either) once, then forks every rank from
itself, so start-up does not grow by one torch import per rank
(bench/startup.py measures it). `--start-method spawn` starts each rank in a
fresh interpreter instead. This module never imports torch: the rank's entry
point is imported by name in the child.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from ddtop.core.config import TrainConfig
from ddtop.core.contract import UsageError
from ddtop.core.processes import LogTail, OwnProcess, ProcessId, read_stat, send_signal
from ddtop.core.rundir import RunPaths
from ddtop.core.state import RunState
from ddtop.daemon.leftovers import Leftover, in_sessions
from ddtop.daemon.relaunches import Relaunch
from ddtop.daemon.starters import Rank, choose_port, rank_program

# Seconds the forkserver and resource tracker get to exit once told to; after that one
# that slept through HELPER_IDLE_S with no CPU run (waiting on a pipe a stray process
# holds) is killed. One still busy (unloading torch on a loaded machine: running, waiting
# for a CPU or for the disk) is given up to HELPER_EXIT_MAX_S.
HELPER_EXIT_S = 5.0
HELPER_IDLE_S = 1.0
HELPER_EXIT_MAX_S = 30.0


def _rank_entry(module: str, entry: str, *args: Any) -> None:
    """Runs in the forked child. Imported by name, so this module stays torch-free."""
    import importlib

    getattr(importlib.import_module(module), entry)(*args)


def _kill_when_idle(name: str, pid: int | None, killed: dict[str, bool],
                   exited: threading.Event) -> None:
    """Kill a helper told to exit that has not within HELPER_EXIT_S and has since
    slept through HELPER_IDLE_S with no CPU run (so is waiting, not exiting), or at
    HELPER_EXIT_MAX_S. One runnable but given no CPU (state R: a loaded machine) or
    reading the disk (D) is exiting, so is not idle."""
    helper = ProcessId.of(pid)
    if pid is None or exited.wait(HELPER_EXIT_S):
        return
    waited, last = HELPER_EXIT_S, read_stat(pid)
    while not exited.wait(HELPER_IDLE_S):
        waited += HELPER_IDLE_S
        now = read_stat(pid)
        if now is None or now.state == "Z":
            return  # gone (or exited, not yet reaped): nothing to kill
        asleep = last is not None and now.cpu == last.cpu and now.state == last.state == "S"
        if asleep or waited >= HELPER_EXIT_MAX_S:
            killed[name] = send_signal(helper, signal.SIGKILL)
            return
        last = now


class LocalRanks:
    def __init__(self, paths: RunPaths, port: int, launch_time: float) -> None:
        # `launch_time`: when the daemon started, for the ranks' "first step done" line.
        self.paths, self.port, self.launch_time = paths, port, launch_time
        self.tails: list[tuple[str, LogTail]] = []
        self.ranks: list[Rank] = []
        self.context: Any = None  # multiprocessing's context classes are not typed alike
        self._started_helpers = False  # the forkserver and resource tracker are this run's

    def start(self, config: TrainConfig, attempt: int, started: list[Rank]) -> None:
        program = rank_program(config)
        if self.context is None:
            self.context = self._context(config.start_method, program.module)
        if attempt:  # a restart after a failure: the port may be held by the dead group
            self.port = choose_port(config.master_addr, 0)
        self.ranks, self.tails = started, []
        for rank in range(config.world_size):
            process = self.context.Process(
                target=_rank_entry,
                args=(program.module, program.entry, rank, config.world_size, config.to_dict(),
                      str(self.paths.root), config.master_addr, self.port, self.launch_time,
                      os.getpid(), attempt),
                name=f"ddtrain-rank-{rank}",
                daemon=False,
            )
            process.start()
            # Echo this attempt's lines only.
            self.tails.append((f"[rank {rank}]", LogTail(self.paths.rank_log(rank),
                                                         from_end=True)))
            # Every signal goes through OwnProcess: never to its pid once it is gone.
            self.ranks.append(Rank(rank, OwnProcess(process)))

    def rank_processes(self) -> list[ProcessId]:
        return [r.process.identity for r in self.ranks
                if r.process.exitcode is None and r.process.identity is not None]

    def rank_exits(self, exited: Rank, state: RunState) -> list[Rank]:
        return [exited]

    def is_rank(self, rank: int, pid: int) -> bool:
        return any(r.rank == rank and r.process.pid == pid for r in self.ranks)

    def relaunched(self) -> list[Relaunch]:
        return []  # the daemon restarts these ranks itself (RunLoop._restart)

    def local_ranks(self) -> list[int]:
        return []

    def numbered(self) -> dict[int, ProcessId]:
        return {r.rank: r.process.identity for r in self.ranks
                if r.process.exitcode is None and r.process.identity is not None}

    def left_behind(self) -> list[Leftover]:
        """Each rank leads its own session (training/worker.py): the rest of it."""
        return in_sessions({r.rank: r.process.identity for r in self.ranks
                            if r.process.identity is not None})

    def close(self) -> None:
        """Stop the forkserver and multiprocessing's resource tracker, if this run
        started them, and wait for both (unloading torch takes the forkserver a
        second; without this it outlived the command). Each exits once every
        copy of its pipe is closed: a process that a rank forked and that left
        its session (so was not ended with the rank) may hold one: after
        HELPER_EXIT_S a helper that waits (runs no CPU) is killed rather than
        waited for, one still exiting (unloading torch) is not."""
        if self.context is None or not self._started_helpers:
            return
        from multiprocessing import forkserver, resource_tracker

        helpers: list[tuple[str, Any, int | None]] = [
            ("forkserver", forkserver._forkserver,
             forkserver._forkserver._forkserver_pid),  # type: ignore[attr-defined]
            ("resource tracker", resource_tracker._resource_tracker,
             resource_tracker._resource_tracker._pid)]  # type: ignore[attr-defined]
        # Our own children, not reaped until _stop returns: their pids are their own.
        # Each gets its own HELPER_EXIT_S, from when it is told to exit.
        killed: dict[str, bool] = {}
        for name, helper, pid in helpers:
            exited = threading.Event()
            watch = threading.Thread(target=_kill_when_idle, args=(name, pid, killed, exited),
                                     daemon=True)
            watch.start()
            try:  # _stop (untyped in the stubs): close its pipe, wait
                with contextlib.suppress(OSError, ChildProcessError):
                    helper._stop()
            finally:
                exited.set()
                watch.join()
        for name in (n for n, sent in killed.items() if sent):
            print(f"ddtrain: multiprocessing's {name} did not exit within {HELPER_EXIT_S:g} s "
                  "(a process the ranks started outside their sessions holds its pipe): killed",
                  file=sys.stderr, flush=True)

    def _context(self, method: str, preload: str) -> Any:
        if method not in multiprocessing.get_all_start_methods():
            raise UsageError(f"--start-method {method} is not available on this platform: "
                             "use spawn")
        ctx = multiprocessing.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload([preload])
            self._start_forkserver()
        return ctx

    def _start_forkserver(self) -> None:
        """Start the forkserver (and multiprocessing's resource tracker) with
        their output going to logs/forkserver.log rather than our terminal: they
        outlive this process by the second it takes to unload torch, and a pipe
        reading our output would otherwise stay open until they are gone."""
        from multiprocessing import forkserver, resource_tracker

        saved = [os.dup(1), os.dup(2)]
        log = os.open(Path(self.paths.logs) / "forkserver.log",
                      os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            for fd in (1, 2):
                os.dup2(log, fd)
            resource_tracker.ensure_running()
            forkserver.ensure_running()
            self._started_helpers = True
        finally:
            for fd, copy in zip((1, 2), saved, strict=True):
                os.dup2(copy, fd)
                os.close(copy)
            os.close(log)
