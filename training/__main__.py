"""`python -m ddtop.training`: one rank, configured by torchrun's variables
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and `ddtrain start`'s
training flags. See the package docstring for launch commands."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from ddtop.core.config import (
    TrainConfig,
)
from ddtop.core.contract import CONFIG_ENV, DAEMON_PID_ENV, EXIT_USAGE, UsageError
from ddtop.core.flags import (
    OneLineParser,
    add_train_arguments,
    explicit_overrides,
)
from ddtop.core.rundir import RunPaths, read_json
from ddtop.training import stopping
from ddtop.training.distributed import RankEnv
from ddtop.training.worker import (
    die_with_daemon,
    dump_stacks_on_signal,
    rank_main,
    redirect_output,
)


def main(argv: list[str] | None = None) -> int:
    stopping.install()  # SIGUSR1: stop gracefully after a step all ranks agree on
    parser = OneLineParser(
        prog="python -m ddtop.training",
        description="Train one rank; run under torchrun (e.g. torchrun --standalone "
        "--nproc-per-node 2 -m ddtop.training --epochs 1).",
    )
    add_train_arguments(parser)
    overrides = explicit_overrides(parser.parse_args(argv))
    error_report = None
    try:
        env = RankEnv.from_environ()
        if os.environ.get(CONFIG_ENV):  # started by ddtrain's daemon through torchrun
            error_report = daemon_started_rank(env)
            overrides = {**read_json(Path(os.environ[CONFIG_ENV])), **overrides}
        if overrides.get("world_size", env.world_size) != env.world_size:
            raise UsageError(f"--world-size {overrides['world_size']} disagrees with torchrun's "
                             f"WORLD_SIZE {env.world_size}: leave --world-size out")
        config = TrainConfig.from_dict({**overrides, "world_size": env.world_size}).validate()
    except UsageError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return rank_main(config, env, error_report)


def daemon_started_rank(env: RankEnv) -> Path:
    """Under ddtrain's daemon: exit with it, ignore Ctrl-C (the daemon decides),
    write output and error report into the run directory. Returns the report's path."""
    die_with_daemon(int(os.environ[DAEMON_PID_ENV]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    paths = RunPaths(Path(os.environ[CONFIG_ENV]).parent)
    redirect_output(paths.rank_log(env.rank))
    dump_stacks_on_signal(paths.rank_stacks(env.rank))
    return paths.rank_error(env.rank)


if __name__ == "__main__":
    sys.exit(main())
