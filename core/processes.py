"""Processes as the daemon sees them: alive or not, tied to their parent's life,
the identity that tells one process from a later one with the same pid, and
the small adapters that give every kind of child one interface.

A pid names a process only until it exits: the kernel hands the number to
the next process that needs one. So the daemon knows a process it started as
a `ProcessId`: the pid, its start time (clock ticks after boot, field 22 of
/proc/<pid>/stat) and the boot it belongs to. `same_process` says whether the
pid still names that process; `send_signal` signals it only if so, through a
pidfd (opened first, then the start time checked: a pidfd cannot come to
name another process), so a reused pid is never signalled. Without /proc
(not Linux) or for records written before start times were kept, the start
time is unknown (None), and such a process is never signalled (send_signal
refuses it: its identity cannot be checked).

No torch, no sockets: ranks import `set_parent_death_signal` and `pid_alive`
from here too.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from itertools import pairwise
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Protocol

PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent exits (Linux;
    elsewhere nothing). Safe between fork and exec (`preexec_fn`)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def lead_own_session() -> None:
    """Make this process the leader of a new session (and process group), so that
    everything it starts can be found by the session's id once it has exited
    (daemon/leftovers.py). Already a leader (torchrun starts each worker so): nothing."""
    with contextlib.suppress(PermissionError):  # EPERM: it leads a group already
        os.setsid()


def pid_alive(pid: int | None) -> bool:
    """True while `pid` names a process that has not exited (a zombie has). Only
    a positive pid names one process (0 and -1 name groups, or everyone)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = read_stat(pid)  # a zombie (exited, not yet reaped) is not alive
    return stat is None or stat.state != "Z"


# -- which process a pid names ------------------------------------------------------
PROC = Path("/proc")


@dataclass(frozen=True)
class Stat:
    """The fields of /proc/<pid>/stat the daemon reads."""

    state: str  # R, S, D, Z (zombie), ...
    ppid: int
    start: int  # clock ticks after boot
    session: int = 0  # the pid of the session's leader (the process that called setsid)
    cpu: int = 0  # clock ticks run, user and system (utime + stime)


def parse_stat(text: str) -> Stat:
    """/proc/<pid>/stat's text. The command name (field 2) is in parentheses and
    may itself hold spaces and parentheses ("a) (b"), so the fields are counted
    from the last ')'. Raises ValueError on anything else."""
    head, paren, rest = text.rpartition(")")
    fields = rest.split()
    if not paren or "(" not in head or len(fields) < 20:
        raise ValueError(f"not a /proc/<pid>/stat line: {text[:80]!r}")
    # fields[0] is field 3 (state): field N is fields[N - 3].
    return Stat(state=fields[0], ppid=int(fields[1]), start=int(fields[19]),
                session=int(fields[3]), cpu=int(fields[11]) + int(fields[12]))


def read_stat(pid: int) -> Stat | None:
    """/proc/<pid>/stat, or None when there is no such process (or no /proc)."""
    try:
        return parse_stat((PROC / str(pid) / "stat").read_text())
    except (OSError, ValueError):
        return None


@cache
def boot_id() -> str:
    """This boot of this machine ("" where unknown): start times count from it."""
    try:
        return (PROC / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class ProcessId:
    """One process, not just a pid: (pid, start time, boot) is never reused."""

    pid: int
    start: int | None = None  # clock ticks after boot; None: unknown (never signalled)
    boot: str = ""  # boot_id() when the start time was read; "": unknown

    @classmethod
    def of(cls, pid: int | None) -> ProcessId | None:
        """The process `pid` names now (None when it names none, or a zombie)."""
        if not pid or not pid_alive(pid):
            return None
        stat = read_stat(pid)
        return cls(pid, stat.start if stat else None, boot_id() if stat else "")


def same_process(process: ProcessId | None) -> bool:
    """True while `process` is alive and its pid still names it (not a later
    process that was given the same pid)."""
    if process is None or not pid_alive(process.pid):
        return False
    if process.start is None:
        return True  # recorded without a start time: the pid is all there is
    if process.boot and process.boot != boot_id():
        return False  # recorded during another boot (or on another machine)
    stat = read_stat(process.pid)
    return stat is not None and stat.start == process.start


def send_signal(process: ProcessId | None, sig: int) -> bool:
    """Send `sig` to `process` if its pid still names it; True when sent.

    The pidfd is opened before the start time is compared: from then on it
    names that one process, exited or not, so the signal cannot reach a
    process that was given the pid in between. Without a start time there is
    nothing to compare: never sent."""
    if process is None or process.pid <= 0:  # a group, or every process: never
        return False
    if process.start is None:  # which process the pid names now cannot be checked
        return False
    try:
        pidfd = os.pidfd_open(process.pid)
    except ProcessLookupError:
        return False
    except OSError:  # no pidfds here: the check, then the signal
        if not same_process(process):
            return False
        try:
            os.kill(process.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    try:
        if not same_process(process):
            return False
        signal.pidfd_send_signal(pidfd, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        os.close(pidfd)


def descendants(root: ProcessId) -> list[tuple[ProcessId, int]]:
    """Every live process below `root` (its children, theirs, ...) with its depth
    (1: a child), read from /proc; empty when `root` is no longer itself. A
    child starts no earlier than its parent, which the start times confirm."""
    if not same_process(root):
        return []
    children: dict[int, list[tuple[int, Stat]]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (stat := read_stat(int(entry.name))) is not None:
            children.setdefault(stat.ppid, []).append((int(entry.name), stat))
    found: list[tuple[ProcessId, int]] = []
    todo = [(root.pid, root.start, 0)]
    while todo:
        pid, start, depth = todo.pop()
        for child, stat in children.get(pid, []):
            if stat.state != "Z" and (start is None or stat.start >= start):
                found.append((ProcessId(child, stat.start, boot_id()), depth + 1))
                todo.append((child, stat.start, depth + 1))
    return found


def lineage(pid: int, root: ProcessId, limit: int = 32) -> list[int] | None:
    """`pid` and its parents up to, not including, `root` (a few /proc reads, not
    a scan of every process), or None when `root` is not among its first `limit`
    ancestors. Each process started no earlier than its parent."""
    if not same_process(root):
        return None
    chain: list[int] = []
    stat = read_stat(pid)
    while stat is not None and stat.state != "Z" and len(chain) < limit:
        chain.append(pid)
        parent = read_stat(stat.ppid) if stat.ppid > 0 else None
        if parent is not None and parent.start > stat.start:
            return None  # a parent younger than its child: the pid was reused meanwhile
        if stat.ppid == root.pid:
            same = root.start is None or (parent is not None and parent.start == root.start)
            return chain if same else None
        pid, stat = stat.ppid, parent
    return None


def command_line(pid: int) -> list[str]:
    """The arguments process `pid` was started with ([] when gone, a zombie or
    unreadable)."""
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    return [arg.decode(errors="replace") for arg in raw.split(b"\0") if arg]


DAEMON_MODULES = ("ddtop.daemon", "ddtop.daemon.cli")


def is_daemon_command(argv: list[str]) -> bool:
    """Whether `argv` is a ddtrain daemon's: the `ddtrain` script (run by its
    interpreter, or directly) or `python [options] -m ddtop.daemon ...`."""
    head = argv[:6]  # an interpreter and its options come first
    if any(Path(arg).name == "ddtrain" for arg in head[:2]):
        return True
    return any(a == "-m" and b in DAEMON_MODULES for a, b in pairwise(head))


def environ_value(pid: int, name: str) -> str | None:
    """The variable `name` in the environment process `pid` started with (readable
    for one's own processes), None when absent or unreadable."""
    try:
        environ = (PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    prefix = name.encode() + b"="
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix):].decode(errors="replace")
    return None


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (/proc/PID/status SigCgt): a
    signal whose default would end it is sent only to a process that catches it."""
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


class LogTail:
    """Complete lines appended to a file since the last read."""

    def __init__(self, path: Path, from_end: bool = False) -> None:
        self.path, self.partial = path, b""
        self.offset = file_size(path) if from_end else 0

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
    """What supervision needs of a process: a rank (OwnProcess), torchrun's agent
    (AgentProcess), or one already seen to exit (ExitedProcess)."""

    @property
    def pid(self) -> int | None: ...
    @property
    def identity(self) -> ProcessId | None: ...
    @property
    def exitcode(self) -> int | None: ...
    @property
    def sentinel(self) -> int: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...
    def join(self, timeout: float | None = None) -> None: ...


class OwnProcess:
    """A rank multiprocessing started for the daemon, signalled only while its pid
    still names it. Under forkserver a rank is the forkserver's child and is
    reaped there: multiprocessing learns of the exit through a pipe and would
    signal the pid, already free for another process, until it has read it."""

    def __init__(self, process: BaseProcess) -> None:
        self.process = process
        # Read as soon as it started: a rank lives for seconds at least, a pid is
        # reused only after the kernel has handed out every other one.
        self.identity = ProcessId.of(process.pid)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    @property
    def sentinel(self) -> int:
        return self.process.sentinel

    def terminate(self) -> None:
        if self.exitcode is None:
            send_signal(self.identity, signal.SIGTERM)

    def kill(self) -> None:
        if self.exitcode is None:
            send_signal(self.identity, signal.SIGKILL)

    def join(self, timeout: float | None = None) -> None:
        self.process.join(timeout)


class AgentProcess:
    """A subprocess (e.g. the torchrun agent) with multiprocessing's Process
    interface: exit codes are negative signal numbers, the sentinel is a pidfd."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        # Our child, not reaped until `popen` says it exited: its pid is its own
        # until then, and Popen signals only a child it has not reaped.
        self.popen = popen
        self.sentinel = os.pidfd_open(popen.pid)
        self.identity = ProcessId.of(popen.pid)

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
    """A process someone else started and saw exit: known by pid and exit code only."""

    def __init__(self, pid: int | None, exitcode: int) -> None:
        self.pid, self.exitcode, self.sentinel = pid, exitcode, -1
        self.identity: ProcessId | None = None  # exited: nothing to signal

    def terminate(self) -> None:
        pass

    def kill(self) -> None:
        pass

    def join(self, timeout: float | None = None) -> None:
        pass
