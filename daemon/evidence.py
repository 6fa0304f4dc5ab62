"""Evidence of a hang or a desync, gathered by the daemon at the moment it is
named, in one folder of the run: `runs/<id>/evidence/<time>/`.

    index.json     what was named, when, why it was gathered, what each file is,
                   and what could not be had (written last: a folder without it is
                   still being written, or its daemon died meanwhile)
    verdict.txt    the words the daemon named it with
    ranks.json     each rank as the daemon's state held it then: its process, host,
                   phase (and for how long), step, the collectives it last entered
                   and finished (with their signatures: group, the group's #N, op,
                   dtype, elements), memory (RSS, CUDA allocated and reserved)
    rank-K.stacks  rank K's Python stacks, every thread (faulthandler's, written by
                   the rank itself), then its native stacks (py-spy's, read from
                   outside: a rank stuck in C++ or holding the GIL still gives them),
                   or the line saying why there are none
    rank-K.fr.json rank K's Flight Recorder: torch's JSON dump of its last
                   collectives on every group (written by the rank's sender thread
                   as its stacks are: training/flightrec.py)

index.json also holds the Flight Recorder's verdict in words (daemon/flightrec.py),
which the daemon tells after the folder's line.

Gathered when a desync is first told (the run goes on: the files are read back on
a thread of their own), when --hang-timeout fails a hang (before its ranks are
stopped), and when asked (`ddtrain evidence`: daemon/stacks.py). The stacks go
through daemon/stacks.py's signal_stacks: only to the processes the daemon
started or verified. A rank that gives no Python stacks
(stopped, gone) is named in the index, as is one whose native stacks took
longer than they were waited for: HANG_NATIVE_S where the run waits (a hang
failed), py-spy's own DUMP_TIMEOUT_S where it goes on (a desync). Everything
is the run owner's alone, as the run folder is.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from ddtop.core import desync
from ddtop.core.contract import FR_JSON_SUFFIX
from ddtop.core.processes import ProcessId
from ddtop.core.rankview import RankView
from ddtop.core.rundir import RunPaths, write_json_atomic
from ddtop.core.state import RunState
from ddtop.daemon import flightrec, nativestacks
from ddtop.daemon.stacks import PYTHON_DUMP, file_size, read_since, signal_stacks

# What a bundle is said to be, by why it was gathered ("evidence of the desync in ...").
SAID = {"desync": "evidence of the desync", "hang": "evidence of the hang",
        "asked": "evidence asked for"}
SETTLE_S = 0.3  # after py-spy: a rank's Python dump is written by then (or never)
FRESH_SLACK_S = 1.0  # a dump this much older than the bundle's start is still its own
INDEX = "index.json"


@dataclass
class Gathering:
    """A bundle begun: its folder, each rank's stacks file and its size before the
    signal (what follows is this bundle's), and py-spy's threads."""

    folder: Path
    run: str
    why: str
    verdict: str
    at: float
    stacks: dict[int, tuple[Path, int]]
    threads: list[threading.Thread]
    groups: dict[str, str]  # the groups the ranks' signatures named, by torch's name


def begin(paths: RunPaths, state: RunState, numbered: dict[int, ProcessId], why: str,
          verdict: str, now: float) -> Gathering:
    """Start a bundle: the state's words and every rank as it holds them, written
    now; the ranks asked for their stacks. OSError: the folder cannot be made."""
    folder = _new_folder(paths.evidence, now)
    (folder / "verdict.txt").write_text(verdict + "\n")
    write_json_atomic(folder / "ranks.json",
                      {str(k): rank_record(v) for k, v in sorted(state.ranks.items())})
    stacks = {k: (paths.rank_stacks(k), file_size(paths.rank_stacks(k))) for k in sorted(numbered)}
    threads = signal_stacks(numbered, [None], paths.rank_stacks)
    return Gathering(folder, paths.run_id, why, verdict, now, stacks, threads,
                     group_names(state))


def group_names(state: RunState) -> dict[str, str]:
    """Each group a rank's last collectives named, by torch's name of the group."""
    return desync.group_names(state.ranks)


def finish(g: Gathering, limit: float) -> tuple[Path, str]:
    """Wait for the stacks (py-spy's `limit` seconds at most), copy each rank's into
    the bundle with its Flight Recorder, and write its index; the folder, and the
    Flight Recorder's verdict ("" without a dump)."""
    nativestacks.wait(g.threads, limit)
    time.sleep(SETTLE_S)
    files = {"verdict.txt": "the words the daemon named it with",
             "ranks.json": "each rank as the daemon's state held it: process, phase, step, "
                           "the collectives it last entered and finished, memory"}
    missing: list[str] = []
    fr_words = _flight_recorder(g, files, missing)
    for k, (path, offset) in g.stacks.items():
        text = read_since(path, offset)
        # (faulthandler's dump and py-spy's block may come in either order: another
        # bundle's py-spy may be done with the rank first)
        python, mark = PYTHON_DUMP in text, nativestacks.NATIVE_MARK in text
        if text.strip():
            (g.folder / f"rank-{k}.stacks").write_text(text)
            files[f"rank-{k}.stacks"] = (
                f"rank {k}'s stacks: " + ("Python's (every thread)" if python
                                          else "no Python stacks (stopped, or gone)")
                + (", native (py-spy, or why not)" if mark else ""))
        if not python:
            missing.append(f"rank {k}: no Python stacks (the process is stopped or gone)")
        if not mark:
            missing.append(f"rank {k}: no native stacks within {limit:g} s (py-spy's, "
                           f"if they come, follow in {path})")
    write_json_atomic(g.folder / INDEX, {
        "run": g.run, "why": g.why, "verdict": g.verdict,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(g.at)),
        "files": files, "missing": missing, "flight_recorder": fr_words})
    return g.folder, fr_words


def _flight_recorder(g: Gathering, files: dict[str, str], missing: list[str]) -> str:
    """Each rank's Flight Recorder dump, written since the bundle began, copied into
    it (`files` and `missing` say so); their verdict in words ("" without any)."""
    dumps: dict[int, flightrec.Dump] = {}
    since = g.at - FRESH_SLACK_S
    for k, (stacks, _) in g.stacks.items():
        as_json = stacks.with_suffix(FR_JSON_SUFFIX)
        if not _written_since(as_json, since):
            missing.append(f"rank {k}: no Flight Recorder dump (off, or its sender thread "
                           "could not run)")
            continue
        dump = flightrec.read(as_json)
        if isinstance(dump, str):
            missing.append(f"rank {k}: its Flight Recorder dump is {dump}")
            continue
        dumps[k] = dump
        shutil.copyfile(as_json, g.folder / f"rank-{k}.fr.json")
        files[f"rank-{k}.fr.json"] = (f"rank {k}'s Flight Recorder, torch's JSON dump: its "
                                      "last collectives on every process group")
    return flightrec.verdict(dumps, g.groups)


def _written_since(path: Path, since: float) -> bool:
    try:
        return path.stat().st_mtime >= since
    except OSError:
        return False


class Gatherer:
    """The run loop's bundles: `gather` begins one (and, `wait`ing, finishes it);
    `told` gives, once each, the lines saying where the finished ones are (a bundle
    finished on its own thread is told by the loop's next pass)."""

    def __init__(self, paths: RunPaths, numbered: Callable[[], dict[int, ProcessId]]) -> None:
        self.paths, self.numbered = paths, numbered
        # (an event type, a line, the folder it names)
        self._told: list[tuple[str, str, str | None]] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []  # the one being finished on its own

    def gather(self, state: RunState, why: str, verdict: str, wait: bool = False,
               limit: float = nativestacks.DUMP_TIMEOUT_S + 1) -> None:
        """Begin a bundle; finish it now (`wait`: py-spy's threads waited for
        HANG_NATIVE_S at most, the run waiting) or on a thread of its own (`limit`)."""
        # One bundle at a time (py-spy holds a rank while it reads it): while one is
        # finished on its own thread, another is not begun, but a hang's waits for it.
        if not wait and any(t.is_alive() for t in self._threads):
            return
        for thread in self._threads:
            thread.join(nativestacks.DUMP_TIMEOUT_S + 1)
        try:
            g = begin(self.paths, state, self.numbered(), why, verdict, time.time())
        except OSError as e:
            self._tell("warning", f"no evidence of the {why} gathered: {e}", None)
            return
        if wait:  # (the run waits: py-spy's threads for HANG_NATIVE_S at most)
            self._finish(g, nativestacks.HANG_NATIVE_S)
            return
        else:  # (the run goes on: a desync's gives each py-spy dump its DUMP_TIMEOUT_S)
            thread = threading.Thread(target=self._finish, args=(g, limit),
                                      name="ddtrain-evidence", daemon=True)
            thread.start()
            self._threads = [thread]

    def close(self) -> None:
        """Wait for the bundle being finished on its own thread, if one is (its py-spy
        dumps bounded: the ranks have ended by now, so they fail fast)."""
        for thread in self._threads:
            thread.join(nativestacks.DUMP_TIMEOUT_S + 1)

    def told(self) -> list[tuple[str, str, str | None]]:
        with self._lock:
            lines, self._told = self._told, []
        return lines

    def _finish(self, g: Gathering, limit: float) -> None:
        try:
            folder, fr_words = finish(g, limit)
        except OSError as e:
            self._tell("warning", f"the evidence of the {g.why} in {g.folder} is incomplete: "
                       f"{e}", None)
            return
        self._tell("info", f"{SAID.get(g.why, g.why)} in {folder}", str(folder))
        if fr_words:
            self._tell("info", fr_words, None)

    def _tell(self, kind: str, line: str, folder: str | None) -> None:
        with self._lock:
            self._told.append((kind, line, folder))


def rank_record(v: RankView) -> dict[str, Any]:
    """What ranks.json says of rank `v`."""
    return {
        "pid": v.pid, "host": v.host, "device": v.device, "phase": v.phase,
        "phase_s": round(v.phase_s, 3), "global_step": v.global_step, "epoch": v.epoch,
        "exited": v.exited, "coll_started": _coll(v.coll_started),
        "coll_completed": _coll(v.coll_completed), "rss": v.rss,
        "cuda_allocated": v.cuda_allocated, "cuda_reserved": v.cuda_reserved}


def _coll(c: Any) -> Any:
    return None if c is None else msgspec.to_builtins(c)


def _new_folder(parent: Path, now: float) -> Path:
    parent.mkdir(mode=0o700, exist_ok=True)
    name = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    for n in range(100):
        folder = parent / (name if n == 0 else f"{name}-{n}")
        try:
            folder.mkdir(mode=0o700)
            return folder
        except FileExistsError:
            continue
    raise FileExistsError(f"{parent}: 100 bundles in one second")
