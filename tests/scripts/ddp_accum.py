"""A user's own 2-rank DDP training script with no ddtop lines (unless --ddtop-step):
gradient accumulation, optionally its own comm hook, GradScaler skipping a step.

    torchrun --nproc-per-node 2 tests/scripts/ddp_accum.py --steps 6 --accum 3 --out W.pt
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--accum", type=int, default=3)
    parser.add_argument("--own-hook", action="store_true", help="register allreduce_hook")
    parser.add_argument("--builtin-hook", action="store_true",
                        help="register DDP's built-in (C++) ALLREDUCE hook")
    parser.add_argument("--by-hand", action="store_true",
                        help="accumulate by setting require_backward_grad_sync, not no_sync()")
    parser.add_argument("--skip-step", type=int, default=-1,
                        help="make this optimizer step's gradients inf (GradScaler skips it)")
    parser.add_argument("--ddtop-step", action="store_true", help="also call ddtop.step()")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)),
                bucket_cap_mb=0.001)  # several buckets
    if args.own_hook:
        model.register_comm_hook(dist.group.WORLD, allreduce_hook)
    if args.builtin_hook:
        model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=1000)
    generator = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        for micro in range(args.accum):
            x, y = torch.randn(8, 32, generator=generator), torch.randn(8, 4, generator=generator)
            last = micro == args.accum - 1
            if args.by_hand:
                model.require_backward_grad_sync = last
                loss = nn.functional.mse_loss(model(x), y)
                if step == args.skip_step:
                    loss = loss * float("inf")
                scaler.scale(loss).backward()
            else:
                context = model.no_sync() if not last else torch.enable_grad()
                with context:
                    loss = nn.functional.mse_loss(model(x), y)
                    if step == args.skip_step:
                        loss = loss * float("inf")
                    scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        if args.ddtop_step:
            import ddtop

            ddtop.step(loss=loss, samples=8 * args.accum)
        with torch.no_grad():  # rank 0 evaluates alone: not a step
            if rank == 0:
                model.module(torch.randn(4, 32))
    if args.out and rank == 0:
        torch.save({k: v.clone() for k, v in model.module.state_dict().items()}, args.out)
    dist.barrier()  # leave together: gloo can abort a rank whose peer is already gone
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
