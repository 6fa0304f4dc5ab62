"""A process's memory cgroup, as the kernel keeps it: where it is, its limit, and
how many times the OOM killer killed in it.

Both hierarchies are read: cgroup v2 (one tree, `0::/path` in /proc/PID/cgroup;
`memory.max`, and `oom_kill` in `memory.events`) and cgroup v1 (the memory
controller's own tree, `N:memory:/path`; `memory.limit_in_bytes`, and
`oom_kill` in `memory.oom_control`). Where each tree is mounted is read from
/proc/self/mountinfo. Every read is of a small kernel file, and every failure
(no cgroup, a container that hides them, a process gone) is None: the daemon
then says what it could not read. Used by the daemon (daemon/oomkill.py) and
by the oom drill (training/drills.py). Pure standard library.
"""

from __future__ import annotations

import os
from pathlib import Path

MOUNTINFO = Path("/proc/self/mountinfo")
V1_FILES = ("memory.limit_in_bytes", "memory.oom_control")
V2_FILES = ("memory.max", "memory.events")
NO_LIMIT = 1 << 60  # v1 says "no limit" with a number near 2**63


def mounts() -> tuple[Path | None, Path | None]:
    """Where the cgroup v2 tree and the v1 memory controller's are mounted (None: not)."""
    v2 = v1 = None
    try:
        lines = MOUNTINFO.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        before, _, after = line.partition(" - ")
        fields, kind = before.split(), after.split()
        if len(fields) < 5 or len(kind) < 3:
            continue
        if kind[0] == "cgroup2" and v2 is None:
            v2 = Path(fields[4])
        elif kind[0] == "cgroup" and "memory" in kind[2].split(",") and v1 is None:
            v1 = Path(fields[4])
    return v2, v1


def of(pid: int | str) -> Path | None:
    """The memory cgroup folder of process `pid` ("self": this one), where readable."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    v2_root, v1_root = mounts()
    for line in lines:
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if v1_root is not None and "memory" in controllers.split(","):
            folder = v1_root / path.lstrip("/")
            if (folder / V1_FILES[1]).is_file():
                return folder
        if v2_root is not None and number == "0" and controllers == "":
            folder = v2_root / path.lstrip("/")
            if (folder / V2_FILES[1]).is_file():
                return folder
    return None


def oom_kills(folder: Path) -> int | None:
    """The OOM killer's kills counted in cgroup `folder` itself (v2's
    memory.events.local where the kernel has it: not its subtree's)."""
    for name in (V1_FILES[1], "memory.events.local", V2_FILES[1]):
        try:
            text = (folder / name).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


def limit(folder: Path) -> int | None:
    """Cgroup `folder`'s memory limit in bytes (None: none, or unreadable)."""
    for name in (V1_FILES[0], V2_FILES[0]):
        try:
            value = (folder / name).read_text().strip()
        except OSError:
            continue
        if value.isdigit() and int(value) < NO_LIMIT:
            return int(value)
        return None
    return None


def limit_file(folder: Path) -> Path:
    """Where a limit is written in cgroup `folder` (v1's or v2's file)."""
    v1 = folder / V1_FILES[0]
    return v1 if v1.exists() else folder / V2_FILES[0]


def host_oom_kills() -> int | None:
    """The OOM killer's kills on this host since it booted (/proc/vmstat oom_kill)."""
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def why_not_writable() -> str:
    """Why no memory cgroup can be made beneath this process's ("" where one can: the
    oom drill's need; a probe made and removed)."""
    here = of("self")
    if here is None:
        return "no memory cgroup of this process is readable here"
    probe = here / f"ddtop-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        return (f"cannot make a memory cgroup in {here} ({e.strerror or e}): the oom drill "
                "needs root and a writable cgroup filesystem")
    return ""
