"""A multi-node job on this machine: two `ddtrain start --nnodes 2` commands,
two ranks each, c10d rendezvous over loopback, node 0's daemon the hub.

Real processes, real ZeroMQ (CURVE), real gloo. Jobs: one shared by two tests
(status, a forwarder with wrong keys, where torch's stores listen and a forged
stop step in one checked while it runs; then its hub frozen for a while, and
stopped with `ddtrain stop` on node 0, the headless summary), one where a rank
on node 1 is killed, one running a user's script, one where node 1's daemon is
killed. And the built-in trainer's stop agreement as a multi-node job makes
it, with only rank 0 told of the stop. Run with -s, they print what they
measure (docs/multi-node.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import zmq
from helpers import TORCHRUN, finish, listening_addresses, start, torchrun
from prometheus_client.parser import text_string_to_metric_families

from ddtop.core import journal, wire
from ddtop.core.config import TrainConfig
from ddtop.core.contract import ATTEMPT_ENV, STOP_SECRET_ENV, UsageError
from ddtop.core.keys import RunKeys, write_peer_folder
from ddtop.core.processes import ProcessId, environ_value
from ddtop.core.rundir import RunPaths
from ddtop.core.state import RunState
from ddtop.daemon import hubfile
from ddtop.daemon.hub import HEARTBEAT_S, NODE_TIMEOUT_S, at_host_of
from ddtop.dashboard import format as fmt
from ddtop.dashboard import panels
from ddtop.dashboard.app import DashboardApp
from ddtop.dashboard.live import LiveFeed
from ddtop.dashboard.widgets import RankTable

# A backstop above each test's own waits (their asserts say more than a timeout).
pytestmark = pytest.mark.timeout(180)

SBATCH = Path(__file__).resolve().parent.parent / "examples" / "slurm" / "ddtrain.sbatch"
TUTORIAL = SBATCH.parent.parent / "ddp_tutorial.py"
STOP_RANKS = Path(__file__).resolve().parent / "scripts" / "stop_ranks.py"
SMALL = ["--synthetic-train-samples", "2048", "--synthetic-val-samples", "128",
         "--batch-size", "64", "--progress-every", "30"]


# `ddtrain stop`'s own timeout, and the most its command can take (that, then
# terminating, plus its backstop): a stop that hangs ends in the daemons' words.
STOP = ["--timeout", "20"]
STOP_WAIT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ddtrain(*args: str, cwd: Path, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ddtop.daemon", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=timeout)


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether `pid` is `ancestor` or a process below it (by /proc's parent pids)."""
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rpartition(")")[2].split()[1])
    return False


def journal_messages(path: Path) -> list[tuple[float, wire.Message]]:
    """(received, message) of every record of a daemon's telemetry journal."""
    return [(r.received, wire.decode([r.frame])) for r in journal.read(path)]


def unpacked(records: Iterable[tuple[float, wire.Message]]
             ) -> Iterator[tuple[float, wire.Message]]:
    """A hub's journal records with its nodes' summaries opened: the ranks'
    messages in them, at the time the hub received the summary."""
    for t, m in records:
        if isinstance(m, wire.NodeSummary):
            yield from ((t, inner) for inner in m.messages)
        else:
            yield t, m


class Job:
    """Both nodes of one job, started here; every process they started, ended."""

    def __init__(self, tmp: Path, run_id: str, *extra: str, shared: bool = True,
                 net: tuple[str, str, str, str] | None = None,
                 program: list[str] | None = None, hub_extra: tuple[str, ...] = ()) -> None:
        """`shared`: both nodes' --runs-dir the same folder (a shared file system);
        else node 1 has its own and is given --hub and a copy of the keys. `net`:
        each node in its own network namespace (`namespaces`), else loopback.
        `program`: a user's script and its arguments (`SCRIPT -- ARGS`) in place
        of the built-in trainer and its SMALL flags. `hub_extra`: node 0's flags only."""
        self.tmp, self.run_id, self.net = tmp, run_id, net
        self.runs = tmp / "runs"
        # node 1's own run directory (its daemon's files)
        self.node1 = (self.runs if shared else tmp / "node1-runs") / run_id / "nodes" / "1"
        host = "10.77.0.1" if net else "127.0.0.1"
        port = free_port() if net is None else 29400
        self.rdzv_port = port
        self.nodes: list[subprocess.Popen[str]] = []
        for k in (0, 1):
            where = ["--runs-dir", str(self.runs)]
            if k and not shared:
                where = ["--runs-dir", str(tmp / "node1-runs"), *self.hub_flags()]
            prefix, env = [], dict(os.environ)
            if net is not None:  # its namespace, its address, gloo on its interface
                prefix = ["ip", "netns", "exec", net[k]]
                where += ["--local-addr", f"10.77.0.{k + 1}"]
                env["GLOO_SOCKET_IFNAME"] = net[2 + k]
            self.nodes.append(subprocess.Popen(
                [*prefix, sys.executable, "-m", "ddtop.daemon", "start", "--foreground",
                 "--headless", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(k),
                 "--rdzv-endpoint", f"{host}:{port}", "--run-id", run_id,
                 *where, *(SMALL if program is None else []), *extra,
                 *(hub_extra if k == 0 else ()), *(program or [])],
                cwd=tmp, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env=env, start_new_session=True))
            time.sleep(0.3)  # node 0 first: it hosts the rendezvous and the hub

    def hub_flags(self) -> list[str]:
        """What a node without the shared folder is given: the endpoint node 0
        wrote, and its keys folder copied (as `scp -rp` would)."""
        hub_file = self.runs / self.run_id / "hub.json"
        deadline = time.monotonic() + 20
        while not hub_file.is_file():
            assert time.monotonic() < deadline and self.nodes[0].poll() is None
            time.sleep(0.05)
        keys = self.tmp / "copied-keys"
        shutil.copytree(self.runs / self.run_id / "peer-keys", keys)
        assert sorted(p.name for p in keys.iterdir()) == [
            "client.key", "client.key_secret", "server.key"]  # never the hub's secret
        return ["--hub", json.loads(hub_file.read_text())["control"], "--hub-keys", str(keys)]

    def status(self, node: int = 0) -> dict:
        """`ddtrain status --json` as run on node 0 (the whole job) or on node 1 (its
        own ranks): in that node's namespace, where the daemon's endpoints are."""
        run = self.run_id if node == 0 else str(self.node1)
        cmd = [sys.executable, "-m", "ddtop.daemon", "status", run, "--json",
               "--runs-dir", str(self.runs)]
        if self.net is not None:
            cmd = ["ip", "netns", "exec", self.net[node], *cmd]
        done = subprocess.run(cmd, cwd=self.tmp, text=True, capture_output=True, timeout=30)
        return json.loads(done.stdout) if done.stdout.strip().startswith("{") else {}

    def wait_running(self, timeout: float = 40) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.status()
            ranks = s.get("ranks", [])
            if (len(ranks) == 4 and all(r["state"] == "running" for r in ranks)
                    and {r.get("node") for r in ranks} == {0, 1}):
                return s
            assert all(p.poll() is None for p in self.nodes), self.output()
            time.sleep(0.3)
        raise AssertionError(f"not all 4 ranks running on 2 nodes: {self.status()}")

    def wait(self, timeout: float = 40) -> list[tuple[int, str, str]]:
        """Both nodes' ends, within `timeout` s for the two together."""
        deadline = time.monotonic() + timeout
        ends = []
        for p in self.nodes:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            ends.append((p.returncode, out, err))
        return ends

    def output(self) -> str:
        return "\n".join(f"node {k} rc={p.poll()}" for k, p in enumerate(self.nodes))

    def node1_rank_pid(self, rank: int, timeout: float = 20) -> int:
        """The pid of `rank` as node 1's own daemon reports it (`ddtrain status
        --json` on node 1), checked to be a process below node 1's daemon."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid = next((r["pid"] for r in self.status(1).get("ranks", [])
                        if r["rank"] == rank and r["pid"]), None)
            if pid is not None and descends_from(pid, self.nodes[1].pid):
                return int(pid)
            time.sleep(0.2)
        raise AssertionError(f"node 1's status has no pid for rank {rank}: {self.status(1)}")

    def close(self) -> None:
        for p in self.nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the group this test started
            p.communicate(timeout=10)


@pytest.fixture
def job_factory(tmp_path: Path) -> Iterator[list[Job]]:
    jobs: list[Job] = []
    yield jobs
    for job in jobs:
        job.close()


@pytest.fixture(scope="module")
def stopjob(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    """One job of the built-in trainer, long enough to outlast the two tests that
    share it, in file order: the first looks at it running, the second freezes
    its hub a while and then stops it with `ddtrain stop` on node 0."""
    job = Job(tmp_path_factory.mktemp("stopjob"), "stopjob", "--epochs", "1000",
              hub_extra=("--metrics", "0", "--metrics-linger", "0"))
    try:
        yield job
    finally:
        job.close()


@pytest.mark.processes
def test_two_nodes_one_hub_status_and_refused_forwarder(stopjob: Job) -> None:
    job = stopjob
    status = job.wait_running()
    # node 0's status lists every rank with its node and host
    assert sorted(r["rank"] for r in status["ranks"]) == [0, 1, 2, 3]
    assert sorted(r["node"] for r in status["ranks"]) == [0, 0, 1, 1]
    assert all(r["host"] for r in status["ranks"])
    table = ddtrain("status", "stopjob", "--runs-dir", str(job.runs), cwd=job.tmp).stdout
    assert "NODE" in table and "HOST" in table
    # the dashboard on node 0 (App.run_test, attached to the hub): all four ranks, by node
    feed = LiveFeed(RunPaths(job.runs / "stopjob"))
    app = DashboardApp(feed, fps=10)
    rows: list[str] = []

    async def watch() -> None:
        async with app.run_test(size=(160, 40)) as pilot:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                rows[:] = [line for line in app.query_one(RankTable).visible_text() if line][1:]
                if len(rows) == 4 and sum(" n1" in r for r in rows) == 2:
                    break
                await pilot.pause(0.1)

    try:
        asyncio.run(watch())
    finally:
        feed.close()
    assert sum(" n0" in r for r in rows) == 2 and sum(" n1" in r for r in rows) == 2, rows
    # node 1 keeps its own files; the hub wrote where it is, owner-only
    assert (job.runs / "stopjob" / "nodes" / "1" / "run.json").is_file()
    hub = json.loads((job.runs / "stopjob" / "hub.json").read_text())
    assert (job.runs / "stopjob" / "hub.json").stat().st_mode & 0o077 == 0
    # a forwarder without the job's keys: refused and counted
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        public, secret = zmq.curve_keypair()
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = (job.runs / "stopjob" / "keys" / "server.key").read_text(
        ).split('public-key = "')[1].split('"')[0].encode()
        sock.connect(hub["nodes"])
        for _ in range(5):
            with contextlib.suppress(zmq.Again):
                sock.send_multipart([b"ddtop-node/1", b"1", b"forged"], zmq.NOBLOCK)
        deadline = time.monotonic() + 10
        while not job.status().get("rejected", {}).get("unauthenticated"):
            assert time.monotonic() < deadline, job.status().get("rejected")
            time.sleep(0.2)
    finally:
        ctx.destroy(linger=0)
    check_torchs_store(job)  # a forged stop step must not stop it: the next test's stop works
    # --metrics on node 0: the hub serves every rank of the job, each labelled with its node
    url = json.loads((job.runs / "stopjob" / "run.json").read_text())["endpoints"]["metrics"]
    with urllib.request.urlopen(url, timeout=10) as reply:
        families = {f.name: f.samples for f in text_string_to_metric_families(
            reply.read().decode())}
    steps = families["ddtop_rank_global_step"]
    assert sorted((s.labels["rank"], s.labels["node"]) for s in steps) == [
        ("0", "0"), ("1", "0"), ("2", "1"), ("3", "1")], steps
    assert all(s.labels["run"] == "stopjob" and s.value > 0 for s in steps), steps
    # `ddtrain evidence` on node 0: the hub's bundle of its own ranks, its index saying
    # where the other node's goes; node 1 gathers its ranks' once its heartbeat's reply
    # names the hub's bundle.
    asked = ddtrain("evidence", "stopjob", "--runs-dir", str(job.runs), cwd=job.tmp)
    assert asked.returncode == 0, asked.stdout + asked.stderr
    assert "\n  nodes: nodes 1-1 each gather their own ranks' into " in asked.stdout, asked.stdout
    (bundle,) = (job.runs / "stopjob" / "evidence").iterdir()
    index = json.loads((bundle / "index.json").read_text())
    assert {"rank-0.stacks", "rank-1.stacks"} <= set(index["files"]), index
    assert not any("rank-2" in f or "rank-3" in f for f in index["files"]), index
    assert index["nodes"].startswith("nodes 1-1 each gather their own ranks' into "
                                     "runs/stopjob/nodes/K/evidence/"), index
    theirs = job.node1 / "evidence"
    deadline = time.monotonic() + 15
    while not (theirs.is_dir() and any((b / "index.json").exists() for b in theirs.iterdir())):
        assert time.monotonic() < deadline, f"no bundle in {theirs}"
        time.sleep(0.2)
    (node_bundle,) = theirs.iterdir()
    node_index = json.loads((node_bundle / "index.json").read_text())
    assert node_index["why"] == "hub", node_index
    assert node_index["verdict"].startswith(f"asked with the hub's evidence {bundle.name}")
    assert {"rank-2.stacks", "rank-3.stacks"} <= set(node_index["files"]), node_index
    assert "trainer.py" in (node_bundle / "rank-2.stacks").read_text()


@pytest.mark.processes
def test_node_1_trains_on_while_the_hub_is_stopped_and_the_hub_catches_up(
        stopjob: Job) -> None:
    """Node 0's daemon frozen (SIGSTOP) for 6 s while both nodes' ranks train:
    node 1 goes on and says the hub has not answered; once it runs again the
    hub shows node 1's ranks running and has every message node 1 folded. Then
    `ddtrain stop` on node 0 stops both nodes, and `ddtop --headless` on node 0
    follows the whole job to that end."""
    job = stopjob
    job.wait_running()

    def node1_steps() -> dict[int, int]:
        return {r["rank"]: r["global_step"] for r in job.status(1).get("ranks", [])}

    def said(journal_path: Path, text: str) -> list[float]:
        return [t for t, m in journal_messages(journal_path)
                if isinstance(m, wire.Event) and text in m.message]

    hub_daemon = job.nodes[0].pid  # node 0's daemon, started by this test's fixture
    before = node1_steps()
    assert len(before) == 2, before
    frozen = time.time()
    os.kill(hub_daemon, signal.SIGSTOP)
    try:
        while (not (warned := said(job.node1 / "telemetry.journal",
                                   "the hub (node 0) has not answered"))
               and time.time() - frozen < 12):
            time.sleep(0.2)
        time.sleep(max(0.0, frozen + 6.5 - time.time()))
        during = node1_steps()  # node 1's own daemon answers for its own ranks
    finally:
        os.kill(hub_daemon, signal.SIGCONT)
    thawed = time.time()
    assert sorted(during) == sorted(before), (before, during)
    assert all(during[r] > before[r] for r in before), (before, during)
    # (5 s after the hub's last reply, which came a heartbeat or more before it froze)
    assert warned and (NODE_TIMEOUT_S - 2 * HEARTBEAT_S
                       <= warned[0] - frozen < 12), (frozen, warned)
    # the hub catches up: node 1's ranks running again, and node 1 hears it answer
    deadline = time.monotonic() + 20
    while True:
        ranks = job.status().get("ranks", [])
        if (len(ranks) == 4 and all(r["state"] == "running" for r in ranks)
                and all(r["global_step"] >= during.get(r["rank"], 0) for r in ranks)):
            break
        assert time.monotonic() < deadline, ranks
        time.sleep(0.3)
    caught_up = time.time()
    deadline = time.monotonic() + 10
    while not (again := said(job.node1 / "telemetry.journal", "the hub (node 0) answers again")):
        assert time.monotonic() < deadline, "node 1 never said the hub answers again"
        time.sleep(0.3)
    print(f"\nhub frozen {thawed - frozen:.1f} s: node 1 warned {warned[0] - frozen:.1f} s in, "
          f"its ranks went "
          f"from step {min(before.values())} to {min(during.values())}; after SIGCONT the hub "
          f"showed all 4 ranks running {caught_up - thawed:.1f} s later, node 1 heard it "
          f"{again[0] - thawed:.1f} s later")
    # ddtop --headless on node 0 follows the whole job and exits with its outcome
    watcher = subprocess.Popen(
        [sys.executable, "-m", "ddtop.dashboard", "stopjob", "--headless", "--runs-dir",
         str(job.runs), "--interval", "1"], cwd=job.tmp, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT)
    try:
        time.sleep(1.0)
        # ddtrain stop on node 0 stops both nodes
        asked_at = time.monotonic()
        asked = time.time()
        stop = ddtrain("stop", "stopjob", "--runs-dir", str(job.runs), *STOP, cwd=job.tmp,
                       timeout=STOP_WAIT_S)
        assert stop.returncode == 0, stop.stderr
        (rc0, out0, err0), (rc1, _, err1) = job.wait()
        print(f"\nddtrain stop on node 0: both nodes exited {time.monotonic() - asked_at:.1f} s "
              "after the command started")
        assert (rc0, rc1) == (130, 130), (err0[-2000:], err1[-2000:])
        watched, _ = watcher.communicate(timeout=20)
        assert watcher.returncode == 130, watched[-2000:]
        assert "rank   3 node " in watched, watched[-2000:]
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.communicate()
    # the headless summary on node 0 shows the four ranks with their node
    for k in range(4):
        assert f"rank   {k} node " in out0
    assert sum(f" node {n} " in out0 for n in (0, 1)) == 2
    assert "warning: the hub (node 0) has not answered for 5 s" in err1, err1[-2000:]
    # nothing dropped: every step node 1's daemon folded a second before the stop
    # reached the hub's journal, in node 1's summaries (after it, the hub may end
    # before node 1's last arrive), and the hub has none node 1 did not fold
    def steps_of(messages: Iterable[tuple[float, wire.Message]], until: float = float("inf")
                 ) -> tuple[set[tuple[int, int]], dict[int, int]]:
        """The (rank, seq) of node 1's ranks' Step messages journalled by `until`,
        and their steps by rank."""
        said, steps = set(), dict.fromkeys(before, 0)
        for t, m in messages:
            if isinstance(m, wire.Step) and m.rank in before and t <= until:
                said.add((m.rank, m.seq))
                steps[m.rank] += m.steps
        return said, steps

    node_1 = list(journal_messages(job.node1 / "telemetry.journal"))
    _, by_1s_before = steps_of(node_1, until=asked - 1.0)
    said_on_1, on_node_1 = steps_of(node_1)
    said_on_hub, on_hub = steps_of(
        unpacked(journal_messages(job.runs / "stopjob" / "telemetry.journal")))
    assert all(0 < by_1s_before[r] <= on_hub[r] <= on_node_1[r] for r in before), (
        by_1s_before, on_hub, on_node_1)
    assert said_on_hub <= said_on_1  # a merged Step is said with its newest message's seq

@pytest.mark.processes
def test_a_rank_killed_on_node_1_is_named_on_node_0_without_a_shared_folder(
        tmp_path: Path, namespaces: tuple[str, str, str, str] | None,
        job_factory: list[Job]) -> None:
    """Node 1 without the shared folder (--hub and a copy of the keys); where
    the test may make them (root), each node in its own network namespace, so
    that the rendezvous, gloo and the forwarding cross an interface. The rank
    killed is one that runs on node 1 (the rendezvous decides which ranks those
    are), so its exit always travels from node 1's daemon to the hub."""
    job = Job(tmp_path, "killjob", "--epochs", "1000", shared=False, net=namespaces)
    job_factory.append(job)
    status = job.wait_running()
    victim = max(r["rank"] for r in status["ranks"] if r["node"] == 1)
    node1 = job.node1
    pid = job.node1_rank_pid(victim)
    killed = time.time()
    os.kill(pid, signal.SIGKILL)  # a rank of node 1, started by this test's node 1
    (rc0, out0, err0), (rc1, out1, err1) = job.wait(60)
    assert rc0 == 1, err0[-3000:]
    assert rc1 == 1, err1[-3000:]  # node 1's own outcome: its rank was killed
    # node 1's own summary: its two ranks, not the hub's as "starting"
    assert sum(line.startswith("  rank ") for line in out1.splitlines()) == 2, out1[-2000:]
    record = json.loads((job.runs / "killjob" / "run.json").read_text())
    assert f"rank {victim} on node 1" in err0 and "SIGKILL" in err0, err0[-3000:]
    assert record["failure"]["rank"] == victim, record["failure"]
    assert f"failure: rank {victim} on node 1 killed by SIGKILL" in out0, out0[-2000:]

    # named on node 0 as soon as on node 1 itself: the exit's receive times
    def exit_of_victim(path: Path) -> float:
        return next(t for t, m in journal_messages(path)
                    if isinstance(m, wire.RankExit) and m.exited == victim)

    on_node_1 = exit_of_victim(node1 / "telemetry.journal")
    on_hub = exit_of_victim(job.runs / "killjob" / "telemetry.journal")
    outcome = max(t for t, m in journal_messages(job.runs / "killjob" / "telemetry.journal")
                  if isinstance(m, wire.RunStatus) and m.status == "failed")
    print(f"\nrank {victim} killed on node 1 ({'namespaces' if namespaces else 'loopback'}): "
          f"its exit in node 1's journal {on_node_1 - killed:.2f} s after the kill, in the "
          f"hub's {(on_hub - on_node_1) * 1000:.0f} ms after node 1's; the hub's outcome "
          f"{outcome - on_hub:.2f} s after that")
    # Milliseconds here (printed above); bounded by what the product promises: before
    # the job's outcome, and within a node's timeout (the hub reads nothing while it
    # is stopping its own ranks, up to a few seconds on a loaded machine).
    assert 0 <= on_hub - on_node_1 < NODE_TIMEOUT_S and on_hub <= outcome, (
        on_node_1, on_hub, outcome)
    assert (node1 / "run.json").is_file()
    control = json.loads((job.runs / "killjob" / "hub.json").read_text())["control"]
    assert control.startswith("tcp://10.77.0.1:" if namespaces else "tcp://127.0.0.1:")


PLAIN_DDP = Path(__file__).resolve().parent / "scripts" / "plain_ddp.py"


def test_a_node_reaches_the_nodes_socket_where_it_reached_the_hub() -> None:
    assert at_host_of("tcp://vm:4242", "tcp://10.77.0.1:41773") == "tcp://10.77.0.1:4242"
    assert at_host_of("tcp://vm:4242", "tcp://[fd00::1]:41773") == "tcp://[fd00::1]:4242"
    assert at_host_of("tcp://[::1]:4242", "tcp://node0:1") == "tcp://node0:4242"
    assert at_host_of("ipc:///tmp/x", "tcp://node0:1") == "ipc:///tmp/x"
    assert at_host_of("tcp://vm:4242", "ipc:///tmp/x") == "tcp://vm:4242"


@pytest.mark.processes
def test_one_watch_per_host_without_a_shared_folder_sees_both_hosts_ranks(
        tmp_path: Path, namespaces: tuple[str, str, str, str] | None) -> None:
    """`ddtrain watch` on each of two hosts (network namespaces where the test may
    make them), each running its host's torchrun of an unchanged script; node 1
    has its own runs folder, the hub's address (--hub) and a copy of its keys.
    Node 1's ranks are seen at the hub step for step: its summaries reach the hub
    at the address node 1 was given, whatever the hub calls itself (its host name,
    which resolves to loopback in the other namespace)."""
    host = "10.77.0.1" if namespaces else "127.0.0.1"
    port = str(29400 if namespaces else free_port())
    procs = []
    for node in (0, 1):
        torchrun = [TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node",
                    "1", "--master-addr", host, "--master-port", port, str(PLAIN_DDP)]
        where = ["--runs-dir", str(tmp_path / f"runs{node}")]
        if node:  # the hub's address as its user would give it, and its keys copied
            hub = tmp_path / "runs0" / "wj" / "hub.json"
            deadline = time.monotonic() + 20
            while not hub.is_file():
                assert time.monotonic() < deadline and procs[0][0].poll() is None
                time.sleep(0.05)
            shutil.copytree(hub.parent / "peer-keys", tmp_path / "keys")
            control = json.loads(hub.read_text())["control"]
            where += ["--hub", f"tcp://{host}:{control.rpartition(':')[2]}",
                      "--hub-keys", str(tmp_path / "keys")]
        prefix = ["ip", "netns", "exec", namespaces[node]] if namespaces else []
        env = {"STEPS": "20", "SLEEP": "0.05"}
        if namespaces:
            env["GLOO_SOCKET_IFNAME"] = namespaces[2 + node]
        procs.append(start([*prefix, sys.executable, "-m", "ddtop.daemon", "watch",
                            "--headless", "--nnodes", "2", "--node-rank", str(node),
                            "--run-id", "wj", *where, "--", *torchrun], tmp_path, env))
    runs = [finish(proc, tag, timeout=120) for proc, tag in procs]
    assert [r.returncode for r in runs] == [0, 0], [r.stderr[-2000:] for r in runs]
    assert "node 1 forwards to the hub" in runs[1].stderr, runs[1].stderr[-2000:]
    record = json.loads((tmp_path / "runs0" / "wj" / "run.json").read_text())
    assert record["status"] == "succeeded", record
    assert [(r["rank"], r["node"], r["state"], r["global_step"]) for r in record["ranks"]] == [
        (0, 0, "finished", 20), (1, 1, "finished", 20)], record["ranks"]
    assert not any(r.leftovers for r in runs)


@pytest.mark.processes
def test_two_nodes_run_a_users_script(tmp_path: Path, job_factory: list[Job]) -> None:
    """examples/ddp_tutorial.py (the DDP tutorial, not the built-in trainer) as
    a two-node job over loopback: 512 samples over 4 ranks in batches of 32, 4
    optimizer steps an epoch, 3 epochs. The hub sees every rank's node, steps and
    DDP's comm timing (node 1's forwarded), and both nodes succeed."""
    job = Job(tmp_path, "userjob", program=[
        str(TUTORIAL), "--", "--epochs", "3", "--save-every", "2", "--dataset-size", "512",
        "--batch-size", "32", "--snapshot-path", "snapshot.pt"])
    job_factory.append(job)
    (rc0, out0, err0), (rc1, out1, err1) = job.wait(80)
    assert (rc0, rc1) == (0, 0), (err0[-2000:], err1[-2000:])
    status = job.status()
    assert status["status"] == "succeeded", status
    ranks = {r["rank"]: r for r in status["ranks"]}
    assert sorted(ranks) == [0, 1, 2, 3]
    assert sorted(r["node"] for r in ranks.values()) == [0, 0, 1, 1], ranks
    assert all(r["host"] and r["state"] == "finished" for r in ranks.values()), ranks
    assert all(r["global_step"] == 12 for r in ranks.values()), ranks
    assert all(r["comm_share"] and r["comm_share"] > 0 for r in ranks.values()), ranks
    # every rank's DDP all-reduce timed in its steps, as the hub received them
    steps = [m for _, m in unpacked(journal_messages(job.runs / "userjob" / "telemetry.journal"))
             if isinstance(m, wire.Step)]
    for rank in range(4):
        mine = [m for m in steps if m.rank == rank]
        assert sum(m.steps for m in mine) == 12, (rank, len(mine))
        assert sum(m.comm_ops for m in mine) >= 12 and sum(m.comm_s for m in mine) > 0, rank
    # node 1's own summary: its two ranks; node 0's: the job's, both nodes
    assert sum(line.startswith("  rank ") for line in out1.splitlines()) == 2, out1[-2000:]
    assert sum(f" node {n} " in out0 for n in (0, 1)) == 2, out0[-2000:]
    assert (tmp_path / "snapshot.pt").is_file()  # rank 0 saved, wherever it ran


@pytest.mark.processes
def test_a_rank_whose_node_never_hears_of_the_stop_stops_after_the_same_step(
        tmp_path: Path) -> None:
    """The built-in trainer's stop agreement in a multi-node job, with only rank 0
    signalled: the other rank (another node, whose daemon is late or never hears)
    finds the target in the store and stops after the same step. Were it to run
    past, the two would wait in different collectives (tests/scripts/stop_ranks.py)."""
    run = torchrun("--standalone", "--nproc-per-node", "2", str(STOP_RANKS), "20",
                   cwd=tmp_path, timeout=90, env={STOP_SECRET_ENV: "7" * 64})
    assert run.returncode == 0, run.stderr[-3000:]
    # (both ranks write to one pipe: their lines may come in either order)
    said = {int(r): (int(step), signalled) for r, step, signalled in re.findall(
        r"rank (\d) stopped after step (\d+) signalled (True|False)", run.stdout)}
    assert said == {0: (said[0][0], "True"), 1: (said[0][0], "False")}, run.stdout
    assert said[0][0] >= 20 + 3, run.stdout  # 3 s of steps after the signal, at least 3
    assert run.leftovers == []
    print(f"\n{run.stdout.strip()}")


# torch's store as the ranks of a job see it: the default process group's keys
# (torch 2.14) under this prefix; the fixed key the stop agreement once used.
DEFAULT_PG = "default_pg/0//"
OLD_STOP_KEY = "ddtop/stop_after"
STORE_CLIENT = """
import sys
from datetime import timedelta
from torch.distributed import TCPStore
store = TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False, timeout=timedelta(seconds=10))
for key, value in zip(sys.argv[3::2], sys.argv[4::2]):
    store.set(key, value)
print("\\n".join(store.list_keys()))
"""


def processes_below(daemons: list[subprocess.Popen[str]]) -> list[int]:
    """Every process below these daemons (by /proc's parent pids), the daemons too."""
    pids = [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]
    return [pid for pid in pids if any(descends_from(pid, d.pid) for d in daemons)]


def test_a_stop_step_counts_only_signed_for_this_launch(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """What a rank reads from torch's store (training/stopping.py), in-process: only
    a value rank 0 of this launch signed with the job's secret is a target; any
    other is ignored, and said once."""
    from ddtop.training.stopping import STORE_KEY, StopAgreement

    monkeypatch.setenv(STOP_SECRET_ENV, "5" * 64)
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv(ATTEMPT_ENV, "0")
    main, other = StopAgreement(True, 100), StopAgreement(False, 100)
    assert main.key == other.key != STORE_KEY and main.key.startswith("ddtop/stop/")
    signed = main._signed(130).encode()
    assert other._verified(signed) == 130
    target, _, mac = signed.partition(b":")
    forged = [b"0", b"131:" + mac, b"0:" + mac, target + b":" + b"0" * 64, target + b":",
              b"-5:" + mac, b"9" * 40, b"\xff\xfe", b""]
    monkeypatch.setenv(STOP_SECRET_ENV, "6" * 64)  # another job's secret
    forged.append(StopAgreement(True, 100)._signed(130).encode())
    monkeypatch.setenv(STOP_SECRET_ENV, "5" * 64)
    monkeypatch.setenv("MASTER_PORT", "29501")  # another launch of this job (a resume)
    forged.append(StopAgreement(True, 100)._signed(130).encode())
    monkeypatch.setenv("MASTER_PORT", "29500")
    forged.append(StopAgreement(True, 120)._signed(130).encode())  # resumed from step 120
    assert [other._verified(v) for v in forged] == [None] * len(forged)
    assert other._verified(signed) == 130  # still: nothing forged is remembered
    assert capsys.readouterr().err.count("ddtop: ignored a stop step in torch's store") == 1
    # a rank started without the secret (a user's own torchrun): the fixed key, plain
    monkeypatch.delenv(STOP_SECRET_ENV)
    plain = StopAgreement(False, 0)
    assert plain.key == STORE_KEY and plain._verified(b"42") == 42


def check_torchs_store(job: Job) -> None:
    """A running 2-node job on loopback: every socket its processes listen on is on
    loopback (the rendezvous store and the store the workers share, hosted by
    torchrun's agents; gloo; the daemons). An outside process sets the stop key
    the ranks once polled, and a forged value at the key they read now: no rank
    stops (before, the ranks other than 0 polled the fixed key, stopped at once,
    and rank 0 waited in an all-reduce); each rank that read it says so once."""
    ranks = job.status()["ranks"]
    rank_pid = job.node1_rank_pid(max(r["rank"] for r in ranks if r["node"] == 1))
    master = [environ_value(rank_pid, name) or "" for name in ("MASTER_ADDR", "MASTER_PORT")]
    listening = {pid: listening_addresses(pid) for pid in processes_below(job.nodes)}
    found = [a for addresses in listening.values() for a in addresses]
    assert all(a.startswith(("127.", "::1:", "::ffff:127.")) for a in found), listening
    assert master[0] == "127.0.0.1", master
    assert f"127.0.0.1:{job.rdzv_port}" in found and f"127.0.0.1:{master[1]}" in found, (
        listening)
    # the outside process: the old fixed key, and a forged value at the key read now
    secret = RunKeys.load(job.runs / job.run_id / "keys").stop_secret().encode()
    key = DEFAULT_PG + "ddtop/stop/" + hmac.new(secret, b"key", hashlib.sha256).hexdigest()[:16]
    before = job.status()["global_step"]
    outside = subprocess.run([sys.executable, "-c", STORE_CLIENT, *master,
                              DEFAULT_PG + OLD_STOP_KEY, "0", key, "0:" + "0" * 64],
                             text=True, capture_output=True, timeout=30)
    assert outside.returncode == 0, outside.stderr[-2000:]
    assert DEFAULT_PG + OLD_STOP_KEY in outside.stdout.split()
    set_at = time.monotonic()

    def ignored() -> list[int]:
        logs = [p.read_text() for p in (job.runs / job.run_id).glob("**/logs/rank-*.log")]
        return [log.count("ddtop: ignored a stop step in torch's store") for log in logs]

    # Every rank but 0 looks in the store twice a second: once the three have said
    # they ignored the forged value, the slowest rank still makes steps, every rank
    # running (a rank that had stopped would hold the others in an all-reduce).
    read_by = time.monotonic() + 20
    while sum(ignored()) < 3 and time.monotonic() < read_by:
        time.sleep(0.2)
    settled = job.status()["global_step"]
    deadline = time.monotonic() + 20
    while (now := job.status()).get("global_step", 0) <= settled + 10:
        assert time.monotonic() < deadline and all(p.poll() is None for p in job.nodes), (
            f"the ranks stopped training after the outside set: the slowest at step {before}, "
            f"{settled} 2 s later, {now.get('global_step')} 20 s after that; {job.output()}")
        time.sleep(0.3)
    assert [r["state"] for r in now["ranks"]] == ["running"] * 4, now["ranks"]
    print(f"\nan outside TCPStore.set at step {before}: the slowest rank at step "
          f"{now['global_step']} {time.monotonic() - set_at:.1f} s later; listening: "
          f"{sorted(set(found))}")
    said = ignored()
    assert sorted(said)[-3:] == [1, 1, 1] and len(said) == 4, said  # the three that read it


@pytest.mark.processes
def test_killing_node_1s_daemon_loses_node_1(tmp_path: Path, job_factory: list[Job],
                                             namespaces: tuple[str, str, str, str] | None
                                             ) -> None:
    """Each node on a host of its own where the test may make them (network
    namespaces), else both on loopback: node 1's daemon SIGKILLed, node 1 lost."""
    job = Job(tmp_path, "lostjob", "--epochs", "1000", net=namespaces)
    job_factory.append(job)
    job.wait_running()
    killed = time.time()
    job.nodes[1].send_signal(signal.SIGKILL)  # node 1's daemon, started by this test
    (rc0, out0, err0), _ = job.wait(60)
    ended = time.time()
    assert rc0 == 1, err0[-3000:]
    assert "node 1 (" in err0 and "lost" in err0, err0[-3000:]
    for pid in map(int, re.findall(r"\(pid (\d+)\)", err0)):  # a rank's pid, once a line
        assert all(line.count(f"pid {pid}") <= 1 for line in err0.splitlines()), err0[-3000:]
    assert "left 1 process behind (pid" not in err0 or "was still running" not in err0
    # Its ranks named, from what it forwarded, even before a heartbeat listed them.
    assert "ranks 2, 3 unreachable" in err0, err0[-3000:]
    record = json.loads((job.runs / "lostjob" / "run.json").read_text())
    assert record["status"] == "failed"
    # One outcome, one culprit: node 1 in run.json, `status` and the headless
    # summary as in the headline, not rank 0 (which only lost its peers).
    failure = record["failure"]
    assert failure["node"] == 1 and failure["rank"] < 0, failure
    assert failure["reason"].startswith("lost: its daemon"), failure
    assert "failure: node 1 lost: its daemon" in out0, out0[-2000:]
    table = ddtrain("status", "lostjob", "--runs-dir", str(job.runs), cwd=tmp_path).stdout
    assert "failure: node 1 lost: its daemon" in table, table
    said = [t for t, m in journal_messages(job.runs / "lostjob" / "telemetry.journal")
            if isinstance(m, wire.Event) and m.node is not None and m.node.node == 1
            and m.node.node_state == "unreachable"]
    assert said, "no unreachable event for node 1"
    print(f"\nnode 1's daemon killed: the hub said node 1 unreachable {said[0] - killed:.1f} s "
          f"later, node 0 exited naming it lost {ended - killed:.1f} s later")


@pytest.mark.processes
def test_the_slurm_example_is_valid_bash() -> None:
    done = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(("flags", "says"), [
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1", "--run-id", "j"],
     "--node-rank 2 must be below --nnodes 2"),
    (["--nnodes", "2", "--run-id", "j"], "needs --rdzv-endpoint"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1"], "needs --run-id"),
    (["--nnodes", "2", "--rdzv-endpoint", "nohostport", "--run-id", "j"], "give HOST:PORT"),
    (["--nnodes", "2", "--nproc-per-node", "2", "-n", "3", "--rdzv-endpoint", "h:1",
      "--run-id", "j"], "--world-size 3 must be --nnodes x --nproc-per-node = 4"),
    (["--node-rank", "1"], "--node-rank is for a multi-node job"),
    (["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h:1", "--run-id", "j",
      "--hub", "tcp://h:5"], "--hub and --hub-keys go together"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--run-id", "j", "--hub", "tcp://h:5",
      "--hub-keys", "k"], "on nodes 1 and up only"),
])
@pytest.mark.processes
def test_bad_multi_node_flags_are_one_line_and_exit_2(
        tmp_path: Path, flags: list[str], says: str) -> None:
    done = ddtrain("start", "--runs-dir", str(tmp_path / "runs"), *flags, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "runs" / "j" / "config.json").exists()


def test_the_dashboard_shows_each_ranks_node_and_a_silent_nodes_ranks_as_unreachable() -> None:
    """The fold the dashboard and status share: the hub's node events give each
    rank its node; the host cell says it (and the filter finds `n1`)."""
    state = RunState(run="j")

    def hello(rank: int) -> wire.Hello:
        return wire.Hello(run="j", rank=rank, seq=0, t=100.0, local_rank=rank % 2, host="vm",
                          pid=1000 + rank, device="cpu", backend="gloo", world_size=4,
                          config_digest="", model="mlp", dataset="synthetic", epochs=1,
                          global_batch=64)

    def node_event(seq: int, node: int, ranks: str, node_state: str) -> wire.Event:
        ranks_of = [int(r) for r in ranks.split(",")]
        news = wire.node_news(node, node_state, ranks_of, "vm")  # type: ignore[arg-type]
        return wire.Event(run="j", rank=wire.DAEMON_RANK, seq=seq, t=100.0, type="info",
                          message=f"node {node}", node=news)

    for rank in range(4):
        state.apply(hello(rank), 100.0)
    state.apply(node_event(0, 0, "0,1", "up"), 100.0)
    state.apply(node_event(1, 1, "2,3", "up"), 100.0)
    rows = fmt.rank_rows(state, 101.0)
    assert [r.cells["host"] for r in rows] == ["vm n0", "vm n0", "vm n1", "vm n1"]
    assert [r.cells["rank"] for r in fmt.filter_rows(rows, "n1", False)] == ["2", "3"]
    assert fmt.nodes(state) == 2
    # sorting by host groups ranks by node, whatever their numbers
    state.apply(node_event(5, 1, "0,3", "up"), 100.0)
    state.apply(node_event(6, 0, "1,2", "up"), 100.0)
    by_host = fmt.sort_rows(fmt.rank_rows(state, 101.0), "host")
    assert [r.cells["rank"] for r in by_host] == ["1", "2", "0", "3"]
    state.apply(node_event(7, 0, "0,1", "up"), 100.0)
    state.apply(node_event(8, 1, "2,3", "up"), 100.0)
    state.apply(node_event(2, 1, "2,3", "unreachable"), 106.0)
    states = state.rank_states(106.5)
    assert (states[2], states[3]) == ("unreachable", "unreachable")
    banner = panels.banner(state, 106.5, "live", "")
    assert banner is not None and "node 1 unreachable" in banner.plain and "ranks 2, 3" in (
        banner.plain)
    assert states[0] != "unreachable"
    summary = state.summary(106.5)
    assert [(r.rank, r.node) for r in summary.ranks] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    # node 1's own daemon shows its own ranks only
    node1 = RunState(run="j")
    for rank in (2, 3):
        node1.apply(hello(rank), 100.0)
    event = node_event(0, 1, "2,3", "up")
    event.node = wire.node_news(1, "up", [2, 3], "vm", local=True)
    node1.apply(event, 100.0)
    assert sorted(node1.rank_states(140.0)) == [2, 3]


@pytest.fixture
def namespaces() -> Iterator[tuple[str, str, str, str] | None]:
    """Two network namespaces joined by a veth pair (10.77.0.1 and 10.77.0.2), as
    two machines; None where they cannot be made (not root, no iproute2)."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        print("\nno network namespaces (not root, or no `ip`): both nodes on loopback")
        yield None
        return
    tag = f"{os.getpid() % 100000}"
    ns, veth = (f"ddtA{tag}", f"ddtB{tag}"), (f"vA{tag}", f"vB{tag}")
    made: list[str] = []
    try:
        for name in ns:
            if subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode:
                break
            made.append(name)
        if len(made) < 2:
            print("\n`ip netns add` failed: both nodes on loopback")
            yield None
            return
        steps = [["ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1]]]
        for name, dev, addr in zip(ns, veth, ("10.77.0.1/24", "10.77.0.2/24"), strict=True):
            steps += [["ip", "link", "set", dev, "netns", name],
                      ["ip", "-n", name, "addr", "add", addr, "dev", dev],
                      ["ip", "-n", name, "link", "set", dev, "up"],
                      ["ip", "-n", name, "link", "set", "lo", "up"]]
        failed = next((step for step in steps
                       if subprocess.run(step, capture_output=True).returncode), None)
        if failed is None:
            yield ns[0], ns[1], veth[0], veth[1]
        else:
            print(f"\n`{' '.join(failed)}` failed: both nodes on loopback")
            yield None
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)



@pytest.mark.processes
@pytest.mark.timeout(60)
def test_a_dead_hubs_hub_json_is_waited_out_then_refused_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub.json left by a dead earlier run of the same run id on this machine
    (before: node 1 forwarded to that dead hub) is waited out as if absent, said,
    then refused in one line naming the file; one whose hub is alive is taken."""
    job = RunPaths(tmp_path / "runs" / "again")
    job.root.mkdir(parents=True)
    RunKeys.create(job.keys)
    write_peer_folder(job.keys, job.peer_keys)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    dead = ProcessId.of(gone.pid)
    gone.wait()
    assert dead is not None and dead.start is not None
    record = {"control": "tcp://127.0.0.1:1", "nodes": "tcp://127.0.0.1:2",
              "keys": str(job.peer_keys), "pid": dead.pid, "host": socket.gethostname(),
              "start": dead.start, "boot": dead.boot}
    job.hub_file.write_text(json.dumps(record))
    monkeypatch.setattr(hubfile, "HUB_WAIT_S", 0.5)
    said: list[str] = []
    config = TrainConfig(world_size=4, nnodes=2, node_rank=1, nproc_per_node=2,
                         run_id="again", rdzv_endpoint="127.0.0.1:1")
    with pytest.raises(UsageError) as refused:
        hubfile.find_hub(config, job, said.append)
    assert str(refused.value) == (
        f"node 1: {job.hub_file} names a hub that is gone (pid {dead.pid} on "
        f"{socket.gethostname()} is not running): a dead earlier run's with the same "
        "--run-id; remove it, or start node 0 of this run")
    assert said and "is a dead hub's" in said[0]
    me = ProcessId.of(os.getpid())
    assert me is not None
    job.hub_file.write_text(json.dumps({**record, "pid": me.pid, "start": me.start}))
    control, keys = hubfile.find_hub(config, job, said.append)
    assert control == "tcp://127.0.0.1:1" and keys.server_secret is None
