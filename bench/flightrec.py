"""What torch's Flight Recorder costs a rank: off (TORCH_FR_BUFFER_SIZE=0) against on
(2,000 entries, what `ddtrain start` gives its ranks), side by side.

    .venv/bin/python bench/flightrec.py [--rounds 6] [--calls 2000] [--steps 200]

The recorder's size is read once per process, as its first group is made, so
each configuration is a pair of gloo ranks of its own (two processes on this
machine, OMP_NUM_THREADS=1). Each round runs one pair off and one pair on, in
a new random order. Each pair measures, on rank 0:

    a collective   `dist.all_reduce` of 4 floats, `--calls` of them: the time a call
                   takes by the clock, and the calling thread's CPU
    a step         `--steps` steps of DDP around the built-in trainer's size of
                   model (an MLP of 235,146 parameters, batch 64), forward, backward
                   (DDP's all-reduce) and SGD: the time a step takes

Each figure is the median over the rounds; the ratios are the median of the
rounds' on/off ratios, with the sign test's 95% interval (bench/stats.py). If
the recorder costs more than 1% of a step it should be off by default.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from stats import median_interval

ENTRIES = 2000
TIMEOUT_S = 300


def rank_main(rank: int, port: int, calls: int, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    small = torch.ones(4)
    for _ in range(200):
        dist.all_reduce(small)
    dist.barrier()
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        dist.all_reduce(small)
    call_wall = (time.perf_counter() - wall) / calls
    call_cpu = (time.thread_time() - cpu) / calls
    model = DDP(nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                              nn.Linear(128, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(10):
        step()
    dist.barrier()
    wall = time.perf_counter()
    for _ in range(steps):
        step()
    step_wall = (time.perf_counter() - wall) / steps
    if rank == 0:
        print(json.dumps({"call_wall": call_wall, "call_cpu": call_cpu,
                          "step_wall": step_wall}), flush=True)
    dist.barrier()
    # (destroy_process_group, or a plain exit, aborts one rank in about one pair of four
    # here: "terminate called without an active exception", gloo's threads at teardown)
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pair(entries: int, calls: int, steps: int) -> dict[str, float]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_FR_BUFFER_SIZE": str(entries)}
    cmd = [sys.executable, __file__, "--port", str(port), "--calls", str(calls),
           "--steps", str(steps), "--rank"]
    procs = [subprocess.Popen([*cmd, str(rank)], env=env, stdout=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    try:
        out = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed (exit codes {[p.returncode for p in procs]})")
    result: dict[str, float] = json.loads(out[0].strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.port, args.calls, args.steps)
        return 0
    rounds: list[dict[int, dict[str, float]]] = []
    print(f"{args.rounds} rounds, each a pair of gloo ranks with the recorder off and one "
          f"with {ENTRIES:,} entries, in a random order", flush=True)
    for n in range(args.rounds):
        order = [0, ENTRIES]
        random.shuffle(order)
        rounds.append({entries: pair(entries, args.calls, args.steps) for entries in order})
        print(f"  round {n + 1}: step {rounds[-1][0]['step_wall'] * 1e3:.2f} ms off, "
              f"{rounds[-1][ENTRIES]['step_wall'] * 1e3:.2f} ms on", flush=True)
    print()
    print(f"{'':24} {'off':>10} {'on':>10} {'on/off [95%]':>24} {'added':>10}")
    for key, what, unit, scale in (("call_wall", "all_reduce, clock", "us", 1e6),
                                   ("call_cpu", "all_reduce, CPU", "us", 1e6),
                                   ("step_wall", "DDP step, clock", "ms", 1e3)):
        off = statistics.median(r[0][key] for r in rounds) * scale
        on = statistics.median(r[ENTRIES][key] for r in rounds) * scale
        ratio = median_interval(r[ENTRIES][key] / r[0][key] for r in rounds)
        print(f"{what:24} {off:>7.1f} {unit} {on:>7.1f} {unit} {ratio.cell():>24} "
              f"{on - off:>+7.1f} {unit}")
    step = median_interval(r[ENTRIES]["step_wall"] / r[0]["step_wall"] for r in rounds)
    added = (statistics.median(r[ENTRIES]["call_cpu"] for r in rounds)
             - statistics.median(r[0]["call_cpu"] for r in rounds))
    step_s = statistics.median(r[0]["step_wall"] for r in rounds)
    print(f"\na step with the recorder on: {step.cell()} of one without it "
          f"({'within' if step.high <= 1.01 else 'cannot tell: the interval reaches past'} "
          "1.01, the 1% that keeps it on by default)")
    print(f"its CPU per collective: {added * 1e6:+.1f} us, {added / step_s:.2%} of a "
          f"{step_s * 1e3:.1f} ms step of one all-reduce (DDP's: one bucket)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
