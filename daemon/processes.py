"""Processes as the daemon sees them: alive or not, tied to their parent's life,
and the small adapters that give every kind of child one interface.

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
from pathlib import Path
from typing import Protocol

PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent exits (Linux;
    elsewhere nothing). Safe between fork and exec (`preexec_fn`)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def pid_alive(pid: int | None) -> bool:
    """True while `pid` names a process that has not exited (a zombie has)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) is not alive
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


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
    """A subprocess (e.g. the torchrun agent) with multiprocessing's Process
    interface: exit codes are negative signal numbers, the sentinel is a pidfd."""

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
    """A process someone else started and saw exit: known by pid and exit code only."""

    def __init__(self, pid: int | None, exitcode: int) -> None:
        self.pid, self.exitcode, self.sentinel = pid, exitcode, -1

    def terminate(self) -> None:
        pass

    def kill(self) -> None:
        pass

    def join(self, timeout: float | None = None) -> None:
        pass
