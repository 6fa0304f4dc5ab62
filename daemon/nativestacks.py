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
Each dump is given DUMP_TIMEOUT_S, all ranks at once (a hang failed by
--hang-timeout waits HANG_NATIVE_S for them); what could not be had is
said in the file in one line, and without py-spy one line says so: the Python
stacks are then all there is.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ddtop.core.processes import ProcessId

NATIVE_MARK = "--- native stacks"  # how each rank's native block begins in its stacks file
# py-spy takes about 0.9 s a rank on this 2-core machine (libtorch's symbols), 1.65 s
# for 4 ranks at once (docs/performance.md): a dump gets DUMP_TIMEOUT_S, and a hang
# failed by --hang-timeout waits for them HANG_NATIVE_S at most before it stops the
# ranks (a dump not done by then ends with its process).
DUMP_TIMEOUT_S = 10.0
HANG_NATIVE_S = 5.0
# The Python dump first: faulthandler writes as the rank takes the signal, and
# py-spy stops the process while it reads it.
AFTER_SIGNAL_S = 0.1


def py_spy() -> str | None:
    """py-spy beside this Python (the virtual environment's), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def dump(numbered: dict[int, ProcessId], asked: list[int | None],
         stacks_file: Callable[[int], Path]) -> list[threading.Thread]:
    """Start reading the native stacks of the ranks `asked` for (None: all) among
    `numbered`, one thread each; each appends its block to `stacks_file(rank)`."""
    tool = py_spy()
    threads = []
    for rank, process in numbered.items():
        if None in asked or rank in asked:
            thread = threading.Thread(target=_one, args=(tool, rank, process, stacks_file(rank)),
                                      name=f"ddtrain-native-stacks-{rank}", daemon=True)
            thread.start()
            threads.append(thread)
    return threads


def wait(threads: list[threading.Thread], limit: float = DUMP_TIMEOUT_S) -> None:
    """Until every dump is written, at most `limit` (and the pause before them)."""
    deadline = time.monotonic() + AFTER_SIGNAL_S + limit
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


def _one(tool: str | None, rank: int, process: ProcessId, path: Path) -> None:
    time.sleep(AFTER_SIGNAL_S)
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
