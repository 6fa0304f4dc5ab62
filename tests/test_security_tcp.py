"""Beyond loopback: over TCP (`ddtrain start --bind`) every socket speaks CURVE;
no key, a wrong key or another run's keys get nothing in (counted), the
owner's status and a dashboard elsewhere holding a copy of the run's keys
do; an address that cannot be bound is one line.

One detached run over TCP (2 ranks, long enough to outlive the tests). A
module of its own, apart from test_security.py's run: each module's run ends
with its module, so the two never train on the same cores at once.
"""

from __future__ import annotations

import contextlib
import json
import queue
import shutil
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import zmq
from helpers import BIN, Detached, ddtrain, running, tagged_env
from test_security import record

from ddtop.core import control, journal, protocol, wire
from ddtop.core.keys import RunKeys

pytestmark = pytest.mark.processes  # every test here starts processes, or shares a run that does


def test_an_address_that_cannot_be_bound_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """... in the foreground and detached, and the refused start leaves no run
    folder behind (it would be listed as `lost`)."""
    for foreground in (["--foreground"], []):
        run = ddtrain("start", *foreground, "-n", "2", "--run-id", "nowhere",
                      "--bind", "192.0.2.1", cwd=tmp_path, timeout=60)  # TEST-NET-1: not ours
        assert run.returncode == 2 and run.leftovers == []
        assert run.stderr.strip().splitlines() == [
            "ddtrain: error: --bind 192.0.2.1: cannot listen there (Cannot assign requested "
            "address (addr='tcp://192.0.2.1:*')): give an address of this machine"]
        assert list((tmp_path / "runs").iterdir()) == [], foreground


TCP_RUN = "overtcp"
DDTOP = str(BIN / "ddtop")
FORGED_LOSS = 12345.0


@pytest.fixture(scope="module")
def over_tcp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Detached, Path]]:
    cwd = tmp_path_factory.mktemp("tcp")
    with running(cwd, TCP_RUN, "-n", "2", "--epochs", "200",
                 "--step-delay", "0.05", "--bind", "127.0.0.1") as run:
        yield run, cwd / "runs" / TCP_RUN


def test_over_tcp_every_socket_speaks_curve_and_the_owner_gets_in(
        over_tcp: tuple[Detached, Path]) -> None:
    run, root = over_tcp
    endpoints = record(root)["endpoints"]
    assert all(e.startswith("tcp://127.0.0.1:") for e in endpoints.values())
    keys = root / "keys"
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in keys.iterdir()} == {
        "server.key": 0o600, "server.key_secret": 0o600, "client.key": 0o600,
        "client.key_secret": 0o600}
    # The ranks got in (their steps arrive), and so does the owner's status and a
    # subscriber holding the run's keys.
    status = run.status(TCP_RUN)
    assert status["status"] == "running" and all(r["global_step"] > 0 for r in status["ranks"])
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    RunKeys.load(keys).client(sub)
    sub.connect(endpoints["publish"])
    try:
        assert sub.poll(10_000), "a subscriber with the run's keys hears nothing"
        assert sub.recv_multipart()
    finally:
        sub.close()
        context.term()


def forge(run: Detached, endpoints: dict[str, str], keys: RunKeys | None, reason: str) -> None:
    """A Step for rank 0 with an absurd loss from a peer holding `keys` (None: no
    CURVE at all); the peer stays until the daemon has counted its refused
    handshake under `reason`."""
    before = run.status(TCP_RUN)["rejected"].get(reason, 0)
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        keys.client(push)
    push.connect(endpoints["telemetry"])
    step = wire.Step(run=TCP_RUN, rank=0, seq=10**9, epoch=0, step=1, steps_per_epoch=1,
                     global_step=10**9, steps=1, samples=1, loss_sum=FORGED_LOSS, lr=0.1,
                     step_s=0.1, data_s=0, forward_s=0, backward_s=0, optimizer_s=0,
                     comm_s=0, comm_bytes=0, comm_ops=0, algbw_gbps=0, busbw_gbps=0,
                     sync_wait_s=0)
    with contextlib.suppress(zmq.Again):
        push.send_multipart(wire.encode(step), zmq.NOBLOCK)
    run.wait_for(TCP_RUN, lambda s: s["rejected"].get(reason, 0) > before, timeout=30)
    push.close()
    context.term()


def stop_answered(endpoints: dict[str, str], keys: RunKeys | None) -> bool:
    """Whether a stop request from a peer holding `keys` gets an answer in 2 s."""
    try:
        control.request(endpoints["control"], protocol.Stop(), 2.0,
                        keys=None if keys is None else keys_folder(keys))
    except control.Unreachable:
        return False
    return True


KEY_FOLDERS: dict[bytes, Path] = {}


def keys_folder(keys: RunKeys) -> Path:
    return KEY_FOLDERS[keys.client_public]


def stranger_keys(base: Path, name: str, server_of: Path | None) -> RunKeys:
    """Keys of another run; with `server_of`, that folder's real server key and a
    client key pair of its own (a peer that knows the daemon but not the run)."""
    folder = base / name
    RunKeys.create(folder)
    if server_of is not None:
        (folder / "server.key").write_bytes((server_of / "server.key").read_bytes())
    keys = RunKeys.load(folder)
    KEY_FOLDERS[keys.client_public] = folder
    return keys


def test_over_tcp_no_key_a_wrong_key_or_another_runs_keys_get_nothing_in(
        over_tcp: tuple[Detached, Path], tmp_path: Path) -> None:
    run, root = over_tcp
    endpoints = record(root)["endpoints"]
    before = run.status(TCP_RUN)["rejected"]
    peers = [(None, "handshake_failed"),
             (stranger_keys(tmp_path, "wrong-client", server_of=root / "keys"),
              "unauthenticated"),
             (stranger_keys(tmp_path, "other-run", server_of=None), "handshake_failed")]
    for keys, reason in peers:
        forge(run, endpoints, keys, reason)
    # Each peer's stop request, all at once: each waits out its 2 s unanswered.
    with ThreadPoolExecutor(len(peers)) as pool:
        answered = list(pool.map(lambda peer: stop_answered(endpoints, peer[0]), peers))
    assert answered == [False] * len(peers)
    status = run.status(TCP_RUN)
    assert status["status"] == "running"  # no stop got through
    rejected = status["rejected"]
    assert rejected.get("unauthenticated", 0) > before.get("unauthenticated", 0), rejected
    assert rejected.get("handshake_failed", 0) > before.get("handshake_failed", 0), rejected
    decoded = (wire.decode([r.frame], TCP_RUN) for r in journal.read(root / "telemetry.journal"))
    forged = [m for m in decoded if isinstance(m, wire.Step) and m.loss_sum == FORGED_LOSS]
    assert forged == []


def test_a_dashboard_elsewhere_needs_the_runs_keys_and_follows_the_run_with_them(
        over_tcp: tuple[Detached, Path], tmp_path: Path) -> None:
    """`ddtop --connect tcp://...` from outside the run's folder (another machine's
    view): without the keys, one line saying to set DDTOP_KEYS, exit 2; with a
    copy of the keys folder in DDTOP_KEYS, the live run's progress."""
    run, root = over_tcp
    control = record(root)["endpoints"]["control"]
    keys = tmp_path / "keys"
    shutil.copytree(root / "peer-keys", keys)  # as copied to the machine the dashboard runs on
    assert not (keys / "server.key_secret").exists()
    bare = subprocess.run([DDTOP, "--headless", "--connect", control, "--wait", "2"],
                          cwd=tmp_path, env=tagged_env(run.tag), text=True,
                          capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    assert bare.returncode == 2, bare.stdout + bare.stderr
    assert len(bare.stderr.strip().splitlines()) == 1 and "DDTOP_KEYS" in bare.stderr
    lines: queue.Queue[str | None] = queue.Queue()
    with (tmp_path / "ddtop.err").open("w") as err:
        watcher = subprocess.Popen(
            [DDTOP, "--headless", "--format", "jsonl", "--interval", "1", "--connect", control],
            cwd=tmp_path, env=tagged_env(run.tag, {"DDTOP_KEYS": str(keys)}), text=True,
            stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)

    def read() -> None:  # a thread, so that a silent watcher cannot block the test
        assert watcher.stdout is not None
        for line in watcher.stdout:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        progress = None
        deadline = time.monotonic() + 60
        while progress is None:
            left = deadline - time.monotonic()
            assert left > 0, (tmp_path / "ddtop.err").read_text()
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                continue
            assert line is not None, (tmp_path / "ddtop.err").read_text()  # it ended
            record_ = json.loads(line)
            if (record_["kind"] == "progress" and len(record_["ranks"]) == 2
                    and all(r["global_step"] > 0 for r in record_["ranks"])):
                progress = record_
    finally:
        watcher.terminate()
        try:
            watcher.wait(timeout=30)
        except subprocess.TimeoutExpired:
            watcher.kill()
            watcher.wait(timeout=30)
        reader.join(timeout=30)
    assert progress is not None and progress["status"] == "running"
    assert [r["state"] for r in progress["ranks"]] == ["running", "running"]
