"""The start-up hook: zero-code watching in a rank that ddtrain did not start
(torchrun, srun, accelerate launch, mpirun, a PyTorchJob, Lightning's own ranks).

The package installs `ddtop-starthook.pth` at the top of site-packages, and
Python's `site` runs its one line at every interpreter start:

    import os; os.environ.get('DDTOP_TELEMETRY', 'off') not in ('', 'off') and ...arm()

Without the watch environment that is one dictionary look-up (`site` has
imported `os` already) and nothing of ddtop is loaded. With it, `arm()` waits
for the process's own `import torch` (a meta path finder that finds nothing
itself; at once if torch is imported already) and then wraps
`torch.distributed.init_process_group` where a program reaches it
(torch.distributed, distributed_c10d, and device_mesh, which holds it by
name), and the collective functions (collectives.py: they call through until
the process is a rank), before the program can take any of them by name.
Once this process has a default process group it is a rank: its LiveRank
starts with the rank and world size the group reports (local rank from
LOCAL_RANK, else the rank) and autowatch.install() instruments it as
`ddtrain start train.py` does: optimizer steps, DDP watched as it is built,
phases, every collective it enters. So Lightning's first rank, the user's own
`python train.py` with no RANK at start, is watched too. A process that never
initialises a group (torchrun's agent, a data loader worker) sends nothing.

A process that reports already (a script's `ddtop.init()` first, a user's
script under `ddtrain start`) keeps its rank and gets the instrumentation; the
built-in trainer, which starts its rank itself after its group, has the hook
stand aside (`stand_aside`); DDTOP_ZERO_CODE=off turns it off for a script
that wants the API alone. `sys.exit(N)` in the main thread is told to the
rank, whose bye says N. Nothing here raises into the program: a failure is one
line on stderr, and the program runs on unwatched.

Until torch is imported, this module has imported nothing but the standard
library's lightest modules.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType

WATCHED = "torch"
# Where a program reaches init_process_group: each that holds torch's is wrapped.
HOLDERS = ("torch.distributed", "torch.distributed.distributed_c10d",
           "torch.distributed.device_mesh")

_armed = False
_wrapped = False
_aside = False
_system_exit = sys.exit


class AfterImport:
    """A meta path finder that finds nothing itself: when module `name` is
    imported, the finder that finds it loads it as usual, and `then()` is called
    once it has executed without error (after which this one leaves
    sys.meta_path). The module keeps its own loader."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if name != self.name:
            return None
        spec = self._find(name, path, target)
        loader = spec.loader if spec is not None else None
        execute = getattr(loader, "exec_module", None)
        if loader is None or execute is None:
            return spec

        def exec_module(module: ModuleType) -> None:
            try:
                execute(module)
            finally:
                with contextlib.suppress(AttributeError):
                    del loader.exec_module  # the loader's own method again
            self._done()

        # On this loader, for this load only (a loader that takes no attribute of
        # its own: the module is imported as usual, and nothing is watched).
        with contextlib.suppress(AttributeError):
            loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec

    def _find(self, name: str, path: Sequence[str] | None,
              target: ModuleType | None) -> ModuleSpec | None:
        """The spec the other finders give, in their order (as the import would)."""
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec: ModuleSpec | None = find(name, path, target)
            if spec is not None:
                return spec
        return None

    def _done(self) -> None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        self.then()


def arm() -> None:
    """Watch this process from its first process group on (idempotent; never raises)."""
    global _armed
    if _armed:
        return
    _armed = True
    if WATCHED in sys.modules:
        _torch_imported()
    else:
        sys.meta_path.insert(0, AfterImport(WATCHED, _torch_imported))


def after_import(name: str, then: Callable[[], None]) -> None:
    """`then()` once module `name` has been imported: at once if it is, else
    right after its import (autowatch: FSDP2, which costs a script that never
    imports it nothing)."""
    if name in sys.modules:
        then()
    else:
        sys.meta_path.insert(0, AfterImport(name, then))


def stand_aside() -> None:
    """This process starts its LiveRank itself, after its process group (the
    built-in trainer): the hook starts none and installs nothing."""
    global _aside
    _aside = True


def _torch_imported() -> None:
    """torch has been imported: wrap init_process_group where programs reach it."""
    global _wrapped
    if _wrapped:
        return
    _wrapped = True
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return
        original = dist.distributed_c10d.init_process_group
        wrapped = _wrap(original)
        for name in HOLDERS:
            module = sys.modules.get(name)
            if module is not None and getattr(module, "init_process_group", None) is original:
                setattr(module, "init_process_group", wrapped)  # noqa: B010 - the point of the hook
        from ddtop.core.contract import ZERO_CODE_ENV

        if os.environ.get(ZERO_CODE_ENV) != "off":
            # Before the program takes any of them by name: marked once it is a rank.
            from ddtop.training import collectives

            collectives.wrap()
    except Exception as e:  # noqa: BLE001 - the program must run on, unwatched
        _say(f"zero-code watching is off in this process: {type(e).__name__}: {e}")


def _wrap(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> None:
        original(*args, **kwargs)
        _became_rank()

    return init_process_group


def _became_rank() -> None:
    """This process has a default process group: report as that rank, instrumented."""
    if _aside:
        return
    try:
        from ddtop.core.contract import ZERO_CODE_ENV

        if os.environ.get(ZERO_CODE_ENV) == "off":
            return
        import torch.distributed as dist

        from ddtop.training import api, autowatch

        if api.running() is None:
            rank = dist.get_rank()
            api.start(rank=rank, local_rank=_local_rank(rank),
                      world_size=dist.get_world_size())
            _dump_stacks_on_signal(rank)
        if autowatch.install(after_import):
            _watch_exit()
    except Exception as e:  # noqa: BLE001 - the program must run on, unwatched
        _say(f"this rank is not watched: {type(e).__name__}: {e}")


_stacks_file: Any = None  # open for the life of the rank: faulthandler writes to its fd


def _dump_stacks_on_signal(rank: int) -> None:
    """`ddtrain stacks` of a watched run: every thread's stack, from faulthandler's
    C handler, to logs/rank-K.stacks in the folder `ddtrain watch` names (where
    it can be written: a rank on another machine may not see it)."""
    global _stacks_file
    import faulthandler
    from pathlib import Path

    from ddtop.core.contract import STACKS_DIR_ENV, STACKS_SIGNAL

    folder = os.environ.get(STACKS_DIR_ENV)
    if not folder or not Path(folder).is_dir():
        return
    path = Path(folder) / f"rank-{rank}.stacks"
    try:
        _stacks_file = path.open("a")
    except OSError as e:
        _say(f"stacks will not be available for this rank: {e}")
        return
    faulthandler.register(STACKS_SIGNAL, file=_stacks_file, all_threads=True, chain=False)
    from ddtop.training import flightrec, profiling

    flightrec.watch(path)  # its Flight Recorder dumped beside them, by the sender thread
    profiling.watch(path)  # and profile requests looked for beside them


def _local_rank(rank: int) -> int:
    """LOCAL_RANK (torchrun, Lightning and accelerate set it), else the rank."""
    try:
        return int(os.environ["LOCAL_RANK"])
    except (KeyError, ValueError):
        return rank


def exit_code(status: object) -> int:
    """The exit code Python gives SystemExit(status): None 0, a number itself, else 1."""
    if status is None:
        return 0
    return status if isinstance(status, int) else 1


def exiting(status: object) -> None:
    """The program leaves with SystemExit(status): its rank's bye says that code."""
    if "ddtop.training.api" not in sys.modules:
        return  # no rank in this process
    from ddtop.training import api

    rank = api.running()
    if rank is not None:
        rank.exits_with(exit_code(status))


def _watch_exit() -> None:
    """From now on sys.exit tells the rank its code first (an exit code cannot be
    read at exit, where the rank says goodbye)."""
    global _system_exit
    if sys.exit is not _exit:
        _system_exit = sys.exit
        sys.exit = _exit


def _exit(status: str | int | None = None, /) -> NoReturn:
    """sys.exit, watched: in the main thread (elsewhere it ends only a thread)."""
    import threading

    if threading.current_thread() is threading.main_thread():
        try:
            exiting(status)
        except Exception as e:  # noqa: BLE001 - the program exits as it asked, whatever
            _say(f"exit code not told: {type(e).__name__}: {e}")
    _system_exit(status)


def _say(message: str) -> None:
    with contextlib.suppress(OSError, ValueError):  # stderr closed: nothing to say it on
        print(f"ddtop: {message}", file=sys.stderr, flush=True)
