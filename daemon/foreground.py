"""A run supervised in this terminal: `ddtrain start --foreground [--headless]`
and `ddtrain watch`. Without --headless the ranks' (or the command's) output is
echoed; with it, the printer's lines from the run's telemetry go to stdout and
ddtrain's own lines to stderr."""

from __future__ import annotations

import argparse
import sys
import time

from ddtop.core.config import TrainConfig
from ddtop.core.contract import UsageError
from ddtop.core.printer import Printer, check_output_arguments
from ddtop.core.rundir import RunPaths, remove_unstarted
from ddtop.core.state import RunState
from ddtop.daemon.supervisor import Supervisor


def supervise(args: argparse.Namespace, config: TrainConfig, paths: RunPaths,
              banner: str) -> tuple[int, Supervisor]:
    """Run the daemon here until the run ends: its exit code, and the supervisor."""
    printer = None
    if args.headless:
        problem = check_output_arguments(args)
        if problem is not None:
            raise UsageError(problem)
        printer = Printer(args.format, args.interval, summary_json=args.summary_json)
    printed: list[RunState] = []  # the daemon's state, once it has polled

    def tick(state: RunState) -> None:
        assert printer is not None
        printed[:] = [state]
        printer.tick(state, time.time())

    print(banner, file=sys.stderr if printer else sys.stdout, flush=True)
    supervisor = (Supervisor(config, paths, out=sys.stderr, echo=False, on_tick=tick)
                  if printer else Supervisor(config, paths))
    try:
        code = supervisor.run()
    except UsageError:
        remove_unstarted(paths)  # refused before it began: no run folder left behind
        raise
    if printer is not None:
        for state in printed:  # over: the time of its last message, not of the clock
            printer.finish(state, state.updated or time.time())
    supervisor.linger()  # --metrics: after the summary, the final state a while longer
    return code, supervisor
