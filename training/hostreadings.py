"""What the host did to a rank, read by its sender thread as it sends steps.

A rank can be slow for reasons outside its own work: the process got less CPU
than it asked for (another process on its cores, a CPU cgroup's quota), or it
waited on the disk for pages it had (swapping, a memory-mapped dataset evicted).
The kernel counts both, for free, whatever the rank does:

- /proc/self/task/TID/schedstat: the training thread's time waiting on a run
  queue for a CPU (the second field, in ns; TID the main thread's);
- /proc/self/stat: the process's major page faults (majflt, the tenth field
  after the command name).

The sender thread reads them as it sends a Step message (at most ten times a
second, never on the training thread: about 20 us a read here) and puts on it
what they grew by since it last did (`take`): Step.runq_s and
Step.major_faults, what core/causes.py weighs a straggler's cause with.
"""

from __future__ import annotations

import threading
from pathlib import Path

STAT = Path("/proc/self/stat")


class HostReadings:
    """The training thread's run-queue wait and the process's major faults, as
    they grew between two `take`s."""

    def __init__(self, tid: int | None = None) -> None:
        tid = threading.main_thread().native_id if tid is None else tid
        self.schedstat = Path(f"/proc/self/task/{tid}/schedstat")
        self.last = self._read()

    def take(self) -> tuple[float, int] | None:
        """(seconds waited for a CPU, major faults) since the last take; None where
        the kernel does not say (not Linux, a kernel without schedstat)."""
        now = self._read()
        last, self.last = self.last, now
        if now is None or last is None:
            return None
        return max(0.0, (now[0] - last[0]) / 1e9), max(0, now[1] - last[1])

    def _read(self) -> tuple[int, int] | None:
        try:
            waited = int(self.schedstat.read_text().split()[1])
            faults = int(STAT.read_text().rpartition(")")[2].split()[9])
        except (OSError, IndexError, ValueError):
            return None
        return waited, faults
