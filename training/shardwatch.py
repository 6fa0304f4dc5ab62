"""FSDP2 models watched: `fully_shard` in a user's script timed with no line changed.

`install(rank)` (autowatch.install, zero-code; or `ddtop.watch` of an FSDP2
model) has FSDP2's collectives timed for `rank` from the moment
torch.distributed.fsdp is imported (`loaded`: at once if it is; the start-up
hook's import watch tells it otherwise, so a script that has not imported FSDP
pays nothing for it: the import alone takes about half a second). What it
changes, in FSDP2's own modules, where every `fully_shard` model reaches them
however the script imported `fully_shard` and whenever it sharded its model:

- The two functions through which every FSDP2 parameter group communicates,
  `foreach_all_gather` and `foreach_reduce` (as `_fsdp_param_group` calls
  them): each gets, for that call, the group's all-gather or reduce-scatter
  object inside a timer (shardcomm.py), which calls it with the same arguments.
  Comm time, bytes (padding included: what FSDP2 moves) and ops per step, the
  exposed time (on CPU all of it: FSDP2 blocks there), and the collective a
  hung rank waits in (`all_gather`, `reduce_scatter`). Not counted in an
  evaluation or checkpoint phase (an evaluation's all-gathers are not a
  training step's). Under HSDP, the all-reduce across replicas (torch's
  `dist.all_reduce`, not a group's object) is not timed here.
- `FSDPState._root_pre_forward`: at the forward of the model's root (the
  outermost `fully_shard` module, before its all-gather), the phase is forward
  (evaluation with gradients off or in eval mode) and, on the first, the
  model's class, device and backend go in the hello; a forward hook on the
  root (public API, added then) says backward when it returns. Phases only for
  zero-code's rank, as for DDP (watched.mark_phases).
- FSDP1 (`FullyShardedDataParallel`) has no such hook points; it calls the
  public collective functions, which collectives.py times as every collective.

Nothing here raises into the user's program: a torch whose FSDP2 lacks these
points (a private module of FSDP2's) says so once, as a warning, and the model
trains untimed.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from ddtop.core import wire
from ddtop.training import watched
from ddtop.training.commledger import CommLedger
from ddtop.training.shardcomm import AllGatherTimer, ReduceScatterTimer
from ddtop.training.watched import hook_failed

FSDP_MODULE = "torch.distributed.fsdp"  # imported: FSDP2 may be used (then `loaded`)
ROOT_ATTR = "_ddtop_fsdp_root"  # on a root module whose forwards ddtop marks
# Not a training step's communication: not counted (an evaluation's all-gathers).
NOT_COUNTED: frozenset[wire.Phase] = frozenset({"evaluation", "checkpoint"})


class Rank(watched.Rank, Protocol):
    """What FSDP2's timing asks of the rank it reports to (api.py's LiveRank)."""

    def learn(self, name: str, module: nn.Module, group: Any) -> None: ...


# The functions of FSDP2's _fsdp_param_group through which its parameter groups
# communicate, the argument that holds the comm object each calls, and its timer.
FOREACH: tuple[tuple[str, str, type[AllGatherTimer]], ...] = (
    ("foreach_all_gather", "all_gather_comm", AllGatherTimer),
    ("foreach_reduce", "reduce_scatter_comm", ReduceScatterTimer),
)

_rank: Rank | None = None
_ledgers: dict[bool, CommLedger] = {}  # by "on CUDA", for _rank
_patched = False


def install(rank: Rank) -> None:
    """Time FSDP2 models for `rank` once torch.distributed.fsdp is imported
    (`loaded`); at once if it is. Idempotent; never raises."""
    global _rank
    if rank is not _rank:
        _rank = rank
        _ledgers.clear()
    if FSDP_MODULE in sys.modules:
        loaded()


def loaded() -> None:
    """torch.distributed.fsdp is imported: FSDP2 timed (once installed;
    idempotent). Never raises (it runs inside the script's import)."""
    global _patched
    rank = _rank
    if _patched or rank is None:
        return
    _patched = True
    try:
        _time_fsdp2()
    except Exception as e:  # noqa: BLE001 - a private interface of torch's
        rank.warn_once("fsdp2", f"FSDP2 (fully_shard) communication cannot be timed on "
                       f"torch {torch.__version__}: {type(e).__name__}: {e}")


def harvest() -> None:
    """CUDA: account for the collectives whose end has passed (never waits)."""
    ledger = _ledgers.get(True)
    if ledger is not None:
        ledger.harvest()


def _time_fsdp2() -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as groups
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    # Looked up (and checked) before anything is changed: all or nothing.
    timed = {name: _timed(getattr(groups, name), parameter, timer)
             for name, parameter, timer in FOREACH}
    root_pre_forward = _marked(FSDPState._root_pre_forward)
    for name, function in timed.items():
        setattr(groups, name, function)
    FSDPState._root_pre_forward = root_pre_forward  # type: ignore[method-assign]


def _timed(foreach: Callable[..., Any], parameter: str, timer: type[AllGatherTimer]
           ) -> Callable[..., Any]:
    """`foreach`, calling its comm object (argument `parameter`) inside `timer`."""
    index = list(inspect.signature(foreach).parameters).index(parameter)  # ValueError: moved

    @functools.wraps(foreach)
    def timed(*args: Any, **kwargs: Any) -> Any:
        rank = _rank
        if rank is None or not rank.active or torch.compiler.is_compiling():
            return foreach(*args, **kwargs)
        if index < len(args):
            args = (*args[:index], timer(args[index], _ledger), *args[index + 1:])
        elif parameter in kwargs:
            kwargs[parameter] = timer(kwargs[parameter], _ledger)
        return foreach(*args, **kwargs)

    return timed


def _ledger(tensor: torch.Tensor) -> CommLedger | None:
    """The ledger for a collective on `tensor`'s device; None: not counted (not
    a training step's, or no rank)."""
    rank = _rank
    if rank is None or rank.telemetry.current_phase in NOT_COUNTED:
        return None
    cuda = tensor.is_cuda
    ledger = _ledgers.get(cuda)
    if ledger is None:
        ledger = _ledgers[cuda] = CommLedger(rank.telemetry, cuda=cuda)
    return ledger


def _marked(root_pre_forward: Callable[..., Any]) -> Callable[..., Any]:
    """FSDPState._root_pre_forward, marking the forwards of a model's root."""

    @functools.wraps(root_pre_forward)
    def marked(state: Any, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        out = root_pre_forward(state, module, *args, **kwargs)
        rank = _rank
        if rank is not None and rank.active and not torch.compiler.is_compiling():
            try:
                if state._state_ctx.iter_forward_root is state:  # this forward's root
                    _forward_begins(rank, module)
            except Exception as e:  # noqa: BLE001 - instrumentation must never break the script
                hook_failed("fsdp-forward", e, rank)
        return out

    return marked


def _forward_begins(rank: Rank, module: nn.Module) -> None:
    if watched.phases_of() is rank:
        if module.training and torch.is_grad_enabled():
            rank.pairing.iteration_started()
            rank.telemetry.phase("forward")
        else:
            rank.telemetry.phase("evaluation")
    if module.__dict__.get(ROOT_ATTR) is None:
        object.__setattr__(module, ROOT_ATTR, True)  # a plain attribute
        # Added inside the root's forward pre-hooks: torch reads the forward hooks
        # after the forward, so this forward's end is marked too.
        module.register_forward_hook(_forward_ends, always_call=True)
        rank.learn(_plain_class(module), module, None)


def _forward_ends(module: nn.Module, args: Any, output: Any) -> None:
    """After a root's forward: backward comes (the loss, then backward)."""
    rank = _rank
    if rank is None or not rank.active or torch.compiler.is_compiling():
        return
    try:
        if watched.phases_of() is rank and module.training and torch.is_grad_enabled():
            rank.telemetry.phase("backward")
    except Exception as e:  # noqa: BLE001 - instrumentation must never break the script
        hook_failed("fsdp-forward", e, rank)


def _plain_class(module: nn.Module) -> str:
    """The model's own class name (fully_shard makes `MLP` an `FSDPMLP`)."""
    from torch.distributed.fsdp import FSDPModule

    for cls in type(module).__mro__:
        if not issubclass(cls, FSDPModule):
            return cls.__name__
    return type(module).__name__


def is_fsdp2(model: object) -> bool:
    """Whether `model` is a `fully_shard` module (imports nothing)."""
    fsdp = sys.modules.get(FSDP_MODULE)
    kind = getattr(fsdp, "FSDPModule", None)
    return isinstance(kind, type) and isinstance(model, kind)
