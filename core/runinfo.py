"""What is known about a run, live or finished, for `status`, `list` and `stop`.

A run is *live* when its run.json has a non-final status and names a daemon
that still exists: its pid, and (recorded since start times were kept) its
start time, so that another process later given the same pid is not taken
for the daemon, and a ddtrain daemon's command line (a run.json written before
start times were kept has nothing else to tell a daemon from pid 1 or a
`sleep`). A daemon without a recorded start time is never signalled. A live
run answers `status` from its daemon's RunState; a finished one from the
RunSummary its daemon wrote last into run.json. A run.json that says
"running" while its daemon is gone means the daemon was killed: such a run is
`lost` (also when its pid names another process now), and its journal (the
same fold, replayed) tells how far it got.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from ddtop.core import control, journal, protocol, wire
from ddtop.core.config import TrainConfig
from ddtop.core.contract import UsageError
from ddtop.core.processes import (
    ProcessId,
    command_line,
    is_daemon_command,
    pid_alive,
    same_process,
)
from ddtop.core.rundir import RunPaths, is_run_dir
from ddtop.core.summary import (
    LOST,
    RECORD_SCHEMA,
    RunRecord,
    RunSummary,
    as_lost,
    decode_record,
)


@dataclass
class RunInfo:
    paths: RunPaths
    record: RunRecord  # run.json (an empty record when missing or unreadable)
    config: TrainConfig | None  # config.json (None when unreadable)
    problem: str | None = None  # why run.json could not be read, if it could not
    # Set by summary(): whether the live daemon answered (None: not asked, the run
    # is not live), and when it did not, why (then run.json's last record is shown).
    answered: bool | None = None
    no_answer: str = ""

    @classmethod
    def load(cls, paths: RunPaths) -> RunInfo:
        record, problem = RunRecord(run_id=paths.run_id), None
        try:
            record = decode_record(paths.status.read_bytes())
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:  # msgspec's errors are ValueErrors
            problem = f"{paths.status} is unreadable ({e})"
            record = cls._from_journal(paths)
        try:
            config: TrainConfig | None = TrainConfig.from_dict(
                msgspec.json.decode(paths.config.read_bytes())).check_ranges()
        except (OSError, ValueError, RecursionError, UsageError):
            # missing, not JSON, nested too deeply, not a config, absurd
            config = None
        return cls(paths, record, config, problem)

    @staticmethod
    def _from_journal(paths: RunPaths) -> RunRecord:
        """In place of an unreadable run.json: how the journal says the run ended
        (schema 0: nothing else is known; `summary` replays the journal)."""
        record = RunRecord(run_id=paths.run_id, schema=0)
        if paths.journal.exists():
            state, _ = journal.replay(paths.journal, paths.run_id)
            if state.status in wire.FINAL_STATUSES:
                record = msgspec.structs.replace(record, status=state.status,
                                                 exit_code=state.exit_code)
        return record

    @property
    def daemon_pid(self) -> int | None:
        return self.record.daemon_pid

    @property
    def daemon(self) -> ProcessId | None:
        """The daemon as run.json names it: pid, start time and boot (a record
        written before start times were kept: the pid alone)."""
        pid = self.record.daemon_pid
        return None if not pid else ProcessId(pid, self.record.daemon_start_ticks,
                                              self.record.boot_id)

    @property
    def daemon_here(self) -> bool:
        """run.json's daemon still exists: its pid names the process started at
        the recorded time (no time recorded: the pid alone), with a ddtrain
        daemon's command line."""
        daemon = self.daemon
        return (daemon is not None and same_process(daemon)
                and is_daemon_command(command_line(daemon.pid)))

    @property
    def live(self) -> bool:
        return self.record.status not in wire.FINAL_STATUSES and self.daemon_here

    @property
    def pid_reused(self) -> bool:
        """The daemon is gone, and its pid names another process now."""
        return pid_alive(self.daemon_pid) and not self.daemon_here

    @property
    def unverifiable(self) -> str | None:
        """Why run.json's daemon pid, alive, must not be signalled: recorded
        without its start time (None when it has one, or names no process)."""
        pid = self.daemon_pid
        if not pid_alive(pid) or self.record.daemon_start_ticks is not None:
            return None
        return (f"run.json names pid {pid} without its start time; not signalling a "
                "process whose identity cannot be checked")

    @property
    def status(self) -> str:
        if self.record.status not in wire.FINAL_STATUSES and not self.live:
            # The daemon may have written its last record and exited since run.json
            # was read: read it again before calling the run lost.
            again = RunInfo.load(self.paths)
            if again.record.status not in wire.FINAL_STATUSES:
                return LOST
            self.record, self.problem = again.record, again.problem
        return self.record.status

    @property
    def keys(self) -> Path | None:
        """The run's CURVE keys folder, when it has one (a run started with --bind)."""
        return self.paths.keys if self.paths.keys.is_dir() else None

    @property
    def control(self) -> str | None:
        return self.record.endpoints.get("control")

    @property
    def metrics(self) -> str | None:
        """Where the daemon serves Prometheus metrics (--metrics), if it does."""
        return self.record.endpoints.get("metrics")

    @property
    def record_written(self) -> float | None:
        """When run.json was last written (None: there is none)."""
        try:
            return self.paths.status.stat().st_mtime
        except OSError:
            return None

    @property
    def world_size(self) -> int:
        return self.record.world_size or (self.config.world_size if self.config else 0)

    def summary(self, timeout_s: float = 2.0) -> RunRecord:
        """run.json's daemon facts with the run as it stands: from the daemon when
        live, from run.json when finished, from the journal when lost."""
        summary: RunSummary | None = None
        if self.live and self.control:
            try:
                reply = control.request(self.control, protocol.Status(), timeout_s,
                                        keys=self.keys)
                if not reply.ok:
                    raise control.Unreachable(f"it refused: {reply.error}")
                if reply.summary is None:
                    raise control.Unreachable("its answer is not a summary")
                summary = reply.summary
                self.answered = True
            except control.Unreachable as e:
                # Told from run.json instead, and said so (unless the daemon has just
                # exited: then its last record is the run's end, read again below).
                if self.live:
                    self.answered, self.no_answer = False, str(e)
        if summary is None and self.status == LOST:
            summary = as_lost(self._replayed())
        elif summary is None and self.record.schema < RECORD_SCHEMA:
            # run.json was unreadable (its record made from the journal): the journal tells.
            summary = msgspec.structs.replace(self._replayed(), status=self.record.status,
                                              exit_code=self.record.exit_code)
        if summary is None:
            return self.record
        return self.record.with_summary(summary)

    def _replayed(self) -> RunSummary:
        """The journal's story, where it has one; else what run.json last said.
        What the journal cannot tell (frames the daemon refused are not in it)
        comes from run.json."""
        if not self.paths.journal.exists():
            return self.record
        state, _ = journal.replay(self.paths.journal, self.paths.run_id)
        summary = state.summary(state.updated or time.time())
        summary.rejected = merged_counts(summary.rejected, self.record.rejected)
        for rank in self.record.ranks:  # ranks that never spoke are still ranks
            if all(r.rank != rank.rank for r in summary.ranks):
                summary.ranks.append(rank)
        summary.ranks.sort(key=lambda r: r.rank)
        return summary


def merged_counts(*counts: dict[str, int]) -> dict[str, int]:
    """Counts by reason from several tellings of one run: the highest of each."""
    merged: dict[str, int] = {}
    for found in counts:
        for reason, n in found.items():
            merged[reason] = max(n, merged.get(reason, 0))
    return merged


def list_runs(runs_dir: Path) -> list[RunInfo]:
    """Every run under `runs_dir`, oldest first."""
    found = [RunInfo.load(RunPaths(p)) for p in runs_dir.glob("*") if is_run_dir(p)]
    return sorted(found, key=lambda i: (i.record.started or 0, i.paths.run_id))
