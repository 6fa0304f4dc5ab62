"""A user's own FSDP2 training script with no ddtop line: a tiny MLP with each
Linear `fully_shard`-ed, then the root (which keeps a parameter of its own), a
few SGD steps on gloo.

    torchrun --nproc-per-node 2 tests/scripts/fsdp2_plain.py --steps 5 --out W

--model builtin: the built-in trainer's `mlp` (784-256-128-10, no root
parameter), to set beside `ddtrain start --strategy fsdp`. --out W: each rank
saves its shards to W.rank-K.pt. --eval: a no-grad forward in eval mode after
every step (FSDP2 all-gathers for it too: not a training step's communication).
--api: with two ddtop lines, `ddtop.watch(model)` and `ddtop.step()` each step.
"""

import argparse
import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

# Dims 0 of 33 rows (and a bias of 33): FSDP2 pads them to 34 on 2 ranks.
TINY = (16, 33, 64, 10)
BUILTIN = (784, 256, 128, 10)


class MLP(nn.Module):
    def __init__(self, sizes: tuple[int, ...], root_parameter: bool) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for n_in, n_out in itertools.pairwise(sizes):
            layers += [nn.Linear(n_in, n_out), nn.ReLU()]
        self.layers = nn.Sequential(*layers[:-1])
        self.scale = nn.Parameter(torch.ones(sizes[-1])) if root_parameter else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(x)
        return out * self.scale if self.scale is not None else out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--model", choices=("tiny", "builtin"), default="tiny")
    parser.add_argument("--eval", action="store_true")
    parser.add_argument("--out", default="")
    parser.add_argument("--api", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    sizes = TINY if args.model == "tiny" else BUILTIN
    model = MLP(sizes, root_parameter=args.model == "tiny")
    mesh = init_device_mesh("cpu", (world,))  # gloo on CPU, even where a GPU is seen
    for layer in model.layers:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if args.api:
        import ddtop

        ddtop.watch(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + rank)
    for _ in range(args.steps):
        x = torch.randn(32, sizes[0])
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        if args.api:
            ddtop.step()
        if args.eval:
            model.eval()
            with torch.no_grad():
                model(x)
            model.train()
    if args.out:
        torch.save({k: v.to_local() for k, v in model.state_dict().items()},
                   f"{args.out}.rank-{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
