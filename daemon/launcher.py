"""The daemon's core: launch one process per rank on this machine, supervise
them, and relay their telemetry.

Ranks are started with multiprocessing's forkserver: the forkserver imports
`ddtop.training.worker` (and torch) once, then forks every rank from itself, so
start-up does not grow by one torch import per rank (bench/startup.py measures
it). This module itself never imports torch.

Supervision: each rank's stdout and stderr go to its own log file (echoed with
a `[rank K]` prefix in the foreground). One loop waits on the ranks' process
sentinels and the relay's sockets together. When a rank fails, the launcher
names it (exit code or signal, and the error the rank reported), stops the
others (they would otherwise wait in their next collective until it times
out), and either restarts every rank from the newest checkpoint
(`--max-restarts`) or reports the run as failed.

Stopping: a `stop` request (or the first Ctrl-C) is graceful: every rank gets
SIGUSR1, the ranks agree on a step to stop after, rank 0 checkpoints, they exit;
whatever is still running after the timeout is terminated. SIGTERM (or a second
Ctrl-C) stops at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import math
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any, Protocol, TextIO

from ddtop.daemon import wire
from ddtop.daemon.config import TrainConfig, UsageError
from ddtop.daemon.contract import (
    ATTEMPT_ENV,
    CONFIG_ENV,
    DAEMON_PID_ENV,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    TELEMETRY_ENV,
)
from ddtop.daemon.relay import Relay
from ddtop.daemon.runs import RunPaths, read_json, write_json_atomic
from ddtop.daemon.state import RunState

# Seconds a rank gets to exit after SIGTERM before it is killed.
TERM_GRACE_S = 5.0
# Seconds between looks at the ranks' logs while they run.
POLL_S = 0.1
# Lines of a failed rank's traceback shown in the failure report.
TRACEBACK_TAIL_LINES = 8
WORKER_MODULE = "ddtop.training.worker"
# Read by `python -m ddtop.training` when the daemon starts it through torchrun.
AGENT = -1  # the `rank` of the torchrun agent process in `LocalLauncher.ranks`
# torchrun's failure summary: "rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 42)"
TORCHRUN_FAILURE = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*"
                              r"(-?\d+) \(pid: (\d+)\)")
# Seconds ranks get to stop gracefully after the first Ctrl-C.
INTERRUPT_STOP_TIMEOUT_S = 30.0
# After a rank fails: seconds the ranks that already wrote an error report get to
# exit by themselves before the others are stopped (their exits race each other).
FAILURE_SETTLE_S = 3.0
# Errors a rank raises because a peer went away (gloo, NCCL, the TCPStore): such a
# rank is a victim of the failure, not its cause.
PEER_LOSS = re.compile(
    r"Connection (?:closed|reset) by peer|remote process exited|Broken pipe|"
    r"communicator was aborted|DistNetworkError|DistBackendError|DistStoreError|"
    r"NCCL error|ncclRemoteError|timed out|Timeout", re.IGNORECASE)


class Stopped(Exception):
    """The launcher was asked to stop (Ctrl-C or SIGTERM)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


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


def _rank_entry(*args: Any) -> None:
    """Runs in the forked child. Imported by name, so this module stays torch-free."""
    import importlib

    importlib.import_module(WORKER_MODULE).launched_rank(*args)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class LogTail:
    """Complete lines appended to a file since the last read."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, b""

    def lines(self, final: bool = False) -> Iterator[str]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        self.offset += len(chunk)
        *complete, self.partial = (self.partial + chunk).split(b"\n")
        if final and self.partial:
            complete.append(self.partial)
            self.partial = b""
        for line in complete:
            yield line.decode(errors="replace")


class Process(Protocol):
    """What supervision needs of a process: multiprocessing's, or AgentProcess."""

    @property
    def pid(self) -> int | None: ...
    @property
    def exitcode(self) -> int | None: ...
    @property
    def sentinel(self) -> int: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...
    def join(self, timeout: float | None = None) -> None: ...


class AgentProcess:
    """A subprocess (the torchrun agent) with multiprocessing's Process interface:
    exit codes are negative signal numbers, the sentinel is a pidfd."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.sentinel = os.pidfd_open(popen.pid)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.popen.terminate()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)


class ExitedProcess:
    """A rank torchrun started and saw exit: known by pid and exit code only."""

    def __init__(self, pid: int | None, exitcode: int) -> None:
        self.pid, self.exitcode, self.sentinel = pid, exitcode, -1

    def terminate(self) -> None:
        pass

    def kill(self) -> None:
        pass

    def join(self, timeout: float | None = None) -> None:
        pass


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Rank:
    rank: int
    process: Process
    tail: LogTail
    exitcode: int | None = None
    stopped_by_us: bool = False
    noted: bool = False  # its exit was reported to the relay

    @property
    def signal_name(self) -> str | None:
        code = self.exitcode
        if code is None or code >= 0:
            return None
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"

    def record(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "pid": self.process.pid,
            "exitcode": self.exitcode,
            "signal": self.signal_name,
            "stopped_by_launcher": self.stopped_by_us,
        }


@dataclass
class Outcome:
    status: str  # succeeded | failed | stopped
    exit_code: int
    failed_rank: Rank | None = None
    report: dict[str, Any] = field(default_factory=dict)


class LocalLauncher:
    def __init__(self, config: TrainConfig, paths: RunPaths, out: TextIO = sys.stdout,
                 err: TextIO = sys.stderr, echo: bool = True,
                 on_tick: Callable[[RunState], None] | None = None) -> None:
        self.config, self.paths, self.out, self.err = config, paths, out, err
        self.echo = echo  # echo rank logs (foreground); a detached daemon does not
        # Called with the RunState after every poll of the sockets (about 10 times a
        # second) and once at the end: `ddtrain start --foreground --headless` prints from it.
        self.on_tick = on_tick
        self.ranks: list[Rank] = []
        self.rank_tails: list[tuple[int, LogTail]] = []  # torchrun: the ranks' own logs
        self.agent_log_start = 0
        self.started = time.time()
        self.port = 0
        self.relay: Relay | None = None
        self.restarts = 0
        self.timeline: list[dict[str, Any]] = []
        self.stopping: float | None = None  # deadline of a graceful stop in progress
        self.interrupted = False  # the stop came from Ctrl-C
        self.attempt_started = 0.0  # wall clock: error reports older than this are stale

    # -- public ----------------------------------------------------------------
    def run(self) -> int:
        self.port = choose_port(self.config.master_addr, self.config.master_port)
        try:
            self.paths.create()
            write_json_atomic(self.paths.config, self.config.to_dict())
            self.relay = Relay(self.paths.run_id, self.paths.journal)
            if not self.config.master_port:
                # Chosen again once the relay's own ports are bound, so it cannot be one of them.
                self.port = choose_port(self.config.master_addr, 0)
            self._write_status("starting")
            self._emit(wire.RunStatus(run="", rank=0, status="starting",
                                      world_size=self.config.world_size,
                                      message=f"run {self.paths.run_id} starting "
                                      f"{self.config.world_size} ranks"))
        except OSError as e:
            raise UsageError(f"cannot write the run directory {self.paths.root}: {e.strerror}; "
                             "pick another --runs-dir") from None
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            try:
                outcome = self._attempts()
            except Stopped as stop:
                for s in previous:  # a second Ctrl-C must not interrupt the clean-up
                    signal.signal(s, signal.SIG_IGN)
                self._stop_all()
                self._note_exits()
                code = EXIT_INTERRUPTED if stop.signum == signal.SIGINT else 128 + stop.signum
                outcome = Outcome("stopped", code)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        self._echo_logs(final=True)
        self._write_status(outcome.status, outcome)
        self._emit(wire.RunStatus(run="", rank=0, status=outcome.status,  # type: ignore[arg-type]
                                  world_size=self.config.world_size, restarts=self.restarts,
                                  message=self._summary_line(outcome)))
        if self.on_tick is not None:
            self.on_tick(self.relay.state)
        self._report(outcome)
        self.relay.close()
        return outcome.exit_code

    def _attempts(self) -> Outcome:
        """Run the ranks; after a failure restart them, up to --max-restarts times."""
        while True:
            self._start_ranks()
            outcome = self._supervise()
            if (outcome.status != "failed" or outcome.exit_code == EXIT_USAGE
                    or self.restarts >= self.config.max_restarts or self.stopping is not None):
                return outcome
            self._restart(outcome)

    def _restart(self, outcome: Outcome) -> None:
        rank = outcome.failed_rank
        assert rank is not None and rank.exitcode is not None and self.relay is not None
        self.restarts += 1
        newest = self._newest_checkpoint()
        view = self.relay.state.ranks.get(rank.rank)
        entry: dict[str, Any] = {
            "restart": self.restarts, "rank": rank.rank, "pid": rank.process.pid,
            "reason": describe_exit(rank.exitcode), "exit_code": rank.exitcode,
            "signal": rank.signal_name, "global_step": view.global_step if view else None,
            "checkpoint": newest.name if newest else None, "time": time.time(),
        }
        self.timeline.append(entry)
        source = f"from {newest.name}" if newest else "from the start (no checkpoint yet)"
        message = (f"restart {self.restarts}/{self.config.max_restarts}: rank {rank.rank} "
                   f"{entry['reason']} at step {entry['global_step']}; restarting {source}")
        print(f"ddtrain: {message}", file=self.err, flush=True)
        self._emit(wire.Event(run="", rank=0, type="restart", message=message, data=entry))
        self._emit(wire.RunStatus(run="", rank=0, status="restarting",
                                  world_size=self.config.world_size, restarts=self.restarts,
                                  message=message))
        self.config = replace(self.config, resume=newest is not None)
        self.ranks = []

    def _newest_checkpoint(self) -> Path | None:
        found = sorted(self.paths.checkpoints.glob("step-*.pt"))
        return found[-1] if found else None

    # -- start -----------------------------------------------------------------
    def _context(self) -> Any:  # multiprocessing's context classes are not typed alike
        method = self.config.start_method
        if method not in multiprocessing.get_all_start_methods():
            raise UsageError(f"--start-method {method} is not available on this platform: "
                             "use spawn")
        ctx = multiprocessing.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload([WORKER_MODULE])
            self._start_forkserver()
        return ctx

    def _start_forkserver(self) -> None:
        """Start the forkserver (and multiprocessing's resource tracker) with
        their output going to logs/forkserver.log rather than our terminal: they
        outlive this process by the second it takes to unload torch, and a pipe
        reading our output would otherwise stay open until they are gone."""
        from multiprocessing import forkserver, resource_tracker

        saved = [os.dup(1), os.dup(2)]
        log = os.open(self.paths.logs / "forkserver.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                      0o644)
        try:
            for fd in (1, 2):
                os.dup2(log, fd)
            resource_tracker.ensure_running()
            forkserver.ensure_running()
        finally:
            for fd, copy in zip((1, 2), saved, strict=True):
                os.dup2(copy, fd)
                os.close(copy)
            os.close(log)

    def _start_ranks(self) -> None:
        # Set before the forkserver starts, so that it and every rank inherit
        # them: one intra-op thread per rank unless told otherwise (as torchrun
        # does), and where to send telemetry (this daemon, unless the user said).
        os.environ.setdefault("OMP_NUM_THREADS", str(self.config.threads_per_rank))
        assert self.relay is not None
        self.attempt_started = time.time()
        if not os.environ.get(TELEMETRY_ENV):
            os.environ[TELEMETRY_ENV] = self.relay.endpoints["telemetry"]
        if self.config.launcher == "torchrun":
            self._start_torchrun()
        else:
            self._start_local()
        self._write_status("running")
        self._emit(wire.RunStatus(run="", rank=0, status="running",
                                  world_size=self.config.world_size, restarts=self.restarts,
                                  message=f"{self.config.world_size} ranks started"))

    def _start_torchrun(self) -> None:
        """torchrun --standalone runs `python -m ddtop.training` once per rank; the
        ranks read this run's config.json, write their own logs, and exit when
        this daemon does."""
        write_json_atomic(self.paths.config, self.config.to_dict())
        log_path = self.paths.logs / "torchrun.log"
        with log_path.open("ab") as log:
            popen = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", str(self.config.world_size), "--max-restarts", "0",
                 "-m", "ddtop.training"],
                env={**os.environ, CONFIG_ENV: str(self.paths.config),
                     DAEMON_PID_ENV: str(os.getpid()), ATTEMPT_ENV: str(self.restarts)},
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, preexec_fn=_die_with_parent,
            )
        tail = LogTail(log_path)
        tail.offset = self.agent_log_start = _size(log_path)
        self.ranks.append(Rank(AGENT, AgentProcess(popen), tail))
        self.rank_tails = []
        for rank in range(self.config.world_size):
            rank_tail = LogTail(self.paths.rank_log(rank))
            rank_tail.offset = _size(self.paths.rank_log(rank))
            self.rank_tails.append((rank, rank_tail))

    def _start_local(self) -> None:
        ctx = self._context()
        config = self.config.to_dict()
        if self.restarts:  # a restart after a failure: the port may be held by the dead group
            self.port = choose_port(self.config.master_addr, 0)
        for rank in range(self.config.world_size):
            process = ctx.Process(
                target=_rank_entry,
                args=(rank, self.config.world_size, config, str(self.paths.root),
                      self.config.master_addr, self.port, self.started, os.getpid(),
                      self.restarts),
                name=f"ddtrain-rank-{rank}",
                daemon=False,
            )
            process.start()
            tail = LogTail(self.paths.rank_log(rank))
            tail.offset = _size(self.paths.rank_log(rank))  # echo this attempt's lines only
            self.ranks.append(Rank(rank, process, tail))

    # -- supervise -------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.stopping is None and self.ranks:
            self.interrupted = True  # the first Ctrl-C: graceful; the loop acts on it
            assert self.relay is not None
            self.relay.stop_request = INTERRUPT_STOP_TIMEOUT_S
            return
        raise Stopped(signum)

    def _supervise(self) -> Outcome:
        assert self.relay is not None
        while True:
            running = [r for r in self.ranks if r.exitcode is None]
            if not running:
                if self.stopping is not None:
                    code = EXIT_INTERRUPTED
                    return Outcome("stopped", code)
                return Outcome("succeeded", EXIT_OK)
            self.relay.serve(POLL_S, [r.process.sentinel for r in running])
            if self.on_tick is not None:
                self.on_tick(self.relay.state)
            self._check_stop()
            self._echo_logs()
            if self._collect_exits(running):
                self._settle()
                self._stop_all()
                culprit = self._culprit()
                self._note_exits(first=culprit)
                return self._failure(culprit)

    def _collect_exits(self, running: list[Rank]) -> bool:
        """Record the exits among `running`; report the clean ones at once. True
        when one failed (its exit is reported once the culprit is known)."""
        failed = False
        for r in running:
            if r.process.exitcode is not None:
                r.exitcode = r.process.exitcode
                if r.exitcode == 0:
                    r.noted = True
                    self._note_exit(r)
                failed |= r.exitcode != 0
        return failed

    def _settle(self) -> None:
        """One rank's failure makes its peers fail within milliseconds, and which
        process the OS reaps first is a race: give every rank that already wrote an
        error report a moment to exit by itself, so that the blame is decided
        from what each rank said rather than from that race."""
        assert self.relay is not None
        deadline = time.monotonic() + FAILURE_SETTLE_S
        while time.monotonic() < deadline:
            running = [r for r in self.ranks if r.exitcode is None]
            if not any(self._error_report(r) for r in running):
                return
            self.relay.serve(POLL_S, [r.process.sentinel for r in running])
            self._collect_exits(running)

    def _check_stop(self) -> None:
        assert self.relay is not None
        if self.stopping is None and self.relay.stop_request is not None:
            timeout = self.relay.stop_request
            self.stopping = time.monotonic() + timeout
            how = "Ctrl-C" if self.interrupted else "a stop request"
            message = (f"stopping on {how}: ranks finish their step, rank 0 checkpoints; "
                       f"anything left after {timeout:g} s is terminated")
            if self.interrupted:
                message += " (Ctrl-C again to stop at once)"
            print(f"ddtrain: {message}", file=self.err, flush=True)
            self._emit(wire.Event(run="", rank=0, type="stop_requested", message=message))
            self._emit(wire.RunStatus(run="", rank=0, status="stopping",
                                      world_size=self.config.world_size, restarts=self.restarts,
                                      message=message))
            self._write_status("stopping")
            for pid in self._rank_pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
        elif self.stopping is not None and time.monotonic() > self.stopping:
            print("ddtrain: ranks did not stop in time; terminating them", file=self.err,
                  flush=True)
            self._stop_all()

    def _rank_pids(self) -> list[int]:
        """The live ranks' pids: our children, or torchrun's (from their hello)."""
        if self.config.launcher == "torchrun":
            assert self.relay is not None
            return [v.pid for v in self.relay.state.ranks.values()
                    if v.pid is not None and not v.exited and v.bye_code is None]
        return [r.process.pid for r in self.ranks
                if r.process.exitcode is None and r.process.pid is not None]

    def _torchrun_ranks(self, agent: Rank) -> list[Rank]:
        """After torchrun exited: each rank's exit, from torchrun's failure summary
        (exit code or signal, pid), the ranks' error reports, and their hellos."""
        assert self.relay is not None and agent.exitcode is not None
        with agent.tail.path.open("rb") as f:  # this attempt's part of torchrun's log
            f.seek(self.agent_log_start)
            log = f.read().decode(errors="replace")
        failed = {int(m[1]): (int(m[2]), int(m[3])) for m in TORCHRUN_FAILURE.finditer(log)}
        ranks = []
        for k in range(self.config.world_size):
            view = self.relay.state.ranks.get(k)
            pid = view.pid if view is not None else None
            if k in failed:
                code, pid = failed[k]
            elif agent.exitcode == 0 or (view is not None and view.bye_code == 0):
                code = 0
            else:  # torchrun stopped it when another rank failed
                code = -signal.SIGTERM
            # SIGTERM is how torchrun stops the others once one rank failed.
            stopped = code == -signal.SIGTERM
            rank = Rank(k, ExitedProcess(pid, code), LogTail(self.paths.rank_log(k)),
                        exitcode=code, stopped_by_us=stopped, noted=True)
            ranks.append(rank)
        return ranks

    def _note_exit(self, r: Rank, culprit: bool = False) -> None:
        """Tell the relay (state, journal, dashboards) that a rank's process exited."""
        assert r.exitcode is not None and r.process.pid is not None
        if r.rank == AGENT:
            ranks = sorted(self._torchrun_ranks(r), key=self._blame_order)
            for rank in ranks:
                self._note_exit(rank, culprit=culprit and rank is ranks[0])
            return
        report = self._error_report(r) if r.exitcode else {}
        tb = report.get("traceback", "").rstrip().splitlines()[-TRACEBACK_TAIL_LINES:]
        self._emit(wire.RankExit(
            run="", rank=0, exited=r.rank, pid=r.process.pid,
            exit_code=r.exitcode if r.exitcode >= 0 else None, signal=r.signal_name,
            stopped_by_daemon=r.stopped_by_us, message=report.get("message"),
            traceback="\n".join(tb) or None, culprit=culprit))

    def _note_exits(self, first: Rank | None = None) -> None:
        """After _stop_all: every rank not yet reported, the failure's culprit
        first (dashboards name the first failed rank they hear of)."""
        for r in sorted(self.ranks, key=lambda r: r is not first):
            if r.exitcode is not None and not r.noted:
                r.noted = True
                self._note_exit(r, culprit=r is first)

    def _emit(self, message: wire.Message) -> None:
        if self.relay is not None:
            message.run = self.paths.run_id
            self.relay.emit(message)

    def _blame_order(self, r: Rank) -> tuple[int, float, int]:
        """Among ranks that failed together, the likely cause comes first: one
        killed by a signal or stopped by bad input; then one that raised an error
        of its own; then one that exited non-zero without a word; then those that
        only lost a peer (gloo's "Connection closed by peer", NCCL's aborted
        communicator, a collective timeout). Within a class, the earliest error
        report first. Ranks the launcher stopped without a report of their own
        come last, and clean exits after them."""
        assert r.exitcode is not None
        report = self._error_report(r)
        when = float(report.get("time", math.inf))
        if r.exitcode == 0:
            cause = 5
        elif report.get("kind") == "usage" or (r.exitcode < 0 and not r.stopped_by_us):
            cause = 0
        elif report and not PEER_LOSS.search(str(report.get("message", ""))):
            cause = 1
        elif not report and not r.stopped_by_us:
            cause = 2
        elif report:
            cause = 3
        else:
            cause = 4
        return cause, when, r.rank

    def _culprit(self) -> Rank:
        """The rank to blame for a failure (the ranks have all exited)."""
        return min((r for r in self.ranks if r.exitcode), key=self._blame_order)

    def _stop_all(self) -> None:
        alive = [r for r in self.ranks if r.process.exitcode is None]
        for r in alive:
            r.stopped_by_us = True
            r.process.terminate()
        deadline = time.monotonic() + TERM_GRACE_S
        for r in alive:
            r.process.join(max(0.0, deadline - time.monotonic()))
            if r.process.exitcode is None:
                r.process.kill()
                r.process.join()
        for r in self.ranks:
            r.exitcode = r.process.exitcode

    def _failure(self, rank: Rank) -> Outcome:
        if rank.rank == AGENT:  # name the rank that failed, not torchrun
            rank = min(self._torchrun_ranks(rank), key=self._blame_order)
        report = self._error_report(rank)
        if report.get("kind") == "usage":
            return Outcome("failed", EXIT_USAGE, rank, report)
        return Outcome("failed", EXIT_FAILED, rank, report)

    def _error_report(self, rank: Rank) -> dict[str, Any]:
        """What the rank wrote about its failure in this attempt ({} if nothing:
        a report left by an earlier attempt is not this one's)."""
        path = self.paths.rank_error(rank.rank)
        try:
            report: dict[str, Any] = read_json(path)
        except (OSError, ValueError):
            return {}
        if not isinstance(report, dict) or float(report.get("time", 0)) < self.attempt_started:
            return {}
        return report

    # -- output ----------------------------------------------------------------
    def _echo_logs(self, final: bool = False) -> None:
        if not self.echo:
            return
        tails = [(r.rank, r.tail) for r in self.ranks] + self.rank_tails
        for rank, tail in tails:
            prefix = "[torchrun]" if rank == AGENT else f"[rank {rank}]"
            for line in tail.lines(final):
                print(f"{prefix} {line}", file=self.out, flush=True)

    def _write_status(self, status: str, outcome: Outcome | None = None) -> None:
        record: dict[str, Any] = {
            "run_id": self.paths.run_id,
            "status": status,
            "launcher_pid": os.getpid(),
            "started": self.started,
            "ended": time.time() if outcome is not None else None,
            "master_addr": self.config.master_addr,
            "master_port": self.port,
            "world_size": self.config.world_size,
            "daemon_pid": os.getpid(),
            "host": socket.gethostname(),
            "endpoints": self.relay.endpoints if self.relay is not None else {},
            "restarts": self.restarts,
            "max_restarts": self.config.max_restarts,
            "timeline": self.timeline,
            "ranks": self._rank_records(),
        }
        if outcome is not None:
            record["exit_code"] = outcome.exit_code
            if outcome.failed_rank is not None:
                record["failure"] = {**outcome.failed_rank.record(), **outcome.report}
        write_json_atomic(self.paths.status, record)

    def _rank_records(self) -> list[dict[str, Any]]:
        agent = next((r for r in self.ranks if r.rank == AGENT), None)
        if agent is None:
            return [r.record() for r in self.ranks]
        if agent.process.exitcode is not None:
            agent.exitcode = agent.process.exitcode
            return [r.record() for r in self._torchrun_ranks(agent)]
        assert self.relay is not None
        views = self.relay.state.ranks
        return [{"rank": k, "pid": views[k].pid if k in views else None, "exitcode": None,
                 "signal": None, "stopped_by_launcher": False}
                for k in range(self.config.world_size)]

    def _resume_hint(self) -> str:
        if any(self.paths.checkpoints.glob("step-*.pt")):
            return ("continue from the last checkpoint with: ddtrain start --resume --run-id "
                    f"{self.paths.run_id}")
        return "no checkpoint was written yet, so it cannot be resumed"

    def _summary_line(self, outcome: Outcome) -> str:
        seconds = time.time() - self.started
        if outcome.status == "failed" and outcome.failed_rank is not None:
            rank = outcome.failed_rank.rank
            return f"run failed after {seconds:.1f} s: rank {rank} {self._how(outcome)}"
        return f"run {outcome.status} after {seconds:.1f} s"

    @staticmethod
    def _how(outcome: Outcome) -> str:
        """How the failed rank ended, for the failure's headline."""
        rank = outcome.failed_rank
        assert rank is not None and rank.exitcode is not None
        if rank.stopped_by_us and outcome.report:
            # It raised, then was still exiting when the launcher stopped the rest.
            return "raised an error (ddtrain stopped its process while it was exiting)"
        return describe_exit(rank.exitcode)

    def _report(self, outcome: Outcome) -> None:
        rid, seconds = self.paths.run_id, time.time() - self.started
        if outcome.status == "succeeded":
            print(f"ddtrain: run {rid} succeeded in {seconds:.1f} s; "
                  f"checkpoints in {self.paths.checkpoints}", file=self.out, flush=True)
            return
        if outcome.status == "stopped":
            print(f"ddtrain: run {rid} stopped after {seconds:.1f} s; {self._resume_hint()}",
                  file=self.err, flush=True)
            return
        rank = outcome.failed_rank
        assert rank is not None and rank.exitcode is not None
        if outcome.exit_code == EXIT_USAGE:
            print(f"ddtrain: error: {outcome.report.get('message')}", file=self.err, flush=True)
            return
        message = outcome.report.get("message")
        cause = f": {message}" if message else ""
        lines = [f"ddtrain: run {rid} failed: rank {rank.rank} (pid {rank.process.pid}) "
                 f"{self._how(outcome)}{cause}"]
        tb = outcome.report.get("traceback", "").rstrip().splitlines()
        lines += [f"  | {line}" for line in tb[-TRACEBACK_TAIL_LINES:]]
        lines.append(f"  log: {self.paths.rank_log(rank.rank)}; {self._resume_hint()}")
        print("\n".join(lines), file=self.err, flush=True)
