"""Which RankStarter a run gets (daemon/starters.py): by `--launcher` for
`ddtrain start`, by whether it was given a command for `ddtrain watch`."""

from __future__ import annotations

from collections.abc import Callable

from ddtop.core.config import TrainConfig
from ddtop.core.runs import RunPaths
from ddtop.core.state import RunState
from ddtop.daemon.local import LocalRanks
from ddtop.daemon.starters import RankStarter
from ddtop.daemon.torchrun import TorchrunRanks
from ddtop.daemon.watching import WatchedCommand, WatchedRanks

STARTERS: dict[str, Callable[[RunPaths, int, float], RankStarter]] = {
    "local": LocalRanks, "torchrun": TorchrunRanks,
    "watch": WatchedCommand, "watch-elsewhere": WatchedRanks}


def starter_name(config: TrainConfig) -> str:
    if config.watch is not None:
        return "watch" if config.watch else "watch-elsewhere"
    return config.launcher


def make_starter(config: TrainConfig, paths: RunPaths, port: int, started: float,
                 state: RunState) -> RankStarter:
    """The run's starter; a commandless watch ends by what `state` says of its ranks."""
    starter = STARTERS[starter_name(config)](paths, port, started)
    if isinstance(starter, WatchedRanks):
        starter.state = state
    return starter
