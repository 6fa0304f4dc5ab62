"""`python -m ddtop.training`: one rank, configured by torchrun's variables
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and `ddtrain start`'s
training flags. See the package docstring for launch commands."""

from __future__ import annotations

import sys

from ddtop.daemon.config import (
    EXIT_USAGE,
    OneLineParser,
    TrainConfig,
    UsageError,
    add_train_arguments,
    explicit_overrides,
)
from ddtop.training import stopping
from ddtop.training.distributed import RankEnv
from ddtop.training.worker import rank_main


def main(argv: list[str] | None = None) -> int:
    stopping.install()  # SIGUSR1: stop gracefully after a step all ranks agree on
    parser = OneLineParser(
        prog="python -m ddtop.training",
        description="Train one rank; run under torchrun (e.g. torchrun --standalone "
        "--nproc-per-node 2 -m ddtop.training --epochs 1).",
    )
    add_train_arguments(parser)
    overrides = explicit_overrides(parser.parse_args(argv))
    try:
        env = RankEnv.from_environ()
        if overrides.get("world_size", env.world_size) != env.world_size:
            raise UsageError(f"--world-size {overrides['world_size']} disagrees with torchrun's "
                             f"WORLD_SIZE {env.world_size}: leave --world-size out")
        config = TrainConfig(**{**overrides, "world_size": env.world_size}).validate()
    except UsageError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return rank_main(config, env, error_report=None)


if __name__ == "__main__":
    sys.exit(main())
