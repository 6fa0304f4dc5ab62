"""A bundle of evidence (daemon/evidence.py), for real, on processes that take the
stacks signal as ranks do (faulthandler on STACKS_SIGNAL, into their stacks file):
its index is written once every rank's stacks are in, or at its budget, saying what
was not; what comes later is added to the bundle and the index says so; and a bundle
asked for while another is being finished is begun once it is. The daemon's use of
it is in tests/test_desync.py, tests/test_faults.py and tests/test_app.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddtop.core.contract import STACKS_SIGNAL
from ddtop.core.processes import ProcessId, catches
from ddtop.core.rundir import RunPaths
from ddtop.core.state import RunState
from ddtop.daemon import evidence, nativestacks

RANK = ("import faulthandler, signal, sys, time\n"
        "faulthandler.register(signal.Signals({sig}), file=open(sys.argv[1], 'a'), "
        "all_threads=True)\n"
        "print('ready', flush=True)\n"
        "def held():\n    time.sleep(60)\nheld()\n")


def test_the_budget_is_2_s_up_to_8_ranks_and_5_s_from_64() -> None:
    assert [evidence.budget(n) for n in (1, 2, 8, 36, 64, 1000)] == [2, 2, 2, 3.5, 5, 5]


@pytest.fixture
def ranks(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Two processes standing for ranks, their run folder, and the ranks numbered."""
    paths = RunPaths(tmp_path / "runs" / "ev")
    paths.logs.mkdir(parents=True)
    script = RANK.format(sig=int(STACKS_SIGNAL))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(paths.rank_stacks(k))],
                              stdout=subprocess.PIPE, text=True) for k in range(2)]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        numbered = {k: ProcessId.of(proc.pid) for k, proc in enumerate(procs)}
        assert all(numbered.values()) and all(catches(p.pid, STACKS_SIGNAL) for p in procs)
        yield paths, numbered
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)


def index_of(folder: Path) -> dict:  # type: ignore[type-arg]
    return json.loads((folder / evidence.INDEX).read_text())


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_what_comes_after_the_index_is_added_to_the_bundle(ranks) -> None:  # type: ignore[no-untyped-def]
    if nativestacks.py_spy() is None:
        pytest.skip("py-spy is not installed (the train extra installs it: make test does)")
    paths, numbered = ranks
    g = evidence.begin(paths, RunState(run="ev"), numbered, "asked", "asked for", time.time())
    # No time at all: py-spy has not begun (it waits for the Python dumps first).
    folder, fr_words, late = evidence.finish(g, 0.0)
    first = index_of(folder)
    assert late == [0, 1] and fr_words == ""
    for k in (0, 1):
        assert (f"rank {k}: no native stacks within 0 s (py-spy reads one rank a core at a "
                "time: added to this bundle when read)") in first["missing"], first
    assert "late" not in first
    evidence.complete(g, late, 0.0)
    index = index_of(folder)
    # The Flight Recorder is off here (no rank dumped one): what is missing is only that.
    assert index["missing"] == [f"rank {k}: no Flight Recorder dump (off, or its sender "
                                "thread could not run)" for k in (0, 1)], index
    assert [line.split(",")[0] for line in index["late"]] == [
        f"rank {k}: its {what} stacks" for k, what in
        ((k, "native" if f"rank {k}: no Python stacks (the process is stopped or gone)"
          not in first["missing"] else "Python and native") for k in (0, 1))], index
    for k in (0, 1):
        text = (folder / f"rank-{k}.stacks").read_text()
        assert "held" in text and nativestacks.NATIVE_MARK in text, text
        assert index["files"][f"rank-{k}.stacks"] == (
            f"rank {k}'s stacks: Python's (every thread), native (py-spy, or why not)")


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_a_bundle_asked_for_meanwhile_is_begun_once_the_first_is_done(ranks) -> None:  # type: ignore[no-untyped-def]
    paths, numbered = ranks
    state = RunState(run="ev")
    gatherer = evidence.Gatherer(paths, lambda: numbered)
    began = time.monotonic()
    gatherer.gather(state, "asked", "the first")
    gatherer.gather(state, "asked", "the second")  # (the first is being finished)
    deadline = time.monotonic() + 30
    while len(list(paths.evidence.iterdir())) < 2 and time.monotonic() < deadline:
        gatherer.pending(state)
        time.sleep(0.05)
    gatherer.close()
    bundles = sorted(paths.evidence.iterdir())
    assert [index_of(b)["verdict"] for b in bundles] == ["the first", "the second"]
    told = gatherer.told()
    assert [line for _, line, _ in told] == [f"evidence asked for in {b}" for b in bundles]
    # Every rank's stacks in: each index written as soon as they were, not at its budget.
    assert time.monotonic() - began < 2 * evidence.budget(2), told
    for b in bundles:
        index = index_of(b)
        assert not any("stacks" in line for line in index["missing"]), index
        assert "late" not in index
