"""A plain DDP script whose ranks desync once: after each optimizer step every
rank all-reduces 4 float32s on a group (the world's, or with --pairs its pair's:
[0, 1], [2, 3], ...), except one rank at one step, which does ODD there.

    torchrun --nproc-per-node 4 tests/scripts/desync.py --steps 20 --at 5 --odd-rank 3 \\
        --odd all_gather

ODD: all_gather (4 float32s a rank), float64 (an all_reduce of 4 float64s),
count (an all_reduce of 8 float32s), skip (no collective: its next all_reduce is
the others' one after), sleep (10 minutes, then none: a hang, not a desync),
p2p (it sleeps 10 minutes, then sends 4 float32s to the next rank, which waits
in recv for them; then none: a hang of a point-to-point pair), p2p-send (it
sends 4 float32s to the next rank, which sends 4 to it: neither receives, a
desync of the pair), p2p-irecv (as p2p, the next rank waiting on an irecv's
work), ddp (it
all-gathers 4 float32s on the world group before that step's forward, where
the others enter DDP's gradient all-reduce), or none (a clean run: every rank
alike). --mesh: the pairs are a DeviceMesh's tp dimension (world/2 x 2, dims dp
and tp) rather than groups of new_group. --exchange: after each step's
collective, every rank sends 4 float32s to the next rank and receives the
previous one's, with batch_isend_irecv, then 2 with isend and irecv (clean
asynchronous point-to-point traffic, never a desync).
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--at", type=int, default=5)
    parser.add_argument("--odd-rank", type=int, default=-1)
    parser.add_argument("--odd", default="all_gather",
                        choices=["all_gather", "float64", "count", "skip", "sleep", "p2p",
                                 "p2p-irecv", "p2p-send", "ddp", "none"])
    parser.add_argument("--pairs", action="store_true")
    parser.add_argument("--mesh", action="store_true",
                        help="the pairs as a DeviceMesh's tp dimension (world/2 x 2: dp, tp)")
    parser.add_argument("--step-s", type=float, default=0.0, help="seconds of sleep a step")
    parser.add_argument("--exchange", action="store_true",
                        help="a ring exchange with batch_isend_irecv, isend and irecv a step")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.mesh:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        group = mesh.get_group("tp") if args.pairs else None
    else:
        pairs = [dist.new_group([r, r + 1]) for r in range(0, world - 1, 2)]
        group = pairs[rank // 2] if args.pairs else None
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(args.steps):
        if args.odd == "ddp" and step == args.at and rank == args.odd_rank:
            print(f"entering {time.time():.6f}", flush=True)
            dist.all_gather([torch.empty(4) for _ in range(world)], torch.ones(4))
        loss = model(torch.randn(16, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(args.step_s)
        odd = args.odd if step == args.at and rank == args.odd_rank else "none"
        peer = (args.odd_rank + 1) % world
        if args.odd in ("p2p", "p2p-irecv") and step == args.at and rank in (args.odd_rank, peer):
            if rank == args.odd_rank:
                time.sleep(600)
                dist.send(torch.ones(4), dst=peer)
            elif args.odd == "p2p":
                dist.recv(torch.empty(4), src=args.odd_rank)
            else:
                dist.irecv(torch.empty(4), src=args.odd_rank).wait()
            odd = "none"
        if args.odd == "p2p-send" and step == args.at and rank in (args.odd_rank, peer):
            print(f"entering {time.time():.6f}", flush=True)
            dist.send(torch.ones(4), dst=peer if rank == args.odd_rank else args.odd_rank)
            odd = "none"
        # When it enters its collective (bench/desync.py).
        if step == args.at and args.odd not in ("ddp", "p2p-send"):
            print(f"entering {time.time():.6f}", flush=True)
        if odd == "none":
            dist.all_reduce(torch.ones(4), group=group)
        elif odd == "all_gather":
            dist.all_gather([torch.empty(4) for _ in range(dist.get_world_size(group))],
                            torch.ones(4), group=group)
        elif odd == "float64":
            dist.all_reduce(torch.ones(4, dtype=torch.float64), group=group)
        elif odd == "count":
            dist.all_reduce(torch.ones(8), group=group)
        elif odd == "sleep":
            time.sleep(600)
            dist.all_reduce(torch.ones(4), group=group)
        if args.exchange:
            exchange(rank, world)
    print(f"rank {rank} of {world} done ({os.getpid()})", flush=True)
    dist.destroy_process_group()


def exchange(rank: int, world: int) -> None:
    after, before = (rank + 1) % world, (rank - 1) % world
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(4), after),
                                    dist.P2POp(dist.irecv, torch.empty(4), before)])
    for work in works:
        work.wait()
    sent, received = dist.isend(torch.ones(2), after), dist.irecv(torch.empty(2), before)
    sent.wait()
    received.wait()


if __name__ == "__main__":
    main()
