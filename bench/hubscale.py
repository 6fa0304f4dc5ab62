"""How a multi-node job's hub and its dashboard grow with ranks: 1,024 to 16,384
ranks, 8 a node, on this machine.

    .venv/bin/python bench/hubscale.py [--ranks 1024 4096 16384] [--per 8]
                                       [--seconds 20] [--fps 2] [--sims 2]

Each size: node 0's real relay and node table (bench/hub.py's hub process: TCP
with CURVE, the `nodes` socket); the nodes simulated by bench/simnodes.py in
--sims processes, each node a real Summariser sending the hub its summaries
(2 a second; 1 from 256 nodes) and a heartbeat a second over CURVE, its ranks stepping 10 times a
second (a node's daemon merges them; what it does for its own ranks is not
simulated: it costs the node, not the hub); the real dashboard (200x60)
attaches to the hub with the job's keys.

Printed per size: the summaries the hub relayed per second, the rank messages
they stand for (10 steps a second per rank), the hub's CPU (share of one core,
over the measured seconds) and its resident memory at the end, the dashboard's
CPU (this process: its fold and its frames), the dashboard's
attach-to-first-frame time with every rank shown, its frames per second and
its lag behind the hub (largest and last, in messages and in seconds of the
hub's messages), how long after a rank's node said it died the dashboard
showed it dead, and whether the targets hold (hub <= 0.5 core and < 1 GB,
>= 2 frames/s, lag < 2 s, attach < 2 s); then a plot of both CPUs against ranks.
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
import hub as hub_bench  # bench/hub.py: the hub process

import dashboard as single  # bench/dashboard.py: PING_EVERY_S

SIM = Path(__file__).resolve().parent / "simnodes.py"
STEP_HZ = 10.0
DEAD_AT_S = 14.0  # a rank dies this long after the simulated nodes said hello
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(world: int, per: int, seconds: float, fps: float, sims: int) -> dict[str, Any]:
    from ddtop.core import control, protocol
    from ddtop.core.keys import KEYS_ENV
    from ddtop.daemon import summariser
    from ddtop.dashboard.app import DashboardApp
    from ddtop.dashboard.live import LiveFeed

    nodes = world // per
    victim = world // 2 + 3  # its node says it died, DEAD_AT_S into the simulation
    # The ranks' steps of one summary in one message: a node merges them (its own work).
    batch = max(1, round(STEP_HZ * summariser.every_s(nodes + 1)))
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        run_s = seconds + 60
        hub = subprocess.Popen([sys.executable, hub_bench.__file__, hub_bench.HUB_FLAG, tmp,
                                str(world), str(nodes), str(run_s)])
        procs = [hub]
        try:
            deadline = time.monotonic() + 30
            while not (base / "hub.json").exists():
                if time.monotonic() > deadline or hub.poll() is not None:
                    raise RuntimeError("the hub did not start")
                time.sleep(0.05)
            share = -(-nodes // sims)
            for first in range(1, nodes + 1, share):
                count = min(share, nodes + 1 - first)
                procs.append(subprocess.Popen(
                    [sys.executable, str(SIM), "--folder", tmp, "--run", "bench", "--world",
                     str(world), "--per", str(per), "--first", str(first), "--count",
                     str(count), "--seconds", str(run_s), "--step-hz", str(STEP_HZ),
                     "--steps-per-message", str(batch), "--scenario",
                     json.dumps({"dead": [victim, DEAD_AT_S]})], stdout=subprocess.DEVNULL))
            # every rank's hello sent (and a moment for the hub to fold them)
            endpoint = json.loads((base / "hub.json").read_text())["control"]
            deadline = time.monotonic() + 120
            while len(list(base.glob("simstart.*"))) < len(procs) - 1:
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError("the simulated nodes did not start")
                time.sleep(0.2)
            time.sleep(3.0)
            os.environ[KEYS_ENV] = str(base / "keys")
            result: dict[str, Any] = {}
            attach_start = time.monotonic()
            feed = LiveFeed(connect=endpoint)
            app = DashboardApp(feed, fps=fps)

            async def drive() -> None:
                async with app.run_test(size=(200, 60)) as pilot:
                    while feed.connection != "live" or app.frames < 1 \
                            or len(feed.state.ranks) < world:
                        await pilot.pause(0.02)
                    result["attach_s"] = time.monotonic() - attach_start
                    await pilot.pause(2.0)
                    lags: list[int] = []
                    first: tuple[int, int] | None = None
                    frames0, start = app.frames, time.monotonic()
                    cpu0, own0 = cpu_seconds(hub.pid), time.process_time()
                    # the clock of the simulation process that runs the victim's node
                    firsts = sorted(int(f.suffix[1:]) for f in base.glob("simstart.*"))
                    mine = max(k for k in firsts if k <= victim // per + 1)
                    dead_at = float((base / f"simstart.{mine}").read_text()) + DEAD_AT_S
                    while time.monotonic() - start < seconds:
                        for _ in range(10):
                            await pilot.pause(single.PING_EVERY_S / 10)
                            view = feed.state.ranks.get(victim)
                            if "dead_s" not in result and view is not None and view.exited:
                                result["dead_s"] = time.time() - dead_at
                        relay_seq = control.request(endpoint, protocol.Ping(), 5.0).seq
                        shown_seq = feed.seq
                        first = (relay_seq, shown_seq) if first is None else first
                        lags.append(relay_seq - shown_seq)
                    elapsed = time.monotonic() - start
                    assert first is not None
                    window = elapsed - single.PING_EVERY_S
                    rate = (relay_seq - first[0]) / window
                    result.update(rate=rate, folded=(shown_seq - first[1]) / window,
                                  lag_max=max(lags), lag_end=lags[-1],
                                  lag_s=max(lags) / rate if rate else float("inf"),
                                  fps=(app.frames - frames0) / elapsed, resyncs=feed.resyncs,
                                  hub_cpu=(cpu_seconds(hub.pid) - cpu0) / elapsed,
                                  dash_cpu=(time.process_time() - own0) / elapsed,
                                  hub_rss=rss_bytes(hub.pid), ranks=len(feed.state.ranks))

            try:
                asyncio.run(drive())
            finally:
                feed.close()
                os.environ.pop(KEYS_ENV, None)
            return result
        finally:
            hub_bench.end(base, procs, 20)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--per", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--fps", type=float, default=5.0)
    parser.add_argument("--sims", type=int, default=2, help="processes simulating the nodes")
    options = parser.parse_args(argv)
    print(f"ddtop hub scale benchmark: {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, {options.per} ranks a node at {STEP_HZ:g} steps/s, "
          f"summaries 2/s a node (1/s from 256 nodes), dashboard 200x60 --fps {options.fps:g}",
          flush=True)
    print(f"{'ranks':>6} {'nodes':>5} {'rank msg/s':>10} {'hub msg/s':>9} {'hub CPU':>7} "
          f"{'hub MB':>6} {'dash CPU':>8} {'attach s':>8} {'fps':>5} {'lag max':>7} {'lag s':>5}"
          f" {'resync':>6} {'dead s':>6}"
          "  targets")
    results = []
    for world in options.ranks:
        r = measure(world, options.per, options.seconds, options.fps, options.sims)
        results.append((world, r))
        ok = (r["hub_cpu"] <= 0.5 and r["hub_rss"] < 2**30 and r["fps"] >= 2
              and r["lag_s"] < 2 and r["attach_s"] < 2)
        print(f"{world:>6} {world // options.per:>5} {world * STEP_HZ:>10,.0f} "
              f"{r['rate']:>9,.0f} {r['hub_cpu']:>7.2f} {r['hub_rss'] / 2**20:>6.0f} "
              f"{r['dash_cpu']:>8.2f} "
              f"{r['attach_s']:>8.2f} {r['fps']:>5.1f} {r['lag_max']:>7,} {r['lag_s']:>5.2f} "
              f"{r['resyncs']:>6} {r.get('dead_s', float('nan')):>6.2f}  "
              f"{'hold' if ok else 'MISSED'}", flush=True)
    if len(results) > 1:
        plot(results)
    return 0


def plot(results: list[tuple[int, dict[str, Any]]]) -> None:
    """CPU (cores) against ranks: the hub's (H) and the dashboard's (D)."""
    import plotext as plt

    ranks = [w for w, _ in results]
    plt.plot(ranks, [r["hub_cpu"] for _, r in results], label="hub CPU, cores", marker="H")
    plt.plot(ranks, [r["dash_cpu"] for _, r in results], label="dashboard CPU, cores",
             marker="D")
    plt.xscale("log")
    plt.xticks(ranks, [f"{w:,}" for w in ranks])
    plt.ylim(0, max(0.6, *(max(r["hub_cpu"], r["dash_cpu"]) for _, r in results)))
    plt.plotsize(72, 18)
    plt.theme("clear")
    plt.xlabel("ranks (8 a node)")
    print(plt.uncolorize(plt.build()))


if __name__ == "__main__":
    sys.exit(main())
