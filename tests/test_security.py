"""A closed door: another local user can neither read a run nor reach its
daemon; what the run's own sockets receive cannot grow the daemon's memory;
the ranks of a single-machine run listen on loopback only (and a script that
picks its own rendezvous port gets torch's, unchanged). Over TCP (`--bind`):
test_security_tcp.py.

One detached run (2 ranks, long enough to outlive the tests) in a folder every
user may traverse, with a `runs/` folder every user may read (as a user's
project folder would be): only the run's own permissions keep others out.
The other user is `nobody`, through the system's Python (the test's venv may
live where `nobody` cannot read), so these tests need root to switch users.
The test that starts a run of its own goes first, before that run trains on
the same cores.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
from helpers import Detached, ddtrain, listening_addresses, running

from ddtop.core import journal, wire

pytestmark = pytest.mark.processes  # every test here starts processes, or shares a run that does

RUN = "guarded"
NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"


TUTORIAL_SETUP = """
import os, socket, sys
import torch, torch.distributed as dist

os.environ["MASTER_ADDR"] = "localhost"  # as the DDP tutorial's setup() does
os.environ["MASTER_PORT"] = sys.argv[1]
dist.init_process_group("gloo", rank=int(os.environ["RANK"]),
                        world_size=int(os.environ["WORLD_SIZE"]))
t = torch.ones(2)
dist.all_reduce(t)
print("sum", t.tolist())
dist.destroy_process_group()
"""


def test_a_script_that_sets_its_own_master_port_rendezvouses_as_without_ddtop(
        tmp_path: Path) -> None:
    """The loopback store is only for the daemon's own MASTER_ADDR/PORT: a program
    that picks its own port gets torch's rendezvous, unchanged (not a client of a
    store nobody hosts, which would hang)."""
    script = tmp_path / "tutorial.py"
    script.write_text(TUTORIAL_SETUP)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = ddtrain("start", "--foreground", "-n", "2", "--run-id", "tutorial", str(script),
                  "--", str(port), cwd=tmp_path, timeout=90)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.leftovers == []
    assert "sum [2.0, 2.0]" in (tmp_path / "runs" / "tutorial" / "logs" / "rank-0.log"
                                ).read_text()


@pytest.fixture(scope="module")
def guarded() -> Iterator[tuple[Detached, Path]]:
    base = Path(tempfile.mkdtemp(prefix="ddtop-security-"))
    try:
        base.chmod(0o755)
        (base / "runs").mkdir(mode=0o755)
        (base / "runs").chmod(0o755)
        with running(base, RUN, "-n", "2", "--epochs", "200", "--step-delay", "0.05") as run:
            yield run, base / "runs" / RUN
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
    try:
        push.connect(record(root)["endpoints"]["telemetry"])
        forged = 0
        for rank in range(2, 3001):
            for seq in range(3):
                beat = wire.Heartbeat(run=RUN, rank=rank, seq=seq, t=time.time(),
                                      phase="forward", epoch=0, global_step=1, phase_s=0.1)
                push.send_multipart(wire.encode(beat))
                forged += 1
        # Open until all is counted: libzmq may drop frames in flight when a
        # back-pressured sender closes (zeromq/libzmq#4660; see test_daemon).
        deadline = time.monotonic() + 30
        while True:
            status = run.status(RUN)
            refused = status["rejected"].get("rank_out_of_range", 0)
            if refused >= forged or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        push.close(linger=0)
        context.term()
    assert refused == forged
    assert [r["rank"] for r in status["ranks"]] == [0, 1]
    after = rss_kb(daemon)
    print(f"daemon RSS under {forged} forged heartbeats: {before / 1024:.1f} MiB before, "
          f"{after / 1024:.1f} MiB after")
    assert after - before < 30 * 1024, (before, after)


def test_a_hello_from_a_pid_that_is_not_the_ranks_is_dropped_and_counted(
        guarded: tuple[Detached, Path]) -> None:
    """A process of the owner's that is not rank 0 (here: this test) says hello as
    rank 0: dropped, counted, and rank 0 keeps its pid (and its sequence)."""
    run, root = guarded
    before = run.status(RUN)
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(record(root)["endpoints"]["telemetry"])
    hello = wire.Hello(run=RUN, rank=0, seq=0, t=time.time(), local_rank=0, host="elsewhere",
                       pid=os.getpid(), device="cpu", backend="gloo", world_size=2,
                       config_digest="x", model="forged", dataset="x", epochs=1,
                       global_batch=1)
    push.send_multipart(wire.encode(hello))
    push.close()
    context.term()
    deadline = time.monotonic() + 30
    while (status := run.status(RUN))["rejected"].get("foreign_pid", 0) < 1:
        assert time.monotonic() < deadline, status["rejected"]
        time.sleep(0.2)
    assert status["ranks"][0]["pid"] == before["ranks"][0]["pid"] != os.getpid()
    assert status["ranks"][0]["global_step"] >= before["ranks"][0]["global_step"]


def needs_sender_pids() -> None:
    """Skip where this libzmq does not name the sending process of an ipc frame
    (its Peer-Address without a pid): the daemon then checks the hello alone."""
    from ddtop.daemon.ipc import peer_pid

    short = Path(tempfile.mkdtemp(prefix="ddtop-peer-", dir="/tmp"))  # a unix socket path
    context = zmq.Context()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    try:
        pull.bind(f"ipc://{short}/peer-check.sock")
        push.connect(f"ipc://{short}/peer-check.sock")
        push.send(b"x")
        if not pull.poll(5000):
            pytest.fail("a frame over ipc did not arrive in 5 s")
        if peer_pid(pull.recv(copy=False)) != os.getpid():
            pytest.skip("this libzmq names no sender pid over ipc")
    finally:
        pull.close(linger=0)
        push.close(linger=0)
        context.term()
        shutil.rmtree(short, ignore_errors=True)


def test_messages_sent_by_a_process_that_is_not_the_rank_are_dropped_and_counted(
        guarded: tuple[Detached, Path]) -> None:
    """The forgeries that once reached the dashboard (a Step with loss 12345 and a
    huge sequence number for rank 0, a Bye making rank 1 look dead, a heartbeat),
    sent by a process of the owner's that is not the rank (here: this test): over
    ipc the kernel names the sender, so each is dropped and counted."""
    needs_sender_pids()
    run, root = guarded
    before = run.status(RUN)["rejected"].get("foreign_pid", 0)
    forged = [
        wire.Step(run=RUN, rank=0, seq=10**9, t=time.time(), epoch=0, step=1,
                  steps_per_epoch=10, global_step=10**6, steps=1, samples=32,
                  loss_sum=12345.0 * 32, lr=0.1, step_s=0.01, data_s=0.0, forward_s=0.0,
                  backward_s=0.0, optimizer_s=0.0, comm_s=0.0, comm_bytes=0, comm_ops=0,
                  algbw_gbps=0.0, busbw_gbps=0.0, sync_wait_s=0.0),
        wire.Bye(run=RUN, rank=1, seq=10**9, t=time.time(), exit_code=0),
        wire.Heartbeat(run=RUN, rank=1, seq=10**9 + 1, t=time.time(), phase="done",
                       epoch=0, global_step=1, phase_s=0.1),
    ]
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    try:
        push.connect(record(root)["endpoints"]["telemetry"])
        for message in forged:
            push.send_multipart(wire.encode(message))
        deadline = time.monotonic() + 30
        while (status := run.status(RUN))["rejected"].get("foreign_pid", 0) < before + 3:
            assert time.monotonic() < deadline, status["rejected"]
            time.sleep(0.2)
    finally:
        push.close(linger=0)
        context.term()
    assert status["rejected"]["foreign_pid"] == before + 3
    later = run.wait_for(RUN, lambda s: all(r["global_step"] > status["ranks"][r["rank"]][
        "global_step"] for r in s["ranks"]))  # both ranks still heard: no duplicate drops
    assert [r["state"] for r in later["ranks"]] == ["running", "running"]
    assert all(r["global_step"] < 10**6 and r["loss"] < 1000 for r in later["ranks"])
    assert all(r["phase"] != "done" for r in later["ranks"])
    kept = [wire.decode([r.frame]) for r in journal.read(root / "telemetry.journal")]
    assert not [m for m in kept if m.rank >= 0 and m.seq >= 10**9]  # none of them journaled


def test_the_ranks_listen_on_loopback_only(guarded: tuple[Detached, Path]) -> None:
    """torch's rendezvous store (rank 0) and gloo's connections between ranks."""
    run, _ = guarded
    pids = [r["pid"] for r in run.status(RUN)["ranks"]]
    addresses = {pid: listening_addresses(pid) for pid in pids}
    assert addresses[pids[0]], "rank 0 hosts the rendezvous store: it listens"
    for pid, found in addresses.items():
        assert all(a.startswith(("127.", "::1:", "::ffff:127.")) for a in found), (pid, found)


# -- beyond loopback: TCP with CURVE ------------------------------------------------------
def test_after_a_restart_the_old_processes_pids_no_longer_speak_for_their_ranks(
        tmp_path: Path) -> None:
    """A real relay over ipc with the starter's answer in the test's hands: this
    process is rank 0's until the ranks are restarted (retire_senders, as the
    supervisor does); then what it still sends as rank 0 is dropped (left over
    from rank 0's earlier process: not counted as foreign), and what it sends as
    rank 1 is dropped and counted. Without retiring, its frames stayed believed."""
    from ddtop.daemon.relay import Relay

    needs_sender_pids()
    mine = os.getpid()
    owner = {0: mine}
    relay = Relay(RUN, tmp_path / "telemetry.journal", tmp_path / "sockets", world_size=2,
                  rank_pid=lambda rank, pid: owner.get(rank) == pid)
    push = relay.context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(relay.endpoints["telemetry"])

    def heartbeat(rank: int, seq: int, step: int) -> wire.Heartbeat:
        return wire.Heartbeat(run=RUN, rank=rank, seq=seq, t=time.time(), phase="forward",
                              epoch=0, global_step=step, phase_s=0.1)

    def settle(check: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 10
        while not check():
            assert time.monotonic() < deadline, relay.state.rejected
            relay.serve(0.02)

    try:
        push.send_multipart(wire.encode(heartbeat(0, 1, 5)))
        settle(lambda: 0 in relay.state.ranks)
        assert relay.state.ranks[0].global_step == 5
        relay.retire_senders()
        owner[0] = -1  # rank 0 restarted: its process is another now
        seq_before = relay.seq
        push.send_multipart(wire.encode(heartbeat(0, 2, 7)))  # the old process, late
        late_hello = wire.Hello(run=RUN, rank=0, seq=3, t=time.time(), local_rank=0,
                                host="h", pid=mine, device="cpu", backend="gloo",
                                world_size=2, config_digest="", model="", dataset="",
                                epochs=0, global_batch=0)
        push.send_multipart(wire.encode(late_hello))  # its hello too: not counted
        push.send_multipart(wire.encode(heartbeat(1, 1, 9)))  # and as another rank
        settle(lambda: relay.state.rejected.get("foreign_pid", 0) >= 1)
        for _ in range(10):
            relay.serve(0.02)
        assert relay.state.rejected == {"foreign_pid": 1}
        assert relay.seq == seq_before and relay.state.ranks[0].global_step == 5
        assert 1 not in relay.state.ranks
        # A new rank 0 given the retired pid (pids are reused) is believed.
        owner[0] = mine
        push.send_multipart(wire.encode(heartbeat(0, 4, 11)))
        settle(lambda: relay.state.ranks[0].global_step == 11)
        assert relay.state.rejected == {"foreign_pid": 1}
    finally:
        push.close()
        relay.close()
