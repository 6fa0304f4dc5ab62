"""What a run's ranks leave behind: processes they started that outlive them.

A rank may start processes of its own (a data prefetcher forked and never
joined, a `subprocess.Popen` never waited for) that are still running when the
rank exits. A run ends when its ranks have ended: once every rank of an
attempt has exited, the daemon ends what they left behind (SIGTERM, then
SIGKILL after a grace) and names it, one line per rank:

    rank 1 left 1 process behind (pid 4242 sleep): terminated

and nothing waits on them. Left running, such a process held the pipes of
multiprocessing's forkserver and resource tracker (inherited through a fork),
so the command waited for it after "succeeded"; started with exec it outlived
the run unnamed.

How a rank's processes are found is its starter's business (daemon/starters.py):

- a rank the daemon starts (daemon/local.py) leads a session of its own
  (training/worker.py); what it leaves behind is the rest of that session,
  looked for only once its leader has exited;
- torchrun starts each worker in a session of its own too, but the daemon does
  not see them all (they are its agent's): a worker's processes are those that
  carry the daemon's pid in the environment the agent gave its workers, started
  after the agent, once the agent has exited (the rank is their RANK).

A process that left the rank's session (`setsid`, `start_new_session=True`) or
was started with an environment of its own is not found: it chose to be its
own. Every process is signalled through its ProcessId (pid and start time,
through a pidfd: core/processes.py), never by pid alone or by group.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ddtop.core.processes import (
    PROC,
    ProcessId,
    Stat,
    boot_id,
    environ_value,
    read_stat,
    same_process,
    send_signal,
)

# Seconds what the ranks left behind gets to exit after SIGTERM before SIGKILL.
GRACE_S = 3.0
# Seconds between looks while waiting for it to exit.
POLL_S = 0.05
# Processes named in a line, at most (the rest are counted).
NAMED_MAX = 4


@dataclass(frozen=True)
class Leftover:
    """A process a rank left behind."""

    rank: int | None  # None: a rank, which one unknown
    process: ProcessId
    name: str  # its command name (/proc/<pid>/comm)
    own: bool = False  # the rank's own process, outliving its launcher: not one it started


def processes() -> Iterator[tuple[int, Stat]]:
    """Every process on this machine that is not a zombie, with its stat."""
    for entry in PROC.iterdir():
        stat = read_stat(int(entry.name)) if entry.name.isdigit() else None
        if stat is not None and stat.state != "Z":
            yield int(entry.name), stat


def command_name(pid: int) -> str:
    try:
        return (PROC / str(pid) / "comm").read_text().strip() or "?"
    except OSError:
        return "?"


def in_sessions(leaders: dict[int, ProcessId]) -> list[Leftover]:
    """The processes in each exited rank's session (`leaders`: rank -> the rank,
    its session's leader). A session whose leader is still running is left
    alone: its processes are its own business while it lives. A session id is
    the leader's pid, which the kernel does not hand out again while the session
    has members; a live process with that pid and another start time means the
    number names another session now, which is skipped."""
    ended = {p.pid: (rank, p) for rank, p in leaders.items()
             if p.start is not None and not same_process(p)}
    if not ended:
        return []
    found: list[tuple[int, Leftover]] = []
    reused = set()
    for pid, stat in processes():
        if pid in ended:
            reused.add(pid)  # the leader's pid names another process now
        elif stat.session in ended and stat.start >= (ended[stat.session][1].start or 0):
            found.append((stat.session, Leftover(ended[stat.session][0],
                                                 ProcessId(pid, stat.start, boot_id()),
                                                 command_name(pid))))
    return [leftover for session, leftover in found if session not in reused]


def with_environment(name: str, value: str, since: ProcessId) -> list[Leftover]:
    """The processes whose starting environment has `name`=`value` and that
    started no earlier than `since`, each with the RANK of that environment."""
    if since.start is None:
        return []
    found = []
    for pid, stat in processes():
        if stat.start < since.start or environ_value(pid, name) != value:
            continue
        rank = environ_value(pid, "RANK")
        found.append(Leftover(int(rank) if rank is not None and rank.isdigit() else None,
                              ProcessId(pid, stat.start, boot_id()), command_name(pid)))
    return found


def end(find: Callable[[], list[Leftover]], grace_s: float = GRACE_S
        ) -> tuple[list[Leftover], set[ProcessId]]:
    """End what `find` finds: SIGTERM (and SIGCONT, for a stopped one), then
    SIGKILL for whatever is still there after `grace_s` (looked for again: a
    process may have started another meanwhile). Returns every process found
    and those that needed SIGKILL."""
    seen: dict[ProcessId, Leftover] = {}
    left = find()
    if not left:
        return [], set()
    deadline = time.monotonic() + grace_s
    while left and time.monotonic() < deadline:
        for leftover in left:
            if leftover.process not in seen:
                seen[leftover.process] = leftover
                send_signal(leftover.process, signal.SIGTERM)
                send_signal(leftover.process, signal.SIGCONT)
        time.sleep(POLL_S)
        left = find()
    killed: set[ProcessId] = set()
    for _ in range(3):  # the rest, and anything they started before they died
        if not left:
            break
        for leftover in left:
            seen.setdefault(leftover.process, leftover)
            if send_signal(leftover.process, signal.SIGKILL):
                killed.add(leftover.process)
        deadline = time.monotonic() + 1.0
        while (left := [f for f in left if same_process(f.process)]) and (
                time.monotonic() < deadline):
            time.sleep(POLL_S)
        left = find()
    return list(seen.values()), killed


def describe(found: list[Leftover], killed: set[ProcessId]) -> list[str]:
    """One line per rank: 'rank 1 left 1 process behind (pid 4242 sleep): terminated'."""
    by_rank: dict[int | None, list[Leftover]] = {}
    for leftover in sorted(found, key=lambda f: (f.rank is None, f.rank or 0, f.process.pid)):
        by_rank.setdefault(leftover.rank, []).append(leftover)
    lines = []
    for leftover in (f for f in found if f.own):  # the rank itself: its pid said once
        how = "killed with SIGKILL" if leftover.process in killed else "terminated"
        lines.append(f"rank {leftover.rank} (pid {leftover.process.pid}) was still running "
                     f"after its launcher exited: {how}")
    for rank, left in by_rank.items():
        left = [f for f in left if not f.own]
        if not left:
            continue
        who = f"rank {rank}" if rank is not None else "a rank"
        named = ", ".join(f"pid {f.process.pid} {f.name}" for f in left[:NAMED_MAX])
        if len(left) > NAMED_MAX:
            named += f" and {len(left) - NAMED_MAX} more"
        hard = sum(f.process in killed for f in left)
        how = ("terminated" if not hard else "killed with SIGKILL" if hard == len(left)
               else f"{len(left) - hard} terminated, {hard} killed with SIGKILL")
        count = f"{len(left)} process{'' if len(left) == 1 else 'es'}"
        lines.append(f"{who} left {count} behind ({named}): {how}")
    return lines
