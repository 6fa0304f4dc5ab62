"""FSDP2's all-gathers and reduce-scatters, timed into a CommLedger.

FSDP2 has no comm hook, but each of its parameter groups calls two objects
for its collectives, an all-gather and a reduce-scatter (torch's `AllGather`
and `ReduceScatter` interfaces: `allocate` a buffer, `__call__` the
collective), which it lets a program replace (`FSDPModule.set_custom_all_gather`
and `set_custom_reduce_scatter`). Both ways of timing them live here:

- `timed_comm_types()`: the built-in trainer's (`--strategy fsdp`,
  strategies.py): subclasses of FSDP2's defaults, installed with those setters.
- `AllGatherTimer` / `ReduceScatterTimer`: zero-code's (shardwatch.py), around
  whatever object a parameter group calls (FSDP2's default, one that allocates
  from the process group, or the script's own), for that one call: the objects
  themselves are never replaced, so FSDP2's checks of their type, and a script's
  own setters, work as they would without ddtop.

Either way: an all-gather's bytes are its output's (the whole padded
parameters), a reduce-scatter's its input's (the whole padded gradients), each
with the bus factor (n-1)/n of nccl-tests. On CPU FSDP2 calls them blocking, so
all of their time is the rank's wait.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ddtop.training.collectives import group_entered
from ddtop.training.commledger import CommLedger, gather_factor
from ddtop.training.telemetry import Signature


def signed(group: Any, part: Any) -> Signature | None:
    """The signature of one of FSDP2's collectives on `group`, counted in its
    sequence: `part`, the tensor one rank gives (an all-gather's input, a
    reduce-scatter's output); None where the arguments are not what FSDP2 gives."""
    try:
        return group_entered(group, str(part.dtype).removeprefix("torch."), part.numel())
    except Exception:  # noqa: BLE001 - FSDP2's own call decides what a bad argument does
        return None


def timed_comm_types() -> tuple[type, type]:
    """FSDP2's own all-gather and reduce-scatter, timed (for FSDPModule's
    set_custom_all_gather / set_custom_reduce_scatter). Imported here, not at the
    top: the private module that holds FSDP2's defaults exists only in recent
    torch releases, and only `fsdp` needs it (ImportError on an older torch)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather,
        DefaultReduceScatter,
    )

    class TimedAllGather(DefaultAllGather):
        def __init__(self, ledger: CommLedger) -> None:
            self.ledger = ledger

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
            def call() -> dist.Work | None:
                return super(TimedAllGather, self).__call__(output_tensor, input_tensor, group,
                                                            async_op=async_op)

            if self.ledger.paused:
                return call()
            # (async_op: not on CPU, where FSDP2 unshards synchronously unless told otherwise)
            return self.ledger.timed("all_gather", output_tensor.nbytes,
                                     gather_factor(group.size()), async_op, call,
                                     None if async_op else signed(group, input_tensor))

    class TimedReduceScatter(DefaultReduceScatter):
        def __init__(self, ledger: CommLedger) -> None:
            self.ledger = ledger

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: dist.ProcessGroup, op: Any,
                     async_op: bool = False) -> dist.Work | None:
            def call() -> dist.Work | None:
                return super(TimedReduceScatter, self).__call__(
                    output_tensor, input_tensor, group, op, async_op=async_op)

            if self.ledger.paused:
                return call()
            return self.ledger.timed("reduce_scatter", input_tensor.nbytes,
                                     gather_factor(group.size()), async_op, call,
                                     None if async_op else signed(group, output_tensor))

    return TimedAllGather, TimedReduceScatter


# -- zero-code: around the object a parameter group calls, for one call ----------------------
Ledgers = Callable[[torch.Tensor], CommLedger | None]  # the ledger for a tensor's device, or
#                                                        None: not a step's (not counted)


class AllGatherTimer:
    """What FSDP2's all-gather gets instead of `inner` for one call: `inner`,
    called with exactly the arguments FSDP2 gave, timed."""

    __slots__ = ("inner", "ledgers")

    def __init__(self, inner: Any, ledgers: Ledgers) -> None:
        self.inner, self.ledgers = inner, ledgers

    def allocate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        buffer: torch.Tensor = self.inner.allocate(*args, **kwargs)
        return buffer

    def __call__(self, *args: Any, **kwargs: Any) -> dist.Work | None:
        # (output_tensor, input_tensor, group, async_op=False): bytes of the output
        if args:
            return _timed("all_gather", self.ledgers, _arg(args, kwargs, 0, "output_tensor"),
                          _arg(args, kwargs, 2, "group"),
                          _arg(args, kwargs, 3, "async_op", False),
                          lambda: self.inner(*args, **kwargs),
                          _arg(args, kwargs, 1, "input_tensor", None))
        # As FSDP2 calls it: by keyword (on every collective: as few calls as can be).
        return _timed("all_gather", self.ledgers, kwargs.get("output_tensor"),
                      kwargs.get("group"), kwargs.get("async_op", False),
                      lambda: self.inner(**kwargs), kwargs.get("input_tensor"))


class ReduceScatterTimer(AllGatherTimer):
    """As AllGatherTimer, for a reduce-scatter (bytes of its input)."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> dist.Work | None:
        # (output_tensor, input_tensor, group, op, async_op=False)
        if args:
            return _timed("reduce_scatter", self.ledgers, _arg(args, kwargs, 1, "input_tensor"),
                          _arg(args, kwargs, 2, "group"),
                          _arg(args, kwargs, 4, "async_op", False),
                          lambda: self.inner(*args, **kwargs),
                          _arg(args, kwargs, 0, "output_tensor", None))
        return _timed("reduce_scatter", self.ledgers, kwargs.get("input_tensor"),
                      kwargs.get("group"), kwargs.get("async_op", False),
                      lambda: self.inner(**kwargs), kwargs.get("output_tensor"))


_MISSING = object()


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str,
         default: Any = _MISSING) -> Any:
    if index < len(args):
        return args[index]
    return kwargs.get(name, default)


def _timed(op: str, ledgers: Ledgers, tensor: Any, group: Any, async_op: Any,
           call: Callable[[], dist.Work | None], part: Any = None) -> dist.Work | None:
    """`call()` timed as `op` on `tensor`'s bytes, and signed by `part` (the tensor
    one rank gives) where it blocks; untimed when the arguments are not what the
    interface says (the call then fails, or not, as it would)."""
    try:
        ledger = ledgers(tensor) if isinstance(tensor, torch.Tensor) else None
        factor = gather_factor(group.size()) if ledger is not None else 0.0
    except Exception:  # noqa: BLE001 - not a process group: FSDP2's own call decides
        ledger = None
    if ledger is None:
        return call()
    blocks = not async_op
    return ledger.timed(op, tensor.nbytes, factor, not blocks, call,
                        signed(group, part) if blocks and part is not None else None)
