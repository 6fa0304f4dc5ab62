"""DDP models ddtop watches: what it changes on DDP's class, for `ddtop.watch`
(api.py) and zero-code (autowatch.py) alike.

- A watched model carries a `Watched` (the rank it reports to, and its
  DDPStats on CPU) as a plain attribute, and a GPU model its CommTimer.
- DDP's `forward` is wrapped (once, for the class) rather than given forward
  hooks: a module with hooks takes torch's slower call path on every call,
  which cost more than the hooks' own work on a step of a few ms; a model
  that is not watched is passed straight through. For a watched model the
  wrapper marks the end of the last step's all-reduce, and after a forward
  that all-reduces in its backward, reads DDP's statistics when due
  (commtimer.DDPStats). For the rank zero-code instruments (`mark_phases`) it
  also infers the phase for heartbeats: forward at a DDP forward (evaluation
  when gradients are off or the model is in eval mode), backward after it; a
  training forward starts a new iteration for the step pairing (pairing.py).
- DDP takes one comm hook, once, so `register_comm_hook` is wrapped: a hook
  registered on a model that has ddtop's timer (the user's, or DDP's own for
  mixed precision) becomes the timer's inner hook, which does the
  communication exactly as it would alone, timed; a second registration fails
  as it would without ddtop. A built-in (C++) hook becomes torch's Python hook
  of the same algorithm (`allreduce_hook`, `fp16_compress_hook`), timed the
  same way.

Nothing here raises into the user's program: where timing is impossible it says
so once, as a warning event.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ddtop.training.collectives import ddp_hook
from ddtop.training.commtimer import CommTimer, DDPStats, timed_allreduce
from ddtop.training.pairing import StepPairing
from ddtop.training.telemetry import LiveTelemetry

TIMER_ATTR = "_ddtop_comm_timer"
WATCHED_ATTR = "_ddtop_watched"  # a DDP model whose forward marks (Watched)


class Rank(Protocol):
    """What the wrappers ask of the rank they report to (api.py's LiveRank)."""

    active: bool  # False in a forked child: nothing is marked
    telemetry: LiveTelemetry
    pairing: StepPairing

    def warn_once(self, key: str, message: str) -> None: ...

    def timer_for(self, ddp: DDP) -> CommTimer: ...


_phases_of: Rank | None = None  # the rank whose phases forwards mark (zero-code)
_wrapping: Rank | None = None  # who times hooks registered on a watched model
_original_forward = DDP.forward
_forward_wrapped = False
_original_register = DDP.register_comm_hook
_original_builtin = DDP._register_builtin_comm_hook
# The built-in (C++) hooks and torch's Python hooks that do the same.
_BUILTIN = dist.BuiltinCommHookType  # type: ignore[attr-defined]  # not re-exported in stubs
_PYTHON_EQUIVALENT = {_BUILTIN.ALLREDUCE: default_hooks.allreduce_hook,
                      _BUILTIN.FP16_COMPRESS: default_hooks.fp16_compress_hook}
_constructing: set[int] = set()  # ids of DDP models inside their constructor


def timer_of(ddp: DDP) -> CommTimer | None:
    timer = ddp.__dict__.get(TIMER_ATTR)
    return timer if isinstance(timer, CommTimer) else None


class Watched:
    """On a DDP model whose forward ddtop marks: the rank, and the model's
    DDPStats (None: timed by a comm hook, or not at all)."""

    __slots__ = ("rank", "stats")

    def __init__(self, rank: Rank, stats: DDPStats | None) -> None:
        self.rank, self.stats = rank, stats

    def __deepcopy__(self, memo: dict[int, Any]) -> Watched:
        return self  # (a copy of a watched model, an EMA copy say, shares it)


def mark_forward(ddp: DDP, rank: Rank, stats: DDPStats | None) -> None:
    """Have `ddp`'s forwards marked for `rank` (and read for `stats`)."""
    object.__setattr__(ddp, WATCHED_ATTR, Watched(rank, stats))  # a plain attribute
    wrap_forward()


def mark_phases(rank: Rank | None) -> None:
    """Forwards of models watched for `rank` also mark its phases (zero-code:
    autowatch.install); None: no rank's."""
    global _phases_of
    _phases_of = rank


def phases_of() -> Rank | None:
    """The rank whose phases watched models' forwards mark (None: no rank's)."""
    return _phases_of


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


def wrap_registration(rank: Rank) -> None:
    """A comm hook registered on a model that has ddtop's timer becomes the
    timer's inner hook (instead of failing: DDP takes one hook, once); also for
    `ddtop.watch` outside ddtrain start. Idempotent."""
    global _wrapping
    if _wrapping is None:
        _wrapping = rank
        DDP.register_comm_hook = _register_comm_hook  # type: ignore[method-assign]
        DDP._register_builtin_comm_hook = _register_builtin  # type: ignore[method-assign]


@contextmanager
def constructing(ddp: DDP) -> Iterator[None]:
    """Inside `ddp`'s constructor: a comm hook registered meanwhile is DDP's own."""
    _constructing.add(id(ddp))
    try:
        yield
    finally:
        _constructing.discard(id(ddp))


def hook_failed(name: str, e: Exception, rank: Rank | None) -> None:
    """Once, as a warning: ddtop's own `name` failed (and was skipped)."""
    if rank is not None:
        rank.warn_once(f"hook-{name}", f"ddtop's {name} hook failed and was skipped: "
                       f"{type(e).__name__}: {e}")


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
        if _phases_of is not None:
            _phases_of.warn_once("compile", "under torch.compile, DDP forwards may not be "
                                 f"marked: {type(e).__name__}: {e}")


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
    phases = rank is _phases_of
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
        hook_failed("forward", e, rank)
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
        hook_failed("forward", e, rank)
    return output


def _register_comm_hook(self: DDP, state: object, hook: Any) -> None:
    # Whichever hook DDP is given, what it calls is DDP's all-reduce: not another
    # collective (collectives.py). A hook that becomes the timer's inner one runs
    # inside timed_allreduce, which is given to DDP so too.
    rank = _wrapping
    timer = timer_of(self)
    if rank is None or hook is timed_allreduce or (timer is not None and timer.inner) \
            or getattr(self, "device_type", "cpu") != "cuda":  # on CPU: DDP's statistics time it
        _original_register(self, state, ddp_hook(hook))  # ours, or a second one: as without ddtop
        return
    # A malformed hook fails as it would without ddtop (torch leaves this unannotated).
    self._check_comm_hook(hook)  # type: ignore[no-untyped-call]
    if self.logger is not None:  # what DDP's own register_comm_hook records
        self.logger._set_comm_hook_name(hook.__qualname__)
    if timer is None:
        if id(self) not in _constructing:
            _original_register(self, state, ddp_hook(hook))  # built before install(): not ours
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


_dynamo_skips = [_ddp_forward, DDPStats.starting, DDPStats.synced, DDPStats._read,
                 DDPStats._set_rate, DDPStats._failed, DDPStats.over,
                 DDPStats._backward_done, hook_failed,
                 StepPairing.iteration_started, LiveTelemetry.phase,
                 LiveTelemetry.collective_over, LiveTelemetry.ddp_reading,
                 LiveTelemetry.ddp_all_reduce, LiveTelemetry.collective_started]
