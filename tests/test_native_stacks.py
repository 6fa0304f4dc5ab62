"""Native stacks read from outside by py-spy (daemon/nativestacks.py), for real:
a Python process blocked in a C call (`time.sleep`, as a rank inside gloo is in
C++) gives its native frames with its Python frames among them, appended to its
stacks file under the mark; a process that is gone, and no py-spy at all, each
give one line saying why. The daemon's use of it at a hang is in
tests/test_desync.py (the world run's rank 3)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddtop.core.processes import ProcessId
from ddtop.daemon import nativestacks

pytestmark = pytest.mark.processes

SLEEPER = "import time\ndef held():\n    time.sleep(60)\nheld()\n"


@pytest.mark.timeout(60)
def test_a_process_blocked_in_c_gives_its_native_and_python_frames(tmp_path: Path) -> None:
    if nativestacks.py_spy() is None:
        pytest.skip("py-spy is not installed (the train extra installs it: make test does)")
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER])
    try:
        process = ProcessId.of(proc.pid)
        assert process is not None
        stacks = tmp_path / "rank-0.stacks"
        stacks.write_text("(the Python dump)\n")
        nativestacks.wait(nativestacks.dump({0: process}, [None], lambda rank: stacks))
        text = stacks.read_text()
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert text.startswith("(the Python dump)\n" f"{nativestacks.NATIVE_MARK} of rank 0 "
                           f"(py-spy dump --native --pid {proc.pid}) ---\n"), text
    assert "clock_nanosleep" in text or "nanosleep" in text, text  # the C frame it waits in
    assert "held (<string>:3)" in text, text  # and the Python frame that called it
    # Not asked for: nothing read.
    assert nativestacks.dump({0: process}, [1], lambda rank: stacks) == []


@pytest.mark.timeout(60)
def test_what_could_not_be_read_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    process = ProcessId.of(proc.pid)
    proc.wait(timeout=30)
    stacks = tmp_path / "rank-1.stacks"
    if nativestacks.py_spy() is not None and process is not None:
        nativestacks.wait(nativestacks.dump({1: process}, [1], lambda rank: stacks))
        lines = stacks.read_text().splitlines()
        assert lines[0].startswith(f"{nativestacks.NATIVE_MARK} of rank 1 ") and \
            lines[1].startswith("py-spy could not read it (exit 1): Error"), lines
        assert len(lines) == 2, lines
    monkeypatch.setattr(nativestacks, "py_spy", lambda: None)
    alive = ProcessId.of(1)
    assert alive is not None
    stacks.unlink(missing_ok=True)
    nativestacks.wait(nativestacks.dump({1: alive}, [None], lambda rank: stacks))
    assert stacks.read_text() == (f"{nativestacks.NATIVE_MARK}: py-spy is not installed (pip "
                                  "install py-spy, or the train extra): the Python stacks "
                                  "above are all there is ---\n")


@pytest.mark.timeout(60)
def test_the_named_ranks_are_read_first_one_a_core_at_a_time(tmp_path: Path) -> None:
    if nativestacks.py_spy() is None:
        pytest.skip("py-spy is not installed (the train extra installs it: make test does)")
    procs = [subprocess.Popen([sys.executable, "-c", SLEEPER]) for _ in range(3)]
    cores = os.sched_getaffinity(0)
    try:
        numbered = {k: ProcessId.of(proc.pid) for k, proc in enumerate(procs)}
        assert all(numbered.values())
        files = {k: tmp_path / f"rank-{k}.stacks" for k in numbered}
        # One a core: as many readers as this process has cores, never more than ranks.
        threads = nativestacks.dump(numbered, [None], files.__getitem__)
        assert len(threads) == min(3, len(cores))
        nativestacks.wait(threads)
        for f in files.values():
            f.unlink()
        # On one core they go one at a time: rank 2, named first, then ranks 0 and 1.
        os.sched_setaffinity(0, {min(cores)})
        threads = nativestacks.dump(numbered, [None], files.__getitem__, first=[2])
        assert len(threads) == 1
        nativestacks.wait(threads)
    finally:
        os.sched_setaffinity(0, cores)
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
    written = sorted(files, key=lambda k: files[k].stat().st_mtime_ns)
    assert written == [2, 0, 1], {k: f.stat().st_mtime_ns for k, f in files.items()}
    assert all("held (<string>:3)" in f.read_text() for f in files.values())


def test_the_main_thread_is_listed_first() -> None:
    from ddtop.core.text import main_thread_first

    dump = ("Thread 0x2 (most recent call first):\n  File \"w.py\", line 2 in worker\n\n"
            "Thread 0x3 (most recent call first):\n  File \"w.py\", line 2 in worker\n\n"
            "Current thread 0x1 (most recent call first):\n  File \"train.py\", line 6 in main\n")
    native = f"{nativestacks.NATIVE_MARK} of rank 0 ---\nThread 1 (idle)\n"
    first = main_thread_first(dump + native)
    assert first.startswith("Current thread 0x1 (most recent call first):\n  File \"train.py\"")
    assert first.index("Thread 0x2") < first.index("Thread 0x3") < first.index(native)
    assert first.endswith(native) and sorted(first.splitlines()) == sorted(
        (dump + native).splitlines())
    assert main_thread_first("no threads here") == "no threads here"
