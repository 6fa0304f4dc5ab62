"""A closed door: another local user can neither read a run nor reach its
daemon; what the run's own sockets receive cannot grow the daemon's memory;
the ranks of a single-machine run listen on loopback only.

One detached run (2 ranks, long enough to outlive the tests) in a folder every
user may traverse, with a `runs/` folder every user may read (as a user's
project folder would be): only the run's own permissions keep others out.
The other user is `nobody`, through the system's Python (the test's venv may
live where `nobody` cannot read), so these tests need root to switch users.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from helpers import Detached, detached

from ddtop.daemon import wire

RUN = "guarded"
NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.fixture(scope="module")
def guarded() -> Iterator[tuple[Detached, Path]]:
    base = Path(tempfile.mkdtemp(prefix="ddtop-security-"))
    try:
        base.chmod(0o755)
        (base / "runs").mkdir(mode=0o755)
        (base / "runs").chmod(0o755)
        with detached("-n", "2", "--epochs", "200", "--run-id", RUN, cwd=base) as run:
            assert run.started.returncode == 0, run.started.stdout + run.started.stderr
            run.wait_for(RUN, lambda s: all(r["global_step"] > 0 for r in s["ranks"]))
            yield run, base / "runs" / RUN
            stopped = run.cli("stop", RUN, "--timeout", "30")
            assert stopped.returncode == 0, stopped.stdout + stopped.stderr
            assert run.leftovers() == []
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)


def record(root: Path) -> dict:  # type: ignore[type-arg]
    data: dict = json.loads((root / "run.json").read_text())  # type: ignore[type-arg]
    return data


def test_the_run_directory_is_its_owners_alone(guarded: tuple[Detached, Path]) -> None:
    _, root = guarded
    loose = []
    for folder, _, files in os.walk(root):  # every folder is walked, and every file in it
        for path in [Path(folder), *(Path(folder) / name for name in files)]:
            mode = stat.S_IMODE(path.lstat().st_mode)
            if mode & 0o077:
                loose.append(f"{path}: {oct(mode)}")
    assert loose == []
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert all(e.startswith(f"ipc://{root}/sock/") for e in record(root)["endpoints"].values())


ATTEMPTS = """
import json, socket, sys
root, endpoints = sys.argv[1], json.loads(sys.argv[2])
results = {}
def attempt(name, action):
    try:
        action()
        results[name] = "allowed"
    except PermissionError:
        results[name] = "denied"
    except OSError as e:
        results[name] = f"error {e.errno}"
attempt("read run.json", lambda: open(root + "/run.json").read())
attempt("list the run", lambda: __import__("os").listdir(root))
attempt("read the journal", lambda: open(root + "/telemetry.journal", "rb").read(1))
for name, endpoint in endpoints.items():
    def connect(path=endpoint[len("ipc://"):]):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
        finally:
            s.close()
    attempt("connect to " + name, connect)
print(json.dumps(results))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_another_user_can_neither_read_the_run_nor_reach_its_daemon(
        guarded: tuple[Detached, Path]) -> None:
    run, root = guarded
    before = run.status(RUN)
    endpoints = record(root)["endpoints"]
    other = subprocess.run([SYSTEM_PYTHON, "-c", ATTEMPTS, str(root), json.dumps(endpoints)],
                           user=NOBODY, group=NOBODY, extra_groups=[], capture_output=True,
                           text=True, timeout=30, cwd="/")
    assert other.returncode == 0, other.stderr
    results = json.loads(other.stdout)
    assert len(results) == 6 and set(results.values()) == {"denied"}, results
    after = run.status(RUN)
    assert after["status"] == "running" and after["daemon_alive"] is True
    assert after["ranks"][0]["global_step"] >= before["ranks"][0]["global_step"]


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def test_messages_for_ranks_beyond_the_world_size_are_dropped_and_counted(
        guarded: tuple[Detached, Path]) -> None:
    """The flood that grew a daemon from 29 MB to 2.4 GB: heartbeats claiming
    ranks 2 to 3000. Now each is refused unread, and counted."""
    run, root = guarded
    daemon = record(root)["daemon_pid"]
    before = rss_kb(daemon)
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(record(root)["endpoints"]["telemetry"])
    forged = 0
    for rank in range(2, 3001):
        for seq in range(3):
            beat = wire.Heartbeat(run=RUN, rank=rank, seq=seq, t=time.time(), phase="forward",
                                  epoch=0, global_step=1, phase_s=0.1)
            push.send_multipart(wire.encode(beat))
            forged += 1
    push.close()
    context.term()
    deadline = time.monotonic() + 30
    while True:
        status = run.status(RUN)
        refused = status["rejected"].get("rank_out_of_range", 0)
        if refused >= forged or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert refused == forged
    assert [r["rank"] for r in status["ranks"]] == [0, 1]
    assert rss_kb(daemon) - before < 30 * 1024, (before, rss_kb(daemon))


def listening_addresses(pid: int) -> list[str]:
    """The local addresses of the TCP sockets process `pid` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = str(fd.readlink())
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            address_hex, port_hex = local.split(":")
            raw = bytes.fromhex(address_hex)
            if family == socket.AF_INET:
                raw = raw[::-1]
            else:  # four little-endian 32-bit words
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
            found.append(f"{socket.inet_ntop(family, raw)}:{int(port_hex, 16)}")
    return found


def test_the_ranks_listen_on_loopback_only(guarded: tuple[Detached, Path]) -> None:
    """torch's rendezvous store (rank 0) and gloo's connections between ranks."""
    run, _ = guarded
    pids = [r["pid"] for r in run.status(RUN)["ranks"]]
    addresses = {pid: listening_addresses(pid) for pid in pids}
    assert addresses[pids[0]], "rank 0 hosts the rendezvous store: it listens"
    for pid, found in addresses.items():
        assert all(a.startswith(("127.", "::1:", "::ffff:127.")) for a in found), (pid, found)
