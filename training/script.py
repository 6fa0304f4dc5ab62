"""A user's own program as one rank: `ddtrain start train.py -- ARGS` or
`ddtrain start -m pkg.train -- ARGS`.

Each rank runs the program the way `torchrun train.py ARGS` would: torchrun's
environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...),
`sys.argv` as the program expects it, `__name__ == "__main__"`, the directory
`ddtrain start` was typed in as the working directory (and, for a script, the
script's folder first on `sys.path`; for a module, the working directory), and
DDTOP_TELEMETRY and DDTOP_RUN_ID pointing at the run's daemon. The program's
own `init_process_group()` (env://) and `DDP(...)` work unchanged, and are
watched with no line changed (training/autowatch.py): optimizer steps, DDP's
communication, phases; `import ddtop` calls add the loss, phases and scalars.

Started by the daemon's forkserver (torch already imported: fast), by spawn,
or under torchrun (`python -m ddtop.training.script`, reading the run's
config.json from DDTOP_CONFIG). A program that raises is reported like a rank
of the built-in trainer: its traceback in the log and in the error report.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.util
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Imported here so that the forkserver pays for torch once, not every rank.
import torch._dynamo  # noqa: F401

from ddtop.core.config import TrainConfig
from ddtop.core.contract import (
    CONFIG_ENV,
    DAEMON_PID_ENV,
    EXIT_USAGE,
    RUN_ID_ENV,
    UsageError,
    restore_user_umask,
)
from ddtop.core.rundir import RunPaths, read_json
from ddtop.training import api, autowatch, drills, starthook, worker
from ddtop.training.asmain import ours as asmain_frame
from ddtop.training.asmain import run_as_main, run_module
from ddtop.training.rendezvous import install as install_loopback
from ddtop.training.worker import (
    enter_rank,
    leave_rank,
    run_reported,
    torchrun_environment,
)

_WORKER_FILE = worker.__file__


def program_runner(config: TrainConfig) -> Callable[[], object]:
    """Set up this process as the program expects it (working directory, argv,
    path) and return what runs it as __main__."""
    workdir = config.workdir or str(Path.cwd())
    os.chdir(workdir)
    if config.program is not None:
        script = config.program
        sys.argv = [script, *config.program_args]
        sys.path.insert(0, str(Path(script).resolve().parent))
        return lambda: run_as_main(Path(script).absolute())
    module = config.module
    assert module is not None, "a program or a module"
    sys.argv = [module, *config.program_args]  # runpy puts the module's file in argv[0]
    sys.path.insert(0, workdir)
    return lambda: run_module(module)


def run_program(config: TrainConfig, rank: int, error_report: Path | None,
                prepare: Callable[[], object] = lambda: None) -> int:
    """Run the user's program in this process, instrumented (zero-code mode: steps,
    comm timing and phases with no line changed; nothing without DDTOP_TELEMETRY);
    its exit code, which the rank's last telemetry message carries."""
    runner = program_runner(config)
    restore_user_umask()  # the files the program writes are as the user would have them
    autowatch.install(starthook.after_import)  # (FSDP2: once the program imports it)
    def body() -> None:
        prepare()
        drills.install_in_script()  # --inject: after each optimizer step (after autowatch's)
        runner()

    code = run_reported(body, rank, error_report, own_frames=_ours)
    live = api.current()
    if live is not None:
        live.close(code)
    return code


def _ours(filename: str) -> bool:
    """Frames of ddtop and runpy, in front of the program's own in a traceback."""
    return filename in (__file__, _WORKER_FILE) or asmain_frame(filename)


def launched_script(rank: int, world_size: int, config_dict: dict[str, Any], run_dir: str,
                    master_addr: str, master_port: int, launch_time: float,
                    daemon_pid: int, attempt: int = 0) -> None:
    """Entry of a rank started by ddtrain's daemon (in the forked or spawned child)."""
    paths = enter_rank(rank, run_dir, daemon_pid)
    os.environ.update(torchrun_environment(rank, world_size, master_addr, master_port, attempt))
    os.environ[RUN_ID_ENV] = paths.run_id
    config = TrainConfig.from_dict(config_dict)
    # A forked rank ends with os._exit (the forkserver's own atexit handlers are not
    # the program's to run), so the program's shutdown is done here as Python does
    # it: join its threads, then its exit handlers and the standard ones it relies on.
    atexit._clear()
    atexit.register(logging.shutdown)  # flush its log handlers (registered first: runs last)
    # multiprocessing's own exit handler joins the program's child processes.
    atexit.register(multiprocessing.util._exit_function)  # type: ignore[attr-defined]
    # (weakref.finalize's exit callbacks are not run: the forkserver's would run too.)
    code = run_program(config, rank, paths.rank_error(rank),
                       prepare=lambda: install_loopback(rank, world_size, master_addr, master_port))
    threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads, executors
    atexit._run_exitfuncs()
    leave_rank(code)


def main() -> int:
    """`python -m ddtop.training.script`: one rank under torchrun, started by the
    daemon (`--launcher torchrun`): the run's config.json names the program."""
    if not os.environ.get(CONFIG_ENV) or "RANK" not in os.environ:
        print("python -m ddtop.training.script is started by ddtrain's daemon through "
              "torchrun; run your script with: ddtrain start train.py -- ARGS", file=sys.stderr)
        return EXIT_USAGE
    config_path = Path(os.environ[CONFIG_ENV])
    try:
        config = TrainConfig.from_dict(read_json(config_path))
    except (OSError, ValueError, UsageError) as e:
        print(f"ddtrain: error: cannot read {config_path}: {e}", file=sys.stderr)
        return EXIT_USAGE
    rank = int(os.environ["RANK"])
    paths = enter_rank(rank, str(config_path.parent), int(os.environ[DAEMON_PID_ENV]))
    os.environ[RUN_ID_ENV] = RunPaths(config_path.parent).run_id
    return run_program(config, rank, paths.rank_error(rank))


if __name__ == "__main__":
    sys.exit(main())
