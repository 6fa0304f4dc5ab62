"""The live side of `import ddtop`: one `LiveRank` per process.

This module owns the process's one live rank: `current()` starts it on first
need, `start()` replaces a closed one. `ddtop` (api/__init__.py) asks for it
on its first call that finds DDTOP_TELEMETRY set (or finds this module
loaded), registering with `follow` to be told of each rank started after, and
forwards every call to it. A user's script and the built-in trainer
(trainer.py) report through the same calls, so there is one way a rank is
counted and timed. It is built on `LiveTelemetry` (a sender thread,
non-blocking sends, heartbeats), `CommTimer` and `DDPStats` (DDP's comm hook,
DDP's statistics), and watched.py (what ddtop changes on DDP's class):

- A script's identity comes from torchrun's RANK, LOCAL_RANK and WORLD_SIZE
  (0, 0, 1 without them) and DDTOP_RUN_ID (else TORCHELASTIC_RUN_ID, else
  "script"); the built-in trainer gives its own (`start`: the run id its ranks
  agreed on, its config, model and dataset). It says hello at once, and again
  when it learns more (the model's class, the device, the backend, the totals
  given to `ddtop.init`).
- Steps are counted where they happen: by `ddtop.step()`, and under
  `ddtrain start` also by a global optimizer hook (autowatch.py). The two are
  paired so a step is never counted twice (pairing.py: a state and its
  transitions): a `step()` right after the hook counted a step goes with that
  step (adds its loss and samples), and the hook right after a `step()` that
  counted one goes with that one.
- The epoch a step goes with: the one a DistributedSampler was last set to
  (`set_epoch`, seen under `ddtrain start`: autowatch.py), else the one the
  totals given to `ddtop.init` imply, else None: not known (shown "-", never 1).
- Time in phases that are not step phases (eval, checkpoint, setup: work that
  only some ranks may do) is not step time, so it shows as that phase, never
  as a slow step or a straggler.
- Nothing here ever runs a collective, reads a device tensor on the training
  thread, or raises into the user's program (a bad argument to log is dropped
  with one warning event).
"""

from __future__ import annotations

import atexit
import math
import operator
import os
import shlex
import socket
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddtop.core import wire
from ddtop.core.contract import RUN_ID_ENV, telemetry_endpoint
from ddtop.training import collectives, profiling, shardwatch
from ddtop.training.commtimer import CommTimer, DDPStats
from ddtop.training.pairing import StepPairing
from ddtop.training.receiver import receiver_answers
from ddtop.training.telemetry import LiveTelemetry
from ddtop.training.watched import (
    TIMER_ATTR,
    WATCHED_ATTR,
    mark_forward,
    timer_of,
    wrap_registration,
)

FALLBACK_RUN_ID = "script"
TORCHELASTIC_RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
STRICT_TIMEOUT_S = 5.0  # ddtop.init(strict=True): how long a receiver may take to answer
PROGRAM_CHARS = wire.MAX_PROGRAM_CHARS  # the program and its arguments, as the header shows them


def program_label() -> str:
    """The program as the header shows it: its file name and its arguments."""
    if not sys.argv or not sys.argv[0]:
        return "python"
    label = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])
    label = "".join(c if c.isprintable() else "?" for c in label)
    return label if len(label) <= PROGRAM_CHARS else label[: PROGRAM_CHARS - 1] + "…"


def rank_identity() -> tuple[str, int, int, int]:
    """(run id, rank, local rank, world size) from the environment."""
    env = os.environ
    run = env.get(RUN_ID_ENV) or env.get(TORCHELASTIC_RUN_ID_ENV) or FALLBACK_RUN_ID

    def number(name: str, default: int) -> int:
        try:
            return int(env.get(name, default))
        except ValueError:
            return default

    rank = number("RANK", 0)
    return run, rank, number("LOCAL_RANK", rank), number("WORLD_SIZE", 1)


class LiveRank:
    """This process, reporting: what `ddtop.init/watch/step/phase/log` do live."""

    def __init__(self, endpoint: str, **identity: Any) -> None:
        """`identity`: Hello fields that replace what the environment says."""
        run, rank, local_rank, world_size = rank_identity()
        self.endpoint = endpoint
        self.hello = wire.Hello(
            run=run, rank=rank, local_rank=local_rank, host=socket.gethostname(),
            pid=os.getpid(), device="cpu", backend=_backend(None), world_size=world_size,
            config_digest="", model="", dataset="", epochs=0, global_batch=0,
            program=program_label(),
            total_steps=0)
        self.hello = msgspec.structs.replace(self.hello, **identity)
        self.telemetry = LiveTelemetry(endpoint, msgspec.structs.replace(self.hello))
        self.active = True  # False in a forked child (a data loader worker): calls do nothing
        self.steps = 0  # optimizer steps, counting those before a resume (start_step)
        self.steps_per_epoch = self._steps_per_epoch()
        # The epoch a DistributedSampler was last set to (autowatch.py), and the
        # steps done when it changed; None: never set (the totals tell, or nobody).
        self.sampler_epoch: int | None = None
        self._epoch_began = 0
        self.telemetry.enter_epoch(self._epoch_of(self.steps))
        self.timers: list[CommTimer] = []
        self.stats: list[DDPStats] = []
        self._lr = 0.0
        self._pacer: weakref.ref[torch.optim.Optimizer] | None = None
        self.pairing = StepPairing()  # ddtop.step() with the optimizer hook: counted once
        self._warned: set[str] = set()
        self._exit_code = 0
        self._closed = False
        atexit.register(self.close)
        self._excepthook = sys.excepthook
        sys.excepthook = self._uncaught

    # -- ddtop.init / watch -----------------------------------------------------------
    def init(self, total_steps: int | None, epochs: int | None, strict: bool,
             start_step: int | None = None) -> str | None:
        """Totals for progress and ETA, and the steps done before this process
        started (a resumed run); with `strict`, why nobody answers (or None)."""
        changes: dict[str, Any] = {}
        # Clamped to what the wire carries, so that a huge total cannot stop the sender.
        if total_steps is not None and total_steps >= 0:
            changes["total_steps"] = min(int(total_steps), 1 << 62)
        if epochs is not None and epochs >= 0:
            changes["epochs"] = min(int(epochs), 1 << 31)
        self._update_hello(**changes)
        self.steps_per_epoch = self._steps_per_epoch()
        if start_step is not None and start_step >= 0 and self.active:
            self.steps = min(int(start_step), 1 << 62)
            self.telemetry.resume_at(self._epoch_of(self.steps), self.steps)
        elif self.active:
            self.telemetry.enter_epoch(self._epoch_of(self.steps))  # the totals may tell it
        if strict:
            return receiver_answers(self.endpoint, STRICT_TIMEOUT_S)
        return None

    def watch(self, model: Any) -> None:
        """Time `model`'s comm hook if it is a DDP model (also under torch.compile),
        its collectives if it is an FSDP2 (`fully_shard`) model; an optimizer is
        the one whose steps are counted and whose lr is shown."""
        if not self.active:
            return
        if isinstance(model, torch.optim.Optimizer):
            self._pacer = weakref.ref(model)
            self._lr = _lr_of(model, self._lr)
            return
        ddp = getattr(model, "_orig_mod", model)
        if shardwatch.is_fsdp2(ddp):
            shardwatch.install(self)  # its collectives, timed from FSDP2's own call sites
            return
        if not isinstance(ddp, DDP):
            self.warn_once("not-ddp", f"ddtop.watch: {type(model).__name__} is not "
                           "DistributedDataParallel: no communication to time")
            return
        if WATCHED_ATTR in ddp.__dict__ or timer_of(ddp) is not None:
            pass  # watched already
        elif ddp.device_type != "cuda":
            self.stats_for(ddp)
        else:
            if ddp._comm_hooks:
                hook = getattr(ddp._comm_hooks[0][0], "__qualname__", "a comm hook")
                self.warn_once("own-hook", f"comm timing unavailable: the model already has "
                               f"a comm hook ({hook}), which it keeps; call ddtop.watch "
                               "before register_comm_hook to have it timed")
            else:
                wrap_registration(self)  # a hook registered later: timed inside
                try:
                    self.timer_for(ddp).attach(ddp)
                except RuntimeError as e:  # a built-in (C++) hook, which DDP does not list
                    object.__delattr__(ddp, TIMER_ATTR)
                    self.warn_once("own-hook", f"comm timing unavailable: {e}")
        self.learn_model(ddp)

    def stats_for(self, ddp: DDP) -> DDPStats | None:
        """Time `ddp` from DDP's own statistics (CPU), and mark its forwards."""
        stats = None
        if getattr(ddp, "_use_python_reducer", False):
            # Compiled autograd's Python reducer keeps no statistics.
            self.warn_once("python-reducer", "comm timing unavailable: DDP runs with "
                           "compiled autograd's Python reducer")
        else:
            try:
                stats = DDPStats(self.telemetry, ddp)
                self.stats.append(stats)
            except Exception as e:  # noqa: BLE001 - instrumentation must never break the script
                self.warn_once("stats", f"comm timing unavailable: {type(e).__name__}: {e}")
        mark_forward(ddp, self, stats)  # the phases, at least
        return stats

    def timer_for(self, ddp: DDP) -> CommTimer:
        """A new CommTimer for `ddp` (not attached yet), remembered on the model."""
        timer = CommTimer(self.telemetry, cuda=ddp.device_type == "cuda",
                          process_group=ddp.process_group)
        object.__setattr__(ddp, TIMER_ATTR, timer)  # a plain attribute, not a submodule
        self.timers.append(timer)
        return timer

    def learn_model(self, ddp: DDP) -> None:
        """Hello again with what the model tells: its class, device and backend."""
        self.learn(type(ddp.module).__name__, ddp.module, ddp.process_group)

    def learn(self, name: str, module: torch.nn.Module, group: Any) -> None:
        """Hello again with a model's class `name`, the device of `module`'s
        parameters and the backend of `group` (None: the default group)."""
        param = next(module.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        if device.type == "cuda":
            self.telemetry.memory_device = device
        self._update_hello(model=self.hello.model or name, device=str(device),
                           backend=_backend(group))

    def sees_collectives(self) -> None:
        """Hello again: every collective this rank enters is seen (zero-code)."""
        self._update_hello(collectives=True)

    # -- ddtop.step and the optimizer hook ------------------------------------------------
    def step(self, loss: Any, samples: int | None) -> None:
        if not self.active:
            return
        if self.pairing.step_called():  # goes with the step the hook just counted
            self.telemetry.add_loss(loss, samples, release=True)
        else:
            pacer = self._pacer() if self._pacer is not None else None
            if pacer is not None:
                self._lr = _lr_of(pacer, self._lr)
            self._count(loss, samples)  # the step and its loss in one go

    def optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """The global optimizer post-hook: one step per step of the first optimizer
        that steps (a second one, as in a GAN, steps in the same iteration)."""
        if not self.active:
            return
        pacer = self._pacer() if self._pacer is not None else None
        if pacer is None:
            self._pacer = weakref.ref(optimizer)
        elif pacer is not optimizer:
            return
        self._lr = _lr_of(optimizer, self._lr)
        # The next step begins by waiting for its batch.
        if self.pairing.optimizer_stepped():  # ddtop.step() already counted it
            self.telemetry.phase("data")
        else:
            # A script that calls ddtop.step gives this step's loss next: wait for it.
            self._count(hold=self.pairing.calls_step, then="data")

    def _count(self, loss: Any = None, samples: int | None = None, hold: bool = False,
               then: wire.Phase | None = None) -> None:
        # On every step's critical path: as few calls as can be.
        for timer in self.timers:
            timer.harvest()
        self._all_reduces_over()
        steps = self.steps = self.steps + 1
        profiling.at_step(steps)  # (`ddtrain profile`: nothing asked is one global read)
        spe = self.steps_per_epoch
        # (self._epoch_of, inline)
        epoch: int | None = self.sampler_epoch
        if epoch is not None:  # the script's own: its steps in it counted since it was set
            step = steps - self._epoch_began
        elif spe:
            epoch = (steps - 1) // spe
            step = steps - epoch * spe
        else:
            step = 0
        counted = None  # every COUNTS_EVERY steps: each group's collectives entered so far
        if steps % wire.COUNTS_EVERY == 0 and (groups := collectives.counts()):
            counted = wire.GroupCounts(steps, groups)
        self.telemetry.count_step(epoch, step, spe, steps, self._lr, loss, samples, hold, then,
                                  counted)

    def sampler_epoch_set(self, epoch: Any) -> None:
        """A DistributedSampler's `set_epoch(epoch)` (autowatch.py): the epoch the
        script is in from now, counted from 0 as the sampler counts it. A value
        that is not a whole number from 0 to wire.MAX_EPOCH is left out, said once."""
        if not self.active:
            return
        try:
            value = operator.index(epoch)
        except TypeError:
            value = -1
        if not 0 <= value <= wire.MAX_EPOCH:
            self.warn_once("set-epoch", f"set_epoch({str(epoch)[:40]}): not an epoch ddtop "
                           "shows (a whole number from 0): the epoch is left as it was")
            return
        if value != self.sampler_epoch:  # set again (another sampler): the same epoch goes on
            self.sampler_epoch, self._epoch_began = value, self.steps
            self.telemetry.enter_epoch(value)

    def _all_reduces_over(self) -> None:
        """The step's DDP all-reduces are over (timed from DDP's statistics)."""
        for stats in self.stats:
            stats.over()

    def _steps_per_epoch(self) -> int:
        """From the totals said so far (0: not known)."""
        total, count = self.hello.total_steps, self.hello.epochs
        return math.ceil(total / count) if isinstance(total, int) and total > 0 and count > 0 \
            else 0

    def _epoch_of(self, steps: int) -> int | None:
        """The epoch step number `steps` (counted from 1) falls in: the sampler's,
        else from the totals; None where neither tells."""
        if self.sampler_epoch is not None:
            return self.sampler_epoch
        spe = self.steps_per_epoch
        return max(0, steps - 1) // spe if spe else None

    def optimizer_starts(self) -> None:
        """The global optimizer pre-hook: the step's all-reduces are over."""
        if self.active:
            self._all_reduces_over()
            self.telemetry.phase("optimizer")

    # -- ddtop.phase / log ------------------------------------------------------------------
    def enter_phase(self, name: str, leaving: bool = False) -> str:
        """Switch to phase `name` (a wire phase); the phase it was in before.
        `leaving`: back to it as a `ddtop.phase` block ends (a data block's end is
        outside the data loader)."""
        previous = self.telemetry.current_phase
        if self.active:
            if name == "optimizer":
                self._all_reduces_over()
            if name == "setup" and self.steps:
                name = "data"  # set-up is over once a step is done
            self.telemetry.phase(name, name == "data" and not leaving)  # type: ignore[arg-type]
        return previous

    def loader_next(self, inside: bool) -> None:
        """A DataLoader's `__next__` entered (`inside`) or left (autowatch): where the
        rank is in the data phase, inside its data loader or between steps."""
        if self.active and self.telemetry.current_phase == "data":
            self.telemetry.in_loader(inside)

    def log(self, scalars: dict[str, Any]) -> None:
        if not self.active:
            return
        for problem in self.telemetry.add_scalars(scalars):
            self.warn_once(problem, f"ddtop.log: {problem}")

    # -- warnings and the end ---------------------------------------------------------------
    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned and len(self._warned) < MAX_WARNINGS:
            self._warned.add(key)
            self.telemetry.event("warning", message[:1000])

    def _update_hello(self, **changes: Any) -> None:
        hello = msgspec.structs.replace(self.hello, **changes)
        if hello != self.hello:
            self.hello = hello
            self.telemetry.send_hello(msgspec.structs.replace(hello))

    def _uncaught(self, kind: type[BaseException], exc: BaseException,
                  tb: TracebackType | None) -> None:
        if self.active:
            self._exit_code = 1
            self.telemetry.error(exc)
        self._excepthook(kind, exc, tb)

    def exits_with(self, code: int) -> None:
        """The program leaves through SystemExit(code) (starthook.py tells): the
        bye at exit says `code`."""
        self._exit_code = code

    def close(self, exit_code: int | None = None) -> None:
        """Say bye (1 after an uncaught exception, else 0 or `exit_code`) and stop."""
        if self._closed or not self.active:
            return
        self._closed = True
        if sys.excepthook == self._uncaught:
            sys.excepthook = self._excepthook
        self.telemetry.close(self._exit_code if exit_code is None else exit_code)

    def forked(self) -> None:
        self.active = False


MAX_WARNINGS = 32


def _backend(group: Any) -> str:
    try:
        return str(dist.get_backend(group)) if dist.is_available() and dist.is_initialized() \
            else ""
    except (RuntimeError, ValueError):  # a group this rank is not part of
        return ""


def _lr_of(optimizer: torch.optim.Optimizer, default: float) -> float:
    """The first parameter group's learning rate, when it is a plain number."""
    try:
        lr = optimizer.param_groups[0].get("lr", default)
    except (IndexError, AttributeError):
        return default
    if isinstance(lr, torch.Tensor):
        return float(lr) if lr.device.type == "cpu" and lr.numel() == 1 else default
    return float(lr) if isinstance(lr, int | float) else default


# The process's one live rank (None: none started), and who is told when it
# changes: `ddtop` (api/__init__.py), once it has asked for it (`follow`).
_current: LiveRank | None = None
_follower: Callable[[LiveRank], None] | None = None
_lock = threading.Lock()


def current() -> LiveRank | None:
    """This process's LiveRank, started on the first call; None when
    DDTOP_TELEMETRY names no endpoint."""
    endpoint = telemetry_endpoint()
    if endpoint is None:
        return None
    with _lock:
        if _current is None:
            _become(LiveRank(endpoint))
        return _current


def follow(told: Callable[[LiveRank], None]) -> LiveRank | None:
    """`ddtop`'s registration (api/__init__.py): `told` is called with each
    rank this process starts from now on. The rank now: `current()`."""
    global _follower
    _follower = told
    return current()


def _become(rank: LiveRank) -> None:
    """`rank` is this process's live rank from now on (under _lock)."""
    global _current
    _current = rank
    if _follower is not None:
        _follower(rank)


def running() -> LiveRank | None:
    """This process's LiveRank if one has started and not closed (starts none)."""
    rank = _current
    return rank if rank is not None and not rank._closed else None


def start(**identity: Any) -> LiveRank | None:
    """This process's LiveRank with `identity` (Hello fields: the built-in
    trainer's run id, config digest, model, dataset...) in place of what the
    environment says; None when DDTOP_TELEMETRY names no endpoint. A rank that
    has closed (a test's earlier rank in the same process) is replaced."""
    endpoint = telemetry_endpoint()
    if endpoint is None:
        return None
    with _lock:
        if _current is not None and not _current._closed:
            raise RuntimeError("ddtop: this process already reports as rank "
                               f"{_current.hello.rank} of run {_current.hello.run}")
        rank = LiveRank(endpoint, **identity)
        _become(rank)  # the public API forwards to it from now on
    return rank


def _forked_child() -> None:
    if _current is not None:
        _current.forked()


os.register_at_fork(after_in_child=_forked_child)
