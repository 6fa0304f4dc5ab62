"""Ranks their launcher started again, under `ddtrain watch -- COMMAND`.

`torchrun --max-restarts N` (and an elastic `--nnodes MIN:MAX` job) ends every
worker of its group when one fails, and starts them all again. The daemon did
not start them and cannot wait on them: it sees each restart as a rank's hello
from a new process, verified as the command's (daemon/watching.py), a new life
of the same rank. Which life failed, and how, torchrun says in the command's
output as it happens, with the pid:

    failed (exitcode: -9) local_rank: 1 (pid: 4242) of binary: .../python
    Sending process 4241 closing signal SIGTERM

Every pid ever verified as a rank is remembered, so such a line names its rank.
Each new attempt (TORCHELASTIC_RESTART_COUNT in the new processes' starting
environment; for a launcher without it, each batch of new lives) is one
restart, told once: the life that failed by itself (a code that is not the
launcher's SIGTERM) is named, with its exit code or signal; where no line names
one, the first rank started again is, as having ended without a word.
"""

from __future__ import annotations

import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from ddtop.core import wire
from ddtop.core.contract import describe_exit, signal_name

# A torchrun worker's failure, and the others it stopped (its elastic agent's log).
FAILED = re.compile(r"failed \(exitcode: (-?\d{1,4})\) local_rank: \d{1,7} \(pid: (\d{1,10})\)")
CLOSING = re.compile(r"Sending process (\d{1,10}) closing signal (SIG[A-Z]{2,7})\b")
# The variable torchrun numbers its attempts with (0 for the first).
ATTEMPT_ENV = "TORCHELASTIC_RESTART_COUNT"
# How much of the command's output a restart's words are looked for in (its newest part).
READ_MAX = 16 << 20
# Pids remembered as ranks, at most (a long elastic job's lives).
PIDS_MAX = 1 << 16


@dataclass(frozen=True)
class Relaunch:
    """One restart by the launcher: the life that failed, and how."""

    attempt: int | None  # torchrun's attempt number of the new lives
    rank: int  # the rank whose life failed (else the first started again)
    pid: int | None
    code: int | None  # its exit code, or minus its signal; None: not said
    ranks: tuple[int, ...]  # the ranks seen started again

    @property
    def reason(self) -> str:
        if self.code is None:
            return "ended without saying goodbye (its launcher started it again)"
        return describe_exit(self.code, None)

    def told(self, restart: int, step: int | None) -> tuple[wire.Restart, str]:
        """It as the run's restart number `restart` (the failed life's last step
        heard: `step`): the timeline's entry, and the line that says it."""
        code = self.code
        entry = wire.Restart(
            restart=restart, rank=self.rank, pid=self.pid, reason=self.reason,
            exit_code=code if code is not None and code >= 0 else None,
            signal=signal_name(code) if code is not None else None, global_step=step,
            time=time.time())
        message = (f"restart {restart}: rank {self.rank}"
                   f"{f' (pid {self.pid})' if self.pid else ''} {self.reason} at step {step}; "
                   f"its launcher started the ranks again"
                   f"{f' (attempt {self.attempt})' if self.attempt is not None else ''}")
        return entry, message


class Lives:
    """The lives of a watch's ranks: each pid verified as a rank, and the new
    lives not yet told as a restart."""

    def __init__(self) -> None:
        self.pids: dict[int, int] = {}  # pid -> the rank it was
        self.new: list[tuple[int, int | None]] = []  # (rank, attempt) of lives untold
        self.told = 0  # the newest attempt told
        self.read_to = 0  # where in the command's output the next restart's words begin

    def verified(self, rank: int, pid: int, replaced: bool, attempt: str | None) -> None:
        """A process verified as `rank`; `replaced`: another process was that rank."""
        if len(self.pids) >= PIDS_MAX:
            self.pids.clear()
        self.pids[pid] = rank
        if replaced:
            number = int(attempt) if attempt is not None and attempt.isdigit() \
                and len(attempt) < 9 else None
            self.new.append((rank, number))

    def stopped(self, log: str, current: dict[int, int]) -> dict[int, tuple[int, int]]:
        """The ranks whose current life (`current`: rank -> pid) torchrun's agent
        stopped itself ('Sending process 4241 closing signal SIGTERM'), as
        (minus the signal, pid): stopped by the launcher, not failed, whatever
        else the agent then did."""
        signals = {s.name: int(s) for s in signal.Signals}
        stopped: dict[int, tuple[int, int]] = {}
        for m in CLOSING.finditer(log):
            pid, sig = int(m[1]), signals.get(m[2])
            rank = self.pids.get(pid)
            if rank is not None and sig is not None and current.get(rank) == pid:
                stopped[rank] = (-sig, pid)
        return stopped

    def take(self, log: Path, start: int) -> list[Relaunch]:
        """The restarts seen since the last look, each told once (`start`: where this
        run's part of the command's output begins)."""
        if not self.new:
            return []
        new, self.new = self.new, []
        attempts: dict[int | None, list[int]] = {}
        for rank, attempt in new:
            attempts.setdefault(attempt, []).append(rank)
        found = []
        for attempt, ranks in attempts.items():
            if attempt is not None and attempt <= self.told:
                continue  # a late life of a restart already told
            said = self._read(log, start)
            failed = [(self.pids[int(m[2])], int(m[2]), int(m[1])) for m in FAILED.finditer(said)
                      if int(m[2]) in self.pids]
            own = [f for f in failed if f[2] != -signal.SIGTERM] or failed
            rank, pid, code = own[0] if own else (min(ranks), None, None)
            found.append(Relaunch(attempt, rank, pid, code, tuple(sorted(set(ranks)))))
            if attempt is not None:
                self.told = attempt
        return found

    def _read(self, log: Path, start: int) -> str:
        """The command's output since the last restart's words (at most READ_MAX)."""
        try:
            with log.open("rb") as f:
                end = f.seek(0, 2)
                begin = max(start, self.read_to, end - READ_MAX)
                f.seek(begin)
                data = f.read(end - begin)
        except OSError:
            return ""
        self.read_to = end
        return data.decode(errors="replace")
