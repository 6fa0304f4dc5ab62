"""What each way of watching a DDP step costs, one piece at a time, with no
second rank and no network in the way: the CPU time of one training thread.

    .venv/bin/python bench/comm_timing.py [--rounds 3000] [--width 256]

One process, a gloo group of one (DDP still buckets and all-reduces every
gradient, through the same reducer as with more ranks), the same MLP as
bench/own_script.py, one intra-op thread. A pool of DDP models, two per
configuration, takes one step of every configuration per round in a new
random order; each configuration's CPU per step (`time.thread_time()`, the
training thread alone) is paired with the mean of the round's two plain
steps. What each
configuration adds:

  plain, again      a second plain model: the noise floor (should read ~0)
  torch hook        torch's Python `allreduce_hook` (any Python comm hook)
  ddtop hook        ddtop's timing comm hook (`ddtop.watch`), telemetry off
  DDP stats, 1      DDP's own runtime statistics at every iteration
                    (`_set_ddp_runtime_logging_sample_rate(1)`): the reducer
                    times forward, backward and the all-reduce in C++, no
                    Python on the path
  DDP stats, 10     the same at one iteration in ten
  optimizer hook    an empty global optimizer step post-hook
  forward hooks     an empty forward pre-hook and forward hook on the DDP model
  lean step         what a step call must do at least: detach the loss and
                    append it with a timestamp to a deque

It answers where a per-step cost under 1% can come from; docs/performance.md
records what it found.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import socket
import statistics
import time

from stats import median_ratio  # bench/stats.py, beside this script


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    if args.rounds < 300:
        parser.error("--rounds: at least 300 (the first 200 warm up)")

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from ddtop.training.commtimer import CommTimer, timed_allreduce
    from ddtop.training.telemetry import Telemetry

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)

    active = {"on": False}
    counted = [0]

    def optimizer_hook(optimizer: object, args: object, kwargs: object) -> None:
        if active["on"]:  # every optimizer's step calls it: count the one configuration's
            counted[0] += 1

    register_optimizer_step_post_hook(optimizer_hook)
    names = ["plain", "plain, again", "torch hook", "ddtop hook", "DDP stats, 1",
             "DDP stats, 10", "optimizer hook", "forward hooks", "lean step"]
    pools: dict[str, list[tuple[DDP, torch.optim.Optimizer]]] = {}
    for _ in range(2):  # the configurations' models made in turn, not one pool after another
        for name in names:
            torch.manual_seed(0)
            model = DDP(nn.Sequential(nn.Linear(64, args.width), nn.ReLU(),
                                      nn.Linear(args.width, args.width), nn.ReLU(),
                                      nn.Linear(args.width, 10)))
            if name == "torch hook":
                model.register_comm_hook(None, allreduce_hook)
            elif name == "ddtop hook":
                model.register_comm_hook(CommTimer(Telemetry(), cuda=False), timed_allreduce)
            elif name == "DDP stats, 1":
                model._set_ddp_runtime_logging_sample_rate(1)
            elif name == "DDP stats, 10":
                model._set_ddp_runtime_logging_sample_rate(10)
            elif name == "forward hooks":
                model.register_forward_pre_hook(lambda module, inputs: None)
                model.register_forward_hook(lambda module, inputs, output: None)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            pools.setdefault(name, []).append((model, optimizer))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    loss_fn = nn.CrossEntropyLoss()
    cpu: dict[str, list[float]] = {name: [] for name in names}
    kept: collections.deque[tuple[torch.Tensor, int, float]] = collections.deque(maxlen=64)
    rng, order, clock = random.Random(1), list(names), time.thread_time
    print(f"{args.rounds} rounds of {len(names)} steps ...", flush=True)
    for r in range(args.rounds):
        rng.shuffle(order)
        for name in order:
            model, optimizer = pools[name][r % 2]
            active["on"] = name == "optimizer hook"
            start = clock()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if name == "lean step":
                kept.append((loss.detach(), 32, time.perf_counter()))
            if r >= 200:
                cpu[name].append(clock() - start)
    dist.destroy_process_group()

    # The round's baseline: the mean of its two plain steps (one pool alone can sit
    # a percent or two off the other, by where its memory landed).
    base = [(a + b) / 2 for a, b in zip(cpu["plain"], cpu["plain, again"], strict=True)]
    print(f"\nOne training thread, a gloo group of one, MLP width {args.width}, "
          f"{args.rounds - 200} timed rounds; paired with the mean of the round's two plain "
          "steps")
    print(f"{'configuration':<16} | {'CPU us/step':>11} | {'added us':>8} | {'ratio':>6}")
    print("-" * 52)
    for name in names:
        added = statistics.median(m - b for m, b in zip(cpu[name], base, strict=True))
        ratio = median_ratio(base, cpu[name])
        print(f"{name:<16} | {statistics.median(cpu[name]) * 1e6:11.1f} | {added * 1e6:+8.1f} | "
              f"{ratio:6.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
