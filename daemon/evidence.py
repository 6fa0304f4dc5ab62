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
started or verified, the ranks the state names (a hang's, a desync's) read by
py-spy first. The index is written once every rank's stacks are in, or at
`budget` (2 s up to 8 ranks, 5 s at 64): a rank that gives no Python stacks
(stopped, gone) is named in it, as is one whose native stacks py-spy had not read
by then. Those that come later (within py-spy's DUMP_TIMEOUT_S) are added to the
bundle and the index rewritten, naming them under "late". Everything is the run
owner's alone, as the run folder is.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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
        "asked": "evidence asked for", "hub": "evidence asked for by the hub"}
FRESH_SLACK_S = 1.0  # a dump this much older than the bundle's start is still its own
INDEX = "index.json"
POLL_S = 0.05  # how often the stacks files are looked at while they are written
# The index waits for the ranks' stacks BUDGET_S up to BUDGET_RANKS ranks, and
# BUDGET_MAX_S at BUDGET_MAX_RANKS and over, in proportion between: py-spy reads one
# rank a core at a time (daemon/nativestacks.py).
BUDGET_S, BUDGET_RANKS = 2.0, 8
BUDGET_MAX_S, BUDGET_MAX_RANKS = 5.0, 64


def budget(ranks: int) -> float:
    """Seconds a bundle of `ranks` ranks waits for their stacks before its index."""
    over = min(max(ranks - BUDGET_RANKS, 0), BUDGET_MAX_RANKS - BUDGET_RANKS)
    return BUDGET_S + (BUDGET_MAX_S - BUDGET_S) * over / (BUDGET_MAX_RANKS - BUDGET_RANKS)


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
    began: float  # time.monotonic() at the signal
    files: dict[str, str] = field(default_factory=dict)  # the index's, once written
    missing: list[str] = field(default_factory=list)
    fr_words: str = ""
    texts: dict[int, str] = field(default_factory=dict)  # each rank's stacks at the index
    nodes: str = ""  # a hub's: where the other nodes' ranks' evidence goes


def begin(paths: RunPaths, state: RunState, numbered: dict[int, ProcessId], why: str,
          verdict: str, now: float) -> Gathering:
    """Start a bundle: the state's words and every rank as it holds them, written
    now; the ranks asked for their stacks. OSError: the folder cannot be made."""
    folder = _new_folder(paths.evidence, now)
    (folder / "verdict.txt").write_text(verdict + "\n")
    write_json_atomic(folder / "ranks.json",
                      {str(k): rank_record(v) for k, v in sorted(state.ranks.items())})
    stacks = {k: (paths.rank_stacks(k), file_size(paths.rank_stacks(k))) for k in sorted(numbered)}
    named = state.hung(now)  # (a hang's or a desync's ranks: py-spy reads them first)
    threads = signal_stacks(numbered, [None], paths.rank_stacks, named[0] if named else ())
    return Gathering(folder, paths.run_id, why, verdict, now, stacks, threads,
                     group_names(state), time.monotonic())


def group_names(state: RunState) -> dict[str, str]:
    """Each group a rank's last collectives named, by torch's name of the group."""
    return desync.group_names(state.ranks)


def finish(g: Gathering, limit: float) -> tuple[Path, str, list[int]]:
    """Wait for the stacks (`limit` seconds from the signal at most), copy each rank's
    into the bundle with its Flight Recorder, and write its index; the folder, the
    Flight Recorder's verdict ("" without a dump), and the ranks whose stacks lacked
    something then (`complete` adds what comes later)."""
    texts = g.texts = _stacks_by(g, g.began + limit)
    g.files = {"verdict.txt": "the words the daemon named it with",
               "ranks.json": "each rank as the daemon's state held it: process, phase, step, "
                             "the collectives it last entered and finished, memory"}
    g.fr_words = _flight_recorder(g, g.files, g.missing)
    late = []
    for k, text in texts.items():
        # (faulthandler's dump and py-spy's block may come in either order: another
        # bundle's py-spy may be done with the rank first)
        _copy_stacks(g, k, text)
        lacks = _lacking(k, text, limit)
        g.missing += lacks
        if lacks:
            late.append(k)
    _write_index(g, [])
    return g.folder, g.fr_words, late


def _lacking(k: int, text: str, limit: float) -> list[str]:
    """What rank `k`'s stacks so far lack, in the index's words."""
    lacks = []
    if PYTHON_DUMP not in text:
        lacks.append(f"rank {k}: no Python stacks (the process is stopped or gone)")
    if nativestacks.NATIVE_MARK not in text:
        lacks.append(f"rank {k}: no native stacks within {limit:g} s (py-spy reads one rank a "
                     "core at a time: added to this bundle when read)")
    return lacks


def complete(g: Gathering, late: list[int], limit: float) -> None:
    """Once py-spy is done (DUMP_TIMEOUT_S a rank at most), what the `late` ranks'
    stacks lacked at the index added to the bundle, and its index rewritten to say so."""
    rounds = -(-len(g.stacks) // max(1, len(g.threads)))
    nativestacks.wait(g.threads, nativestacks.DUMP_TIMEOUT_S * rounds)
    added = []
    for k in late:
        path, offset = g.stacks[k]
        text = read_since(path, offset)
        before = _lacking(k, g.texts[k], limit)
        came = [line for line in before if line not in _lacking(k, text, limit)]
        if not came:
            continue
        try:
            _copy_stacks(g, k, text)
        except OSError:
            continue
        g.missing = [line for line in g.missing if line not in came]
        what = " and ".join(("Python" if "Python" in line else "native") for line in came)
        added.append(f"rank {k}: its {what} stacks, {time.monotonic() - g.began:.1f} s "
                     "after the signal")
    if added:
        with contextlib.suppress(OSError):  # (a full disk, a folder gone: the first stands)
            _write_index(g, added)


def _stacks_by(g: Gathering, deadline: float) -> dict[int, str]:
    """Each rank's stacks written since the bundle began, once every rank's Python and
    native stacks are in (py-spy's threads done, the files still for a poll), or as
    they are at `deadline`."""
    texts: dict[int, str] = {}
    while True:
        before, texts = texts, {k: read_since(path, offset)
                                for k, (path, offset) in g.stacks.items()}
        done = (texts == before and not any(t.is_alive() for t in g.threads)
                and all(PYTHON_DUMP in text for text in texts.values()))
        if done or time.monotonic() >= deadline:
            return texts
        time.sleep(POLL_S)


def _copy_stacks(g: Gathering, k: int, text: str) -> None:
    if not text.strip():
        return
    (g.folder / f"rank-{k}.stacks").write_text(text)
    g.files[f"rank-{k}.stacks"] = (
        f"rank {k}'s stacks: " + ("Python's (every thread)" if PYTHON_DUMP in text
                                  else "no Python stacks (stopped, or gone)")
        + (", native (py-spy, or why not)" if nativestacks.NATIVE_MARK in text else ""))


def _write_index(g: Gathering, late: list[str]) -> None:
    index: dict[str, Any] = {
        "run": g.run, "why": g.why, "verdict": g.verdict,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(g.at)),
        "files": g.files, "missing": g.missing, "flight_recorder": g.fr_words}
    if g.nodes:
        index["nodes"] = g.nodes
    if late:
        index["late"] = late
    write_json_atomic(g.folder / INDEX, index)


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

    def __init__(self, paths: RunPaths, numbered: Callable[[], dict[int, ProcessId]],
                 began: Callable[[str], None] = lambda bundle: None, nodes: int = 1) -> None:
        """`began`: told each bundle's folder name as it begins (a hub's asks its nodes
        for theirs); `nodes`: the job's (the index of a hub's says where theirs go)."""
        self.paths, self.numbered, self.began, self.nodes = paths, numbered, began, nodes
        # (an event type, a line, the folder it names)
        self._told: list[tuple[str, str, str | None]] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []  # the one being finished on its own
        self._next: tuple[str, str] | None = None  # asked for meanwhile: (why, verdict)

    def gather(self, state: RunState, why: str, verdict: str, wait: bool = False) -> None:
        """Begin a bundle; finish it now (`wait`: the run waits, `budget` at most; the
        late native stacks are added on a thread of its own) or on a thread of its own."""
        # One bundle at a time (py-spy holds a rank while it reads it): while one is
        # finished on its own thread, another is begun by `pending` once it is done,
        # but a hang's waits for it.
        if not wait and self._busy():
            self._next = (why, verdict)
            return
        self._next = None
        for thread in self._threads:
            thread.join(nativestacks.DUMP_TIMEOUT_S + 1)
        numbered = self.numbered()
        try:
            g = begin(self.paths, state, numbered, why, verdict, time.time())
        except OSError as e:
            self._tell("warning", f"no evidence of the {why} gathered: {e}", None)
            return
        self.began(g.folder.name)
        if self.nodes > 1 and why != "hub":
            g.nodes = (f"nodes 1-{self.nodes - 1} each gather their own ranks' into "
                       f"runs/{g.run}/nodes/K/evidence/ on their host, within a second of "
                       "this one (\"why\": \"hub\", its verdict naming this folder)")
        limit = budget(len(numbered))
        late = self._finish(g, limit) if wait else None  # (the run waits for the index)
        thread = threading.Thread(target=self._complete, args=(g, limit, late),
                                  name="ddtrain-evidence", daemon=True)
        thread.start()
        self._threads = [thread]

    def pending(self, state: RunState) -> None:
        """Begin the bundle asked for while another was being finished, once it is."""
        if self._next is not None and not self._busy():
            self.gather(state, *self._next)

    def close(self) -> None:
        """Wait for the bundle being finished on its own thread, if one is (its py-spy
        dumps bounded: the ranks have ended by now, so they fail fast)."""
        for thread in self._threads:
            thread.join(nativestacks.DUMP_TIMEOUT_S + 1)

    def told(self) -> list[tuple[str, str, str | None]]:
        with self._lock:
            lines, self._told = self._told, []
        return lines

    def _busy(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def _complete(self, g: Gathering, limit: float, late: list[int] | None) -> None:
        complete(g, self._finish(g, limit) if late is None else late, limit)

    def _finish(self, g: Gathering, limit: float) -> list[int]:
        """The bundle's index written, and told; the ranks whose native stacks are late."""
        try:
            folder, fr_words, late = finish(g, limit)
        except OSError as e:
            self._tell("warning", f"the evidence of the {g.why} in {g.folder} is incomplete: "
                       f"{e}", None)
            return []
        self._tell("info", f"{SAID.get(g.why, g.why)} in {folder}", str(folder))
        if fr_words:
            self._tell("info", fr_words, None)
        return late

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
