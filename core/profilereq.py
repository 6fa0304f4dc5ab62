"""A request to profile ranks, as a file of the run: what `ddtrain profile` and
the dashboard's `P` write, and what each rank's sender thread reads
(training/profiling.py).

    logs/profile.json    {"id": "20261207-104512", "ranks": [0, 3] or "all",
                          "start": 120, "steps": 5}

The ranks asked begin after global step `start` and profile `steps` steps;
each writes `profiles/<id>/rank-K.trace.json.gz` and, last,
`profiles/<id>/rank-K.top.json`. The file is written whole (a temporary file
renamed), the run owner's alone as the run folder is; what a rank reads of it
is checked against these types and bounds, and a bad one is skipped. Pure
standard library and msgspec: no torch.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Annotated, Literal

import msgspec

REQUEST = "profile.json"
PROFILES = "profiles"
MAX_STEPS = 1000
# The ranks begin after the fastest asked one's step now plus LEAD_S of steps (at least
# LEAD_STEPS): each rank's sender thread reads the request within 0.1 s, and the step
# the daemon's state gave may be that old too.
LEAD_S = 1.0
LEAD_STEPS = 3
MAX_REQUEST_BYTES = 64 << 10
Id = Annotated[str, msgspec.Meta(min_length=1, max_length=32, pattern=r"^[0-9-]+$")]


class Request(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: Id
    ranks: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]],
                     msgspec.Meta(max_length=65536)] | Literal["all"]
    start: Annotated[int, msgspec.Meta(ge=0)]
    steps: Annotated[int, msgspec.Meta(ge=1, le=MAX_STEPS)]

    def covers(self, rank: int) -> bool:
        return self.ranks == "all" or rank in self.ranks


def start_after(steps_now: list[int], step_s: float) -> int:
    """The global step after which ranks now at `steps_now`, `step_s` a step at the
    slowest, all begin: every one of them is still before it."""
    lead = max(LEAD_STEPS, math.ceil(LEAD_S / step_s) if step_s > 0 else LEAD_STEPS)
    return max(steps_now, default=0) + lead


def request_path(logs: Path) -> Path:
    return logs / REQUEST


def profiles_path(run_root: Path) -> Path:
    return run_root / PROFILES


def read(path: Path) -> Request | None:
    """The request in `path`; None where there is none, or it is not one."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_REQUEST_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_REQUEST_BYTES:
        return None
    try:
        return msgspec.json.decode(data, type=Request)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def write(logs: Path, ranks: list[int] | Literal["all"], start: int, steps: int,
          now: float | None = None) -> Request:
    """A new request, written whole into `logs`: its id is the time (unique within
    the run's profiles). OSError: it cannot be written."""
    now = time.time() if now is None else now
    name = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    root = profiles_path(logs.parent)
    root.mkdir(mode=0o700, exist_ok=True)
    for number in range(1000):  # (the id taken by making its folder: one writer wins it)
        taken = f"{name}-{number}" if number else name
        try:
            (root / taken).mkdir(mode=0o700)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"{root}: 1000 profiles asked in one second")
    request = Request(id=taken, ranks=ranks, start=start, steps=steps)
    tmp = request_path(logs).with_name(f".{REQUEST}.{os.getpid()}.{number}")
    tmp.write_bytes(msgspec.json.encode(request))
    tmp.replace(request_path(logs))
    return request
