"""What a big job's summary costs the daemon: RunState.summary(now) and
rank_states(now) at 1,024 / 4,096 / 16,384 ranks, and its run.json.

    .venv/bin/python bench/summary.py [--ranks 1024 4096 16384] [--rounds 5]
                                      [--repeats 7] [--baseline GIT-REF]

A RunState is fed, in process, what a job of N ranks on N/8 nodes has said by
the time it is summarised: each rank's hello, each node's `up`, then every rank
a few Step windows and a Heartbeat inside an all-reduce (rank 7 a 1.3x
straggler; one rank dead, one silent, one stalled among them). Then, CPU time
(time.process_time: the machine is shared, the clock is not this process's),
the median of --repeats calls of:

- summary: RunState.summary(now), what `ddtrain status`, run.json, the
  headless printer and the GitHub summary are built from;
- states: RunState.rank_states(now), each rank's state;
- run.json: RunRecord.with_summary + encode_record (the bytes written), and its size;
- reply: the `status` request's answer, summary included (RunState.summary +
  protocol.encode of its StatusReply: the daemon's work per `ddtrain status`),
  and its size.

--baseline REF measures the package as it was at a git commit too (`git archive
REF` of its parts, as that commit laid them out): each world size, each round, the
baseline then this tree, each in a fresh process, so both see the same load;
the table gives the medians of the rounds and the median of the paired ratios
(bench/stats.py). Numbers in docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from stats import median_ratio  # bench/stats.py, beside this script
from tui_cpu import baseline_tree  # bench/tui_cpu.py, beside this script

ROOT = Path(__file__).resolve().parent.parent
PER_NODE = 8
WINDOWS = 3  # Step messages per rank before the summary
MEASURE_FLAG = "--measure"


def build(world: int) -> Any:
    """A RunState of `world` ranks, fed as a job's hub is."""
    from ddtop.core import wire
    from ddtop.core.state import RunState

    run, t0 = "bench", 100.0
    dead, silent, stalled = world // 3, world // 2, world - 2
    s = RunState(run=run)
    for r in range(world):
        s.apply(wire.Hello(run=run, rank=r, seq=0, t=t0, local_rank=r % PER_NODE,
                           host=f"node{r // PER_NODE:04d}", pid=10_000 + r, device="cuda:0",
                           backend="nccl", world_size=world, config_digest="bench",
                           model="mlp", dataset="synthetic", epochs=1,
                           global_batch=32 * world), t0)
    for k in range(world // PER_NODE):
        ranks = list(range(k * PER_NODE, (k + 1) * PER_NODE))
        news = wire.node_news(k, "up", ranks, f"node{k:04d}")
        # Typed since the core/ room; a baseline from before says it in the event's data.
        said = {"node": news} if "node" in wire.Event.__struct_fields__ else {"data": news}
        s.apply(wire.Event(run=run, rank=wire.DAEMON_RANK, seq=k, t=t0, type="info",
                           message="node up", **said), t0)
    for w in range(1, WINDOWS + 1):
        t = t0 + w
        for r in range(world):
            if r == silent and w > 1:
                continue
            slow = 1.3 if r == 7 else 1.0
            s.apply(wire.Step(run=run, rank=r, seq=w, t=t, epoch=0, step=w,
                              steps_per_epoch=1000, global_step=w, steps=1, samples=32,
                              loss_sum=32 * 2.0, lr=0.1, step_s=0.09 * slow, data_s=0.01,
                              forward_s=0.03 * slow, backward_s=0.04 * slow,
                              optimizer_s=0.01, comm_s=0.03, comm_bytes=25_000_000,
                              comm_ops=4, algbw_gbps=0.8, busbw_gbps=1.6, sync_wait_s=0.0,
                              rss=2 * 10**9), t)
    t = t0 + WINDOWS + 0.5
    for r in range(world):
        if r == silent:
            continue
        coll = wire.Collective(seq=WINDOWS * 4 + 1, op="allreduce", bytes=6_250_000)
        s.apply(wire.Heartbeat(run=run, rank=r, seq=WINDOWS + 1, t=t, phase="backward",
                               epoch=0, global_step=WINDOWS,
                               phase_s=40.0 if r == stalled else 0.02, coll_started=coll,
                               coll_completed=None if r == stalled else coll), t)
    s.apply(wire.RankExit(run=run, rank=wire.DAEMON_RANK, seq=world, t=t, exited=dead,
                          pid=10_000 + dead, exit_code=1, signal=None, culprit=True), t)
    return s


def cpu_ms(call: Any, repeats: int) -> float:
    """The median CPU time of `repeats` calls, in ms."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        call()
        times.append((time.process_time() - start) * 1000)
    return statistics.median(times)


def measure(world: int, repeats: int) -> dict[str, float]:
    from ddtop.core import protocol
    from ddtop.core.summary import RunRecord, encode_record

    state = build(world)
    now = (state.updated or 0.0) + 1.0
    summary = state.summary(now)
    data = encode_record(RunRecord(run_id="bench").with_summary(summary))
    assert len(summary.ranks) == world, len(summary.ranks)
    return {
        "summary_ms": cpu_ms(lambda: state.summary(now), repeats),
        "states_ms": cpu_ms(lambda: state.rank_states(now), repeats),
        "record_ms": cpu_ms(lambda: encode_record(RunRecord(run_id="bench").with_summary(
            summary)), repeats),
        "record_mb": len(data) / 1e6,
        "reply_ms": cpu_ms(lambda: protocol.encode(protocol.StatusReply(
            ok=True, seq=1, summary=state.summary(now))), repeats),
        "reply_mb": len(protocol.encode(protocol.StatusReply(ok=True, summary=summary))) / 1e6,
    }


def run_child(world: int, repeats: int, pythonpath: str | None) -> dict[str, float]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath  # ahead of the editable install's finder
    out = subprocess.run([sys.executable, __file__, MEASURE_FLAG, str(world), str(repeats)],
                         env=env, capture_output=True, text=True, check=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--baseline", metavar="GIT-REF", default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ddtop-bench-summary-") as tmp:
        trees: dict[str, str | None] = {"this tree": None}
        if args.baseline:
            trees = {args.baseline: str(baseline_tree(args.baseline, Path(tmp))), **trees}
        print(f"CPU ms, median of {args.repeats} calls, then of {args.rounds} rounds "
              f"(each tree in a fresh process a round)", flush=True)
        print(f"{'ranks':>6} | {'tree':<12} | {'summary':>8} | {'states':>7} | "
              f"{'run.json':>8} | {'size':>7} | {'reply':>6} | {'size':>7}")
        for world in args.ranks:
            got: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
            for _ in range(args.rounds):
                for name, path in trees.items():
                    got[name].append(run_child(world, args.repeats, path))
            for name, rows in got.items():
                med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
                print(f"{world:>6} | {name:<12} | {med['summary_ms']:>8.1f} | "
                      f"{med['states_ms']:>7.1f} | {med['record_ms']:>8.1f} | "
                      f"{med['record_mb']:>5.2f} MB | {med['reply_ms']:>6.1f} | "
                      f"{med['reply_mb']:>5.2f} MB", flush=True)
            if args.baseline:
                old, new = got[args.baseline], got["this tree"]
                for key, label in (("summary_ms", "summary"), ("states_ms", "states")):
                    ratio = median_ratio([r[key] for r in old], [r[key] for r in new])
                    print(f"{world:>6} | {label} {ratio:.1f}x faster (median of paired ratios)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == MEASURE_FLAG:
        print(json.dumps(measure(int(sys.argv[2]), int(sys.argv[3]))))
        sys.exit(0)
    sys.exit(main())
