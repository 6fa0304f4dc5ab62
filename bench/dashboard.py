"""Does ddtop keep up with hundreds of ranks? Synthetic telemetry at 10 Hz per rank.

    .venv/bin/python bench/dashboard.py [--ranks 256 1024] [--seconds 10] [--fps 5]
                                        [--size 120x40] [--baseline GIT-REF [--rounds 2]]

For each world size N, every rank sends 10 Step messages and 1 Heartbeat per
second (11 N messages/s offered), and the script measures:

- fold: wire.decode + RunState.apply in one thread, no sockets: messages/s, and
  that rate over the offered load (how many times faster than needed);
- frame: one frame's work from a RunState of N ranks: the rows (all N, sorted
  and filtered), header, banner, comm panel, events and run-wide charts
  (median and p95 ms); and `DashboardApp.render_view()` in the real app
  (App.run_test at 120x40), i.e. the same plus handing it to the widgets
  (median and p95). The frame's work builds the run-wide charts every time; the
  app rebuilds them once a second, so "frame" is an upper bound of that part;
- live: end to end. A feeder process runs a real daemon relay (PULL/PUB/
  ROUTER) and pushes the synthetic telemetry into it in real time; this
  process runs the real dashboard attached with `--connect`. Reported: the
  messages the relay accepted per second and the dashboard folded per second
  ("dash/s": its relay sequence number's advance), its lag behind the
  relay (relay sequence number minus the dashboard's, sampled every 0.5 s: the
  largest and the last), snapshots re-requested after a gap (resyncs), frames
  drawn per second against --fps, and a verdict: it keeps up when the last lag
  is under one second of messages and it drew at least 80% of its frames;
  and the dashboard process's CPU time over the window (its drawing thread,
  the feed's worker and the rest), in % of one core and per frame drawn.

--baseline REF measures the dashboard package as it was at a git commit too
(bench/tui_cpu.py's tree: the package's parts from `git archive`, as REF laid them
out; the feeder is this tree's):
each world size, each round, the baseline then this tree, each in a fresh
process of its own, so that both see the same load; a table of render ms, fps
and CPU, every round and the medians.

Numbers in docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from stats import percentile  # bench/stats.py, beside this script
from tui_cpu import baseline_tree  # bench/tui_cpu.py, beside this script

STEP_HZ = 10
PING_EVERY_S = 0.5
FEEDER_FLAG = "--feeder"
MEASURE_FLAG = "--measure"  # one world size's render and live measures, as a JSON line


# -- synthetic telemetry --------------------------------------------------------------
def hello(run: str, rank: int, world: int) -> Any:
    from ddtop.core import wire

    return wire.Hello(run=run, rank=rank, seq=0, t=time.time(), local_rank=rank % 8,
                      host=f"node{rank // 8:03d}", pid=10_000 + rank, device=f"cuda:{rank % 8}",
                      backend="nccl", world_size=world, config_digest="bench", model="mlp",
                      dataset="synthetic", epochs=1, global_batch=32 * world)


def step(run: str, rank: int, seq: int, t: float, global_step: int) -> Any:
    from ddtop.core import wire

    slow = 1.3 if rank == 7 else 1.0  # one straggler, so the view has something to mark
    return wire.Step(run=run, rank=rank, seq=seq, t=t, epoch=0, step=global_step % 1000,
                     steps_per_epoch=1000, global_step=global_step, steps=1, samples=32,
                     loss_sum=32 * (2.0 - global_step * 1e-4), lr=0.1, step_s=0.09 * slow,
                     data_s=0.01, forward_s=0.03 * slow, backward_s=0.04 * slow,
                     optimizer_s=0.01, comm_s=0.03, comm_bytes=25_000_000, comm_ops=4,
                     algbw_gbps=0.8, busbw_gbps=1.6, sync_wait_s=0.0, rss=2 * 10**9)


def heartbeat(run: str, rank: int, seq: int, t: float, global_step: int) -> Any:
    from ddtop.core import wire

    coll = wire.Collective(seq=global_step * 4, op="allreduce", bytes=6_250_000)
    return wire.Heartbeat(run=run, rank=rank, seq=seq, t=t, phase="backward", epoch=0,
                          global_step=global_step, phase_s=0.02, coll_started=coll,
                          coll_completed=coll)


def synthetic_frames(run: str, world: int, seconds: float) -> list[bytes]:
    """`seconds` of telemetry from `world` ranks, in send order."""
    from ddtop.core import wire

    frames = [wire.encode(hello(run, r, world))[0] for r in range(world)]
    seqs = [1] * world
    t0 = time.time()
    for tick in range(int(seconds * STEP_HZ)):
        t = t0 + tick / STEP_HZ
        for r in range(world):
            frames.append(wire.encode(step(run, r, seqs[r], t, tick + 1))[0])
            seqs[r] += 1
            if tick % STEP_HZ == 0:
                frames.append(wire.encode(heartbeat(run, r, seqs[r], t, tick + 1))[0])
                seqs[r] += 1
    return frames


# -- fold and frame ----------------------------------------------------------------------
def quiet_feed(state: Any) -> Any:
    """A StateFeed whose pump() waits its timeout as a live feed's does: StateFeed's
    own returns at once (its owner never pumps it in a loop), which would make the
    app's worker thread spin and take the GIL from the frames being timed."""
    from ddtop.dashboard.feed import StateFeed

    class QuietFeed(StateFeed):
        def pump(self, timeout_s: float) -> int:
            time.sleep(timeout_s)
            return super().pump(timeout_s)

    return QuietFeed(state)


def percentiles(times: list[float]) -> tuple[float, float]:
    """(median, p95)."""
    return statistics.median(times), percentile(times, 95)


def measure_fold(world: int) -> tuple[float, Any]:
    from ddtop.core import wire
    from ddtop.core.state import RunState

    frames = synthetic_frames("bench", world, seconds=3.0)
    state = RunState(run="bench")
    start = time.perf_counter()
    for frame in frames:
        state.apply(wire.decode([frame], "bench"), time.time())
    return len(frames) / (time.perf_counter() - start), state


def frame_work(state: Any, now: float) -> None:
    from ddtop.dashboard import format as fmt
    from ddtop.dashboard import panels, series

    rows = fmt.sort_rows(fmt.filter_rows(fmt.rank_rows(state, now), "", False), "step_ms")
    panels.header(state, now)
    panels.banner(state, now, "live", "")
    panels.comm(state, now, rows[0].rank, 9)
    panels.events(state, 8)
    series.global_loss(state)
    series.rank_loss(state, rows[0].rank)
    series.throughput(state, 120)
    series.comm_share(state, 120)


def measure_renders(state: Any, size: tuple[int, int], repeat: int = 30) -> tuple[float, float]:
    """(median ms, p95 ms) of render_view() in the real app."""
    from ddtop.dashboard.app import DashboardApp

    app = DashboardApp(quiet_feed(state), fps=1.0)
    renders: list[float] = []

    async def drive() -> None:
        async with app.run_test(size=size) as pilot:
            await pilot.pause(0.2)
            for _ in range(repeat):
                start = time.perf_counter()
                app.render_view()
                renders.append(1000 * (time.perf_counter() - start))
                await pilot.pause(0.01)

    asyncio.run(drive())
    return percentiles(renders)


def measure_frames(state: Any, size: tuple[int, int],
                   repeat: int = 30) -> tuple[float, float, float, float]:
    """(median ms, p95 ms) of the frame's work, then of render_view() in the app."""
    now = time.time()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        frame_work(state, now)
        times.append(1000 * (time.perf_counter() - start))
    return (*percentiles(times), *measure_renders(state, size, repeat))


# -- live, end to end ---------------------------------------------------------------------
def feeder(world: int, seconds: float, endpoint_file: str) -> int:
    """A real relay, fed in real time: PUSH -> PULL, folded, journaled, published."""
    import zmq

    from ddtop.core import wire
    from ddtop.daemon.relay import Relay

    with tempfile.TemporaryDirectory() as tmp:
        relay = Relay("bench", Path(tmp) / "telemetry.journal")
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDHWM, 1_000_000)
        push.connect(relay.endpoints["telemetry"])
        Path(endpoint_file).write_text(json.dumps(relay.endpoints))
        for r in range(world):
            push.send(wire.encode(hello("bench", r, world))[0])
        seqs = [1] * world
        start, tick = time.monotonic(), 0
        deadline = start + seconds + 3.0  # the dashboard attaches during the first seconds
        while time.monotonic() < deadline:
            due = start + tick / STEP_HZ
            while time.monotonic() < due:
                relay.serve(max(0.0, min(0.01, due - time.monotonic())))
            t = time.time()
            for r in range(world):
                push.send(wire.encode(step("bench", r, seqs[r], t, tick + 1))[0])
                seqs[r] += 1
                if tick % STEP_HZ == 0:
                    push.send(wire.encode(heartbeat("bench", r, seqs[r], t, tick + 1))[0])
                    seqs[r] += 1
            tick += 1
        end = time.monotonic() + 5.0
        while time.monotonic() < end:  # serve requests until the dashboard is done
            relay.serve(0.05)
        push.close()
        context.term()
        relay.close()
    return 0


def measure_live(world: int, seconds: float, fps: float,
                 size: tuple[int, int] = (120, 40)) -> dict[str, Any]:
    from ddtop.core import control, protocol
    from ddtop.dashboard.app import DashboardApp
    from ddtop.dashboard.live import LiveFeed

    with tempfile.TemporaryDirectory() as tmp:
        endpoint_file = Path(tmp) / "endpoints.json"
        proc = subprocess.Popen([sys.executable, __file__, FEEDER_FLAG, str(world),
                                 str(seconds), str(endpoint_file)])
        try:
            deadline = time.monotonic() + 30
            while not endpoint_file.exists() or not endpoint_file.read_text():
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the feeder did not start")
                time.sleep(0.05)
            control_endpoint = json.loads(endpoint_file.read_text())["control"]
            feed = LiveFeed(connect=control_endpoint)
            app = DashboardApp(feed, fps=fps)
            result: dict[str, Any] = {}

            async def drive() -> None:
                async with app.run_test(size=size) as pilot:
                    while feed.connection != "live":
                        await pilot.pause(0.05)
                    lags: list[int] = []
                    first: tuple[int, int] | None = None  # (relay seq, dashboard seq)
                    frames0, start, cpu0 = app.frames, time.monotonic(), time.process_time()
                    while time.monotonic() - start < seconds:
                        await pilot.pause(PING_EVERY_S)
                        relay_seq = control.request(control_endpoint, protocol.Ping(), 5.0).seq
                        shown_seq = feed.seq
                        first = (relay_seq, shown_seq) if first is None else first
                        lags.append(relay_seq - shown_seq)
                    elapsed = time.monotonic() - start
                    cpu = time.process_time() - cpu0
                    assert first is not None
                    window = elapsed - PING_EVERY_S  # from the first sample to the last
                    result.update(rate=(relay_seq - first[0]) / window,
                                  folded=(shown_seq - first[1]) / window,
                                  lag_max=max(lags), lag_end=lags[-1],
                                  fps=(app.frames - frames0) / elapsed,
                                  resyncs=feed.resyncs, cpu=100 * cpu / elapsed,
                                  cpu_frame=1000 * cpu / max(1, app.frames - frames0))

            try:
                asyncio.run(drive())
            finally:
                feed.close()
            return result
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- this tree against a baseline ---------------------------------------------------------
def measure_one(world: int, seconds: float, fps: float, size: tuple[int, int]) -> int:
    """In a process of its own (MEASURE_FLAG): one world size's render and live figures."""
    _, state = measure_fold(world)
    render, render_p95 = measure_renders(state, size)
    live = measure_live(world, seconds, fps, size)
    print(json.dumps({"render": render, "render_p95": render_p95, **live}), flush=True)
    return 0


def measure_in_child(world: int, seconds: float, fps: float, size: tuple[int, int],
                     pythonpath: str | None) -> dict[str, Any]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    done = subprocess.run([sys.executable, __file__, MEASURE_FLAG, str(world), str(seconds),
                           str(fps), f"{size[0]}x{size[1]}"], env=env, capture_output=True,
                          text=True, timeout=300 + 2 * seconds, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {world} ranks failed: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def paired(options: argparse.Namespace, size: tuple[int, int]) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="ddtop-bench-dashboard-"))
    variants = [(options.baseline, str(baseline_tree(options.baseline, tmp / "base"))),
                ("this tree", None)]
    print(f"{'ranks':>6} {'dashboard':<12} {'round':>5} {'render ms':>10} {'p95':>6} "
          f"{'fps':>5} {'CPU %':>6} {'CPU ms/frame':>13} {'lag end':>8}  keeps up", flush=True)
    try:
        for world in options.ranks:
            offered = world * (STEP_HZ + 1)
            results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in variants}
            for round_ in range(options.rounds):
                for name, pythonpath in variants:
                    r = measure_in_child(world, options.seconds, options.fps, size, pythonpath)
                    results[name].append(r)
                    keeps_up = r["lag_end"] < offered and r["fps"] >= 0.8 * options.fps
                    print(f"{world:>6} {name[:12]:<12} {round_ + 1:>5} {r['render']:>10.1f} "
                          f"{r['render_p95']:>6.1f} {r['fps']:>5.1f} {r['cpu']:>6.1f} "
                          f"{r['cpu_frame']:>13.1f} {r['lag_end']:>8,}  "
                          f"{'yes' if keeps_up else 'NO'}", flush=True)
            for name, _ in variants:
                med = {k: statistics.median(r[k] for r in results[name])
                       for k in ("render", "render_p95", "fps", "cpu", "cpu_frame")}
                print(f"{world:>6} {name[:12]:<12} {'med':>5} {med['render']:>10.1f} "
                      f"{med['render_p95']:>6.1f} {med['fps']:>5.1f} {med['cpu']:>6.1f} "
                      f"{med['cpu_frame']:>13.1f}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


# -- main ----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == FEEDER_FLAG:
        return feeder(int(args[1]), float(args[2]), args[3])
    if args and args[0] == MEASURE_FLAG:
        width, height = map(int, args[4].split("x"))
        return measure_one(int(args[1]), float(args[2]), float(args[3]), (width, height))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="live measuring window per world size (default 10)")
    parser.add_argument("--fps", type=float, default=5.0, help="dashboard frame rate (default 5)")
    parser.add_argument("--size", default="120x40", help="the terminal, WxH (default 120x40)")
    parser.add_argument("--baseline", metavar="GIT-REF",
                        help="also measure the dashboard as it was at this commit, alternating")
    parser.add_argument("--rounds", type=int, default=2,
                        help="with --baseline: measures of each, alternating (default 2)")
    options = parser.parse_args(args)
    width, height = map(int, options.size.split("x"))
    print(f"ddtop dashboard benchmark: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"{STEP_HZ} steps/s + 1 heartbeat/s per rank, --fps {options.fps:g}, "
          f"{width}x{height}", flush=True)
    if options.baseline:
        return paired(options, (width, height))
    header = (f"{'ranks':>6} {'offered/s':>10} {'fold/s':>9} {'x need':>7} {'frame ms':>9} "
              f"{'p95':>6} {'render ms':>10} {'p95':>6} {'relay/s':>8} {'dash/s':>8} "
              f"{'lag max':>8} {'lag end':>8} {'resync':>6} {'fps':>5} {'CPU %':>6} "
              f"{'ms/frame':>8}  keeps up")
    print(header)
    for world in options.ranks:
        offered = world * (STEP_HZ + 1)
        fold_rate, state = measure_fold(world)
        frame_med, frame_p95, render_med, render_p95 = measure_frames(state, (width, height))
        live = measure_live(world, options.seconds, options.fps, (width, height))
        keeps_up = live["lag_end"] < offered and live["fps"] >= 0.8 * options.fps
        print(f"{world:>6} {offered:>10,} {fold_rate:>9,.0f} {fold_rate / offered:>7.1f} "
              f"{frame_med:>9.1f} {frame_p95:>6.1f} {render_med:>10.1f} {render_p95:>6.1f} "
              f"{live['rate']:>8,.0f} {live['folded']:>8,.0f} "
              f"{live['lag_max']:>8,} {live['lag_end']:>8,} {live['resyncs']:>6} "
              f"{live['fps']:>5.1f} {live['cpu']:>6.1f} {live['cpu_frame']:>8.1f}  "
              f"{'yes' if keeps_up else 'NO'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
