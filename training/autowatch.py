"""Zero-code instrumentation: what a script with no ddtop lines still shows.

`install()` is called in each rank, just before the user's script runs
(`ddtrain start train.py`). With DDTOP_TELEMETRY set it:

- counts optimizer steps with a global optimizer step hook (torch.optim's
  `register_optimizer_step_post_hook`): one step per `optimizer.step()` of the
  first optimizer that steps. Micro-batches under `no_sync()` (or with
  `require_backward_grad_sync` set to False by hand) call no optimizer step, and
  neither does GradScaler when it skips a step after an inf, so neither counts;
- times every DDP model's gradient communication: DDP's constructor is wrapped
  so that each model is watched as it is built. On CPU, from DDP's own
  statistics (commtimer.DDPStats: no comm hook, so any hook the user registers
  is kept as it is and timed too). On a GPU with the timing comm hook, which
  takes in a hook the user (or DDP itself, for mixed precision) registers
  (watched.py: DDP takes one comm hook, once);
- times every FSDP2 (`fully_shard`) model's all-gathers and reduce-scatters,
  from FSDP2's own call sites (shardwatch.py), once the script imports
  torch.distributed.fsdp (`after_import`: the start-up hook's import watch);
- infers the phase for heartbeats: forward and backward at a DDP forward
  (watched.py) or an FSDP2 root's (shardwatch.py), optimizer in
  `optimizer.step()`, data after it. A DDP model built before install() is
  passed straight through. An optimizer step given a closure (Lightning's
  `optimizer.step(closure)`: forward and backward inside the step) is split as
  it runs: forward from the closure's start, backward after the model's
  forward, optimizer once the closure returns (the update itself);
- follows the epoch: DistributedSampler's `set_epoch` is wrapped (once, on the
  class), so the epoch the script set its sampler to goes with each step and
  heartbeat (LiveRank.sampler_epoch_set). A sampler class that overrides
  set_epoch without calling DistributedSampler's is not seen; a rank whose
  sampler was never set says no epoch (shown "-"), unless ddtop.init's totals
  tell it;
- sees the data loader: a DataLoader iterator's `__next__` is wrapped (once,
  on the class), so a rank in the data phase says whether it is inside its
  data loader or between steps, outside it (LiveRank.loader_next): words name
  "in data" only the first;
- sees every collective of torch.distributed the rank enters (collectives.py:
  Lightning's, Accelerate's and the Trainer's own, barriers, object
  collectives), named while the rank is in it and timed as communication; its
  hello says so (`collectives`), so that ranks that never communicate can be
  told from ranks whose collectives are not seen.

Nothing here raises into the user's program: where timing is impossible it says
so once, as a warning event.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.data.dataloader import _BaseDataLoaderIter
from torch.utils.data.distributed import DistributedSampler

from ddtop.training import collectives, shardwatch, watched
from ddtop.training.api import LiveRank, current
from ddtop.training.watched import WATCHED_ATTR, hook_failed, mark_forward, timer_of

_installed: LiveRank | None = None
_original_init = DDP.__init__
_original_set_epoch = DistributedSampler.set_epoch
_original_next = _BaseDataLoaderIter.__next__


ImportWatch = Callable[[str, Callable[[], None]], None]  # (module name, then)


def install(after_import: ImportWatch | None = None) -> bool:
    """Instrument this process for the user's script; False (and nothing done)
    without DDTOP_TELEMETRY. `after_import(name, then)`: calls `then()` once
    module `name` is imported (starthook.after_import), for FSDP2, which a
    script may import after this. Idempotent."""
    global _installed
    rank = current()
    if rank is None:
        return False
    if _installed is None:
        _installed = rank
        register_optimizer_step_pre_hook(_optimizer_starts)
        register_optimizer_step_post_hook(_optimizer_done)
        DDP.__init__ = _ddp_init  # type: ignore[method-assign]  # the point of zero-code
        DistributedSampler.set_epoch = _set_epoch  # type: ignore[method-assign]  # (the same)
        _BaseDataLoaderIter.__next__ = _next  # type: ignore[method-assign]  # (the same)
        watched.mark_phases(rank)
        watched.wrap_forward()
        watched.wrap_registration(rank)
        collectives.wrap()
        collectives.watch(rank)
        rank.sees_collectives()
        shardwatch.install(rank)
        if after_import is not None:
            after_import(shardwatch.FSDP_MODULE, shardwatch.loaded)
    return True


# The optimizer hooks run on every step: a failure of their own is reported once,
# as a warning, instead of raising into the user's program.
def _optimizer_starts(optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The pre-hook; a step given a closure gets it back marked (what torch
    calls the step with)."""
    rank = _installed
    if rank is not None:
        try:
            rank.optimizer_starts()
            shardwatch.harvest()
            return _closure_marked(args, kwargs, rank)
        except Exception as e:  # noqa: BLE001 - instrumentation must never break the script
            hook_failed("_optimizer_starts", e, rank)
    return None


def _optimizer_done(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if _installed is not None:
        try:
            _installed.optimizer_stepped(optimizer)
        except Exception as e:  # noqa: BLE001 - instrumentation must never break the script
            hook_failed("_optimizer_done", e, _installed)


def _next(self: _BaseDataLoaderIter) -> Any:
    """A DataLoader's next batch: the rank, in the data phase, is inside its data
    loader meanwhile (words say so; between steps, outside it, they do not)."""
    rank = _installed
    if rank is None:
        return _original_next(self)
    try:
        rank.loader_next(True)
    except Exception as e:  # noqa: BLE001 - instrumentation must never break the script
        hook_failed("_next", e, rank)
    try:
        return _original_next(self)
    finally:
        try:
            rank.loader_next(False)
        except Exception as e:  # noqa: BLE001 - (the same)
            hook_failed("_next", e, rank)


def _set_epoch(self: DistributedSampler[Any], epoch: int) -> None:
    """DistributedSampler.set_epoch, then the epoch told to the rank (once per
    epoch: no cost worth counting)."""
    _original_set_epoch(self, epoch)
    rank = _installed
    if rank is not None:
        try:
            rank.sampler_epoch_set(epoch)
        except Exception as e:  # noqa: BLE001 - instrumentation must never break the script
            hook_failed("set_epoch", e, rank)


def _closure_marked(args: tuple[Any, ...], kwargs: dict[str, Any], rank: LiveRank
                    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """`optimizer.step(closure)`'s arguments (args[0]: the optimizer) with the
    closure marked; None (unchanged) when it has none."""
    closure = kwargs.get("closure")
    if callable(closure):
        return args, {**kwargs, "closure": _marked(closure, rank)}
    if len(args) > 1 and callable(args[1]):
        return (args[0], _marked(args[1], rank), *args[2:]), kwargs
    return None


def _marked(closure: Callable[..., Any], rank: LiveRank) -> Callable[..., Any]:
    """`closure` as the step calls it: forward from its start (backward from
    the model's forward's end, watched.py), the update once it returns."""

    def closure_in_step(*args: Any, **kwargs: Any) -> Any:
        _closure_mark(rank, returned=False)
        out = closure(*args, **kwargs)
        _closure_mark(rank, returned=True)
        return out

    return closure_in_step


def _closure_mark(rank: LiveRank, returned: bool) -> None:
    """A closure starts (forward: it computes the loss) or has returned (the
    update begins, the step's all-reduces are over)."""
    try:
        if returned:
            rank.optimizer_starts()
        elif rank.active:
            rank.telemetry.phase("forward")
    except Exception as e:  # noqa: BLE001 - instrumentation must never break the script
        hook_failed("closure", e, rank)


def _ddp_init(self: DDP, *args: Any, **kwargs: Any) -> None:
    with watched.constructing(self):
        _original_init(self, *args, **kwargs)
    rank = _installed
    if rank is None or not rank.active:
        return
    try:
        if self.device_type != "cuda":
            rank.stats_for(self)  # (which says why not, if it cannot)
        elif getattr(self, "_use_python_reducer", False):
            # Compiled autograd's Python reducer calls comm hooks with (grad, param),
            # not a bucket: leave the model untimed rather than break its backward.
            rank.warn_once("python-reducer", "comm timing unavailable: DDP runs with "
                           "compiled autograd's Python reducer")
        elif timer_of(self) is None and not self._comm_hooks:
            rank.timer_for(self).attach(self)
        elif timer_of(self) is None:
            rank.warn_once("builtin-hook", "comm timing unavailable: this DDP model has a "
                           "built-in comm hook, which it keeps")
        if WATCHED_ATTR not in self.__dict__:
            mark_forward(self, rank, None)
        rank.learn_model(self)
    except Exception as e:  # noqa: BLE001 - instrumentation must never break the script
        rank.warn_once("attach", f"comm timing unavailable: {type(e).__name__}: {e}")
