"""Does one dashboard keep up with a multi-node job's hub? 1,024 ranks across 8
simulated nodes, against the same 1,024 ranks on one node.

    .venv/bin/python bench/hub.py [--ranks 1024] [--nodes 8] [--seconds 10] [--fps 5]

Telemetry as in bench/dashboard.py: every rank 10 Step messages and 1
Heartbeat per second (11 N messages/s offered).

- one node: bench/dashboard.py's live case: a real relay (ipc), fed in real
  time, and the real dashboard attached with `--connect`.
- hub: a hub process runs a real node 0 relay (TCP with CURVE, the `nodes`
  socket, daemon/hub.Hub); each of --nodes node processes runs a real node
  relay (ipc) that its N / nodes ranks' telemetry is pushed into, and a real
  daemon/forwarder.Forwarder that forwards every folded message to the hub (CURVE
  PUSH) and heartbeats on its control socket. The dashboard attaches to the
  hub with the job's keys.

Reported per case as bench/dashboard.py does: the messages the (hub) relay
accepted per second, the dashboard folded per second, its lag behind the relay
(largest, last), resyncs, frames per second, and whether it keeps up (the last
lag under one second of messages, at least 0.9 of its frames).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dashboard as single  # bench/dashboard.py: telemetry and the one-node case

HUB_FLAG, NODE_FLAG = "--hub-process", "--node-process"


def config_for(world: int, nodes: int) -> Any:
    """The job: node 0 the hub (no ranks of its own here), nodes 1..`nodes` the ranks'."""
    from ddtop.core.config import TrainConfig

    return TrainConfig(world_size=world, nnodes=nodes + 1, nproc_per_node=world // nodes,
                       rdzv_endpoint="127.0.0.1:1", run_id="bench", launcher="torchrun")


def hub_process(folder: str, world: int, nodes: int, seconds: float) -> int:
    """Node 0's relay and node table, serving until the measurement is over."""
    from ddtop.core.keys import RunKeys
    from ddtop.daemon.hub import Hub
    from ddtop.daemon.relay import Relay

    base = Path(folder)
    keys = RunKeys.create(base / "keys")
    relay = Relay("bench", base / "telemetry.journal", world_size=world, bind="127.0.0.1",
                  keys=keys, nodes=True)
    hub = Hub(config_for(world, nodes), relay)
    relay.hub = hub
    hub.nodes_endpoint = relay.endpoints["nodes"]
    (base / "hub.json").write_text(json.dumps(relay.endpoints))
    deadline = time.monotonic() + seconds + 40
    while time.monotonic() < deadline and not (base / "done").exists():
        relay.serve(0.05)
        hub.check()
    relay.close()
    return 0


def node_process(folder: str, k: int, world: int, nodes: int, seconds: float) -> int:
    """Node k: its ranks' telemetry pushed into a real node relay in real time;
    the relay's forwarder sends every folded message to the hub."""
    import zmq

    from ddtop.core import wire
    from ddtop.core.keys import RunKeys
    from ddtop.daemon.forwarder import Forwarder
    from ddtop.daemon.relay import Relay

    base = Path(folder)
    endpoints = json.loads((base / "hub.json").read_text())
    config = config_for(world, nodes)
    config = type(config)(**{**config.to_dict(), "node_rank": k})
    per = world // nodes
    mine = range((k - 1) * per, k * per)
    with tempfile.TemporaryDirectory() as tmp:
        relay = Relay("bench", Path(tmp) / "telemetry.journal", world_size=world)
        forwarder = Forwarder(config, endpoints["control"], RunKeys.load(base / "keys"),
                              "bench", lambda: relay.state.ranks)
        relay.forward = forwarder.forward
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDHWM, 1_000_000)
        push.connect(relay.endpoints["telemetry"])
        for r in mine:
            push.send(wire.encode(single.hello("bench", r, world))[0])
        seqs = dict.fromkeys(mine, 1)
        start, tick = time.monotonic(), 0
        deadline = start + seconds + 6.0  # the dashboard attaches during the first seconds
        while time.monotonic() < deadline and not (base / "done").exists():
            due = start + tick / single.STEP_HZ
            while time.monotonic() < due:
                relay.serve(max(0.0, min(0.01, due - time.monotonic())))
                forwarder.tick(list(mine), "running")
            t = time.time()
            for r in mine:
                push.send(wire.encode(single.step("bench", r, seqs[r], t, tick + 1))[0])
                seqs[r] += 1
                if tick % single.STEP_HZ == 0:
                    push.send(wire.encode(single.heartbeat("bench", r, seqs[r], t, tick + 1))[0])
                    seqs[r] += 1
            tick += 1
        print(f"node {k}: forwarder dropped {forwarder.dropped}", file=sys.stderr, flush=True)
        push.close()
        context.term()
        forwarder.close(list(mine), {"status": "stopped"})
        relay.close()
    return 0


def measure_hub(world: int, nodes: int, seconds: float, fps: float) -> dict[str, Any]:
    from ddtop.core import control, protocol
    from ddtop.core.keys import KEYS_ENV
    from ddtop.dashboard.app import DashboardApp
    from ddtop.dashboard.live import LiveFeed

    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        procs = [subprocess.Popen([sys.executable, __file__, HUB_FLAG, tmp, str(world),
                                   str(nodes), str(seconds)])]
        try:
            deadline = time.monotonic() + 30
            while not (base / "hub.json").exists():
                if time.monotonic() > deadline or procs[0].poll() is not None:
                    raise RuntimeError("the hub did not start")
                time.sleep(0.05)
            procs += [subprocess.Popen([sys.executable, __file__, NODE_FLAG, tmp, str(k),
                                        str(world), str(nodes), str(seconds)])
                      for k in range(1, nodes + 1)]
            os.environ[KEYS_ENV] = str(base / "keys")
            control_endpoint = json.loads((base / "hub.json").read_text())["control"]
            feed = LiveFeed(connect=control_endpoint)
            app = DashboardApp(feed, fps=fps)
            result: dict[str, Any] = {}

            async def drive() -> None:
                async with app.run_test(size=(120, 40)) as pilot:
                    while feed.connection != "live":
                        await pilot.pause(0.05)
                    await pilot.pause(2.0)  # every node forwarding
                    lags: list[int] = []
                    first: tuple[int, int] | None = None
                    frames0, start = app.frames, time.monotonic()
                    while time.monotonic() - start < seconds:
                        await pilot.pause(single.PING_EVERY_S)
                        relay_seq = control.request(control_endpoint, protocol.Ping(), 5.0).seq
                        shown_seq = feed.seq
                        first = (relay_seq, shown_seq) if first is None else first
                        lags.append(relay_seq - shown_seq)
                    elapsed = time.monotonic() - start
                    assert first is not None
                    window = elapsed - single.PING_EVERY_S
                    result.update(rate=(relay_seq - first[0]) / window,
                                  folded=(shown_seq - first[1]) / window,
                                  lag_max=max(lags), lag_end=lags[-1],
                                  fps=(app.frames - frames0) / elapsed, resyncs=feed.resyncs,
                                  ranks=len(feed.state.ranks),
                                  nodes=len(set(feed.state.rank_nodes.values())))

            try:
                asyncio.run(drive())
            finally:
                feed.close()
                os.environ.pop(KEYS_ENV, None)
            return result
        finally:
            end(base, procs, 15)


def end(base: Path, procs: list[subprocess.Popen[Any]], timeout_s: float) -> None:
    """The measurement is over (base/done, which the processes look for): each
    process waited for, and killed if it outlives `timeout_s`."""
    (base / "done").write_text("")
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == HUB_FLAG:
        return hub_process(args[1], int(args[2]), int(args[3]), float(args[4]))
    if args and args[0] == NODE_FLAG:
        return node_process(args[1], int(args[2]), int(args[3]), int(args[4]), float(args[5]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--fps", type=float, default=5.0)
    options = parser.parse_args(args)
    if options.ranks % options.nodes:
        parser.error("--ranks must be a multiple of --nodes")
    world, offered = options.ranks, options.ranks * (single.STEP_HZ + 1)
    print(f"ddtop hub benchmark: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"{world} ranks, {single.STEP_HZ} steps/s + 1 heartbeat/s per rank "
          f"({offered:,} messages/s), --fps {options.fps:g}", flush=True)
    print(f"{'case':<18} {'relay/s':>8} {'dash/s':>8} {'lag max':>8} {'lag end':>8} "
          f"{'resync':>6} {'fps':>5}  keeps up")
    cases = [("1 node", lambda: single.measure_live(world, options.seconds, options.fps)),
             (f"{options.nodes} nodes -> hub",
              lambda: measure_hub(world, options.nodes, options.seconds, options.fps))]
    for name, run in cases:
        live = run()
        keeps_up = live["lag_end"] < offered and live["fps"] >= 0.9 * options.fps
        extra = (f"  ({live['ranks']} ranks from {live['nodes']} nodes shown)"
                 if "ranks" in live else "")
        print(f"{name:<18} {live['rate']:>8,.0f} {live['folded']:>8,.0f} "
              f"{live['lag_max']:>8,} {live['lag_end']:>8,} {live['resyncs']:>6} "
              f"{live['fps']:>5.1f}  {'yes' if keeps_up else 'NO'}{extra}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
