"""How a TrainConfig field appears on the command line: its Flag (what the field's
name, type, default and docstring cannot say), declared beside the field with
`flag(...)`; and --runs-dir for the commands that find an existing run.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ddtop.core.bounds import Range, non_empty
from ddtop.core.contract import RUNS_DIR_ENV

T = TypeVar("T")


def default_runs_dir() -> str:
    """Where runs live when --runs-dir is not given: $DDTOP_RUNS_DIR, else ./runs."""
    return os.environ.get(RUNS_DIR_ENV) or "runs"


def add_runs_dir_argument(parser: argparse.ArgumentParser) -> None:
    """--runs-dir for the commands that find an existing run (status, ddtop, ...)."""
    parser.add_argument("--runs-dir", type=non_empty, default=None, metavar="DIR",
                        help=f"folder of run directories (default ${RUNS_DIR_ENV} or ./runs)")


# The --help section of the built-in trainer's flags: given with a script, one is
# bad input (the script takes its own flags after its name).
BUILT_IN = "built-in trainer (without a script)"


@dataclass(frozen=True)
class Flag:
    """How a config field appears on the command line, beyond what its name, type,
    default and docstring say (see flags.add_config_arguments)."""

    metavar: str | None = None  # N, DIR...; argparse's own is the upper-cased name
    short: str | None = None  # an alias such as -n
    group: str = BUILT_IN  # its section of --help; BUILT_IN: refused with a script
    default_text: str | None = None  # shown as "(default: TEXT)" instead of the default
    enabled: bool = True  # False: the field has no flag
    torchrun: bool = False  # torchrun's option too: its --under_score spelling, PET_<NAME>


def flag(default: T, *, metavar: str | None = None, short: str | None = None,
         group: str = BUILT_IN, default_text: str | None = None, torchrun: bool = False,
         low: int | None = None, high: int | None = None, why: str = "") -> T:
    """A dataclass field's default, with the Flag that the field's type cannot tell
    and, for an integer, the Range of values it takes (`low` to `high`, `why`)."""
    metadata: dict[str, Any] = {"flag": Flag(metavar, short, group, default_text,
                                             torchrun=torchrun)}
    if low is not None and high is not None:
        metadata["range"] = Range(low, high, why)
    elif low is not None or high is not None:
        raise TypeError("flag(): give a range as both low= and high=")
    return field(default=default, metadata=metadata)
