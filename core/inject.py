"""Fault drills: the one grammar of `ddtrain start --inject SPEC`.

    SPEC    = RANK ":" ACTION [ "@" WHEN ]
    ACTION  = kill | stop | hang | raise | segfault | exit=CODE
            | slow=FACTORx | slowdata=MSms | cpuhog | stall-data=SECONDSs
            | desync | skip | p2p-hang | oom | take-port
    WHEN    = step=N | epoch=E

e.g. `1:kill@step=50`, `2:hang@step=80`, `1:exit=3@epoch=1`, `1:slow=1.5x`,
`0:stall-data=2s@step=30`. A drill fires once the rank's global optimizer
step N is done (steps count from 1, across epochs, as `ddtrain status` shows
them), or once epoch E (counted from 1) is done, i.e. after its last step;
`slow` acts on every step from there on (from the first step without WHEN),
every other action once, and each needs WHEN; but `0:take-port` acts at the
start, on rank 0 alone, without WHEN.

`ddtrain start` parses and checks the specs before anything starts (bad input:
one line naming the problem and the fix) and hands them to the daemon and the
ranks in DDTOP_FAULT, comma-separated in the same grammar; the rank parses them
again with this module (training/drills.py acts on them). DDTOP_FAULT is only
that transport: `ddtrain start` sets it from --inject alone and removes one it
inherited (daemon/cli.py arm_drills). Pure: no torch, no processes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ddtop.core.contract import FAULT_ENV, UsageError

FLAG = "--inject"
# What each action does, for --help and errors (docs/cli.md#failure-drills says more).
ACTIONS = {
    "kill": "SIGKILL itself",
    "stop": "SIGSTOP itself (frozen: silent, the others wait)",
    "hang": "block before its next collective, for good (the others wait inside it)",
    "raise": "raise an exception (a traceback)",
    "segfault": "crash with a segmentation fault (SIGSEGV)",
    "exit": "exit=CODE: exit at once with CODE (0-255; 0: a rank that leaves early)",
    "slow": "slow=FACTORx: take FACTOR times its normal step time (e.g. 1.5x)",
    "slowdata": ("slowdata=MSms: from then on each of its data loadings takes MS milliseconds "
                 "longer (e.g. 40ms): a slow data loader"),
    "cpuhog": ("from then on a busy process shares its CPU: the rank and the hog are pinned "
               "to one core (a noisy neighbour)"),
    "stall-data": "stall-data=SECONDSs: its data loading stalls that long, once (e.g. 2s)",
    "desync": ("call a collective of its own once (an all_gather on the world group) where "
               "the others go on to their next one"),
    "skip": ("skip its next step's gradient all-reduce (DDP's no_sync, --strategy ddp): "
             "the backend pairs the others' next ones with its own, one apart"),
    "p2p-hang": ("wait in a recv from the next rank, which never sends (the others wait for "
                 "it in their next collective)"),
    "oom": ("join a memory cgroup of its own (a 256 MiB limit) and allocate until the "
            "kernel's OOM killer kills it (where the cgroup filesystem is writable: root; "
            "else it says so and trains on)"),
    "take-port": ("rank 0 only, no WHEN: another process binds the rendezvous port the daemon "
                  "picked before rank 0 does (the daemon starts the ranks again on another)"),
}
ONE_OF = ("kill, stop, hang, raise, segfault, exit=CODE, slow=FACTORx, slowdata=MSms, "
          "cpuhog, stall-data=SECONDSs, desync, skip, p2p-hang, oom or take-port")
AT_START = ("take-port",)  # actions at the start, before any step: no WHEN
REPEATS = ("slow", "slowdata")  # every step from the trigger on
FROM_FIRST = ("slow", "slowdata", "cpuhog")  # without WHEN: from the first step
# Actions on the built-in trainer's DDP model: not in a user's script, and only with
# --strategy ddp.
DDP_ONLY = ("skip",)
SEPARATOR = ","
MAX_EXIT_CODE = 255
MAX_SLOW_FACTOR = 1000.0
MAX_STALL_S = 86400.0
MAX_SLOWDATA_MS = 60000.0

_SPEC = re.compile(r"(?P<rank>[^:@]*):(?P<action>[^@=]*)(?:=(?P<value>[^@]*))?"
                   r"(?:@(?P<when>.*))?")
_WHEN = re.compile(r"(?P<unit>step|epoch)=(?P<count>.*)")
_OLD = re.compile(r"(?P<rank>\d+):(?P<step>\d+)(?::(?P<action>.*))?")
_OLD_ACTIONS = {"": "kill", "SIGKILL": "kill", "SIGSTOP": "stop", "SIGSEGV": "segfault",
                "raise": "raise"}


@dataclass(frozen=True)
class Drill:
    """One parsed SPEC."""

    rank: int
    action: str  # a key of ACTIONS
    value: float = 0.0  # exit: the code; slow: the factor; stall-data: seconds
    step: int | None = None  # after this global step (counted from 1) ...
    epoch: int | None = None  # ... or after the last step of this epoch (from 1)

    @property
    def repeats(self) -> bool:
        """True for `slow` and `slowdata`: every step from the trigger on, not once
        (`cpuhog` acts once, and its hog stays)."""
        return self.action in REPEATS

    def first_step(self, steps_per_epoch: int) -> int | None:
        """The global step after which it fires (from which on, for slow); None
        while an epoch trigger's steps per epoch are unknown (0), and for one that
        acts at the start (AT_START)."""
        if self.action in AT_START:
            return None
        if self.epoch is not None:
            return self.epoch * steps_per_epoch if steps_per_epoch > 0 else None
        return self.step if self.step is not None else 1

    def spec(self) -> str:
        """The drill in the grammar, as parsed: '1:slow=1.5x@step=10'."""
        action = self.action
        if action == "exit":
            action += f"={int(self.value)}"
        elif action == "slow":
            action += f"={_spelled(self.value)}x"
        elif action == "stall-data":
            action += f"={_spelled(self.value)}s"
        elif action == "slowdata":
            action += f"={_spelled(self.value)}ms"
        when = (f"@step={self.step}" if self.step is not None
                else f"@epoch={self.epoch}" if self.epoch is not None else "")
        return f"{self.rank}:{action}{when}"


def _spelled(value: float) -> str:
    """Short where that is exact ('1.5', '2'), else every digit: a spec carried to
    the ranks parses back to the value that was checked."""
    short = f"{value:g}"
    return short if float(short) == value else repr(value)


def parse(text: str, source: str = FLAG) -> Drill:
    """One SPEC; UsageError naming the problem and the fix (`source` says where the
    spec came from: --inject, or DDTOP_FAULT as a rank reads it)."""
    spec = text.strip()

    def bad(problem: str) -> UsageError:
        return UsageError(f"{source} {spec!r}: {problem}")

    old = _OLD.fullmatch(spec)
    if old is not None:  # RANK:STEP[:ACTION], the form before --inject
        was = old["action"] or ""
        action = (f"stall-data={was[5:]}s" if was.startswith("sleep") else
                  "slow=1.5x" if was.startswith("slow") else _OLD_ACTIONS.get(was, "kill"))
        raise bad(f"write it as RANK:ACTION@step=N, e.g. "
                  f"{old['rank']}:{action}@step={old['step']} (ACTION: {ONE_OF})")
    match = _SPEC.fullmatch(spec)
    if match is None:
        raise bad(f"write it as RANK:ACTION[@step=N|@epoch=E], e.g. 1:kill@step=50 "
                  f"(ACTION: {ONE_OF})")
    rank = _integer(match["rank"])
    if rank is None:
        raise bad(f"the rank {match['rank']!r} must be a whole number from 0, e.g. "
                  f"1:{match['action']}")
    action = match["action"]
    if action not in ACTIONS:
        raise bad(f"unknown action {action!r}: use {ONE_OF}")
    value = _value(action, match["value"], bad)
    step = epoch = None
    when = match["when"]
    if when is not None:
        found = _WHEN.fullmatch(when)
        count = _integer(found["count"]) if found is not None else None
        if found is None or count is None or count < 1:
            raise bad(f"'@{when}' must be @step=N or @epoch=E, with N or E a whole number "
                      "from 1 (steps and epochs count from 1)")
        if found["unit"] == "step":
            step = count
        else:
            epoch = count
    if action in AT_START:
        if when is not None or rank != 0:
            raise bad(f"{action} acts on rank 0 at the start: write it as 0:{action}")
    elif when is None and action not in FROM_FIRST:
        raise bad(f"say when: add @step=N (after global step N) or @epoch=E "
                  f"(after epoch E), e.g. {rank}:{match['action']}"
                  f"{'=' + match['value'] if match['value'] is not None else ''}@step=50")
    return Drill(rank, action, value, step, epoch)


def _value(action: str, text: str | None, bad: Callable[[str], UsageError]) -> float:
    """The number after '=' that `action` takes (none for the others)."""
    if action in ("exit", "slow", "slowdata", "stall-data"):
        if text is None:
            example = {"exit": "exit=3", "slow": "slow=1.5x", "slowdata": "slowdata=40ms",
                       "stall-data": "stall-data=2s"}
            raise bad(f"{action} needs a value, e.g. {example[action]}")
    elif text is not None:
        raise bad(f"{action} takes no value: drop '={text}'")
    else:
        return 0.0
    if action == "exit":
        code = _integer(text)
        if code is None or not 0 <= code <= MAX_EXIT_CODE:
            raise bad(f"exit={text}: the code must be a whole number from 0 to "
                      f"{MAX_EXIT_CODE} (0: a clean exit, while the others train on), e.g. exit=3")
        return float(code)
    if action == "slow":
        factor = _number(text.removesuffix("x"))
        if factor is None or not 1.0 < factor <= MAX_SLOW_FACTOR:
            raise bad(f"slow={text}: the factor must be a number above 1 and at most "
                      f"{MAX_SLOW_FACTOR:g}, e.g. slow=1.5x (1.5 times its normal step time)")
        return factor
    if action == "slowdata":
        ms = _number(text.removesuffix("ms"))
        if ms is None or not 0.0 < ms <= MAX_SLOWDATA_MS:
            raise bad(f"slowdata={text}: give milliseconds above 0 and at most "
                      f"{MAX_SLOWDATA_MS:g}, e.g. slowdata=40ms")
        return ms
    seconds = _number(text.removesuffix("s"))
    if seconds is None or not 0.0 < seconds <= MAX_STALL_S:
        raise bad(f"stall-data={text}: give seconds above 0 and at most {MAX_STALL_S:g}, "
                  "e.g. stall-data=2s")
    return seconds


def _integer(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse_all(specs: Iterable[str], source: str = FLAG) -> list[Drill]:
    """Every SPEC, in order (the first bad one raises)."""
    return [parse(spec, source) for spec in specs]


def parse_environ(value: str) -> list[Drill]:
    """DDTOP_FAULT's value: specs separated by commas."""
    return parse_all((part for part in value.split(SEPARATOR) if part.strip()), FAULT_ENV)


def check_ranks(drills: Iterable[Drill], world_size: int, source: str = FLAG) -> None:
    """UsageError for a drill aimed at a rank the run does not have."""
    for drill in drills:
        if drill.rank >= world_size:
            ranks = "rank 0" if world_size == 1 else f"ranks 0-{world_size - 1}"
            raise UsageError(f"{source} {drill.spec()!r}: there is no rank {drill.rank}: "
                             f"--world-size {world_size} has {ranks}")


def check_epochs(drills: Iterable[Drill], epochs: int, source: str = FLAG) -> None:
    """UsageError for a drill at an epoch the built-in trainer never ends."""
    for drill in drills:
        if drill.epoch is not None and drill.epoch > epochs:
            raise UsageError(f"{source} {drill.spec()!r}: the run trains --epochs {epochs}, so "
                             f"epoch {drill.epoch} never ends: use @epoch=1 to @epoch={epochs}, "
                             "or more --epochs")


def check_ddp(drills: Iterable[Drill], strategy: str | None, source: str = FLAG) -> None:
    """UsageError for a drill of DDP's gradient all-reduce (DDP_ONLY) in a run
    without the built-in trainer's DDP model (`strategy` None: a user's script)."""
    for drill in drills:
        if drill.action not in DDP_ONLY or strategy == "ddp":
            continue
        where = ("in a user's script ddtrain cannot reach its model: make the rank skip "
                 "a collective in the script itself" if strategy is None
                 else f"--strategy {strategy} has none: use --strategy ddp (the default)")
        raise UsageError(f"{source} {drill.spec()!r}: {drill.action} drills the built-in "
                         f"trainer's DDP gradient all-reduce; {where}")


def encode(drills: Iterable[Drill]) -> str:
    """The value of DDTOP_FAULT that carries `drills` to the ranks."""
    return SEPARATOR.join(drill.spec() for drill in drills)


def for_rank(drills: Iterable[Drill], rank: int) -> list[Drill]:
    return [drill for drill in drills if drill.rank == rank]
