"""`ddtrain stacks`: every rank's Python stacks, all threads, now (and their
native stacks, where py-spy is installed: daemon/nativestacks.py). And
`ddtrain evidence`: the daemon asked to gather the evidence now (daemon/evidence.py),
the folder it wrote printed.

Each rank the daemon starts registers the standard library's `faulthandler`
on STACKS_SIGNAL (SIGUSR2), writing to `logs/rank-<k>.stacks`. faulthandler
dumps from its C signal handler, so a rank blocked inside a collective (or
any C call) still answers; nothing else in the rank stops. The daemon sends
the signal (to the processes it started, checked by start time: never a pid a
message names) when asked with the `stacks` request; this command asks, waits
for the dumps to be written (the native one too: its block, or the line saying
why there is none), and prints them. They stay in the run directory.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from ddtop.core import control, protocol
from ddtop.core.contract import EXIT_FAILED, EXIT_OK, STACKS_SIGNAL, UsageError
from ddtop.core.flagspec import default_runs_dir
from ddtop.core.hangs import rank_list
from ddtop.core.processes import ProcessId, catches, send_signal
from ddtop.core.rundir import locate_run
from ddtop.core.runinfo import RunInfo
from ddtop.core.text import main_thread_first
from ddtop.daemon import nativestacks


def signal_stacks(numbered: dict[int, ProcessId], asked: list[int | None],
                  stacks_file: Callable[[int], Path],
                  first: Iterable[int] = ()) -> list[threading.Thread]:
    """The daemon's part: the stacks signal to the ranks `asked` for (None: all),
    among the processes it started (or verified: `numbered`, checked by start
    time), and only to one that catches it: a rank ddtop does not instrument
    (one a watched command started that reports by itself) would die of it.
    Then their native stacks, read by py-spy into the same files
    (daemon/nativestacks.py; the ranks `first` first): the threads doing it, to
    wait for."""
    for rank, process in numbered.items():
        if (None in asked or rank in asked) and catches(process.pid, STACKS_SIGNAL):
            send_signal(process, STACKS_SIGNAL)
    return nativestacks.dump(numbered, asked, stacks_file, first)


WAIT_S = 5.0  # for every asked rank's Python dump to appear
# For the evidence asked for: the daemon's next pass, the bundle's wait for the stacks
# (evidence.budget: 5 s at most) and the files.
EVIDENCE_WAIT_S = 10.0
SETTLE_S = 0.3  # a dump is complete once its file has not grown for this long
PYTHON_DUMP = "(most recent call first)"  # in each thread's header of faulthandler's dump


def cmd_stacks(args: argparse.Namespace) -> int:
    paths = locate_run(args.runs_dir or default_runs_dir(), args.run)
    info = RunInfo.load(paths)
    if args.rank is not None and not 0 <= args.rank < max(info.world_size, 1):
        raise UsageError(f"--rank {args.rank}: run {paths.run_id} has "
                         f"{rank_list(list(range(max(info.world_size, 1))))}")
    ranks = [args.rank] if args.rank is not None else list(range(info.world_size))
    if not info.live or info.control is None:
        raise UsageError(f"run {paths.run_id} is not running ({info.status}): the stacks "
                         f"saved while it ran are in {paths.logs}/rank-K.stacks")
    files = {k: paths.rank_stacks(k) for k in ranks}
    before = {k: file_size(f) for k, f in files.items()}
    try:
        reply = control.request(info.control, protocol.Stacks(rank=args.rank),
                                control.STOP_REQUEST_TIMEOUT_S, keys=info.keys)
    except control.Unreachable as e:
        raise UsageError(f"the daemon of run {paths.run_id} does not answer: {e}") from None
    if not reply.ok:
        raise UsageError(f"the daemon refused: {reply.error}")
    dumps = _wait_for_dumps(files, before)
    answered = False
    for k in ranks:
        text = dumps.get(k, "")
        _, mark, native = text.partition(nativestacks.NATIVE_MARK)
        if PYTHON_DUMP in text:  # (before or after a py-spy block: another's may come first)
            answered = True
            print(f"== rank {k} ({files[k]}) ==")
            print(main_thread_first(text).rstrip())
        else:
            print(f"== rank {k}: no stacks within {WAIT_S:g} s (the process is stopped, "
                  "gone, or not one the daemon started) ==")
            if mark:  # what py-spy read of it from outside, or why it could not
                print((mark + native).rstrip())
    return EXIT_OK if answered else EXIT_FAILED


def cmd_evidence(args: argparse.Namespace) -> int:
    paths = locate_run(args.runs_dir or default_runs_dir(), args.run)
    info = RunInfo.load(paths)
    folder = paths.evidence
    if not info.live or info.control is None:
        kept = f": what was gathered while it ran is in {folder}" if folder.is_dir() else ""
        raise UsageError(f"run {paths.run_id} is not running ({info.status}){kept}")
    before = set(folder.iterdir()) if folder.is_dir() else set()
    try:
        reply = control.request(info.control, protocol.Evidence(),
                                control.STOP_REQUEST_TIMEOUT_S, keys=info.keys)
    except control.Unreachable as e:
        raise UsageError(f"the daemon of run {paths.run_id} does not answer: {e}") from None
    if not reply.ok:
        raise UsageError(f"the daemon refused: {reply.error}")
    deadline = time.monotonic() + EVIDENCE_WAIT_S
    while time.monotonic() < deadline:
        done = sorted(f for f in (folder.iterdir() if folder.is_dir() else ())
                      if f not in before and (f / "index.json").exists())
        if done:
            _print_bundle(done[-1])
            return EXIT_OK
        time.sleep(0.1)
    print(f"ddtrain: no evidence written in {folder} within {EVIDENCE_WAIT_S:g} s (the "
          "daemon is busy or stopping; it may still come)", file=sys.stderr)
    return EXIT_FAILED


def _print_bundle(bundle: Path) -> None:
    """The bundle's index in words (what arrives from the run folder: shown, not trusted)."""
    try:
        index = json.loads((bundle / "index.json").read_text())
        files, missing = dict(index["files"]), list(index["missing"])
        verdict = str(index["verdict"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"{bundle} (its index.json cannot be read: {e})")
        return
    print(f"{bundle}: {verdict}")
    if isinstance(index.get("flight_recorder"), str) and index["flight_recorder"]:
        print(f"  {index['flight_recorder']}")
    for name, what in files.items():
        print(f"  {name}: {what}")
    for line in missing:
        print(f"  missing: {line}")
    if isinstance(index.get("nodes"), str) and index["nodes"]:
        print(f"  nodes: {index['nodes']}")


def _wait_for_dumps(files: dict, before: dict) -> dict[int, str]:  # type: ignore[type-arg]
    """Each asked rank's dump: its Python stacks within WAIT_S (a rank that gives
    none then, stopped or gone, is not waited for longer), and after them its
    native block (py-spy's, within its DUMP_TIMEOUT_S, or the line saying why not;
    the ranks are read one a core at a time)."""
    start = time.monotonic()
    deadline = start + WAIT_S
    rounds = math.ceil(len(files) / nativestacks.jobs())
    native_deadline = (start + nativestacks.AFTER_SIGNAL_S + nativestacks.DUMP_TIMEOUT_S
                       + 0.5 * rounds)
    sizes = dict(before)
    quiet_since: dict[int, float] = {}
    while (now := time.monotonic()) < max(deadline, native_deadline):
        for k, f in files.items():
            size = file_size(f)
            if size != sizes[k]:
                sizes[k], quiet_since[k] = size, time.monotonic()
        grown = [k for k in files if sizes[k] > before[k]]
        settled = all(now - quiet_since.get(k, 0) >= SETTLE_S for k in grown)
        every = len(grown) == len(files) or now >= deadline  # (the rest never answered)
        if every and settled and all(_native_in(files[k], before[k]) for k in grown):
            break
        if now >= deadline and not grown:
            break
        time.sleep(0.05)
    dumps = {}
    for k, f in files.items():
        if sizes[k] > before[k]:
            dumps[k] = read_since(f, before[k])
    return dumps


def _native_in(path: Path, offset: int) -> bool:
    """Whether the native block (or its one line) follows the Python dump yet."""
    return nativestacks.NATIVE_MARK in read_since(path, offset)


def file_size(path: Path) -> int:
    """A rank's stacks file's size now (0: none yet): where the next dumps begin."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def read_since(path: Path, offset: int) -> str:
    """What a rank's stacks file gained past `offset` ("" where it cannot be read)."""
    try:
        with path.open("rb") as handle:
            handle.seek(offset)
            return handle.read().decode(errors="replace")
    except OSError:
        return ""
