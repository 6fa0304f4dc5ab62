"""Every --strategy, one after another, in the same 2 ranks (run under torchrun).

For each strategy: the MLP from the same seed, STEPS steps of SGD on a fixed
global batch split across the ranks, reporting through `import ddtop` to
DDTOP_TELEMETRY as run `strategy-<name>`; rank 0 saves the weights to
OUT/<name>.pt. Then the checkpoint round trip: the strategy's model and
optimizer state, loaded into a fresh model under the same strategy, must give
the same weights as the original after one more step (OUT/<name>-resumed.pt).

usage: torchrun --nproc-per-node 2 strategy_ranks.py OUT [STRATEGY ...]
"""

from __future__ import annotations

import copy
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import ddtop
from ddtop.core.strategy_names import STRATEGIES
from ddtop.training import api, starthook
from ddtop.training.data import SYNTHETIC_SPEC
from ddtop.training.models import build_model
from ddtop.training.strategies import Strategy, build
from ddtop.training.telemetry import Telemetry

SEED, LR, BATCH, STEPS = 5, 0.05, 16, 3


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(SEED)
    return [(torch.randn(BATCH, 1, 28, 28, generator=g),
             torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(STEPS + 1)]


def fresh(name: str, state: dict | None = None) -> tuple[Strategy, torch.optim.Optimizer]:
    torch.manual_seed(SEED)
    model = build_model("mlp", SYNTHETIC_SPEC)
    if state is not None:
        model.load_state_dict(state["model"])
    live = api.running()
    strategy = build(name, model, torch.device("cpu"),
                     live.telemetry if live is not None else Telemetry())
    optimizer = torch.optim.SGD(strategy.model.parameters(), lr=LR, momentum=0.9)
    if state is not None:
        strategy.load_optimizer_state(optimizer, state["optimizer"])
    return strategy, optimizer


def train_step(strategy: Strategy, optimizer: torch.optim.Optimizer,
               batch: tuple[torch.Tensor, torch.Tensor], rank: int, world: int) -> None:
    x, y = batch
    per = BATCH // world
    x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(strategy.model(x), y)
    strategy.backward(loss)
    optimizer.step()
    ddtop.step(loss=loss, samples=per)


def main() -> None:
    out = Path(sys.argv[1])
    names = sys.argv[2:] or list(STRATEGIES)
    torch.set_num_threads(1)
    starthook.stand_aside()  # a rank of its own per strategy (api.start), as the trainer's
    dist.init_process_group("gloo")
    for name in names:
        run_strategy(name, out)
    gc.collect()  # every model, hook and pending work gone before the group is
    dist.barrier()
    dist.destroy_process_group()


def run_strategy(name: str, out: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    data = batches()
    api.start(run=f"strategy-{name}", device="cpu", backend="gloo", config_digest="",
              model="mlp", dataset="synthetic", epochs=1, global_batch=BATCH,
              program="", total_steps=STEPS, strategy=name)
    strategy, optimizer = fresh(name)
    for batch in data[:STEPS]:
        train_step(strategy, optimizer, batch, rank, world)
    model_state = strategy.model_state()  # collective with fsdp
    optimizer_state = strategy.optimizer_state(optimizer)
    live = api.running()
    if live is not None:
        live.close(0)
    if rank == 0:
        torch.save(model_state, out / f"{name}.pt")
    # The checkpoint round trip: every rank loads rank 0's state, as --resume does.
    # (A copy: a state dict holds the live tensors, as torch.save would not.)
    state = [copy.deepcopy({"model": model_state, "optimizer": optimizer_state})]
    dist.broadcast_object_list(state, src=0)
    resumed, resumed_opt = fresh(name, state[0])
    train_step(strategy, optimizer, data[STEPS], rank, world)
    train_step(resumed, resumed_opt, data[STEPS], rank, world)
    after, resumed_after = strategy.model_state(), resumed.model_state()
    if rank == 0:
        torch.save({"original": after, "resumed": resumed_after}, out / f"{name}-resumed.pt")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
