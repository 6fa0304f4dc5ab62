"""How the ranks of one attempt end: their exits seen, told and blamed.

The supervisor's loop asks this for everything about an exit: which of the
running ranks exited and whether one failed (`collect`), a moment for ranks
that already reported an error to exit by themselves (`settle`), each exit
told to the relay once, the culprit's first (`note`), whom the failure is
blamed on (`failure`, through core/blame.py) and the one way every rank
still running is stopped (`stop_all`). What it knows of an attempt (its
ranks, when it started, the daemon's own verdicts) starts again with `begin`.
"""

from __future__ import annotations

import signal
import time

from ddtop.core import blame, wire
from ddtop.core.contract import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    ErrorReport,
    signal_name,
)
from ddtop.core.rundir import RunPaths
from ddtop.core.summary import TRACEBACK_TAIL_LINES
from ddtop.daemon import oomkill
from ddtop.daemon.relay import Relay
from ddtop.daemon.report import Outcome
from ddtop.daemon.starters import COMMAND, WATCH, Rank, RankStarter, process_name

# Seconds a rank gets to exit after SIGTERM before it is killed.
TERM_GRACE_S = 5.0
# Seconds between looks at the sockets while ranks settle.
POLL_S = 0.1
# After a rank fails: seconds the ranks that already wrote an error report get to
# exit by themselves before the others are stopped (their exits race each other).
FAILURE_SETTLE_S = 3.0


class Exits:
    def __init__(self, paths: RunPaths, relay: Relay, starter: RankStarter,
                 stop_signal: int) -> None:
        self.paths, self.relay, self.starter = paths, relay, starter
        self.stop_signal = stop_signal  # what a graceful stop sends (a clean end for a script)
        self.ranks: list[Rank] = []  # the supervised processes of this attempt
        self.started = 0.0  # wall clock: error reports older than this are stale
        # A rank failed by the daemon (--hang-timeout): its exit carries this report.
        self.verdicts: dict[int, ErrorReport] = {}
        # The ranks' memory, read once a second: a SIGKILL by the OOM killer is named so.
        self.oom = oomkill.Watch()

    def begin(self) -> list[Rank]:
        """A new attempt: no ranks yet (the starter appends them), no verdicts."""
        self.ranks, self.verdicts, self.started = [], {}, time.time()
        return self.ranks

    def running(self) -> list[Rank]:
        return [r for r in self.ranks if r.exitcode is None]

    # -- seeing exits --------------------------------------------------------------
    def collect(self, running: list[Rank], stopping: bool) -> bool:
        """Record the exits among `running`; tell the clean ones at once. True
        when one failed (its exit is told once the culprit is known)."""
        failed = False
        # Ranks seen to exit in the same look are not ordered: each ran when the other left.
        others = self.running()
        for r in running:
            if r.process.exitcode is not None:
                r.exitcode, r.ended = r.process.exitcode, time.time()
                r.others_running = any(o is not r for o in others)
                if stopping and (r.exitcode in (-self.stop_signal, 128 + self.stop_signal)
                                 or r.rank in (COMMAND, WATCH)):
                    # It ended as a stop asked it to (a user's program), or it is the
                    # command of a watch, whose ranks the stop ended.
                    r.stopped_by_us = True
                if r.exitcode == 0 or r.stopped_by_us:
                    self.note(None, [r])
                else:
                    failed = True
        return failed

    def settle(self, stopping: bool) -> None:
        """Which of the ranks that fail together the OS reaps first is a race:
        give every rank that already wrote an error report a moment to exit by
        itself, so that the blame is decided from what each rank said."""
        deadline = time.monotonic() + FAILURE_SETTLE_S
        while time.monotonic() < deadline:
            running = self.running()
            if not any(self.error_report(r.rank) for r in running):
                return
            self.relay.serve(POLL_S, [r.process.sentinel for r in running])
            self.collect(running, stopping)

    def stop_all(self) -> None:
        """Every rank still running: SIGTERM, SIGKILL after TERM_GRACE_S; each
        exit recorded (the one way the daemon ends ranks that did not end)."""
        alive = self.running()
        for r in alive:
            r.process.terminate()
        deadline = time.monotonic() + TERM_GRACE_S
        killed = set()
        for r in alive:
            r.process.join(max(0.0, deadline - time.monotonic()))
            if r.process.exitcode is None:
                r.process.kill()
                r.process.join()
                killed.add(r.rank)
        for r in alive:
            r.stopped_by_us = stopped_by_us(r.process.exitcode, r.rank in killed)
        for r in self.ranks:
            r.exitcode = r.process.exitcode

    def describe(self, ranks: list[Rank]) -> str:
        """'rank 1 (silent, last in forward of step 571)', for each of `ranks`."""
        state, parts = self.relay.state, []
        states = state.rank_states(time.time())
        for r in ranks:
            view = state.ranks.get(r.rank)
            if r.rank < 0:
                parts.append(f"{process_name(r.rank)} (and its ranks)")
            elif view is None:
                parts.append(f"rank {r.rank} (never heard from)")
            else:
                parts.append(f"rank {r.rank} ({states.get(r.rank, '?')}, last {view.where()})")
        return ", ".join(parts) or "no rank"

    # -- telling and blaming -------------------------------------------------------
    def ends(self, processes: list[Rank]) -> list[Rank]:
        """How each rank ended, for processes that have exited (one killed by the
        kernel's OOM killer said so: daemon/oomkill.py)."""
        ends = [end for p in processes if p.exitcode is not None
                for end in self.starter.rank_exits(p, self.relay.state)]
        for end in ends:
            pid = end.process.pid
            if (end.exitcode == -signal.SIGKILL and not end.stopped_by_us
                    and end.reason is None and end.rank >= 0 and pid is not None):
                end.reason = self.oom.verdict(end.rank, pid)
        return ends

    def failure(self, stopping: bool) -> Outcome:
        """Blame one rank, tell every exit (the culprit's first), and the outcome."""
        ends = self.ends(self.ranks)
        self._judge_leavers(ends, stopping)
        stop = next((e.stopped_by for e in ends if e.stopped_by), None)
        if stop is not None and not any(e.exitcode and not e.stopped_by_us for e in ends):
            # Stopped from outside, by whoever runs the job (SLURM's scancel): no failure.
            self.note()
            return Outcome("stopped", EXIT_INTERRUPTED, reason=stop)
        reports = {e.rank: r for e in ends if (r := self.error_report(e.rank)) is not None}
        exits = {e.rank: e.end() for e in ends}
        chosen = blame.culprit(exits, reports)
        # No rank failed, yet a process did (torchrun's agent itself): blame that.
        failed = next((e for e in ends if e.rank == chosen),
                      next(p for p in self.ranks if p.exitcode))
        if failed.left_early_at is not None:
            failed.noted = False  # said as it exited, as finished: said again, as the culprit
        self.note(chosen)
        report = reports.get(chosen) if chosen is not None else None
        code = EXIT_USAGE if report is not None and report.kind == "usage" else EXIT_FAILED
        return Outcome("failed", code, failed, report, reason=left_early(failed))

    def _judge_leavers(self, ends: list[Rank], stopping: bool) -> None:
        """Which of the ranks that exited 0 left early (blame.left_early): exited
        while the others ran, before the last step, without a goodbye."""
        self.relay.serve(0)  # a goodbye still queued is heard first
        state = self.relay.state
        total = state.progress()[1]
        for e in ends:
            view = state.ranks.get(e.rank)
            if e.exitcode != 0 or view is None:
                continue
            early = blame.left_early(blame.Leaving(
                said_hello=view.max_seq >= 0, said_bye=view.bye_code is not None,
                others_running=e.others_running, stopping=stopping,
                global_step=view.global_step, total_steps=total))
            e.left_early_at = view.global_step if early else None

    def note(self, culprit: int | None = None, processes: list[Rank] | None = None) -> None:
        """Tell the relay (state, journal, dashboards) how each rank of the exited
        `processes` (default: all not yet told) ended, the culprit's first:
        dashboards name the first failed rank they hear of."""
        todo = [p for p in (self.ranks if processes is None else processes)
                if p.exitcode is not None and not p.noted]
        for p in todo:
            p.noted = True
        for r in sorted(self.ends(todo), key=lambda r: r.rank != culprit):
            assert r.exitcode is not None
            report = self.error_report(r.rank) if r.exitcode else None
            tb = report.traceback.rstrip().splitlines()[-TRACEBACK_TAIL_LINES:] if report else []
            self.relay.emit(
                wire.RankExit, exited=r.rank, pid=r.process.pid,
                exit_code=r.exitcode if r.exitcode >= 0 else None,
                signal=signal_name(r.exitcode), stopped_by_daemon=r.stopped_by_us,
                message=report.message if report else None, traceback="\n".join(tb) or None,
                culprit=r.rank == culprit, reason=left_early(r),
                left_early=r.left_early_at is not None)

    def error_report(self, rank: int) -> ErrorReport | None:
        if rank in self.verdicts:
            return self.verdicts[rank]
        found = blame.read_error_report(self.paths.rank_error(rank), self.started)
        if found is None and getattr(self.starter, "reports_in_telemetry", False):
            # A rank ddtrain did not start writes no report file: its error event says it.
            view = self.relay.state.ranks.get(rank)
            if view is not None and view.error:
                found = ErrorReport(message=view.error, traceback=view.traceback or "",
                                    time=view.last_seen or self.started, rank=rank)
        return found


def stopped_by_us(exitcode: int | None, killed: bool) -> bool:
    """Whether the daemon's stop explains a rank's exit: SIGTERM, the SIGKILL it sent
    after TERM_GRACE_S, or an exit after its SIGTERM. A signal it did not send (the
    rank's own SIGKILL, a segfault, the OOM killer) is the rank's own end, reported
    late: a forkserver's rank is seen to exit only once the forkserver has reaped it,
    so a rank that died first may be seen after a peer that only lost it."""
    if exitcode is None or exitcode >= 0:
        return True
    return exitcode == -signal.SIGTERM or (killed and exitcode == -signal.SIGKILL)


def left_early(rank: Rank) -> str | None:
    """How a rank ended, in words, where its exit code does not say it: it left
    early, or (a watched rank) it ended without a goodbye. None: the code says it."""
    if rank.reason is not None:
        return rank.reason
    return None if rank.left_early_at is None else blame.left_early_words(rank.left_early_at)
