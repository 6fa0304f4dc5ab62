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
  is kept as it is and timed too). On a GPU with the timing comm hook: DDP
  takes one comm hook, once, so `register_comm_hook` is wrapped too: a hook
  the user (or DDP itself, for mixed precision) registers becomes the timer's
  inner hook, which does the communication exactly as it would alone, timed;
  a second registration fails as it would without ddtop. A built-in (C++)
  hook, `_register_builtin_comm_hook`, becomes torch's Python hook of the same
  algorithm (`allreduce_hook`, `fp16_compress_hook`), timed the same way;
- infers the phase for heartbeats: forward at a DDP forward (evaluation when
  gradients are off or the model is in eval mode), backward after it, optimizer
  in `optimizer.step()`, data after it. A training forward also starts a new
  iteration for pairing the hook's steps with `ddtop.step()` calls. DDP's
  `forward` is wrapped (once, for the class) rather than given forward hooks:
  a module with hooks takes torch's slower call path on every call, which cost
  more than the hooks' own work on a step of a few ms; a model built before
  install() is passed straight through.

Nothing here raises into the user's program: where timing is impossible it says
so once, as a warning event.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ddtop.training.api import WATCHED_ATTR, LiveRank, current, timer_of
from ddtop.training.commtimer import DDPStats, timed_allreduce
from ddtop.training.pairing import StepPairing
from ddtop.training.telemetry import LiveTelemetry

_installed: LiveRank | None = None
_wrapping: LiveRank | None = None  # who times hooks registered on a watched model
_original_init = DDP.__init__
_original_forward = DDP.forward
_forward_wrapped = False
_original_register = DDP.register_comm_hook
_original_builtin = DDP._register_builtin_comm_hook
# The built-in (C++) hooks and torch's Python hooks that do the same.
_BUILTIN = dist.BuiltinCommHookType  # type: ignore[attr-defined]  # not re-exported in stubs
_PYTHON_EQUIVALENT = {_BUILTIN.ALLREDUCE: default_hooks.allreduce_hook,
                      _BUILTIN.FP16_COMPRESS: default_hooks.fp16_compress_hook}
_constructing: set[int] = set()  # ids of DDP models inside their constructor


def install() -> bool:
    """Instrument this process for the user's script; False (and nothing done)
    without DDTOP_TELEMETRY. Idempotent."""
    global _installed
    rank = current()
    if rank is None:
        return False
    if _installed is None:
        _installed = rank
        register_optimizer_step_pre_hook(_optimizer_starts)
        register_optimizer_step_post_hook(_optimizer_done)
        DDP.__init__ = _ddp_init  # type: ignore[method-assign]  # the point of zero-code
        wrap_forward()
        wrap_registration(rank)
    return True


def wrap_registration(rank: LiveRank) -> None:
    """A comm hook registered on a model that has ddtop's timer becomes the
    timer's inner hook (instead of failing: DDP takes one hook, once); also for
    `ddtop.watch` outside ddtrain start. Idempotent."""
    global _wrapping
    if _wrapping is None:
        _wrapping = rank
        DDP.register_comm_hook = _register_comm_hook  # type: ignore[method-assign]
        DDP._register_builtin_comm_hook = _register_builtin  # type: ignore[method-assign]


class Watched:
    """On a DDP model whose forward ddtop marks: the rank, and the model's
    DDPStats (None: timed by a comm hook, or not at all)."""

    __slots__ = ("rank", "stats")

    def __init__(self, rank: LiveRank, stats: DDPStats | None) -> None:
        self.rank, self.stats = rank, stats

    def __deepcopy__(self, memo: dict[int, Any]) -> Watched:
        return self  # (a copy of a watched model, an EMA copy say, shares it)


def wrap_forward() -> None:
    """DDP's forward, wrapped (once, for the class): a watched model's forwards
    are marked, any other model's pass straight through. Idempotent."""
    global _forward_wrapped
    if not _forward_wrapped:
        _forward_wrapped = True
        DDP.forward = _ddp_forward  # type: ignore[method-assign]
        if "torch._dynamo" in sys.modules:
            _skipped_by_dynamo()
        else:
            torch.compile = _compile


# torch.compile traces a compiled model's forward, the wrapper and what it calls
# included, and would leave out the marks (they are not torch operations): the
# wrapper's code runs as Python instead, while DDP's forward and the model are
# compiled as they would be. torch._dynamo is imported by torch.compile (almost a
# second), so the code is registered then, not before.
_original_compile = torch.compile
_dynamo_skips: list[Callable[..., Any]] = []  # filled below, once defined


def _compile(*args: Any, **kwargs: Any) -> Any:
    _skipped_by_dynamo()
    return _original_compile(*args, **kwargs)


def _skipped_by_dynamo() -> None:
    global _dynamo_skips
    skips, _dynamo_skips = _dynamo_skips, []
    if not skips:
        return
    try:
        from torch._dynamo.eval_frame import skip_code

        for fn in skips:
            skip_code(fn.__code__)
    except Exception as e:  # noqa: BLE001 - a private interface of torch's
        if _installed is not None:
            _installed.warn_once("compile", "under torch.compile, DDP forwards may not be "
                                 f"marked: {type(e).__name__}: {e}")


def mark_forward(ddp: DDP, rank: LiveRank, stats: DDPStats | None) -> None:
    """Have `ddp`'s forwards marked for `rank` (and read for `stats`)."""
    object.__setattr__(ddp, WATCHED_ATTR, Watched(rank, stats))  # a plain attribute
    wrap_forward()


# The optimizer hooks run on every step: a failure of their own is reported once,
# as a warning, instead of raising into the user's program.
def _optimizer_starts(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if _installed is not None:
        try:
            _installed.optimizer_starts()
        except Exception as e:  # noqa: BLE001 - instrumentation must never break the script
            _hook_failed("_optimizer_starts", e)


def _optimizer_done(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if _installed is not None:
        try:
            _installed.optimizer_stepped(optimizer)
        except Exception as e:  # noqa: BLE001 - instrumentation must never break the script
            _hook_failed("_optimizer_done", e)


def _hook_failed(name: str, e: Exception, rank: LiveRank | None = None) -> None:
    """Once, as a warning: ddtop's own `name` failed (and was skipped)."""
    rank = rank or _installed
    if rank is not None:
        rank.warn_once(f"hook-{name}", f"ddtop's {name} hook failed and was skipped: "
                       f"{type(e).__name__}: {e}")


def _ddp_init(self: DDP, *args: Any, **kwargs: Any) -> None:
    _constructing.add(id(self))
    try:
        _original_init(self, *args, **kwargs)
    finally:
        _constructing.discard(id(self))
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


def _register_comm_hook(self: DDP, state: object, hook: Any) -> None:
    rank = _wrapping
    timer = timer_of(self)
    if rank is None or hook is timed_allreduce or (timer is not None and timer.inner) \
            or getattr(self, "device_type", "cpu") != "cuda":  # on CPU: DDP's statistics time it
        _original_register(self, state, hook)  # ours, or a second one: as without ddtop
        return
    # A malformed hook fails as it would without ddtop (torch leaves this unannotated).
    self._check_comm_hook(hook)  # type: ignore[no-untyped-call]
    if self.logger is not None:  # what DDP's own register_comm_hook records
        self.logger._set_comm_hook_name(hook.__qualname__)
    if timer is None:
        if id(self) not in _constructing:
            _original_register(self, state, hook)  # built before install(): not ours
            return
        # DDP's own hook (mixed precision), registered from inside its constructor.
        timer = rank.timer_for(self)
        timer.wrap(hook, state)
        timer.attach(self)
        return
    timer.wrap(hook, state)


def _register_builtin(self: DDP, comm_hook_type: Any) -> None:
    timer = timer_of(self)
    python = _PYTHON_EQUIVALENT.get(comm_hook_type)
    if _wrapping is None or timer is None or timer.inner or python is None:
        _original_builtin(self, comm_hook_type)  # type: ignore[no-untyped-call]  # not ours, or a second: as without ddtop
        return
    if self.logger is not None:  # what DDP's own records
        self.logger._set_comm_hook_name(str(comm_hook_type))
    timer.wrap(python, self.process_group)


def _ddp_forward(self: DDP, *inputs: Any, **kwargs: Any) -> Any:
    """DDP's forward, marked for a watched model: the phases (zero-code mode),
    the end of the last step's all-reduce, and after a forward that all-reduces
    in its backward, a reading of DDP's statistics when due (DDPStats)."""
    watched = None if torch.compiler.is_compiling() else self.__dict__.get(WATCHED_ATTR)
    if watched is None or not watched.rank.active:  # (nothing to trace into a compiled graph)
        return _original_forward(self, *inputs, **kwargs)  # type: ignore[no-untyped-call]
    rank, stats = watched.rank, watched.stats
    if stats is not None and stats.reducer is not self.reducer:
        stats = None  # a copy of a watched model (its own reducer): phases only
    phases = rank is _installed
    grad = torch.is_grad_enabled()
    training = self.training and grad
    syncs = grad and self.require_backward_grad_sync  # (as DDP decides it)
    try:
        if stats is not None:
            stats.over()
            if syncs:
                stats.starting()
        if phases:
            if training:
                rank.pairing.iteration_started()
            rank.telemetry.phase("forward" if training else "evaluation")
    except Exception as e:  # noqa: BLE001 - instrumentation must never break the script
        _hook_failed("forward", e, rank)
    output = _original_forward(self, *inputs, **kwargs)  # type: ignore[no-untyped-call]
    try:
        if stats is not None:
            if syncs:
                stats.synced(self)
            else:
                stats.armed = False  # (its backward, if any, all-reduces nothing)
        if phases and training:
            rank.telemetry.phase("backward")  # the loss, then backward
    except Exception as e:  # noqa: BLE001 - instrumentation must never break the script
        _hook_failed("forward", e, rank)
    return output


_dynamo_skips = [_ddp_forward, DDPStats.starting, DDPStats.synced, DDPStats._read,
                 DDPStats._set_rate, DDPStats._failed, DDPStats.over,
                 DDPStats._backward_done, _hook_failed,
                 StepPairing.iteration_started, LiveTelemetry.phase,
                 LiveTelemetry.collective_over, LiveTelemetry.ddp_reading,
                 LiveTelemetry.ddp_all_reduce, LiveTelemetry.collective_started]
