"""What a frame of the rank map costs at thousands of ranks, and attaching to such a run.

    .venv/bin/python bench/rankmap.py [--ranks 4096 16384] [--seconds 5] [--fps 5]
                                      [--size 200x60] [--baseline GIT-REF] [--rounds 2]

A RunState of N ranks, 8 a node (one failed, one hung, one slow), folded in
process (no sockets: the feed's side is bench/dashboard.py's and bench/hub.py's),
shown by the real app (App.run_test) with the map as its view. Measured, each
variant in a fresh process of its own:

- map ms: `rankmap.snapshot(state, now)` alone (the states' pass, the colours,
  the distribution and the outliers; median CPU time);
- render ms: `DashboardApp.render_view()` (median and p95 of the drawing thread's
  CPU time, the feed held still), the whole frame's build under the feed's lock:
  header, banner, map, outliers;
- CPU ms/frame and fps: the app at --fps for --seconds while a feed folds the
  next Step of 1/CHURN_SHARE of the ranks at every pump (so that every tick draws
  a frame): the process's CPU time over the frames drawn, Textual's paint
  included, the feed's folding not (timed and taken off: "fold ms/s");
- attach s: from the daemon's snapshot bytes (`encode_snapshot` of the state) to
  the map's first frame on screen, laid out at the screen's width: decode, the
  app's start, its frames up to that one (decode s: the decode alone; CPU s: the
  process's CPU time over the attach).

--baseline REF measures the dashboard package as it was at a git commit beside
this tree (bench/tui_cpu.py's baseline_tree: the package's parts from `git
archive`, as REF laid them out), alternating, --rounds times each. Numbers in
docs/performance.md.
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

PER_NODE = 8
RUN = "big"
T0 = 100.0
MEASURE_FLAG = "--measure"
REPEAT = 20  # render_view() calls timed
CHURN_SHARE = 50  # the churning feed folds a Step of one rank in this many a pump


def step(rank: int, seq: int, t: float, global_step: int, took: float) -> Any:
    from ddtop.core import wire

    return wire.Step(run=RUN, rank=rank, seq=seq, t=t, epoch=0, step=global_step,
                     steps_per_epoch=1000, global_step=global_step, steps=1, samples=32,
                     loss_sum=32.0, lr=0.1, step_s=took, data_s=0.01, forward_s=0.03,
                     backward_s=0.03, optimizer_s=0.01, comm_s=0.02, comm_bytes=10_000_000,
                     comm_ops=10, algbw_gbps=1.0, busbw_gbps=1.0, sync_wait_s=0.0)


def took(rank: int) -> float:
    return 0.2 if rank == 37 * PER_NODE + 3 else 0.1 + (rank % 7) * 0.001


def big_state(ranks: int) -> Any:
    """N ranks stepping, rank 1000 failed, rank 5000 hung in its backward."""
    from ddtop.core import wire
    from ddtop.core.state import RunState

    state = RunState(run=RUN)
    for rank in range(ranks):
        state.apply(wire.Hello(run=RUN, rank=rank, seq=0, t=T0, local_rank=rank % PER_NODE,
                               host=f"node{rank // PER_NODE}", pid=1000 + rank, device="cpu",
                               backend="gloo", world_size=ranks, config_digest="d",
                               model="mlp", dataset="synthetic", epochs=1,
                               global_batch=32 * ranks), T0)
    for rank in range(ranks):
        state.apply(step(rank, 1, T0 + 1, 1, took(rank)), T0 + 1)
    if ranks > 5000:
        state.apply(wire.Heartbeat(run=RUN, rank=5000, seq=2, t=T0 + 1, phase="backward",
                                   epoch=0, global_step=1, phase_s=30.0), T0 + 1)
    if ranks > 1000:
        state.apply(wire.RankExit(run=RUN, rank=wire.DAEMON_RANK, t=T0 + 1, exited=1000,
                                  pid=2000, exit_code=1, signal=None), T0 + 1)
    return state


def churn_feed(state: Any) -> Any:
    """A feed that folds the next Step of 1/CHURN_SHARE of the ranks at each pump."""
    from ddtop.dashboard.feed import StateFeed

    class ChurnFeed(StateFeed):
        def __init__(self, state: Any) -> None:
            super().__init__(state)
            self.turn, self.seqs = 0, {r: 3 for r in state.ranks}
            self.fold_s = 0.0  # CPU time spent folding
            self.still = False  # True: folds nothing

        def pump(self, timeout_s: float) -> int:
            time.sleep(timeout_s)
            if self.still:
                return 0
            ranks = sorted(self.seqs)[self.turn::CHURN_SHARE]
            self.turn = (self.turn + 1) % CHURN_SHARE
            now, start = time.time(), time.thread_time()
            with self.lock:
                for rank in ranks:
                    if rank in (1000, 5000):
                        continue
                    self.seqs[rank] += 1
                    self.state.apply(step(rank, self.seqs[rank], now, self.seqs[rank],
                                          took(rank)), now)
            self.fold_s += time.thread_time() - start
            return len(ranks)

        def now(self) -> float:
            return time.time()

    return ChurnFeed(state)


def measure_one(ranks: int, seconds: float, fps: float, size: tuple[int, int]) -> int:
    """In a process of its own: this variant's figures, as a JSON line."""
    from ddtop.core.state import decode_snapshot, encode_snapshot
    from ddtop.dashboard import rankmap
    from ddtop.dashboard.app import DashboardApp
    from ddtop.dashboard.feed import StateFeed

    state = big_state(ranks)
    now = T0 + 2
    maps = []
    for _ in range(REPEAT):
        start = time.thread_time()
        rankmap.snapshot(state, now)
        maps.append(1000 * (time.thread_time() - start))
    blob = encode_snapshot(state)
    result: dict[str, Any] = {"map": statistics.median(maps)}

    # Attach: the snapshot's bytes to the first frame of the map on screen (laid out at
    # the screen's width: fewer lines than the screen has).
    async def attach() -> None:
        start, cpu = time.perf_counter(), time.process_time()
        decoded = decode_snapshot(blob)
        result["decode"] = time.perf_counter() - start
        app = DashboardApp(StateFeed(decoded), fps=fps)
        async with app.run_test(size=size) as pilot:
            the_map = app.query_one(rankmap.RankMap)
            while not 0 < len(the_map.layout_.lines) < size[1] or len(the_map.strips) < 2:
                await pilot.pause(0.01)
            result["attach"] = time.perf_counter() - start
            result["attach_cpu"] = time.process_time() - cpu

    asyncio.run(attach())

    # Frames: render_view() timed, then the app's CPU per frame under a churning feed.
    feed = churn_feed(decode_snapshot(blob))
    app = DashboardApp(feed, fps=fps)

    async def frames() -> None:
        async with app.run_test(size=size) as pilot:
            while app.frames < 2:
                await pilot.pause(0.05)
            await pilot.pause(0.5)
            frames0, fold0 = app.frames, feed.fold_s
            cpu0, start = time.process_time(), time.monotonic()
            await pilot.pause(seconds)
            drawn = max(1, app.frames - frames0)
            elapsed = time.monotonic() - start
            fold = feed.fold_s - fold0
            result.update(cpu_frame=1000 * (time.process_time() - cpu0 - fold) / drawn,
                          fold=1000 * fold / elapsed, fps=drawn / elapsed,
                          shown=bool(app.map_shown))
            feed.still = True
            renders = []
            for _ in range(REPEAT):
                start_r = time.thread_time()
                app.render_view()
                renders.append(1000 * (time.thread_time() - start_r))
                await pilot.pause(0.02)
            result.update(render=statistics.median(renders),
                          render_p95=percentile(renders, 95))

    asyncio.run(frames())
    print(json.dumps(result), flush=True)
    return 0


def measure_in_child(ranks: int, options: argparse.Namespace,
                     pythonpath: str | None) -> dict[str, Any]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath  # ahead of the editable install's finder
    done = subprocess.run([sys.executable, __file__, MEASURE_FLAG, str(ranks),
                           str(options.seconds), str(options.fps), options.size], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {ranks} ranks failed: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


COLUMNS = (("map", "map ms", 7, ".1f"), ("render", "render ms", 10, ".1f"),
           ("render_p95", "p95", 6, ".1f"), ("cpu_frame", "CPU ms/frame", 13, ".1f"),
           ("fps", "fps", 5, ".1f"), ("fold", "fold ms/s", 10, ".0f"),
           ("decode", "decode s", 9, ".2f"), ("attach", "attach s", 9, ".2f"),
           ("attach_cpu", "CPU s", 6, ".2f"))


def row(ranks: int, name: str, round_: str, r: dict[str, Any]) -> str:
    cells = "".join(f" {r[key]:>{width}{spec}}" for key, _, width, spec in COLUMNS)
    return f"{ranks:>6} {name[:12]:<12} {round_:>5}{cells}"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == MEASURE_FLAG:
        width, height = map(int, args[4].split("x"))
        return measure_one(int(args[1]), float(args[2]), float(args[3]), (width, height))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--seconds", type=float, default=5.0,
                        help="the CPU-per-frame window (default 5)")
    parser.add_argument("--fps", type=float, default=5.0, help="dashboard frame rate (default 5)")
    parser.add_argument("--size", default="200x60", help="the terminal, WxH (default 200x60)")
    parser.add_argument("--baseline", metavar="GIT-REF",
                        help="also measure the dashboard as it was at this commit, alternating")
    parser.add_argument("--rounds", type=int, default=2,
                        help="measures of each variant (default 2)")
    options = parser.parse_args(args)
    print(f"ddtop rank map benchmark: {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, {PER_NODE} ranks a node, --fps {options.fps:g}, "
          f"{options.size}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="ddtop-bench-rankmap-"))
    variants: list[tuple[str, str | None]] = [("this tree", None)]
    if options.baseline:
        variants.insert(0, (options.baseline,
                            str(baseline_tree(options.baseline, tmp / "base"))))
    titles = "".join(f" {title:>{width}}" for _, title, width, _ in COLUMNS)
    print(f"{'ranks':>6} {'dashboard':<12} {'round':>5}{titles}", flush=True)
    try:
        for ranks in options.ranks:
            results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in variants}
            for round_ in range(options.rounds):
                for name, pythonpath in variants:
                    r = measure_in_child(ranks, options, pythonpath)
                    results[name].append(r)
                    print(row(ranks, name, str(round_ + 1), r), flush=True)
            for name, _ in variants:
                med = {key: statistics.median(r[key] for r in results[name])
                       for key, *_ in COLUMNS}
                print(row(ranks, name, "med", med), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
