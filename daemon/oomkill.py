"""Whether the kernel's OOM killer killed a rank, with its evidence.

A rank killed by the OOM killer ends with SIGKILL, as one killed by a person,
the launcher or the scheduler does. To tell them apart, the daemon keeps, for
each rank it started (by pid and start time, as every signal it sends), once a
second (`sample`):

- its memory cgroup (core/memcg.py), the count of OOM kills there and its
  limit; the oom drill's own cgroup beneath it (`ddtop-oom-PID`) too;
- its RSS (VmRSS of /proc/PID/status), over the last RSS_WINDOW_S;
- the host's count of OOM kills (/proc/vmstat oom_kill);

and reads the kernel log (/dev/kmsg, where readable: root, or a host that lets
it) from where it stood when the daemon started, never blocking. When a rank
it did not stop ends with SIGKILL (`verdict`):

- the kernel log's "Killed process PID" for its pid names it, certainly;
- else a count of OOM kills that rose in its cgroup since the last look names it
  as most likely (another process of the cgroup may have been the one; a
  container's kernel log names the host's pids);
- else, where the log is not readable, one that rose on the host, as maybe;
- else it stays "killed by SIGKILL".

The words carry the evidence: the cgroup and its limit, the kernel's line,
and the rank's RSS over its last minute. A drill's cgroup is removed once its
rank is gone (named, or at the run's end: `sweep`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from ddtop.core import memcg
from ddtop.core.processes import ProcessId

SAMPLE_S = 1.0  # how often the ranks' cgroups and RSS are read
RSS_WINDOW_S = 60.0  # the RSS history kept, and said
KMSG = "/dev/kmsg"
MAX_KERNEL_LINES = 64  # the OOM killer's newest lines kept from the kernel log
DRILL_PREFIX = "ddtop-oom-"  # the oom drill's cgroup: DRILL_PREFIX + the rank's pid
KILLED = re.compile(r"Killed process (\d+) \(")
MIB = 1 << 20


@dataclass
class Seen:
    """A rank as last read: its memory cgroup, the OOM kills counted there, RSS."""

    pid: int
    cgroup: Path | None = None
    kills: int | None = None
    host_kills: int | None = None  # the host's count at that reading
    rss: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=128))


class KernelLog:
    """The kernel log's new lines about the OOM killer, read without blocking."""

    def __init__(self) -> None:
        self.lines: deque[str] = deque(maxlen=MAX_KERNEL_LINES)
        self.why_not = ""
        try:
            self.fd: int | None = os.open(KMSG, os.O_RDONLY | os.O_NONBLOCK)
            os.lseek(self.fd, 0, os.SEEK_END)  # from now on
        except OSError as e:
            self.fd, self.why_not = None, f"{KMSG}: {e.strerror or e}"

    def read(self) -> None:
        """Every record written since the last read (one read() each)."""
        while self.fd is not None:
            try:
                record = os.read(self.fd, 8192)
            except OSError as e:
                if e.errno == errno.EPIPE:  # (records overwritten meanwhile: go on)
                    continue
                return  # EAGAIN: none now
            if not record:
                return
            text = record.decode(errors="replace").partition(";")[2].strip()
            if "Killed process" in text or "out of memory" in text.lower():
                self.lines.append(text)

    def killed(self, pid: int) -> str | None:
        """The kernel's line saying it killed `pid` (read so far)."""
        return next((line for line in reversed(self.lines)
                     if (m := KILLED.search(line)) is not None and int(m[1]) == pid), None)

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


class Watch:
    """The ranks' memory, read once a second, and the OOM killer's verdicts."""

    def __init__(self) -> None:
        self.log = KernelLog()
        self.seen: dict[int, Seen] = {}  # by rank
        self.host_kills = memcg.host_oom_kills()
        self.last = 0.0
        self.said: dict[tuple[int, int], str | None] = {}  # (rank, pid) -> its verdict

    def sample(self, numbered: dict[int, ProcessId], now: float | None = None) -> None:
        """Read each live rank's cgroup and RSS, at most once every SAMPLE_S."""
        now = time.monotonic() if now is None else now
        if now - self.last < SAMPLE_S:
            return
        self.last = now
        self.log.read()
        self.host_kills = memcg.host_oom_kills()
        for rank, process in numbered.items():
            seen = self.seen.get(rank)
            if seen is None or seen.pid != process.pid:
                seen = self.seen[rank] = Seen(process.pid)
            cgroup = _drill_cgroup(memcg.of(process.pid), process.pid)
            if cgroup is not None:
                seen.cgroup, seen.kills = cgroup, memcg.oom_kills(cgroup)
            seen.host_kills = self.host_kills
            rss = _rss(process.pid)
            if rss is not None:
                seen.rss.append((now, rss))
                while seen.rss and seen.rss[0][0] < now - RSS_WINDOW_S:
                    seen.rss.popleft()

    def verdict(self, rank: int, pid: int) -> str | None:
        """How rank `rank` (process `pid`), ended by a SIGKILL the daemon did not send,
        was killed, where the OOM killer did it: the words for its exit; None where
        nothing says so."""
        key = (rank, pid)
        if key not in self.said:
            self.said[key] = self._verdict(rank, pid)
        return self.said[key]

    def _verdict(self, rank: int, pid: int) -> str | None:
        self.log.read()
        seen = self.seen.get(rank)
        seen = seen if seen is not None and seen.pid == pid else Seen(pid)
        line = self.log.killed(pid)
        cgroup = _drill_cgroup(seen.cgroup, pid)
        kills = memcg.oom_kills(cgroup) if cgroup is not None else None
        # (the count when last read; a drill's cgroup made since counted none before)
        base = seen.kills if cgroup == seen.cgroup else (
            0 if cgroup is not None and cgroup.name == f"{DRILL_PREFIX}{pid}" else None)
        host = memcg.host_oom_kills()
        evidence = []
        if cgroup is not None:
            cap = memcg.limit(cgroup)
            count = (f", its OOM kills {base} -> {kills}"
                     if kills is not None and base is not None else "")
            evidence.append(f"memory cgroup {cgroup}"
                            + (f" (limit {cap / MIB:,.0f} MiB{count})" if cap
                               else f" (no limit{count})"))
        counted = kills is not None and base is not None and kills > base
        if line is not None:
            words = "was killed by the kernel's OOM killer (SIGKILL)"
            evidence.append(f"kernel: {line[:300]!r}")
        elif counted:  # (a log that names other pids: a container's view of the host's)
            words = ("was killed by SIGKILL, most likely by the kernel's OOM killer (its "
                     "memory cgroup counted a kill as it died)")
        elif self.log.fd is not None:
            return None  # the kernel log names whom it killed, and not this rank
        elif host is not None and seen.host_kills is not None and host > seen.host_kills:
            words = ("was killed by SIGKILL, maybe by the kernel's OOM killer (the host "
                     f"counted {host - seen.host_kills} OOM kill(s) as it died)")
        else:
            return None
        if self.log.fd is None:
            evidence.append(f"the kernel log is not readable here ({self.log.why_not})")
        evidence.append(_rss_words(seen.rss, time.monotonic()))
        if cgroup is not None and cgroup.name == f"{DRILL_PREFIX}{pid}":
            with contextlib.suppress(OSError):  # (the oom drill's, empty now)
                cgroup.rmdir()
        return f"{words}: " + "; ".join(evidence)

    def sweep(self) -> None:
        """Remove the oom drill's cgroups of the ranks seen (at the end: they are gone)."""
        for rank, seen in list(self.seen.items()):
            cgroup = _drill_cgroup(seen.cgroup, seen.pid)
            if cgroup is not None and cgroup.name == f"{DRILL_PREFIX}{seen.pid}":
                with contextlib.suppress(OSError):
                    cgroup.rmdir()
            del self.seen[rank]

    def close(self) -> None:
        self.sweep()
        self.log.close()


def _drill_cgroup(cgroup: Path | None, pid: int) -> Path | None:
    """The oom drill's own cgroup of `pid` where it made one beneath `cgroup`."""
    if cgroup is None or cgroup.name == f"{DRILL_PREFIX}{pid}":
        return cgroup
    drill = cgroup / f"{DRILL_PREFIX}{pid}"
    return drill if drill.is_dir() else cgroup


def _rss(pid: int) -> int | None:
    try:
        with Path(f"/proc/{pid}/status").open("rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _rss_words(rss: deque[tuple[float, int]], now: float) -> str:
    """'RSS 312 MiB 58 s before, 590 MiB 0.4 s before it died (peak 590 MiB)'."""
    if not rss:
        return "its RSS was not read"
    (t0, first), (t1, last) = rss[0], rss[-1]
    peak = max(r for _, r in rss)
    if len(rss) == 1:
        return f"RSS {last / MIB:,.0f} MiB {now - t1:.1f} s before it died"
    return (f"RSS {first / MIB:,.0f} MiB {now - t0:.0f} s before, {last / MIB:,.0f} MiB "
            f"{now - t1:.1f} s before it died (peak {peak / MIB:,.0f} MiB)")
