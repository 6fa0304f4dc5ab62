"""What zero-code watching costs an FSDP2 (`fully_shard`) script: its steps
bare against its steps with every FSDP2 collective timed and its phases marked.

    .venv/bin/python bench/fsdp2.py [--rounds 400] [--width 256] [--pin]

Two gloo ranks (spawned, one intra-op thread each) hold a pool of FSDP2
models, the MLP of bench/own_script.py (64-WIDTH-WIDTH-10), each Linear
`fully_shard`-ed, then the root, with an SGD optimizer (momentum 0.9). Every
round they take one step of each configuration, in a new random order (a
barrier before each step), each on a model dealt out afresh from its pool, so
that a burst of outside load lands on a whole round and each step pairs with
the round's bare step taken a few ms away:

  bare          FSDP2 as torch ships it: ddtop's wrappers of its functions
                taken out for the step (the originals put back)
  bare, again   the same on another model: the noise floor (should read 1.0)
  zero-code     what `ddtrain start train.py` installs for FSDP2
                (training/shardwatch.py: each all-gather and reduce-scatter
                timed, the root's forwards marked) and its optimizer hooks

Each figure is the median of the rounds' paired ratios, bare over
configuration (1.0: no cost; the target is at least 0.99), with the sign
test's 95% interval (bench/stats.py); +us: the median time added per step.
By the clock (rank 0's: the ranks step together) and by CPU (both ranks, every
thread). ddtop's own threads (its sender, ZeroMQ) run throughout: their CPU is
given apart, then charged to the zero-code steps for the CPU verdict.
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
import weakref
from pathlib import Path
from typing import Any

from own_script import RANK_HELPERS  # bench/own_script.py: pinning, per-thread CPU
from stats import median_interval  # bench/stats.py, beside this script
from telemetry import Listener  # bench/telemetry.py, beside this script

CONFIGS = ("bare", "bare, again", "zero-code")
BASE = "bare"
WARM_ROUNDS = 20
REPEATS, CALLS = 15, 2000  # the timer alone
OPS = 9  # the MLP's collectives a step: each Linear all-gathered twice, reduce-scattered
TIMEOUT_S = 900


def _rank(rank: int, port: int, endpoint: str, rounds: int, width: int, pin: bool,
          out: str) -> None:
    helpers: dict[str, Any] = {}
    exec(RANK_HELPERS, helpers)
    if pin:
        helpers["pin_to_core"](rank)
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as groups
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2", DDTOP_TELEMETRY=endpoint)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from ddtop.training import api, autowatch, shardwatch, watched

    live = api.current()
    assert live is not None
    shardwatch.install(live)  # FSDP2 is imported: its functions wrapped now
    watched.mark_phases(live)  # (zero-code marks phases for its rank)
    wrapped = {name: getattr(groups, name) for name, _, _ in shardwatch.FOREACH}
    wrapped_root = FSDPState._root_pre_forward
    assert all(hasattr(f, "__wrapped__") for f in [*wrapped.values(), wrapped_root])

    def zero_code(on: bool) -> list[Any]:
        """FSDP2 watched or as torch ships it; the optimizer hooks' handles."""
        for name, function in wrapped.items():
            setattr(groups, name, function if on else function.__wrapped__)
        FSDPState._root_pre_forward = wrapped_root if on else wrapped_root.__wrapped__
        autowatch._installed = live if on else None
        if not on:
            return []
        return [register_optimizer_step_pre_hook(autowatch._optimizer_starts),
                register_optimizer_step_post_hook(autowatch._optimizer_done)]

    mesh = init_device_mesh("cpu", (2,))

    def model() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                            nn.Linear(width, 10))
        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        return net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

    # Two more models than the configurations that use a pool, dealt out afresh
    # every round (as bench/own_script.py: no step finds its model's caches warm).
    pools = {"bare": [model() for _ in range(4)], "zero-code": [model() for _ in range(3)]}
    generator = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(32, 64, generator=generator),
                torch.randint(0, 10, (32,), generator=generator)) for _ in range(16)]
    loss_fn = nn.CrossEntropyLoss()
    wall: dict[str, list[float]] = {name: [] for name in CONFIGS}
    cpu: dict[str, list[float]] = {name: [] for name in CONFIGS}
    order = list(CONFIGS)
    rng = random.Random(2)  # the same order on both ranks
    clock, cpu_clock = time.perf_counter, time.process_time
    threads = helpers["thread_cpu"]()
    began = clock()
    for r in range(WARM_ROUNDS + rounds):
        rng.shuffle(order)
        dealt = {kind: rng.sample(pool, len(pool)) for kind, pool in pools.items()}
        x, y = batches[r % len(batches)]
        for name in order:
            on = name == "zero-code"
            net, optimizer = dealt["zero-code" if on else "bare"].pop()
            handles = zero_code(on)
            live._pacer = weakref.ref(optimizer)  # (its steps are the ones counted)
            dist.barrier()  # both ranks start the step together
            start, start_cpu = clock(), cpu_clock()
            loss_fn(net(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            end, end_cpu = clock(), cpu_clock()
            for handle in handles:
                handle.remove()
            if r >= WARM_ROUNDS:
                wall[name].append(end - start)
                cpu[name].append(end_cpu - start_cpu)
    duration = clock() - began
    threads = {kind: s - threads[kind] for kind, s in helpers["thread_cpu"]().items()}
    # The timer alone, around a collective that takes no time: what one FSDP2
    # collective costs the training thread (median of REPEATS batches of CALLS).
    from ddtop.training.shardcomm import AllGatherTimer

    def no_collective(**_: Any) -> None:
        return None

    tensor = torch.empty(1024)
    kwargs = {"output_tensor": tensor, "input_tensor": tensor, "group": dist.group.WORLD,
              "async_op": False}
    timer = AllGatherTimer(no_collective, shardwatch._ledger)
    per_call: dict[str, list[float]] = {"bare": [], "timed": []}
    for _ in range(REPEATS):
        for kind, call in (("bare", no_collective), ("timed", timer)):
            start = clock()
            for _ in range(CALLS):
                call(**kwargs)
            per_call[kind].append((clock() - start) / CALLS)
        time.sleep(0.15)  # (ddtop's thread folds the marks meanwhile)
    timer_s = statistics.median(per_call["timed"]) - statistics.median(per_call["bare"])
    zero_code(False)
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"wall": wall, "cpu": cpu, "threads": threads, "duration": duration,
         "steps": (WARM_ROUNDS + rounds) * len(CONFIGS), "counted": live.steps,
         "timer_s": timer_s}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=400, help="timed steps of each")
    parser.add_argument("--width", type=int, default=256, help="the MLP's hidden width")
    parser.add_argument("--pin", action="store_true", help="pin each rank to a core")
    args = parser.parse_args()

    import torch.multiprocessing as mp

    listener = Listener()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(_rank, args=(port, listener.endpoint, args.rounds,
                                                  args.width, args.pin, out),
                                     nprocs=2, start_method="spawn", join=False)
        assert context is not None
        deadline = time.monotonic() + TIMEOUT_S
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                    process.join()
                sys.exit(f"no result within {TIMEOUT_S} s")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    listener.close()
    wall = ranks[0]["wall"]
    cpu = {name: [a + b for a, b in zip(ranks[0]["cpu"][name], ranks[1]["cpu"][name],
                                        strict=True)] for name in CONFIGS}
    print(f"FSDP2, 2 gloo ranks on CPU: the MLP (width {args.width}), each Linear and the "
          f"root fully_shard-ed, {args.rounds} rounds of one step each in random order"
          f"{', ranks pinned' if args.pin else ''} (zero-code counted "
          f"{ranks[0]['counted']} steps on rank 0)")
    print(f"{'configuration':<14} | {'ms/step':>7} | {'wall ratio':<21} | {'us':>5} | "
          f"{'CPU ms':>6} | {'CPU ratio':<21} | {'CPU us':>6}")
    print("-" * 98)
    for name in CONFIGS:
        w = median_interval([b / m for m, b in zip(wall[name], wall[BASE], strict=True)])
        c = median_interval([b / m for m, b in zip(cpu[name], cpu[BASE], strict=True)])
        added_wall = statistics.median(m - b for m, b in zip(wall[name], wall[BASE],
                                                             strict=True))
        added_cpu = statistics.median(m - b for m, b in zip(cpu[name], cpu[BASE], strict=True))
        print(f"{name:<14} | {statistics.median(wall[name]) * 1e3:7.3f} | {w.cell():<21} | "
              f"{added_wall * 1e6:+5.0f} | {statistics.median(cpu[name]) * 1e3:6.3f} | "
              f"{c.cell():<21} | {added_cpu * 1e6:+6.0f}")
    background = sum(rank["threads"]["ddtop"] for rank in ranks)
    duration = ranks[0]["duration"]
    per_second = background / duration
    print(f"ddtop's threads (sender, ZeroMQ), both ranks: {per_second * 100:.2f}% of a core; "
          f"the bench's PULL socket received {listener.count} messages")
    name = "zero-code"
    w = median_interval([b / m for m, b in zip(wall[name], wall[BASE], strict=True)])
    whole = median_interval([b / (m + per_second * t) for m, b, t in
                             zip(cpu[name], cpu[BASE], wall[name], strict=True)])
    timer_us = statistics.median(rank["timer_s"] for rank in ranks) * 1e6
    print(f"the timer alone, around a collective that takes no time: {timer_us:.1f} us of the "
          f"training thread a collective; {OPS} a step: {OPS * timer_us:.0f} us, "
          f"{OPS * timer_us / 1e3 / statistics.median(wall[BASE]) / 1e3 * 100:.2f}% of the "
          "bare step")
    print(f"verdict, zero-code: wall {w.cell()}: {w.verdict()}; CPU with ddtop's threads "
          f"{whole.cell()}: {whole.verdict()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
