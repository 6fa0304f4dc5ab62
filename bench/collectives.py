"""What zero-code mode's view of every collective costs a call: `dist.all_reduce`
of a small tensor (4 floats) in two gloo ranks on this machine, torch's own
function against the wrapped one (training/collectives.py), side by side.

    .venv/bin/python bench/collectives.py [--rounds 400] [--calls 20] [--alone]

Both ranks run the same rounds; each round runs a block of `--calls` calls of
every configuration below, in a new random order (the same on both ranks), a
barrier before each block:

    torch's own          the original function (the baseline)
    torch's own, again   the same, a second block (the noise floor: reads 1.0)
    wrapped, no rank     the wrapped function before any rank is watched (the start-up
                         hook wraps at torch's import: what every other process pays)
    watched, unsigned    the same without the collective's signature (its group, the
                         group's count, dtype, elements): the wrapper before signatures
    wrapped, watched     the wrapped function for a live rank (its telemetry
                         sending to a PULL socket this process drains): a collective
                         number, the collective named, its time and bytes marked

Per configuration: the time a call takes by the clock (rank 0's, the ranks
call together), and the CPU of the calling thread (`time.thread_time`, both
ranks), which other load on the machine moves less. Each figure is the median
of the rounds' paired ratios to the baseline block of the same round, with the
sign test's 95% interval (bench/stats.py), and the median added microseconds
per call. ddtop's sender thread folds the marks meanwhile: its CPU is given
apart, as a share of a core.

Then the wrapper alone, in this process: the same wrapper around a function
that does nothing (no gloo, no other thread's work between calls: the cost
with the caches warm), `--calls` calls a block, the ways in a random order each
round, by this thread's CPU time. "watched, unsigned" is the wrapper without
the collective's signature (its group, the group's count, dtype, elements), as
it was before signatures: the signature's cost is the difference of the two
watched ways. `--alone`: this part only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from stats import median_interval  # bench/stats.py, beside this script
from telemetry import Listener  # bench/telemetry.py, beside this script

BASE = "torch's own"
CONFIGS = (BASE, "torch's own, again", "wrapped, no rank", "watched, unsigned",
           "wrapped, watched")
WATCHED = ("watched, unsigned", "wrapped, watched")
WARM_ROUNDS = 20
TIMEOUT_S = 600


def _rank(rank: int, port: int, endpoint: str, rounds: int, calls: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2", DDTOP_TELEMETRY=endpoint)
    import threading

    import torch
    import torch.distributed as dist

    from ddtop.training import api, collectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    live = api.current()
    assert live is not None
    original = dist.all_reduce
    collectives.wrap()
    wrapped = dist.all_reduce
    assert wrapped is not original
    size, family, _ = collectives.OPS["all_reduce"]
    unsigned = collectives._wrap("all_reduce", original, size, family, None)
    calls_of = {BASE: original, "torch's own, again": original,
                "wrapped, no rank": wrapped, "watched, unsigned": unsigned,
                "wrapped, watched": wrapped}
    tensor = torch.ones(4)
    wall: dict[str, list[float]] = {name: [] for name in CONFIGS}
    cpu: dict[str, list[float]] = {name: [] for name in CONFIGS}
    order = list(CONFIGS)
    rng = random.Random(3)  # the same order on both ranks
    clock, thread_clock = time.perf_counter, time.thread_time
    sender = next(t for t in threading.enumerate() if t.name == "ddtop-telemetry")
    sender_cpu = _thread_cpu(sender.native_id)
    began = clock()
    for r in range(WARM_ROUNDS + rounds):
        rng.shuffle(order)
        for name in order:
            call = calls_of[name]
            collectives.watch(live if name in WATCHED else None)
            original(tensor)  # (a barrier that costs what a call does, never wrapped)
            start, start_cpu = clock(), thread_clock()
            for _ in range(calls):
                call(tensor)
            end, end_cpu = clock(), thread_clock()
            if r >= WARM_ROUNDS:
                wall[name].append((end - start) / calls)
                cpu[name].append((end_cpu - start_cpu) / calls)
    collectives.watch(None)
    sender_cpu = _thread_cpu(sender.native_id) - sender_cpu
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"wall": wall, "cpu": cpu, "sender_cpu": sender_cpu, "duration": clock() - began}))
    original(tensor)
    dist.destroy_process_group()


def _thread_cpu(tid: int | None) -> float:
    """CPU seconds of thread `tid` of this process so far (the scheduler's count)."""
    try:
        return int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError):
        return 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=400, help="timed rounds")
    parser.add_argument("--calls", type=int, default=20, help="calls per block")
    parser.add_argument("--alone", action="store_true",
                        help="the wrapper alone only (no gloo ranks): seconds, not a minute")
    args = parser.parse_args()
    import torch.multiprocessing as mp

    listener = Listener()
    if args.alone:
        alone(listener.endpoint, args.rounds, args.calls)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(_rank, args=(port, listener.endpoint, args.rounds,
                                                  args.calls, out),
                                     nprocs=2, start_method="spawn", join=False)
        assert context is not None
        deadline = time.monotonic() + TIMEOUT_S
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                    process.join()
                sys.exit(f"no result within {TIMEOUT_S} s")
        ranks: list[dict[str, Any]] = [json.loads(Path(out, f"rank{r}.json").read_text())
                                       for r in range(2)]
    listener.close()
    wall = ranks[0]["wall"]  # the ranks call together: rank 0's clock is the run's
    cpu = {name: [a + b for a, b in zip(ranks[0]["cpu"][name], ranks[1]["cpu"][name],
                                        strict=True)] for name in CONFIGS}
    print(f"dist.all_reduce of 4 floats, 2 gloo ranks, {args.rounds} rounds of "
          f"{args.calls} calls per configuration, in random order")
    print("ratio: median of the rounds' paired ratios, configuration's time over the "
          "baseline's [95% interval, sign test]; us: median added per call")
    print(f"{'configuration':<20} | {'us/call':>7} | {'wall ratio':<21} | {'+us':>5} | "
          f"{'CPU us':>6} | {'CPU ratio (2 ranks)':<21} | {'+CPU us':>7}")
    print("-" * 104)
    for name in CONFIGS:
        w = median_interval([m / b for m, b in zip(wall[name], wall[BASE], strict=True)])
        c = median_interval([m / b for m, b in zip(cpu[name], cpu[BASE], strict=True)])
        added = statistics.median(m - b for m, b in zip(wall[name], wall[BASE], strict=True))
        added_cpu = statistics.median(m - b for m, b in zip(cpu[name], cpu[BASE], strict=True))
        print(f"{name:<20} | {statistics.median(wall[name]) * 1e6:7.1f} | {w.cell():<21} | "
              f"{added * 1e6:+5.1f} | {statistics.median(cpu[name]) * 1e6:6.1f} | "
              f"{c.cell():<21} | {added_cpu * 1e6:+7.1f}")
    sender = sum(rank["sender_cpu"] for rank in ranks)
    duration = ranks[0]["duration"]
    print(f"ddtop's sender threads, both ranks: {sender * 1e3:.1f} ms of CPU in "
          f"{duration:.1f} s ({sender / duration * 100:.2f}% of a core); the PULL socket "
          f"received {listener.count} messages")
    alone(listener.endpoint, args.rounds, args.calls)
    return 0


def alone(endpoint: str, rounds: int, calls: int) -> None:
    """The wrapper around a function that does nothing, in this process."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", DDTOP_TELEMETRY=endpoint)
    import torch

    from ddtop.training import api, collectives

    live = api.current()
    assert live is not None

    def nothing(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        return None

    size, family, described = collectives.OPS["all_reduce"]
    wrapped = collectives._wrap("all_reduce", nothing, size, family, described)
    unsigned = collectives._wrap("all_reduce", nothing, size, family, None)
    ways = {"nothing": (nothing, None), "wrapped, no rank": (wrapped, None),
            "watched, unsigned": (unsigned, live), "wrapped, watched": (wrapped, live)}
    tensor = torch.ones(4)
    cpu: dict[str, list[float]] = {name: [] for name in ways}
    order = list(ways)
    rng = random.Random(4)
    for r in range(WARM_ROUNDS + rounds):
        rng.shuffle(order)
        for name in order:
            call, rank = ways[name]
            collectives.watch(rank)
            start = time.thread_time()
            for _ in range(calls):
                call(tensor)
            if r >= WARM_ROUNDS:
                cpu[name].append((time.thread_time() - start) / calls)
    collectives.watch(None)
    live.close()
    print(f"\nThe wrapper alone around a function that does nothing, this thread's CPU, "
          f"{rounds} rounds of {calls} calls each way:")
    for name in ways:
        added = statistics.median(m - b for m, b in zip(cpu[name], cpu["nothing"], strict=True))
        print(f"{name:<20} | {statistics.median(cpu[name]) * 1e6:5.2f} us/call | "
              f"{added * 1e6:+5.2f} us")


if __name__ == "__main__":
    sys.exit(main())
