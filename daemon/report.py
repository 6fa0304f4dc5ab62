"""What the daemon writes down about its run: run.json, and the lines a person
reads in the terminal when the run ends.

run.json is a `RunRecord`: the RunSummary derived from the daemon's RunState
(the same one `ddtrain status` asks the live daemon for), plus what only the
daemon's process knows (its pid and start time, host, endpoints, the
rendezvous port). It is rewritten atomically whenever the run's status changes.

A disk that fills up does not stop the daemon here either: a run.json that
cannot be written is said once on stderr and written again at the next change
of status. So that the final status (succeeded, failed, stopped) is written
even then, the report keeps a reserve beside run.json (RESERVE_BYTES, made when
run.json is first written) and gives it up to write the final record.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import TextIO

from ddtop.core import wire
from ddtop.core.config import TrainConfig
from ddtop.core.contract import EXIT_USAGE, ErrorReport, describe_exit
from ddtop.core.processes import ProcessId
from ddtop.core.rundir import RunPaths, atomic_file
from ddtop.core.state import RunState
from ddtop.core.summary import TRACEBACK_TAIL_LINES, ProcessRecord, RunRecord, encode_record
from ddtop.daemon.starters import AGENT, Rank, process_name

# Room kept on the run directory's disk for the final run.json (a few KiB; this
# much leaves room for a record of thousands of ranks).
RESERVE_BYTES = 1 << 20
RESERVE_NAME = ".run.json.reserve"
# The failed rank's own words in the headline: their first line, up to this long.
HEADLINE_CAUSE_CHARS = 500


@dataclass
class Outcome:
    status: wire.RunStatusName  # succeeded | failed | stopped
    exit_code: int
    failed_rank: Rank | None = None
    report: ErrorReport | None = None  # what the failed rank said, if it wrote anything
    # How the failed rank ended, in words, where the daemon decided it (a hang,
    # --hang-timeout) rather than the rank's exit: "hung for 30 s (--hang-timeout 30)".
    # A stop's: who stopped the run where ddtrain did not ("by SLURM (scancel of ...)").
    reason: str | None = None
    # Who failed, where it is not one of this daemon's ranks (a multi-node job:
    # "node 1 (host) lost", "rank 3 on node 1 (host)").
    who: str | None = None
    log: str | None = None  # where its log is, when not in this run's logs/
    hint: str | None = None  # what to do next, where resuming is not it (no rank seen)


class RunReport:
    def __init__(self, config: TrainConfig, paths: RunPaths) -> None:
        self.config, self.paths = config, paths
        self.started = time.time()
        self.daemon = ProcessId.of(os.getpid())  # how `status` and `stop` tell it from a stranger
        self.reserve = paths.root / RESERVE_NAME
        self._reserved = False  # the reserve is made (on the first write)
        self.unwritten: OSError | None = None  # why the newest run.json was not written

    def elapsed(self) -> float:
        return time.time() - self.started

    # -- run.json ----------------------------------------------------------------------
    def write(self, state: RunState, endpoints: dict[str, str], port: int,
              processes: list[ProcessRecord], ended: bool = False) -> None:
        record = RunRecord(
            run_id=self.paths.run_id, daemon_pid=os.getpid(),
            daemon_start_ticks=self.daemon.start if self.daemon else None,
            boot_id=self.daemon.boot if self.daemon else "", host=socket.gethostname(),
            started=self.started, ended=time.time() if ended else None, endpoints=endpoints,
            master_addr=self.config.master_addr, master_port=port,
            max_restarts=self.config.max_restarts, processes=processes,
        ).with_summary(state.summary(time.time()))
        data = encode_record(record)
        if ended:  # every rank is gone: the room they held for error reports is free
            self.paths.remove_error_reserves()
        if not self._reserved:
            self._reserved = True
            self._make_reserve()
        try:
            self._replace_status(data)
        except OSError as e:
            if not (ended and self._release_reserve()):
                self._not_written(e, ended)
                return
            try:  # the final record, in the room the reserve held
                self._replace_status(data)
            except OSError as again:
                self._not_written(again, ended)
                return
        if self.unwritten is not None:
            self.unwritten = None
            self._say(f"{self.paths.status} written again")
        if ended:
            self._release_reserve()

    def _replace_status(self, data: bytes) -> None:
        with atomic_file(self.paths.status, "wb") as f:
            f.write(data)

    def _not_written(self, error: OSError, ended: bool) -> None:
        if ended:
            self._say(f"warning: the final {self.paths.status} could not be written "
                      f"({error.strerror or error}): `ddtrain status` will call the run lost")
        elif self.unwritten is None:
            self._say(f"warning: {self.paths.status} could not be written "
                      f"({error.strerror or error}); tried again at the next change of status")
        self.unwritten = error

    def _make_reserve(self) -> None:
        """Hold RESERVE_BYTES of the disk for the final run.json (none when the disk
        has not that much: nothing to give up later)."""
        try:
            fd = os.open(self.reserve, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, RESERVE_BYTES)
            finally:
                os.close(fd)
        except OSError:
            self._release_reserve()

    def _release_reserve(self) -> bool:
        """Give the reserve's room back; True when there was one."""
        try:
            self.reserve.unlink()
        except OSError:
            return False
        return True

    @staticmethod
    def _say(line: str) -> None:
        with contextlib.suppress(OSError):  # stderr on the same full disk
            print(f"ddtrain: {line}", file=sys.stderr, flush=True)

    # -- the terminal ----------------------------------------------------------------
    def headline(self, outcome: Outcome) -> str:
        """The final RunStatus line: "run failed after 3.1 s: rank 1 was killed by
        SIGKILL", with what the failed rank said, if it said anything ("...: rank 0
        exited with code 1: CheckpointWriteError: cannot write checkpoint ...: No
        space left on device")."""
        seconds = self.elapsed()
        if outcome.status == "failed" and outcome.failed_rank is not None:
            who = outcome.who or self._who(outcome.failed_rank)
            report = outcome.report
            said = (f": {report.message.strip().splitlines()[0][:HEADLINE_CAUSE_CHARS]}"
                    if report is not None and report.message.strip()
                    and outcome.reason is None else "")
            return (f"run failed after {seconds:.1f} s: {who} "
                    f"{self._how(outcome)}{said}")
        by = f" {outcome.reason}" if outcome.status == "stopped" and outcome.reason else ""
        return f"run {outcome.status} after {seconds:.1f} s{by}"

    @staticmethod
    def _who(rank: Rank) -> str:
        return process_name(rank.rank)

    @staticmethod
    def _how(outcome: Outcome) -> str:
        """How the failed rank ended."""
        rank = outcome.failed_rank
        assert rank is not None and rank.exitcode is not None
        if outcome.reason is not None:
            return outcome.reason
        if rank.stopped_by_us and outcome.report is not None:
            # It raised, then was still exiting when the daemon stopped the rest.
            return "raised an error (ddtrain stopped its process while it was exiting)"
        return describe_exit(rank.exitcode, None)

    def resume_hint(self) -> str:
        if self.config.multi_node:
            return "a multi-node job cannot be resumed yet (docs/multi-node.md)"
        if self.config.watch is not None:
            if not self.config.watch:
                return "to go on, start the ranks again (your program resumes from its own)"
            return ("to go on, run the same ddtrain watch again (your program resumes from "
                    "its own checkpoints)")
        if self.config.runs_user_code:
            return ("start it again with: ddtrain start --resume --run-id "
                    f"{self.paths.run_id} (your program resumes from its own checkpoints)")
        if self.paths.checkpoint_files():
            return ("continue from the last checkpoint with: ddtrain start --resume --run-id "
                    f"{self.paths.run_id}")
        return "no checkpoint was written yet, so it cannot be resumed"

    def print_outcome(self, outcome: Outcome, out: TextIO, err: TextIO) -> None:
        with contextlib.suppress(OSError):  # the daemon's log on a full disk: run.json has it
            self._print_outcome(outcome, out, err)

    def _print_outcome(self, outcome: Outcome, out: TextIO, err: TextIO) -> None:
        rid, seconds = self.paths.run_id, self.elapsed()
        if outcome.status == "succeeded":
            where = (f"the command's output in {self.paths.logs / 'command.log'}"
                     if self.config.watch else "the ranks' output is their launcher's"
                     if self.config.watch is not None else f"rank logs in {self.paths.logs}"
                     if self.config.runs_user_code
                     else f"checkpoints in {self.paths.checkpoints}")
            print(f"ddtrain: run {rid} succeeded in {seconds:.1f} s; {where}", file=out,
                  flush=True)
            return
        if outcome.status == "stopped":
            by = f" {outcome.reason}" if outcome.reason else ""  # who, where not ddtrain
            print(f"ddtrain: run {rid} stopped after {seconds:.1f} s{by}; "
                  f"{self.resume_hint()}", file=err, flush=True)
            return
        rank, report = outcome.failed_rank, outcome.report
        assert rank is not None
        if outcome.exit_code == EXIT_USAGE and report is not None:
            print(f"ddtrain: error: {report.message}", file=err, flush=True)
            return
        cause = f": {report.message}" if report is not None and report.message else ""
        who, how = outcome.who or self._who(rank), self._how(outcome)
        pid = rank.process.pid
        # Its pid once: a lost node's reason names its daemon's pid already.
        said = f" (pid {pid})" if pid is not None and f"(pid {pid})" not in how else ""
        lines = [f"ddtrain: run {rid} failed: {who}{said} {how}{cause}"]
        tb = report.traceback.rstrip().splitlines() if report is not None else []
        lines += [f"  | {line}" for line in tb[-TRACEBACK_TAIL_LINES:]]
        log = (self.paths.logs / "torchrun.log" if rank.rank == AGENT else
               self.paths.logs / "command.log" if self.config.watch else
               self.paths.rank_log(rank.rank))
        hint = outcome.hint or self.resume_hint()
        if self.config.watch == [] and outcome.log is None:  # the ranks' output is elsewhere
            lines.append(f"  {hint}")
        else:
            lines.append(f"  log: {outcome.log or log}; {hint}")
        print("\n".join(lines), file=err, flush=True)
