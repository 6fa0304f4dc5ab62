"""Every thread's native stacks of the ranks, read from outside by py-spy.

A rank's Python stacks come from its own faulthandler (daemon/stacks.py): a
thread inside gloo or NCCL, or in any C++ call, shows only the Python frame
that called in, or none. Where py-spy is installed (the train extra installs
it), each time the daemon asks ranks for their stacks (`ddtrain stacks`, the
dashboard's `t`, a hang failed by --hang-timeout) it also runs `py-spy dump
--native --pid P` on each of those ranks, and appends what py-spy printed to
the rank's stacks file (logs/rank-K.stacks, after the Python dump) under
NATIVE_MARK. py-spy reads the process from outside (ptrace), so a rank stuck in
C++ or holding the GIL still gives every thread's native frames, its Python
frames among them.

Only the processes the daemon started or verified are read (`numbered`: by
pid and start time, as every signal it sends), never a pid a message names.
The ranks are read one a core at a time (`jobs`), the ranks a hang or a
desync names first, and each dump is given DUMP_TIMEOUT_S; what could not be
had is said in the file in one line, and without py-spy one line says so: the
Python stacks are then all there is. (How long a bundle of evidence waits for
them is its own: daemon/evidence.py.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path

from ddtop.core import text
from ddtop.core.processes import ProcessId

NATIVE_MARK = text.NATIVE_MARK  # how each rank's native block begins in its stacks file
# py-spy takes 0.2 to 0.3 s a training rank alone on a 2-core machine (0.3 CPU-s:
# libtorch's symbols); 8 ranks at once 2.2 to 2.5 s, two at a time 1.7 s
# (docs/performance.md): so one a core at a time, each given DUMP_TIMEOUT_S.
DUMP_TIMEOUT_S = 10.0
# The Python dump first: faulthandler writes as the rank takes the signal, and
# py-spy stops the process while it reads it.
AFTER_SIGNAL_S = 0.1


def py_spy() -> str | None:
    """py-spy beside this Python (the virtual environment's), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def jobs() -> int:
    """py-spy dumps run at once: one a core this process may use."""
    return max(1, len(os.sched_getaffinity(0)))


def dump(numbered: dict[int, ProcessId], asked: list[int | None],
         stacks_file: Callable[[int], Path], first: Iterable[int] = ()) -> list[threading.Thread]:
    """Start reading the native stacks of the ranks `asked` for (None: all) among
    `numbered`, the ranks `first` first, then by rank, `jobs()` at a time; each
    appends its block to `stacks_file(rank)`. The threads doing it, to wait for."""
    tool, ahead = py_spy(), set(first)
    todo = deque(sorted(((rank, process) for rank, process in numbered.items()
                         if None in asked or rank in asked),
                        key=lambda item: (item[0] not in ahead, item[0])))
    threads = [threading.Thread(target=_work, args=(tool, todo, stacks_file),
                                name=f"ddtrain-native-stacks-{n}", daemon=True)
               for n in range(min(len(todo), jobs()))]
    for thread in threads:
        thread.start()
    return threads


def wait(threads: list[threading.Thread], limit: float = DUMP_TIMEOUT_S) -> None:
    """Until every dump is written, at most `limit` (and the pause before them)."""
    deadline = time.monotonic() + AFTER_SIGNAL_S + limit
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


def _work(tool: str | None, todo: deque[tuple[int, ProcessId]],
          stacks_file: Callable[[int], Path]) -> None:
    time.sleep(AFTER_SIGNAL_S)
    while True:
        try:
            rank, process = todo.popleft()  # (one call: safe between threads)
        except IndexError:
            return
        _one(tool, rank, process, stacks_file(rank))


def _one(tool: str | None, rank: int, process: ProcessId, path: Path) -> None:
    text = _read(tool, rank, process)
    try:
        with path.open("a") as f:
            f.write(text)
    except OSError:
        pass  # a full disk, a folder gone: the Python stacks are what there is


def _read(tool: str | None, rank: int, process: ProcessId) -> str:
    if tool is None:
        return (f"{NATIVE_MARK}: py-spy is not installed (pip install py-spy, or the train "
                "extra): the Python stacks above are all there is ---\n")
    head = f"{NATIVE_MARK} of rank {rank} (py-spy dump --native --pid {process.pid}) ---\n"
    try:
        done = subprocess.run([tool, "dump", "--native", "--pid", str(process.pid)],
                              capture_output=True, text=True, timeout=DUMP_TIMEOUT_S,
                              check=False, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"{head}py-spy did not finish within {DUMP_TIMEOUT_S:g} s\n"
    except OSError as e:
        return f"{head}py-spy could not be run: {e.strerror or e}\n"
    if done.returncode != 0:  # its "Error: ..." line (a backtrace may follow it)
        said = next((line for line in done.stderr.splitlines() if line.startswith("Error")),
                    (done.stderr.strip().splitlines() or ["no message"])[-1])
        return f"{head}py-spy could not read it (exit {done.returncode}): {said[:300]}\n"
    return head + done.stdout
