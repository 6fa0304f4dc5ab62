"""What the daemon's sockets cost: plain TCP (before issue 12), ipc (now the
default) and TCP with CURVE (`ddtrain start --bind`), measured side by side.

    .venv/bin/python bench/sockets.py [--rounds 5] [--steps 60] [--senders 8]
                                      [--attaches 40] [--quick]

Every part runs the real daemon relay (daemon/relay.py: PULL, fold into the
RunState, journal, PUB, ROUTER answering requests) in a process of its own,
for each transport:

    tcp (before)    plain TCP on 127.0.0.1, no keys: the relay as it was
                    before issue 12, reproduced by `PlainTcpRelay` below
                    (the same Relay, its `_bind` binding tcp://127.0.0.1:*)
    ipc             ZeroMQ ipc:// sockets in an owner-only folder (the default)
    tcp + CURVE     `Relay(bind="127.0.0.1", keys=RunKeys.create(...))`, as
                    `--bind 127.0.0.1` makes it: every socket a CURVE server,
                    the relay answering ZAP; every peer holds the run's keys

1. Ingest: 8 sender processes (1,024 ranks, 128 each) PUSH encoded Step
   messages and a Heartbeat every 5th step (core/wire.py, the messages
   training/telemetry.py sends), pre-encoded, with a rank's socket options
   (SNDHWM 64, NOBLOCK; on a full queue they wait for room instead of dropping,
   so the relay is kept busy). One dashboard is subscribed to the relay's PUB
   (this process, draining raw frames), so the publish side carries the load
   too. Reported: messages the relay accepted per second, from its first
   accepted message to its last (min and max over the rounds too); CPU per
   message, every thread (ZeroMQ's I/O threads decrypt and encrypt under
   CURVE), of the relay process, of the senders together, of the subscriber,
   and of all of them; messages the relay handled per `serve()` call (how
   much of a batch its loop found waiting); and the share the subscriber got
   (the lowest round: a PUB drops for a reader that falls behind). Rounds
   interleave the transports (the order rotated each round); medians. On a
   machine with fewer cores than processes here, accepted/s is what the relay
   gets of the CPU; CPU per message is what a transport costs.
2. What a rank pays: one sender process sends 1,024 ranks' telemetry (a hello,
   then 20 steps and 4 heartbeats each) to each of the three relays over its
   own socket, in bursts of 16 with a short sleep after each, the transports
   taking turns burst by burst (so a change in the machine's load falls on all
   three alike), as a rank's sender thread sends (a few messages, then idle;
   its queue never full): microseconds per `send_multipart(NOBLOCK)` call
   (median, p99), and the sender process's CPU per message, every thread (the
   calls, and ZeroMQ's I/O thread, which encrypts under CURVE), counted from a
   burst's first send to the end of the sleep after it; its ratio is the
   median over blocks of 50 bursts. "queue full": sends that found the
   64-message queue full (the relay process descheduled for a while); a rank
   drops and counts those, this sender waits.
3. Attach: with those 1,024 ranks in each relay, a dashboard attaches as
   `ddtop --connect` does: a `dashboard.live.LiveFeed` is made and pumped until
   it is live (ping, SUB connect, `snapshot` request, decode), `--attaches`
   times per transport, interleaved; median, p95, min, and the snapshot's size.
   CPU per attach, every thread: of the attaching process (median), and of the
   relay process (its /proc ticks over all the attaches and pings made to it,
   divided by the attaches: so it includes one ping each).
   Beside each attach, one `ping` request alone (a new REQ socket and
   connection, as every request makes: under CURVE a handshake and a ZAP
   answer), which tells the handshakes' share from the snapshot's.

Every ratio is to "tcp (before)": the median of the ratios of measurements
taken side by side (in the same round, block of 50 bursts or attach), so that load from
other programs, which moves from one second to the next, cancels as far as it
can. Numbers in docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq
from stats import median_ratio, percentile  # bench/stats.py, beside this script

RUN = "bench"
WORLD = 1024
SENDERS = 8
HEARTBEAT_EVERY = 5  # steps
SEND_HWM = 64  # training/telemetry.py's
BURST = 16  # messages per burst of the paced sender
BURST_SLEEP_S = 0.0005
SEND_BLOCK = 50  # bursts per block of the paired CPU ratio
ATTACH_STEPS = 20  # steps per rank in the relays dashboards attach to
TRANSPORTS = ("tcp (before)", "ipc", "tcp + CURVE")
BASE = TRANSPORTS[0]
RELAY_FLAG, SENDER_FLAG = "--relay", "--sender"


# -- the relays -------------------------------------------------------------------
def make_relay(transport: str, folder: Path) -> tuple[Any, Path | None]:
    """(a Relay for `transport`, the keys folder its peers need, or None)."""
    from ddtop.core.keys import RunKeys
    from ddtop.daemon.relay import Relay

    class PlainTcpRelay(Relay):
        """The relay as it was before issue 12: its three sockets plain TCP on loopback."""

        def _bind(self, kind: int, name: str) -> zmq.Socket[bytes]:
            sock: zmq.Socket[bytes] = self.context.socket(kind)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind("tcp://127.0.0.1:*")
            return sock

    journal = folder / "telemetry.journal"
    if transport == "tcp (before)":
        return PlainTcpRelay(RUN, journal, world_size=WORLD), None
    if transport == "ipc":
        return Relay(RUN, journal, sockets=folder / "sock", world_size=WORLD), None
    keys = folder / "keys"
    return Relay(RUN, journal, world_size=WORLD, bind="127.0.0.1",
                 keys=RunKeys.create(keys)), keys


def relay_main(transport: str, folder: Path, expect: int) -> int:
    """Serve until asked to stop; write when the relay accepted its first message
    and its `expect`-th (wall clock and process CPU) to folder/relay.json."""
    from ddtop.core import protocol

    relay, keys = make_relay(transport, folder)
    (folder / "endpoints.tmp").write_text(json.dumps(
        {"endpoints": relay.endpoints, "keys": str(keys) if keys else None}))
    (folder / "endpoints.tmp").rename(folder / "endpoints.json")
    # (wall, CPU, messages accepted, serve() calls)
    first: tuple[float, float, int, int] | None = None
    last: tuple[float, float, int, int] | None = None
    calls = 0
    stopped = False
    while not stopped:
        relay.serve(0.05)
        stopped = any(isinstance(r, protocol.Stop) for r in relay.asked.take())
        calls += 1
        if first is None and relay.seq >= 1:
            first = (time.perf_counter(), time.process_time(), relay.seq, calls)
        if last is None and relay.seq >= expect:
            last = (time.perf_counter(), time.process_time(), relay.seq, calls)
    (folder / "relay.json").write_text(json.dumps(
        {"seq": relay.seq, "first": first, "last": last, "rejected": relay.state.rejected}))
    relay.close()
    return 0


class RelayProcess:
    """A relay in a process of its own, and how to reach it from this one."""

    def __init__(self, transport: str, expect: int) -> None:
        self.transport = transport
        self.tmp = tempfile.TemporaryDirectory(prefix="ddtop-sockets-")
        self.folder = Path(self.tmp.name)
        self.proc = subprocess.Popen([sys.executable, __file__, RELAY_FLAG, transport,
                                      str(self.folder), str(expect)])
        deadline = time.monotonic() + 30
        found = self.folder / "endpoints.json"
        while not found.exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError(f"the {transport} relay did not start")
            time.sleep(0.02)
        info = json.loads(found.read_text())
        self.endpoints: dict[str, str] = info["endpoints"]
        self.keys: Path | None = Path(info["keys"]) if info["keys"] else None

    def request(self, request: Any) -> Any:
        """The relay's reply to `request` (core/protocol.py)."""
        from ddtop.core import control

        return control.request(self.endpoints["control"], request, 10.0, keys=self.keys)

    def cpu_s(self) -> float:
        """CPU seconds the relay process has used, every thread (/proc, 10 ms ticks)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def wait_for(self, seq: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        from ddtop.core import protocol

        while self.request(protocol.Ping()).seq < seq:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {self.transport} relay did not get {seq} messages")
            time.sleep(0.05)

    def stop(self) -> dict[str, Any]:
        from ddtop.core import protocol

        self.request(protocol.Stop())
        self.proc.wait(timeout=30)
        result: dict[str, Any] = json.loads((self.folder / "relay.json").read_text())
        self.close()
        return result

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.tmp.cleanup()


# -- the senders --------------------------------------------------------------------
def step_seq(k: int) -> int:
    """A rank's sequence number of its Step for step k (1, 2, ...): after its hello
    (0), k-1 steps and a heartbeat after every HEARTBEAT_EVERY-th step."""
    return k + (k - 1) // HEARTBEAT_EVERY


def rank_frames(rank: int, first: int, last: int) -> list[bytes]:
    """Rank `rank`'s frames for steps first..last (its hello first when first is 1)."""
    from ddtop.core import wire

    frames = []
    t = time.time()
    if first == 1:
        frames.append(wire.encode(wire.Hello(
            run=RUN, rank=rank, seq=0, t=t, local_rank=rank % 8, host=f"node{rank // 8:03d}",
            pid=10_000 + rank, device=f"cuda:{rank % 8}", backend="nccl", world_size=WORLD,
            config_digest="bench", model="mlp", dataset="synthetic", epochs=1,
            global_batch=32 * WORLD))[0])
    for k in range(first, last + 1):
        frames.append(wire.encode(wire.Step(
            run=RUN, rank=rank, seq=step_seq(k), t=t, epoch=0, step=k, steps_per_epoch=10_000,
            global_step=k, steps=1, samples=32, loss_sum=32 * (2.0 - k * 1e-4), lr=0.1,
            step_s=0.09, data_s=0.01, forward_s=0.03, backward_s=0.04, optimizer_s=0.01,
            comm_s=0.03, comm_bytes=25_000_000, comm_ops=4, algbw_gbps=0.8, busbw_gbps=1.6,
            sync_wait_s=0.0, rss=2 * 10**9, loss_weight=32.0))[0])
        if k % HEARTBEAT_EVERY == 0:
            coll = wire.Collective(seq=k * 4, op="allreduce", bytes=6_250_000)
            frames.append(wire.encode(wire.Heartbeat(
                run=RUN, rank=rank, seq=step_seq(k) + 1, t=t, phase="backward", epoch=0,
                global_step=k, phase_s=0.02, coll_started=coll, coll_completed=coll))[0])
    return frames


def messages_per_rank(first: int, last: int) -> int:
    return (first == 1) + (last - first + 1) + sum(
        1 for k in range(first, last + 1) if k % HEARTBEAT_EVERY == 0)


def sender_main(config: dict[str, Any]) -> int:
    """Connect to every target (handshakes done), encode the frames, say `ready`,
    wait for `go` on stdin, send; then print what the sends cost as one JSON line.

    One target: flood it (on a full queue wait for room). Several (paced): the
    same frames to each, in bursts of BURST with a sleep after each burst, the
    targets taking turns burst by burst; a burst's CPU is counted from its first
    send to the end of the sleep after it, so the I/O thread's work for it is in."""
    from zmq.utils.monitor import recv_monitor_message

    from ddtop.core.keys import secure

    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sockets = []
    for endpoint, keys in config["targets"]:
        sock = context.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.LINGER, 30_000)  # deliver everything before closing
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        secure(sock, endpoint, keys)
        sock.connect(endpoint)
        sockets.append((sock, monitor))
    by_rank = [rank_frames(rank, config["first"], config["last"])
               for rank in range(config["lo"], config["hi"])]
    frames = [f for tick in zip(*by_rank, strict=True) for f in tick]  # round robin
    for sock, monitor in sockets:
        if not monitor.poll(30_000) or recv_monitor_message(monitor)["event"] != \
                zmq.EVENT_HANDSHAKE_SUCCEEDED:
            sys.exit("no handshake")
        sock.disable_monitor()
        monitor.close(linger=0)
    print("ready", flush=True)
    sys.stdin.readline()
    n = len(sockets)
    calls: list[list[float]] = [[] for _ in range(n)]
    cpu: list[list[float]] = [[] for _ in range(n)]  # per burst
    waits = [0] * n
    clock, cpu_clock = time.perf_counter, time.process_time
    paced = n > 1
    bursts = [frames[i:i + BURST] for i in range(0, len(frames), BURST)] if paced else [frames]
    cpu0 = cpu_clock()
    for b, burst in enumerate(bursts):
        for j in ([*range(b % n, n), *range(b % n)]):  # who goes first rotates
            sock = sockets[j][0]
            burst_cpu = cpu_clock()
            for frame in burst:
                while True:
                    start = clock()
                    try:
                        sock.send_multipart([frame], zmq.NOBLOCK)
                    except zmq.Again:
                        waits[j] += 1  # a rank would drop it (and count it); we wait for room
                        sock.poll(1000, zmq.POLLOUT)
                        continue
                    calls[j].append(clock() - start)
                    break
            if paced:
                time.sleep(BURST_SLEEP_S)
                cpu[j].append(cpu_clock() - burst_cpu)
    time.sleep(0.3)  # ZeroMQ's I/O thread finishes what is queued (its CPU counts too)
    total_cpu = cpu_clock() - cpu0
    for sock, _ in sockets:
        sock.close()  # lingers until delivered
    context.term()
    out = []
    for j in range(n):
        out.append({"sent": len(frames), "waits": waits[j], "cpu": total_cpu,
                    "burst_cpu": cpu[j], "median": statistics.median(calls[j]),
                    "p99": percentile(calls[j], 99)})
    print(json.dumps(out), flush=True)
    return 0


def start_senders(targets: list[RelayProcess], first: int, last: int,
                  senders: int) -> list[subprocess.Popen[str]]:
    """`senders` processes, the ranks shared out between them, each sending to
    every one of `targets` (more than one: paced)."""
    per = WORLD // senders
    procs = []
    for i in range(senders):
        config = {"targets": [(r.endpoints["telemetry"], str(r.keys) if r.keys else None)
                              for r in targets],
                  "lo": i * per, "hi": (i + 1) * per, "first": first, "last": last}
        procs.append(subprocess.Popen([sys.executable, __file__, SENDER_FLAG, json.dumps(config)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    for proc in procs:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            stop_all(procs)
            raise RuntimeError("a sender did not start")
    return procs


def go(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()


def results(procs: list[subprocess.Popen[str]]) -> list[list[dict[str, Any]]]:
    out = []
    for proc in procs:
        assert proc.stdout is not None
        out.append(json.loads(proc.stdout.readline()))
        proc.wait(timeout=60)
    return out


def stop_all(procs: Sequence[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- 1. ingest ------------------------------------------------------------------------
def ingest_round(transport: str, steps: int, senders: int) -> dict[str, float]:
    from ddtop.core import protocol, wire
    from ddtop.core.keys import secure

    expect = WORLD * messages_per_rank(1, steps)
    relay = RelayProcess(transport, expect)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = context.socket(zmq.SUB)
    procs: list[subprocess.Popen[str]] = []
    try:
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 200_000)  # as dashboard.live.LiveFeed
        sub.setsockopt(zmq.SUBSCRIBE, wire.RELAY_TOPIC)
        secure(sub, relay.endpoints["publish"], relay.keys)
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sub.connect(relay.endpoints["publish"])
        procs = start_senders([relay], 1, steps, senders)
        if not monitor.poll(10_000):
            raise RuntimeError(f"the subscriber's handshake with the {transport} relay failed")
        sub.disable_monitor()
        monitor.close(linger=0)
        relay.request(protocol.Ping())  # the subscription has had time to reach the PUB
        go(procs)
        sub_cpu0 = time.process_time()
        got, quiet_since = 0, time.monotonic()
        while time.monotonic() - quiet_since < 1.0 and got < expect:
            if sub.poll(100):
                quiet_since = time.monotonic()
                while True:
                    try:
                        sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    got += 1
        sub_cpu = time.process_time() - sub_cpu0
        sent = [r[0] for r in results(procs)]
        relay.wait_for(expect)
        done = relay.stop()
    finally:
        stop_all(procs)
        sub.close(linger=0)
        context.term()
        relay.close()
    (t0, cpu0, seq0, calls0), (t1, cpu1, seq1, calls1) = done["first"], done["last"]
    if done["rejected"]:
        raise RuntimeError(f"the {transport} relay rejected {done['rejected']}")
    relay_us = 1e6 * (cpu1 - cpu0) / (seq1 - seq0)
    senders_us = 1e6 * sum(s["cpu"] for s in sent) / expect
    sub_us = 1e6 * sub_cpu / max(got, 1)
    return {"rate": (seq1 - seq0) / (t1 - t0), "relay_us": relay_us, "senders_us": senders_us,
            "sub_us": sub_us, "all_us": relay_us + senders_us + sub_us, "got": got / expect,
            "batch": (seq1 - seq0) / max(1, calls1 - calls0)}


# -- 2. what a rank pays, 3. attach ------------------------------------------------------
def attach_once(relay: RelayProcess) -> tuple[float, float, int]:
    """Seconds from making a LiveFeed until it is live, the CPU seconds this
    process spent on it (every thread), and the ranks it holds."""
    from ddtop.dashboard.feed import LIVE
    from ddtop.dashboard.live import LiveFeed

    cpu = time.process_time()
    start = time.perf_counter()
    feed = LiveFeed(connect=relay.endpoints["control"])
    feed.keys = relay.keys  # what `DDTOP_KEYS=... ddtop --connect` gives it
    try:
        while feed.connection != LIVE:
            feed.pump(0.0)
            if time.perf_counter() - start > 30:
                raise RuntimeError(f"no attach to the {relay.transport} relay: {feed.detail}")
        elapsed = time.perf_counter() - start
        return elapsed, time.process_time() - cpu, len(feed.state.ranks)
    finally:
        feed.close()


# -- printing ---------------------------------------------------------------------------
def table(title: str, columns: list[tuple[str, int]], rows: list[list[str]]) -> None:
    print(f"\n{title}")
    header = " | ".join(f"{name:<{width}}" if i == 0 else f"{name:>{width}}"
                        for i, (name, width) in enumerate(columns))
    print(header)
    print("-" * len(header))
    for row in rows:
        print(" | ".join(f"{cell:<{width}}" if i == 0 else f"{cell:>{width}}"
                         for i, (cell, (_, width)) in enumerate(zip(row, columns, strict=True))),
              flush=True)


def rotated(round_: int) -> list[str]:
    k = round_ % len(TRANSPORTS)
    return [*TRANSPORTS[k:], *TRANSPORTS[:k]]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == RELAY_FLAG:
        return relay_main(args[1], Path(args[2]), int(args[3]))
    if args and args[0] == SENDER_FLAG:
        return sender_main(json.loads(args[1]))
    from ddtop.core import protocol

    parser = argparse.ArgumentParser(description=str(__doc__).split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5,
                        help="ingest rounds per transport (default 5)")
    parser.add_argument("--steps", type=int, default=60,
                        help="steps per rank in one ingest round (default 60)")
    parser.add_argument("--senders", type=int, default=SENDERS,
                        help=f"sender processes in the ingest (default {SENDERS})")
    parser.add_argument("--attaches", type=int, default=40,
                        help="attaches per transport (default 40)")
    parser.add_argument("--quick", action="store_true",
                        help="1 round of 40 steps, 10 attaches")
    options = parser.parse_args(args)
    if WORLD % options.senders:
        parser.error(f"--senders must divide {WORLD}")
    if options.quick:
        options.rounds, options.steps, options.attaches = 1, 40, 10
    os.environ.pop("DDTOP_KEYS", None)  # keys only where a transport has them
    print(f"ddtop sockets benchmark: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"pyzmq {zmq.pyzmq_version()}, libzmq {zmq.zmq_version()}, load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)

    # 1. Ingest.
    ingest: dict[str, list[dict[str, float]]] = {t: [] for t in TRANSPORTS}
    for round_ in range(options.rounds):
        for transport in rotated(round_):
            ingest[transport].append(ingest_round(transport, options.steps, options.senders))
    messages = WORLD * messages_per_rank(1, options.steps)

    def ingest_cell(t: str, key: str, fmt: str) -> str:
        return format(statistics.median(r[key] for r in ingest[t]), fmt)

    def ingest_ratio(t: str, key: str) -> str:
        return f"{median_ratio([r[key] for r in ingest[t]], [r[key] for r in ingest[BASE]]):.2f}"

    table(f"1. Ingest: {options.senders} sender processes, {WORLD} ranks, {messages:,} messages "
          f"a round (Step, Heartbeat every {HEARTBEAT_EVERY}th), the relay folds, journals and "
          f"publishes to 1 subscriber; medians of {options.rounds} interleaved round(s); CPU: "
          "us per message, every thread of the relay / the senders / the subscriber",
          [("transport", 14), ("accepted/s", 10), ("min", 7), ("max", 7), ("ratio", 5),
           ("relay CPU", 9), ("ratio", 5), ("senders CPU", 11), ("sub CPU", 7),
           ("all CPU", 7), ("ratio", 5), ("per serve", 9), ("sub got", 7)],
          [[t, ingest_cell(t, "rate", ",.0f"), f"{min(r['rate'] for r in ingest[t]):,.0f}",
            f"{max(r['rate'] for r in ingest[t]):,.0f}", ingest_ratio(t, "rate"),
            ingest_cell(t, "relay_us", ".2f"), ingest_ratio(t, "relay_us"),
            ingest_cell(t, "senders_us", ".2f"), ingest_cell(t, "sub_us", ".2f"),
            ingest_cell(t, "all_us", ".2f"), ingest_ratio(t, "all_us"),
            ingest_cell(t, "batch", ",.0f"),
            f"{100 * min(r['got'] for r in ingest[t]):.1f}%"] for t in TRANSPORTS])

    # 2. What a rank pays (and the 1,024 ranks dashboards attach to in 3.).
    relays = {t: RelayProcess(t, 0) for t in TRANSPORTS}
    try:
        procs = start_senders([relays[t] for t in TRANSPORTS], 1, ATTACH_STEPS, 1)
        try:
            go(procs)
            (sent,) = results(procs)
        finally:
            stop_all(procs)
        sends = dict(zip(TRANSPORTS, sent, strict=True))
        expect = WORLD * messages_per_rank(1, ATTACH_STEPS)
        for relay in relays.values():
            relay.wait_for(expect)

        def cpu_blocks(t: str) -> list[float]:
            """us per message, in blocks of SEND_BLOCK bursts."""
            bursts = sends[t]["burst_cpu"]
            return [1e6 * sum(bursts[i:i + SEND_BLOCK]) / (BURST * SEND_BLOCK)
                    for i in range(0, len(bursts) - SEND_BLOCK + 1, SEND_BLOCK)]

        def cpu_us(t: str) -> float:
            return 1e6 * float(sum(sends[t]["burst_cpu"])) / int(sends[t]["sent"])

        table(f"2. What a rank pays: 1 sender, {expect:,} messages to each transport's relay in "
              f"bursts of {BURST}, the transports taking turns burst by burst; us per "
              "send_multipart(NOBLOCK) call, and the sender's CPU per message, all threads",
              [("transport", 14), ("us/send", 7), ("p99", 6), ("ratio", 5),
               ("CPU us/msg", 10), ("ratio", 5), ("queue full", 10)],
              [[t, f"{1e6 * sends[t]['median']:.2f}", f"{1e6 * sends[t]['p99']:.2f}",
                f"{sends[t]['median'] / sends[BASE]['median']:.2f}", f"{cpu_us(t):.2f}",
                f"{median_ratio(cpu_blocks(t), cpu_blocks(BASE)):.2f}", f"{sends[t]['waits']}"]
               for t in TRANSPORTS])

        # 3. Attach.
        sizes = {t: len(relays[t].request(protocol.Snapshot()).state) for t in TRANSPORTS}
        attaches: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
        pings: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
        client_cpu: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
        # An idle relay wakes every 50 ms for a few microseconds: its CPU over
        # the whole phase is its CPU for the attaches and pings made to it.
        relay_cpu = {t: relays[t].cpu_s() for t in TRANSPORTS}
        for i in range(options.attaches):
            for transport in rotated(i):
                elapsed, cpu_s, ranks = attach_once(relays[transport])
                if ranks != WORLD:
                    raise RuntimeError(f"{transport}: attached to {ranks} ranks, not {WORLD}")
                attaches[transport].append(1000 * elapsed)
                client_cpu[transport].append(1000 * cpu_s)
                start = time.perf_counter()
                relays[transport].request(protocol.Ping())
                pings[transport].append(1000 * (time.perf_counter() - start))
        relay_cpu = {t: relays[t].cpu_s() - relay_cpu[t] for t in TRANSPORTS}
        rows = []
        for t in TRANSPORTS:
            times = attaches[t]
            rows.append([t, f"{statistics.median(times):.1f}",
                         f"{percentile(times, 95):.1f}", f"{min(times):.1f}",
                         f"{median_ratio(times, attaches[BASE]):.2f}",
                         f"{statistics.median(client_cpu[t]):.1f}",
                         f"{1000 * relay_cpu[t] / options.attaches:.1f}",
                         f"{statistics.median(pings[t]):.2f}", f"{sizes[t] / 1e3:,.0f}"])
        table(f"3. Attach: LiveFeed(connect=...) until live (ping, SUB, snapshot, decode) to a "
              f"run of {WORLD} ranks, {ATTACH_STEPS} steps each; {options.attaches} attaches "
              "per transport, interleaved",
              [("transport", 14), ("median ms", 9), ("p95", 6), ("min", 6), ("ratio", 5),
               ("ddtop CPU ms", 12), ("relay CPU ms", 12), ("1 ping ms", 9),
               ("snapshot KB", 11)], rows)
        for relay in relays.values():
            relay.stop()
        print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    finally:
        for relay in relays.values():
            relay.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
