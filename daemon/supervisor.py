"""The daemon's loop: start the ranks, supervise them, relay their telemetry,
and end the run with one outcome.

One loop waits on the ranks' process sentinels and the relay's sockets
together. Each rank's stdout and stderr go to its own log file (echoed with a
`[rank K]` prefix in the foreground). When a rank fails, the supervisor lets
the ranks that already reported an error exit by themselves, stops the others
(they would otherwise wait in their next collective until it times out),
names the culprit (daemon/blame.py), and either restarts every rank from the
newest checkpoint (`--max-restarts`) or ends the run as failed.

Stopping: a `stop` request (or the first Ctrl-C) is graceful: every rank of
the built-in trainer gets SIGUSR1, the ranks agree on a step to stop after,
rank 0 checkpoints, they exit (a user's program gets SIGTERM, as torchrun would
send it); whatever is still running after the timeout is terminated. SIGTERM (or a second
Ctrl-C) stops at once.

How ranks are started is a `RankStarter`'s business (daemon/starters.py); what
is written down and printed at the end, the report's (daemon/report.py).
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from types import FrameType
from typing import TextIO

from ddtop.daemon import blame, leftovers, nodes, wire
from ddtop.daemon.config import TrainConfig, UsageError, count_of
from ddtop.daemon.contract import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    FAULT_ENV,
    STACKS_SIGNAL,
    STOP_SECRET_ENV,
    TELEMETRY_ENV,
    ErrorReport,
    describe_exit,
    signal_name,
)
from ddtop.daemon.keys import KEYS_ENV, RunKeys
from ddtop.daemon.local import LocalRanks
from ddtop.daemon.noderole import NodeRole
from ddtop.daemon.processes import send_signal
from ddtop.daemon.rankview import STALLED
from ddtop.daemon.relay import Relay
from ddtop.daemon.report import Outcome, RunReport
from ddtop.daemon.runs import RunPaths, hold_run, write_json_atomic
from ddtop.daemon.starters import Rank, RankStarter, choose_port, rank_program
from ddtop.daemon.state import RunState
from ddtop.daemon.summary import TRACEBACK_TAIL_LINES, ProcessRecord
from ddtop.daemon.torchrun import TorchrunRanks

# Seconds a rank gets to exit after SIGTERM before it is killed.
TERM_GRACE_S = 5.0
# Seconds between looks at the sockets and the ranks' logs while they run.
POLL_S = 0.1
# Seconds ranks get to stop gracefully after the first Ctrl-C.
INTERRUPT_STOP_TIMEOUT_S = 30.0
# After a rank fails: seconds the ranks that already wrote an error report get to
# exit by themselves before the others are stopped (their exits race each other).
FAILURE_SETTLE_S = 3.0
# A hang failed by --hang-timeout: seconds the ranks get to write their stacks first.
STACKS_GRACE_S = 0.3


# How ranks are started, by --launcher.
STARTERS: dict[str, Callable[[RunPaths, int, float], RankStarter]] = {
    "local": LocalRanks, "torchrun": TorchrunRanks}


class Stopped(Exception):
    """The daemon was asked to stop at once (a second Ctrl-C, or SIGTERM)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Supervisor:
    def __init__(self, config: TrainConfig, paths: RunPaths, out: TextIO = sys.stdout,
                 err: TextIO = sys.stderr, echo: bool = True,
                 on_tick: Callable[[RunState], None] | None = None) -> None:
        self.config, self.paths, self.out, self.err = config, paths, out, err
        self.echo = echo  # echo rank logs (foreground); a detached daemon does not
        # Called with the RunState after every poll of the sockets (about 10 times a
        # second) and once at the end: `ddtrain start --foreground --headless` prints from it.
        self.on_tick = on_tick
        self.report = RunReport(config, paths)
        self.starter: RankStarter | None = None
        self.ranks: list[Rank] = []  # the supervised processes of this attempt
        self.relay: Relay | None = None
        self.restarts = 0
        self.stopping: float | None = None  # deadline of a graceful stop in progress
        self.interrupted = False  # the stop came from Ctrl-C
        self.late: list[Rank] = []  # ranks a stop had to kill (SIGKILL) after its timeout
        self.lock: int | None = None  # the run's lock (runs.hold_run), held while supervising
        self.attempt_started = 0.0  # wall clock: error reports older than this are stale
        self.hung_since: float | None = None  # wall clock: since when the run hangs
        # The hung rank's failure, said by the daemon (--hang-timeout): its exit carries it.
        self.verdicts: dict[int, ErrorReport] = {}
        # This daemon's part in a multi-node job (node 0's hub, node K's forwarder, or
        # none): daemon/noderole.py.
        self.role: NodeRole | None = None
        # Signs the stop step in torch's store (training/stopping.py): this daemon's
        # own, or a multi-node job's, derived from its keys (the same on every node).
        self.stop_secret = secrets.token_hex(32)

    # -- public ----------------------------------------------------------------
    def run(self) -> int:
        port = choose_port(self.config.master_addr, self.config.master_port)
        try:
            self.paths.create()
            self.lock = hold_run(self.paths)  # the one daemon of this run, until it exits
            write_json_atomic(self.paths.config, self.config.to_dict())
            hub = self.config.multi_node and self.config.is_hub
            bind = nodes.hub_bind_address(self.config) if hub else self.config.bind
            keys = RunKeys.create(self.paths.keys) if bind else None
            self.relay = Relay(self.paths.run_id, self.paths.journal, self.paths.sockets,
                               world_size=self.config.world_size,
                               bind=bind or None, keys=keys, nodes=hub)
            self.role = NodeRole(self.config, self.paths, self.relay, self.err, self._local_ranks)
            if hub:
                assert keys is not None
                self.stop_secret = keys.stop_secret()
                self.role.become_hub(bind)
            if not self.config.master_port:
                # Chosen again once the relay's own ports are bound, so it cannot be one of them.
                port = choose_port(self.config.master_addr, 0)
            self.starter = STARTERS[self.config.launcher](self.paths, port, self.report.started)
            self.relay.rank_pid = self.starter.is_rank  # a hello from any other pid: dropped
            self._status("starting", f"run {self.paths.run_id} starting "
                         f"{count_of(self.config.world_size, 'rank')}")
            if self.config.multi_node and not self.config.is_hub:
                self.stop_secret = self.role.join_hub().stop_secret()
        except (OSError, UsageError) as e:
            if self.relay is not None:
                self.relay.close()
            if self.lock is not None:
                os.close(self.lock)  # the folder is free (a start refused leaves none behind)
            if isinstance(e, UsageError):
                raise
            raise UsageError(f"cannot write the run directory {self.paths.root}: {e.strerror}; "
                             "pick another --runs-dir") from None
        try:
            return self._run()
        except BaseException:
            # An error the loop did not survive: its ranks must not train on
            # unsupervised while the clean-up below waits for them.
            self._stop_all()
            raise
        finally:
            self._end_leftovers()  # an exception's way out too: nothing may hold the helpers
            if self.role is not None:
                self.role.close()
            self.starter.close()  # the forkserver and resource tracker, waited for
            self.relay.close()  # its sockets (and a private sockets folder) go with it
            if self.lock is not None:
                os.close(self.lock)

    def _run(self) -> int:
        assert self.relay is not None and self.role is not None
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            try:
                outcome = self.role.settle(self._attempts(), lambda: self._note_exits(None),
                                           self.on_tick)
            except Stopped as stop:
                for s in previous:  # a second Ctrl-C must not interrupt the clean-up
                    signal.signal(s, signal.SIG_IGN)
                self._stop_all()
                self._note_exits(None)
                self._end_leftovers()
                code = EXIT_INTERRUPTED if stop.signum == signal.SIGINT else 128 + stop.signum
                outcome = Outcome("stopped", code)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        self._echo_logs(final=True)
        headline = self.report.headline(outcome)
        if self.late:  # the ranks a stop had to kill: named, not blamed
            names = ", ".join("torchrun's agent" if r.rank < 0 else f"rank {r.rank}"
                              for r in self.late)
            headline += f" ({names} did not stop in time and was killed with SIGKILL)"
            print(f"ddtrain: {names} did not stop in time and was killed with SIGKILL",
                  file=self.err, flush=True)
        self._status(outcome.status, headline, exit_code=outcome.exit_code)
        self.role.record_final(outcome, headline)
        self.relay.guarded("tick", self._tick)
        self.report.print_outcome(outcome, self.out, self.err)
        return outcome.exit_code

    def _attempts(self) -> Outcome:
        """Run the ranks; after a failure restart them, up to --max-restarts times."""
        while True:
            self._start_ranks()
            outcome = self._supervise()
            self._end_leftovers()  # the ranks have ended: so does what they left running
            if (outcome.status != "failed" or outcome.exit_code == EXIT_USAGE
                    or self.restarts >= self.config.max_restarts or self.stopping is not None):
                return outcome
            self._restart(outcome)

    def _restart(self, outcome: Outcome) -> None:
        rank = outcome.failed_rank
        assert rank is not None and rank.exitcode is not None and self.relay is not None
        self.restarts += 1
        newest = self.paths.newest_checkpoint()
        view = self.relay.state.ranks.get(rank.rank)
        reason = outcome.reason or describe_exit(rank.exitcode, None)
        step = view.global_step if view else None
        entry = wire.Restart(
            restart=self.restarts, rank=rank.rank, pid=rank.process.pid, reason=reason,
            exit_code=rank.exitcode if rank.exitcode >= 0 else None,
            signal=signal_name(rank.exitcode), global_step=step,
            checkpoint=newest.name if newest else None, time=time.time())
        source = ("(the program resumes by its own means)" if self.config.runs_user_code
                  else f"from {newest.name}" if newest else "from the start (no checkpoint yet)")
        message = (f"restart {self.restarts}/{self.config.max_restarts}: rank {rank.rank} "
                   f"{reason} at step {step}; restarting {source}")
        print(f"ddtrain: {message}", file=self.err, flush=True)
        self.relay.emit(wire.Restarting, message=message, restart=entry)
        self._status("restarting", message, write=False)
        self.config = replace(self.config, resume=newest is not None)
        self.ranks = []  # a signal before the new ranks exist stops at once
        self.relay.retire_senders()  # the old processes' pids are not the ranks' now
        self.hung_since, self.verdicts = None, {}

    # -- start -----------------------------------------------------------------
    def _start_ranks(self) -> None:
        # Set before the forkserver starts, so that it and every rank inherit
        # them: one intra-op thread per rank unless told otherwise (as torchrun
        # does), and where to send telemetry (this daemon, unless the user said).
        os.environ.setdefault("OMP_NUM_THREADS", str(self.config.threads_per_rank))
        assert self.relay is not None and self.starter is not None
        self.attempt_started = time.time()
        if not os.environ.get(TELEMETRY_ENV):
            os.environ[TELEMETRY_ENV] = self.relay.endpoints["telemetry"]
            if self.relay.keys is not None:  # over TCP: the run's keys let the ranks in
                os.environ[KEYS_ENV] = str(self.paths.keys)
        if self.config.runs_user_code:  # only the built-in trainer reads it
            os.environ.pop(STOP_SECRET_ENV, None)
        else:
            os.environ[STOP_SECRET_ENV] = self.stop_secret
        drills = os.environ.get(FAULT_ENV)
        if drills and not self.restarts:  # --inject (checked by ddtrain start)
            message = f"fault drills armed: {drills} (in the first attempt only)"
            print(f"ddtrain: {message}", file=self.err, flush=True)
            self.relay.emit(wire.Event, type="info", message=message)
        self.ranks = []
        self.starter.start(self.config, self.restarts, self.ranks)
        self._status("running", f"{count_of(self.config.world_size, 'rank')} started")

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
                    return Outcome("stopped", EXIT_INTERRUPTED)
                return Outcome("succeeded", EXIT_OK)
            self.relay.serve(POLL_S, [r.process.sentinel for r in running])
            # What these act on came from outside (the printer's reading of the state,
            # the other nodes, requests, the ranks' output): an exception in one is
            # said and counted by the relay, and the ranks stay supervised.
            self.relay.guarded("tick", self._tick)
            assert self.role is not None
            self.relay.guarded("nodes", self.role.tick)
            self._check_stop()
            self.relay.guarded("stacks", self._serve_stacks)
            self.relay.guarded("logs", self._echo_logs)
            if self._collect_exits(running):
                self._settle()
                self._stop_all()
                return self._failure()
            hung = self._check_hang()
            if hung is not None:
                return hung

    def _local_ranks(self) -> list[int]:
        seen = getattr(self.starter, "seen", None)
        return sorted(seen) if isinstance(seen, dict) else []

    def _tick(self) -> None:
        if self.on_tick is not None:
            assert self.relay is not None
            self.on_tick(self.relay.state)

    def _collect_exits(self, running: list[Rank]) -> bool:
        """Record the exits among `running`; report the clean ones at once. True
        when one failed (its exit is reported once the culprit is known)."""
        failed = False
        stop_signal = rank_program(self.config).stop_signal
        # Ranks seen to exit in the same look are not ordered: each ran when the other left.
        others = [o for o in self.ranks if o.exitcode is None]
        for r in running:
            if r.process.exitcode is not None:
                r.exitcode, r.ended = r.process.exitcode, time.time()
                r.others_running = any(o is not r for o in others)
                if self.stopping is not None and r.exitcode in (-stop_signal, 128 + stop_signal):
                    r.stopped_by_us = True  # it ended as a stop asked it to (a user's program)
                if r.exitcode == 0 or r.stopped_by_us:
                    self._note_exits(None, [r])
                else:
                    failed = True
        return failed

    def _settle(self) -> None:
        """Which of the ranks that fail together the OS reaps first is a race:
        give every rank that already wrote an error report a moment to exit by
        itself, so that the blame is decided from what each rank said."""
        assert self.relay is not None
        deadline = time.monotonic() + FAILURE_SETTLE_S
        while time.monotonic() < deadline:
            running = [r for r in self.ranks if r.exitcode is None]
            if not any(self._error_report(r.rank) for r in running):
                return
            self.relay.serve(POLL_S, [r.process.sentinel for r in running])
            self._collect_exits(running)

    def _check_stop(self) -> None:
        assert self.relay is not None and self.starter is not None
        if self.stopping is None and self.relay.stop_request is not None:
            timeout = self.relay.stop_request
            self.stopping = time.monotonic() + timeout
            how = "Ctrl-C" if self.interrupted else "a stop request"
            what = ("the ranks get SIGTERM" if self.config.runs_user_code
                    else "ranks finish their step, rank 0 checkpoints")
            message = (f"stopping on {how}: {what}; "
                       f"anything left after {timeout:g} s is terminated")
            if self.interrupted:
                message += " (Ctrl-C again to stop at once)"
            # Only processes the starter started (or its agent did), each checked to
            # be still that process: never a pid a telemetry message claimed. Rank 0
            # last: the built-in trainer's rank 0 picks the step every rank stops after
            # as soon as it sees the signal, 3 steps ahead, so the others must have
            # theirs first (signalled first and the daemon descheduled before the
            # next, rank 1 once ran past the target and waited forever for rank 0).
            # The ranks first, then run.json (an fsync): another node's ranks must
            # hear of the stop before the target step rank 0 picks (training/stopping.py).
            numbered = self.starter.numbered()
            for rank in sorted(numbered, key=lambda k: (k == 0, k)):
                send_signal(numbered[rank], rank_program(self.config).stop_signal)
            print(f"ddtrain: {message}", file=self.err, flush=True)
            self.relay.emit(wire.Event, type="stop_requested", message=message)
            self._status("stopping", message)
        elif self.stopping is not None and time.monotonic() > self.stopping:
            late = [r for r in self.ranks if r.process.exitcode is None]
            message = (f"{self._describe(late)} did not stop within "
                       f"{self.relay.stop_request or 0:g} s: terminating (SIGTERM, then SIGKILL)")
            print(f"ddtrain: {message}", file=self.err, flush=True)
            self.relay.emit(wire.Event, type="warning", message=message)
            self._stop_all()
            self.late = [r for r in late if r.process.exitcode == -signal.SIGKILL]

    def _check_hang(self) -> Outcome | None:
        """--hang-timeout: a hang the state has declared (daemon/state.py: ranks
        stalled in a collective) for that long fails the run, blamed on the rank
        the others wait for; every rank is stopped."""
        limit = self.config.hang_timeout
        assert self.relay is not None
        if limit is None or self.stopping is not None:
            return None
        now = time.time()
        found = self.relay.state.hung(now)
        if found is None:
            self.hung_since = None
            return None
        if self.hung_since is None:
            self.hung_since = now
        if now - self.hung_since < limit:
            return None
        waited_for, text = found
        stalled = [r for r, s in self.relay.state.rank_states(now).items() if s == STALLED]
        blamed = min(waited_for or stalled or [0])
        reason = f"hung for {limit:g} s (--hang-timeout {limit:g})"
        message = f"rank {blamed} {reason}: {text}"
        print(f"ddtrain: {message}; stopping the ranks (their stacks first: "
              f"{self.paths.logs}/rank-K.stacks)", file=self.err, flush=True)
        self.relay.emit(wire.Event, type="warning", message=message)
        self.verdicts[blamed] = ErrorReport(rank=blamed, message=f"{reason}: {text}")
        assert self.starter is not None
        numbered = self.starter.numbered()
        for process in numbered.values():  # where each rank hangs, kept
            send_signal(process, STACKS_SIGNAL)
        time.sleep(STACKS_GRACE_S)
        for r in self.ranks:
            if r.process.exitcode is None:
                r.stopped_by_us = True
                r.process.terminate()
        # A rank frozen with SIGSTOP dies of its pending SIGTERM once continued (at
        # once, taking no step; it writes no stacks), not 5 s later of SIGKILL.
        for process in numbered.values():
            send_signal(process, signal.SIGCONT)
        self._stop_all()
        self._note_exits(blamed)
        ends = self._rank_ends(self.ranks)
        failed = next((e for e in ends if e.rank == blamed), None) or next(
            p for p in self.ranks if p.exitcode is not None)
        return Outcome("failed", EXIT_FAILED, failed, self.verdicts[blamed],
                       reason=f"{reason} and was stopped")

    def _serve_stacks(self) -> None:
        """`ddtrain stacks`: the stacks signal to the ranks asked for, among the
        processes this daemon started (checked by start time)."""
        assert self.relay is not None and self.starter is not None
        if not self.relay.stacks_requests:
            return
        asked, self.relay.stacks_requests = self.relay.stacks_requests, []
        numbered = self.starter.numbered()
        for rank, process in numbered.items():
            if None in asked or rank in asked:
                send_signal(process, STACKS_SIGNAL)

    def _describe(self, ranks: list[Rank]) -> str:
        """'rank 1 (silent, last in forward of step 571)', for each of `ranks`."""
        assert self.relay is not None
        state, parts = self.relay.state, []
        states = state.rank_states(time.time())
        for r in ranks:
            view = state.ranks.get(r.rank)
            if r.rank < 0:
                parts.append("torchrun's agent (and its ranks)")
            elif view is None:
                parts.append(f"rank {r.rank} (never heard from)")
            else:
                parts.append(f"rank {r.rank} ({states.get(r.rank, '?')}, last {view.where()})")
        return ", ".join(parts) or "no rank"

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

    # -- the end of an attempt ---------------------------------------------------
    def _end_leftovers(self) -> None:
        """End what the exited ranks left running (daemon/leftovers.py), named in
        one line per rank, so that nothing they started outlives the run or keeps
        the command waiting."""
        if self.starter is None or any(r.process.exitcode is None for r in self.ranks):
            return
        found, killed = leftovers.end(self.starter.left_behind)
        for line in leftovers.describe(found, killed):
            print(f"ddtrain: {line}", file=self.err, flush=True)
            if self.relay is not None:
                self.relay.emit(wire.Event, type="warning", message=line)

    def _rank_ends(self, processes: list[Rank]) -> list[Rank]:
        """How each rank ended, for processes that have exited."""
        assert self.starter is not None and self.relay is not None
        return [end for p in processes if p.exitcode is not None
                for end in self.starter.rank_exits(p, self.relay.state)]

    def _failure(self) -> Outcome:
        """Blame one rank, report every exit (the culprit's first), and the outcome."""
        ends = self._rank_ends(self.ranks)
        self._judge_leavers(ends)
        reports = {e.rank: r for e in ends if (r := self._error_report(e.rank)) is not None}
        exits = {e.rank: e.end() for e in ends}
        chosen = blame.culprit(exits, reports)
        # No rank failed, yet a process did (torchrun's agent itself): blame that.
        failed = next((e for e in ends if e.rank == chosen),
                      next(p for p in self.ranks if p.exitcode))
        if failed.left_early_at is not None:
            failed.noted = False  # said as it exited, as finished: said again, as the culprit
        self._note_exits(chosen)
        report = reports.get(chosen) if chosen is not None else None
        code = EXIT_USAGE if report is not None and report.kind == "usage" else EXIT_FAILED
        return Outcome("failed", code, failed, report, reason=_left_early(failed))

    def _judge_leavers(self, ends: list[Rank]) -> None:
        """Which of the ranks that exited 0 left early (blame.left_early): exited
        while the others ran, before the last step, without a goodbye."""
        assert self.relay is not None
        self.relay.serve(0)  # a goodbye still queued is heard first
        state = self.relay.state
        total = state.progress()[1]
        for e in ends:
            view = state.ranks.get(e.rank)
            if e.exitcode != 0 or view is None:
                continue
            early = blame.left_early(blame.Leaving(
                said_hello=view.max_seq >= 0, said_bye=view.bye_code is not None,
                others_running=e.others_running, stopping=self.stopping is not None,
                global_step=view.global_step, total_steps=total))
            e.left_early_at = view.global_step if early else None

    def _note_exits(self, culprit: int | None, processes: list[Rank] | None = None) -> None:
        """Tell the relay (state, journal, dashboards) how each rank of the exited
        `processes` (default: all not yet reported) ended, the culprit's first:
        dashboards name the first failed rank they hear of."""
        todo = [p for p in (self.ranks if processes is None else processes)
                if p.exitcode is not None and not p.noted]
        for p in todo:
            p.noted = True
        assert self.relay is not None
        for r in sorted(self._rank_ends(todo), key=lambda r: r.rank != culprit):
            assert r.exitcode is not None
            report = self._error_report(r.rank) if r.exitcode else None
            tb = report.traceback.rstrip().splitlines()[-TRACEBACK_TAIL_LINES:] if report else []
            self.relay.emit(
                wire.RankExit, exited=r.rank, pid=r.process.pid,
                exit_code=r.exitcode if r.exitcode >= 0 else None,
                signal=signal_name(r.exitcode), stopped_by_daemon=r.stopped_by_us,
                message=report.message if report else None, traceback="\n".join(tb) or None,
                culprit=r.rank == culprit, reason=_left_early(r),
                left_early=r.left_early_at is not None)

    def _error_report(self, rank: int) -> ErrorReport | None:
        if rank in self.verdicts:
            return self.verdicts[rank]
        return blame.read_error_report(self.paths.rank_error(rank), self.attempt_started)

    # -- output ----------------------------------------------------------------
    def _status(self, status: wire.RunStatusName, message: str, write: bool = True,
                exit_code: int | None = None) -> None:
        """Announce the run's status (state, journal, dashboards), then record it in
        run.json from the state it is now in."""
        assert self.relay is not None and self.starter is not None
        self.relay.emit(wire.RunStatus, status=status, world_size=self.config.world_size,
                        restarts=self.restarts, message=message, exit_code=exit_code)
        if write:
            self.report.write(self.relay.state, self.relay.endpoints, self.starter.port,
                              [ProcessRecord.of(r.rank, r.process.pid, r.process.identity)
                               for r in self.ranks],
                              ended=status in wire.FINAL_STATUSES)

    def _echo_logs(self, final: bool = False) -> None:
        if not self.echo or self.starter is None:
            return
        for prefix, tail in self.starter.tails:
            for line in tail.lines(final):
                print(f"{prefix} {line}", file=self.out, flush=True)


def _left_early(rank: Rank) -> str | None:
    """How a rank that left early ended, in words (None: it did not)."""
    return None if rank.left_early_at is None else blame.left_early_words(rank.left_early_at)
