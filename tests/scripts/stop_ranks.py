"""The graceful stop's agreement (training/stopping.py) in 2 ranks under torchrun,
each standing for a node of a multi-node job (GROUP_WORLD_SIZE=2). Only rank 0
gets the stop signal, at step SIGNAL_AT: rank 1 is a node whose daemon hears of
the stop late, or never. Both must stop after the same step, rank 1 by finding
the target in the store. The ranks keep in step as DDP keeps them (an
all-reduce a step); each prints `rank R stopped after step S signalled B`.

usage: torchrun --nproc-per-node 2 stop_ranks.py SIGNAL_AT
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ddtop.training import stopping

LIMIT = 20_000  # steps: far beyond any target (3 s of steps at a few hundred a second)


def main() -> None:
    signal_at = int(sys.argv[1])
    stopping.install()
    # A rank that ran past the target would wait in a collective the other skipped:
    # gloo's own timeout ends it, so a broken agreement fails rather than hangs.
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    os.environ["GROUP_WORLD_SIZE"] = "2"  # as if each rank were a node of its own
    agreement = stopping.StopAgreement(rank == 0)
    step, grad = 0, torch.ones(1)
    while not agreement.due(step):
        if rank == 0 and step == signal_at:
            os.kill(os.getpid(), stopping.STOP_SIGNAL)
        dist.all_reduce(grad)
        time.sleep(0.005)  # a step of a few milliseconds
        step += 1
        if step >= LIMIT:
            raise SystemExit(f"rank {rank}: no stop after {LIMIT} steps")
    steps = [0, 0]
    dist.all_gather_object(steps, step)  # the collective both make after the target
    line = (f"rank {rank} stopped after step {step} signalled {stopping._requested} "
            f"(target {agreement.target}; steps {steps})\n")
    os.write(1, line.encode())  # one write: the ranks share the pipe
    os._exit(0)  # as a rank of ddtrain's leaves (training/worker.py): no gloo teardown


if __name__ == "__main__":
    main()
