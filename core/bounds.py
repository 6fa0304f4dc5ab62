"""The values `ddtrain start`'s flags take, checked before anything starts.

Every integer field of TrainConfig carries a Range (`flag(..., low=, high=)`):
`flags.add_config_arguments` refuses an integer field without one, `check_ranges`
checks a config against them (typed flags and a config.json alike), and --help
says each upper limit. A string flag given an empty value is refused by the
parser (`non_empty`): an empty --runs-dir or --bind would otherwise mean "the
default" without a word. docs/cli.md#limits lists the ranges and their reasons.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Upper bounds of what one machine can be asked to run: the ranks it starts (a
# single-node job's world size, a node's --nproc-per-node). Both launchers start
# every such rank here (local forks them; torchrun runs them under its agent),
# each rank a process with torch loaded, and gloo connects every rank to every
# other: N - 1 sockets a rank, against the usual limit of 1024 open files.
MAX_MACHINE_RANKS = 1024
# A multi-node job (--nnodes x --nproc-per-node ranks): the ranks one hub folds
# (RunState holds at most this many; 2,048 nodes of 8 GPUs are a quarter of it),
# and so every rank number a message, run.json or a reply of the job may hold.
MAX_JOB_RANKS = 1 << 16
MAX_NNODES = 8192  # machines of one multi-node job: 8 ranks each fill MAX_JOB_RANKS
JOB_RANKS_WHY = "the ranks one job's hub follows"
MAX_WORKERS = 1024  # data-loader processes, all ranks together
MAX_THREADS_PER_RANK = 256
# Every rank holds the whole synthetic set in memory: 3 KB a sample.
MAX_SYNTHETIC_SAMPLES = 1_000_000
MAX_EPOCHS = 1_000_000
# The global batch: no training set the built-in trainer loads is larger.
MAX_BATCH_SIZE = MAX_SYNTHETIC_SAMPLES
# Seeds as numpy takes them. The trainer derives further seeds from this one
# (S x 1000003 + 2 for the synthetic set, S x 7919 + ... for the loader), and torch
# refuses a seed beyond 64 bits: 2^32 - 1 keeps every one of them far inside.
MAX_SEED = 2**32 - 1
# Every K steps: a billion steps is more than any run takes (11 days at 1000 steps/s).
MAX_EVERY_STEPS = 1_000_000_000
MAX_KEEP_CHECKPOINTS = 10_000  # 0 keeps all of them
MAX_STEP_DELAY_S = 3600.0  # --step-delay: an hour between steps is a paused run, not a slow one
# --metrics-linger: two scrapes at Prometheus' default 15 s interval by default; an hour
# at most (a daemon kept for its last scrapes, not a server).
METRICS_LINGER_S = 30.0
MAX_METRICS_LINGER_S = 3600.0
MAX_RESTARTS = 1000  # each restarts every rank; a run failing that often will not finish
MAX_PORT = 65535
# A run id names a folder, and the sockets inside it: short enough for any file system.
MAX_RUN_ID_CHARS = 100
# The longest file name (one path component) Linux file systems take, in bytes.
NAME_MAX = 255
# A number of more digits than this is shown by its head and its length.
SHOWN_DIGITS = 20


@dataclass(frozen=True)
class Range:
    """The values an integer field takes, `low` to `high`: checked by `check_ranges`
    (the error names the flag, the range and `why`), the upper limit said in --help."""

    low: int
    high: int
    why: str = ""  # the reason for `high`, in the error

    def problem(self, flag: str, value: int) -> str | None:
        if self.low <= value <= self.high:
            return None
        side = f"at least {self.low}" if value < self.low else f"at most {self.high}"
        why = f" ({self.why})" if self.why and value > self.high else ""
        return f"{flag} must be {side} (got {shown(value)}): give {self.low} to {self.high}{why}"


def shown(value: int) -> str:
    """An integer as an error shows it: whole, unless it is absurdly long."""
    text = str(value)
    digits = len(text.lstrip("-"))
    return text if digits <= SHOWN_DIGITS else f"{text[:8]}..., {digits} digits"


def field_range(f: dataclasses.Field[Any]) -> Range | None:
    bounds = f.metadata.get("range")
    return bounds if isinstance(bounds, Range) else None


def check_ranges(config: Any, instead: Mapping[str, Range | None] | None = None) -> str | None:
    """The first integer field of the dataclass `config` out of its Range, as a
    one-line problem naming the flag, or None. `instead`: a field's range where
    it is not its own (None: that field not checked here)."""
    for f in dataclasses.fields(config):
        bounds = (instead or {}).get(f.name, field_range(f))
        if bounds is not None:
            value = getattr(config, f.name)
            if value is None:  # (an optional one not given)
                continue
            problem = bounds.problem("--" + f.name.replace("_", "-"), value)
            if problem is not None:
                return problem
    return None


def job_size_problem(nnodes: int, per_node: int) -> str | None:
    """A multi-node job of more ranks than MAX_JOB_RANKS, as a one-line problem."""
    ranks = nnodes * per_node
    if ranks <= MAX_JOB_RANKS:
        return None
    return (f"--nnodes x --nproc-per-node must be at most {MAX_JOB_RANKS} ranks (got "
            f"{shown(nnodes)} x {shown(per_node)} = {shown(ranks)}): fewer nodes or fewer "
            f"ranks per node ({JOB_RANKS_WHY})")


def non_empty(text: str) -> str:
    """argparse's type for a string flag: an empty value is refused, not taken for
    the default (the parser names the flag)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty value: give one, or leave the flag out "
                                         "for its default")
    return text
