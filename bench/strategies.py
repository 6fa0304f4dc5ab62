"""The gradient synchronisation strategies (--strategy) side by side: the same
model and global batch under each, at world size 2 and 4, in one table.

    .venv/bin/python bench/strategies.py [--world-sizes 2 4] [--model mlp] [--steps 30]
                                         [--rounds 3]

For each world size one torchrun starts the ranks, which then run every
strategy in turn (same seed, same batches), through training/strategies.py
and ddtop's telemetry exactly as `ddtrain start --strategy` does: WARMUP steps,
a pause so their telemetry leaves, then --steps timed steps between two
barriers (the bench's own, outside the timed steps); --rounds times over,
the strategies taking turns within each round, so that a machine that gets
busier or quieter part-way is spread over all of them. Columns:
  steps/s      timed steps / wall time of rank 0 between the barriers, the
               median over the rounds
  comm ms      communication per step (telemetry comm_s; mean over ranks)
  ops, bytes   collectives per step and their payload (rank 0)
  overlap      share of comm time that overlapped the rank's own work
  exposed ms   comm time per step the rank sat waiting for it (comm - overlap)
  busbw        bus bandwidth, GB/s (nccl-tests' definition per op kind)
The numbers come from the telemetry ddtop shows (Step messages), read by a
PULL socket here: comm time is what docs/strategies.md says each strategy's
timer measures.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ddtop.core.strategy_names import STRATEGIES

WARMUP = 5
FLUSH_S = 0.3  # > the telemetry's send interval: warm-up steps leave before timed ones


def worker(out: Path, model_name: str, batch: int, steps: int, names: list[str],
           rounds: int) -> None:
    """One rank: every strategy in turn (run under torchrun)."""
    import torch
    import torch.distributed as dist

    from ddtop.training import api
    from ddtop.training.data import SYNTHETIC_SPEC
    from ddtop.training.models import build_model
    from ddtop.training.strategies import build

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per = batch // world
    g = torch.Generator().manual_seed(rank)
    spec = SYNTHETIC_SPEC
    x = torch.randn(per, spec.channels, spec.size, spec.size, generator=g)
    y = torch.randint(0, SYNTHETIC_SPEC.classes, (per,), generator=g)
    results: dict[str, list[float]] = {name: [] for name in names}
    for round_, name in ((r, n) for r in range(rounds) for n in names):
        live = api.start(run=f"bench-{round_}-{name}", device="cpu", backend="gloo",
                         config_digest="", model=model_name, dataset="synthetic", epochs=1,
                         global_batch=batch,
                         program="", total_steps=WARMUP + steps, strategy=name)
        assert live is not None, "DDTOP_TELEMETRY is not set"
        torch.manual_seed(0)
        strategy = build(name, build_model(model_name, SYNTHETIC_SPEC), torch.device("cpu"),
                         live.telemetry)
        optimizer = torch.optim.SGD(strategy.model.parameters(), lr=0.01, momentum=0.9)

        for _ in range(WARMUP):
            train_step(strategy, optimizer, x, y)
        time.sleep(FLUSH_S)
        dist.barrier()  # the bench's own sync, outside the timed steps
        start = time.perf_counter()
        for _ in range(steps):
            train_step(strategy, optimizer, x, y)
        dist.barrier()
        results[name].append(steps / (time.perf_counter() - start))
        live.close(0)
    if rank == 0:
        (out / "steps_per_s.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def train_step(strategy: Any, optimizer: Any, x: Any, y: Any) -> None:
    """One step, reported as the built-in trainer reports it."""
    from torch import nn

    import ddtop

    with ddtop.phase("forward"):
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(strategy.model(x), y)
    with ddtop.phase("backward"):
        strategy.backward(loss)
    with ddtop.phase("optimizer"):
        optimizer.step()
    ddtop.step(loss=loss, samples=len(y))


def measure(world: int, model: str, batch: int, steps: int, rounds: int, names: list[str],
            tmp: Path) -> dict[str, dict[str, float]]:
    import zmq

    from ddtop.core import wire

    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind("tcp://127.0.0.1:*")
    endpoint = pull.getsockopt_string(zmq.LAST_ENDPOINT)
    messages: list[wire.Message] = []
    stop = threading.Event()

    def drain() -> None:
        while not stop.is_set():
            if pull.poll(100):
                messages.append(wire.decode(pull.recv_multipart()))

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    env = {**os.environ, "DDTOP_TELEMETRY": endpoint, "OMP_NUM_THREADS": "1"}
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone",
           "--nproc-per-node", str(world), __file__, "--worker", str(tmp), "--model", model,
           "--batch-size", str(batch), "--steps", str(steps), "--rounds", str(rounds),
           "--strategies", *names]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600,
                         check=False)
    time.sleep(0.5)
    stop.set()
    thread.join()
    pull.close()
    context.term()
    if run.returncode != 0:
        sys.exit(f"world size {world} failed ({run.returncode}):\n{run.stderr[-3000:]}")
    rates = json.loads((tmp / "steps_per_s.json").read_text())
    sums: dict[tuple[str, int], collections.Counter[str]] = collections.defaultdict(
        collections.Counter)
    for m in messages:
        if isinstance(m, wire.Step) and m.global_step > WARMUP:
            c = sums[(m.run.split("-", 2)[2], m.rank)]  # bench-ROUND-NAME
            c["steps"] += m.steps
            c["comm_s"] += m.comm_s
            c["ops"] += m.comm_ops
            c["bytes"] += m.comm_bytes
            c["bus"] += m.busbw_gbps * m.comm_s  # busbw x time = bus bytes / 1e9
            c["overlap_s"] += m.comm_overlap_s if isinstance(m.comm_overlap_s, float) else 0.0
    table = {}
    for name in names:
        per_rank = [sums[(name, r)] for r in range(world)]
        steps_seen = sum(c["steps"] for c in per_rank)
        comm = sum(c["comm_s"] for c in per_rank) / steps_seen
        overlap = sum(c["overlap_s"] for c in per_rank) / steps_seen
        zero = per_rank[0]
        table[name] = {
            "steps_per_s": statistics.median(rates[name]),
            "low": min(rates[name]), "high": max(rates[name]), "comm_ms": 1000 * comm,
            "ops": zero["ops"] / zero["steps"], "bytes": zero["bytes"] / zero["steps"],
            "overlap": overlap / comm if comm else 0.0, "exposed_ms": 1000 * (comm - overlap),
            "busbw": sum(c["bus"] for c in per_rank) / sum(c["comm_s"] for c in per_rank),
            "steps_seen": steps_seen / world,
        }
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--model", default="mlp", choices=["mlp", "cnn", "resnet18"])
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--steps", type=int, default=30,
                        help="timed steps per strategy and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.model, args.batch_size, args.steps, args.strategies,
               args.rounds)
        return 0
    print(f"model {args.model}, global batch {args.batch_size}, {args.rounds} rounds of "
          f"{args.steps} timed steps "
          f"after {WARMUP} warm-up, gloo on CPU, {os.cpu_count()} cores")
    header = (f"{'world':>5} {'strategy':<12} {'steps/s':>8} {'(range)':>11} {'comm ms':>8} "
              f"{'ops':>5} "
              f"{'MB/step':>8} {'overlap':>8} {'exposed ms':>10} {'busbw GB/s':>10}")
    rows: list[str] = []
    for world in args.world_sizes:
        with tempfile.TemporaryDirectory() as tmp:
            table: dict[str, Any] = measure(world, args.model, args.batch_size, args.steps,
                                            args.rounds, args.strategies, Path(tmp))
        for name, r in table.items():
            rows.append(f"{world:>5} {name:<12} {r['steps_per_s']:>8.1f} "
                        f"{r['low']:>5.1f}-{r['high']:<5.1f} {r['comm_ms']:>8.2f} "
                        f"{r['ops']:>5.0f} {r['bytes'] / 1e6:>8.2f} {100 * r['overlap']:>7.0f}% "
                        f"{r['exposed_ms']:>10.2f} {r['busbw']:>10.3f}")
    print(header)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
