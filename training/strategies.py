"""How the built-in trainer's ranks synchronise gradients (`--strategy`).

Data parallelism is taught in steps, from averaging gradients by hand to DDP;
each step is a strategy here, and every one reports its communication through
the same telemetry (ops, bytes, time, bus bandwidth, and how much of it
overlapped with the rank's own work), so ddtop shows them side by side (docs/strategies.md):

- `ddp`: torch DDP; gradients all-reduced bucket by bucket while backward runs
  (timed by the comm hook of commtimer.py, attached by `ddtop.watch`).
- `allreduce`: after backward, one blocking `all_reduce` per parameter's
  gradient, then a division by the world size (the classic `average_gradients`).
- `hooks`: a `register_post_accumulate_grad_hook` per parameter all-reduces its
  gradient the moment it is ready, blocking backward meanwhile.
- `hooks-async`: the same hooks launch asynchronous all-reduces; backward goes on
  while they run, and all are waited for before the optimizer step.
- `ring`: after backward, each gradient all-reduced by a ring of send/recv:
  reduce-scatter, then all-gather, 2(n-1) exchanges of 1/n of it (ring all-reduce).
- `fsdp`: FSDP2 `fully_shard` per layer and on the root: each layer's parameters
  all-gathered before its forward and backward, gradients reduce-scattered.

Whatever the strategy, the averaged gradient is where the optimizer finds it
when `backward` returns, so the training loop is the same for all. The
collectives a strategy issues itself are timed by commledger.py's `CommLedger`
(FSDP2's through the comm objects of shardcomm.py). The names are declared once,
in core/strategy_names.py; `BUILDERS` maps each to its implementation here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import ddtop
from ddtop.core.contract import UsageError
from ddtop.core.strategy_names import STRATEGIES, SyncStrategy
from ddtop.training.commledger import CommLedger, allreduce_factor
from ddtop.training.shardcomm import timed_comm_types
from ddtop.training.telemetry import Telemetry

# FSDP2's public fully_shard and its custom all-gather / reduce-scatter hooks
# (set_custom_all_gather and the private DefaultAllGather it is timed through)
# arrived in this release; pyproject.toml allows older torch for the rest.
FSDP_MIN_TORCH = "2.9"


class Strategy:
    """`model` is what the loop runs forward through; `backward` leaves every
    parameter's gradient averaged over the ranks."""

    def __init__(self, module: nn.Module, ledger: CommLedger) -> None:
        self.module = module  # the bare model: evaluation, checkpoints
        self.model: nn.Module = module
        self.ledger = ledger
        self.world = dist.get_world_size()

    def backward(self, loss: torch.Tensor) -> None:
        self.ledger.harvest()
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated

    def skip_sync(self) -> None:
        """This step's forward and backward without the gradients' averaging (a skip
        drill: training/drills.py; --inject checks it is given to ddp alone)."""
        raise NotImplementedError(f"{type(self).__name__} cannot skip its gradient sync")

    # -- checkpoints: the same format for every strategy (a plain module's and a
    # -- plain optimizer's state dicts), so a run may resume with another one.
    def model_state(self) -> dict[str, Any]:
        """Collective for fsdp: every rank calls it; rank 0's is the one to save."""
        return self.module.state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer,
                             state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)

    @contextmanager
    def evaluating(self) -> Iterator[nn.Module]:
        """The model to evaluate with: no collective per batch, so uneven shards
        of the validation set cannot hang."""
        yield self.module

    def _parameters(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def _broadcast_from_rank0(self) -> None:
        """What DDP does on construction: every rank starts from rank 0's weights."""
        with torch.no_grad():
            for t in [*self.module.parameters(), *self.module.buffers()]:
                dist.broadcast(t, src=0)


class TorchDDP(Strategy):
    """`ddp`: torch's DistributedDataParallel, its buckets all-reduced during backward."""

    def __init__(self, module: nn.Module, ledger: CommLedger, device: torch.device) -> None:
        super().__init__(module, ledger)
        # DDP broadcasts rank 0's parameters on construction; device_ids only for CUDA.
        self.model = DDP(module, device_ids=[device.index] if device.type == "cuda" else None)
        ddtop.watch(self.model)  # comm time, bytes and ops per step, through DDP's comm hook
        self._ready = 0.0  # when the last gradient of this backward was accumulated
        if ledger.telemetry.live and not ledger.cuda:
            for p in self._parameters():
                p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                    self._grad_ready)

    def _grad_ready(self, _: torch.Tensor) -> None:
        self._ready = time.perf_counter()

    def backward(self, loss: torch.Tensor) -> None:
        self._ready = 0.0
        # DDP all-reduces (averages) gradients bucket by bucket here.
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        if self._ready:  # then waits for the buckets still in flight
            self.ledger.telemetry.comm_exposed(time.perf_counter() - self._ready)
        assert isinstance(self.model, DDP)
        self.model.require_backward_grad_sync = True  # (after a skipped sync: again)

    def skip_sync(self) -> None:
        assert isinstance(self.model, DDP)
        # What DDP's no_sync() does, from this forward to the end of its backward.
        self.model.require_backward_grad_sync = False


class AllReduceAfterBackward(Strategy):
    """`allreduce`: one blocking all-reduce per gradient once backward is done."""

    def __init__(self, module: nn.Module, ledger: CommLedger) -> None:
        super().__init__(module, ledger)
        self._broadcast_from_rank0()
        self.params = self._parameters()
        self.factor = allreduce_factor(self.world)

    def backward(self, loss: torch.Tensor) -> None:
        super().backward(loss)
        for p in self.params:
            if p.grad is not None:
                self.reduce(p.grad)
                p.grad.div_(self.world)

    def reduce(self, grad: torch.Tensor) -> None:
        with self.ledger.blocking("allreduce", grad.nbytes, self.factor):
            dist.all_reduce(grad)


class RingAfterBackward(AllReduceAfterBackward):
    """`ring`: as `allreduce`, each all-reduce a ring of send/recv (ring_all_reduce)."""

    def reduce(self, grad: torch.Tensor) -> None:
        with self.ledger.blocking("ring_allreduce", grad.nbytes, self.factor):
            if grad.is_contiguous():
                ring_all_reduce(grad.view(-1))
            else:
                flat = grad.reshape(-1).clone()
                ring_all_reduce(flat)
                grad.copy_(flat.view_as(grad))


def ring_all_reduce(flat: torch.Tensor) -> None:
    """Sum a contiguous 1-D tensor over all ranks in place, around the ring
    rank -> rank+1. Reduce-scatter: in n-1 steps each rank passes one chunk
    (1/n of the tensor) on and adds the one it receives, after which rank r
    holds the full sum of chunk r+1. All-gather: n-1 more steps pass the
    summed chunks round. Every rank sends 2(n-1)/n of the tensor in all."""
    rank, n = dist.get_rank(), dist.get_world_size()
    if n == 1:
        return
    chunks = list(flat.tensor_split(n))
    right, left = (rank + 1) % n, (rank - 1) % n
    scratch = torch.empty_like(chunks[0])

    def exchange(send: int, recv: int, into: torch.Tensor) -> None:
        # An empty chunk (a tensor smaller than the ring) is neither sent nor
        # received: the neighbour skips the same chunk, which has the same index.
        request = dist.isend(chunks[send], right) if chunks[send].numel() else None
        if into.numel():
            dist.recv(into, left)
        if request is not None:
            request.wait()

    for s in range(n - 1):  # reduce-scatter
        recv = (rank - s - 1) % n
        buffer = scratch[: chunks[recv].numel()]
        exchange((rank - s) % n, recv, buffer)
        chunks[recv].add_(buffer)
    for s in range(n - 1):  # all-gather
        exchange((rank + 1 - s) % n, (rank - s) % n, chunks[(rank - s) % n])


class PerParameterHooks(Strategy):
    """All-reduce each gradient from its post-accumulate-grad hook, during backward
    (`hooks`: blocking; `hooks-async`: asynchronous, waited for when backward returns)."""

    def __init__(self, module: nn.Module, ledger: CommLedger, asynchronous: bool) -> None:
        super().__init__(module, ledger)
        self.asynchronous = asynchronous
        self._broadcast_from_rank0()
        self.factor = allreduce_factor(self.world)
        self._in_flight: list[torch.futures.Future[Any]] = []
        for p in self._parameters():
            p.register_post_accumulate_grad_hook(self._ready)  # type: ignore[no-untyped-call]

    def _ready(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        if not self.asynchronous:  # blocking hooks: backward stops here until it is summed
            with self.ledger.blocking("allreduce", grad.nbytes, self.factor):
                dist.all_reduce(grad)
            grad.div_(self.world)
            return
        grad.div_(self.world)  # divide first, then sum (as DDP's allreduce_hook)
        self._in_flight.append(self.ledger.launch(
            "allreduce", grad.nbytes, self.factor,
            lambda: _work(dist.all_reduce(grad, async_op=True))))

    def backward(self, loss: torch.Tensor) -> None:
        super().backward(loss)
        if self._in_flight:
            with self.ledger.waiting():  # every gradient summed before the optimizer step
                for future in self._in_flight:
                    future.wait()
            self._in_flight.clear()


def _work(work: dist.Work | None) -> dist.Work:
    """What an async_op=True collective returns (typed as optional)."""
    assert work is not None
    return work


class FullyShard(Strategy):
    """`fsdp`: FSDP2's fully_shard per layer and on the root (shard_units)."""

    def __init__(self, module: nn.Module, ledger: CommLedger, device: torch.device) -> None:
        try:  # FSDP2 and its collectives: only this strategy needs them (a recent torch)
            from torch.distributed.fsdp import FSDPModule, fully_shard
            all_gather, reduce_scatter = timed_comm_types()
            for hook in ("set_custom_all_gather", "set_custom_reduce_scatter"):
                if not hasattr(FSDPModule, hook):  # an FSDP2 without custom collectives
                    raise ImportError(f"FSDPModule has no {hook}")
        except ImportError as e:
            raise UsageError(f"--strategy fsdp needs torch {FSDP_MIN_TORCH} or newer, this is "
                             f"torch {torch.__version__} ({e}): upgrade torch or pick another "
                             f"--strategy") from e
        super().__init__(module, ledger)
        # The ranks' device type, not FSDP's guess (CUDA when present, even for --device cpu).
        mesh = init_device_mesh(device.type, (self.world,))
        self.layers = shard_units(module)
        for layer in self.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        # The root keeps its parameters after forward: backward needs them at once.
        fully_shard(module, mesh=mesh, reshard_after_forward=False)
        self.units: list[FSDPModule] = [m for m in module.modules()
                                        if isinstance(m, FSDPModule)]
        for unit in self.units:  # FSDP2's hooks for its collectives: ours time them
            unit.set_custom_all_gather(all_gather(ledger))
            unit.set_custom_reduce_scatter(reduce_scatter(ledger))
        self.names = [name for name, _ in module.named_parameters()]

    def model_state(self) -> dict[str, Any]:
        """Gathered (every rank takes part), whole on rank 0: a plain state dict."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.module, options=_full_state())

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Gathered, whole on rank 0, with parameters numbered as optimizer.state_dict()
        numbers them (FSDP's own names them)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state: Any = get_optimizer_state_dict(self.module, optimizer, options=_full_state())
        index = {name: i for i, name in enumerate(self.names)}
        return {"state": {index[k]: v for k, v in state.get("state", {}).items()},
                "param_groups": [{**g, "params": [index[p] for p in g["params"]]}
                                 for g in state.get("param_groups", [])]}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer,
                             state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        named: Any = {"state": {self.names[i]: v for i, v in state["state"].items()},
                 "param_groups": [{**g, "params": [self.names[i] for i in g["params"]]}
                                  for g in state["param_groups"]]}
        set_optimizer_state_dict(self.module, optimizer, named,
                                 options=StateDictOptions(full_state_dict=True))

    @contextmanager
    def evaluating(self) -> Iterator[nn.Module]:
        """Every layer all-gathered once (a collective at a point every rank
        reaches) and kept for the whole evaluation, so that the batches, whose
        number may differ by one between ranks, run no collective."""
        from torch.distributed.fsdp import FSDPModule  # imported by __init__ already

        assert isinstance(self.module, FSDPModule)
        self.module.set_reshard_after_forward(False)
        self.ledger.paused = True  # the evaluation's all-gathers are not a step's
        try:
            for unit in self.units:
                unit.unshard()
            yield self.module
        finally:
            self.ledger.paused = False
            for unit in self.units:
                unit.reshard()
            for layer in self.layers:
                assert isinstance(layer, FSDPModule)
                layer.set_reshard_after_forward(True, recurse=False)


def _full_state() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def shard_units(model: nn.Module) -> list[nn.Module]:
    """What gets its own fully_shard below the root: ResNet's residual blocks,
    else every Linear and convolution (the root keeps the rest)."""
    blocks = [m for m in model.modules() if type(m).__name__ in ("BasicBlock", "Bottleneck")]
    return blocks or [m for m in model.modules() if isinstance(m, nn.Linear | nn.Conv2d)]


# Each --strategy's implementation, built around the model with the rank's ledger
# and device (inside the process group: a collective).
Builder = Callable[[nn.Module, CommLedger, torch.device], Strategy]
BUILDERS: dict[SyncStrategy, Builder] = {
    "ddp": TorchDDP,
    "allreduce": lambda module, ledger, _: AllReduceAfterBackward(module, ledger),
    "hooks": lambda module, ledger, _: PerParameterHooks(module, ledger, asynchronous=False),
    "hooks-async": lambda module, ledger, _: PerParameterHooks(module, ledger,
                                                               asynchronous=True),
    "ring": lambda module, ledger, _: RingAfterBackward(module, ledger),
    "fsdp": FullyShard,
}


def build(name: str, module: nn.Module, device: torch.device, telemetry: Telemetry) -> Strategy:
    """`name`'s strategy around `module` (inside the process group; a collective)."""
    ledger = CommLedger(telemetry, cuda=device.type == "cuda")
    if name not in BUILDERS:
        raise ValueError(f"unknown strategy {name!r}: one of {', '.join(STRATEGIES)}")
    return BUILDERS[name](module, ledger, device)
