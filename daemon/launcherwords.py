"""What srun and mpirun said of a watched command's tasks, read from its output.

`ddtrain watch -- srun ...` (or an sbatch script that runs srun under a watch),
`ddtrain watch -- mpirun ...`: the tasks are slurmstepd's or Open MPI's
daemon's children, not the daemon's, so how each ended is known only to the
launcher, which says it on its stderr:

    srun: error: node7: task 1: Killed
    srun: error: node7: tasks 0,2-3: Exited with exit code 1
    slurmstepd: error: *** STEP 42.0 ON node7 CANCELLED AT 2026-12-06T10:00:00 ***
    slurmstepd: error: *** JOB 42 ON node7 CANCELLED AT 2026-... DUE TO TIME LIMIT ***
    mpirun noticed that process rank 1 with PID 0 on node node7 exited on signal 9 (Killed).

`task_ends` turns srun's and mpirun's words into exit codes (negative: the
signal, from its strsignal text or number), by task number and the variable
that numbers the task in its environment (SLURM_PROCID, OMPI_COMM_WORLD_RANK);
`cancelled` says SLURM's cancel in words ("by SLURM (scancel of job step
42.0)"), where SLURM stopped the tasks (scancel, the time limit, a preemption)
rather than a task failing. The output is the user's program's too: only whole
lines in these forms are read, and a task number or code out of range is
ignored.
"""

from __future__ import annotations

import re
import signal

# A task's number and an exit code are bounded: a line with larger ones is not SLURM's.
MAX_TASK = 1 << 24
MAX_RANGE_TASKS = 1 << 16
# The variables that number the tasks of each launcher in the tasks' environment.
SRUN_TASK_ENV = "SLURM_PROCID"
MPI_TASK_ENV = "OMPI_COMM_WORLD_RANK"
TASK_END = re.compile(r"^srun: error: [^\s:]+: tasks? ([\d,-]{1,4096}): (.{1,200}?)"
                      r"(?: \(core dumped\))?\s*$", re.MULTILINE)
MPI_SIGNALLED = re.compile(r"^mpirun noticed that process rank (\d{1,8}) with PID \d{1,10} on "
                           r"node \S{1,256} exited on signal (\d{1,2})\b", re.MULTILINE)
EXITED = re.compile(r"Exited with exit code (\d{1,3})")
CANCELLED = re.compile(r"\*\*\* (JOB|STEP) ([\w.+]{1,64}) (?:ON \S{1,256} )?CANCELLED AT \S{1,64}"
                       r"(?: DUE TO ([A-Z ]{1,64}?))? \*\*\*")
# torchrun's words as it ends its other workers after one failed (or when stopped).
TORCHRUN_CLOSING = re.compile(r"Sending process \d{1,10} closing signal SIG[A-Z]{2,8}$",
                              re.MULTILINE)
# The reasons SLURM gives for ending tasks that did not fail by themselves.
STOPS = {None: "scancel", "TIME LIMIT": "the time limit", "PREEMPTION": "a preemption"}
# strsignal()'s text of each signal, as slurmstepd reports a task's death.
_BY_TEXT = {signal.strsignal(s): -int(s) for s in signal.Signals if signal.strsignal(s)}


def _tasks(spec: str) -> list[int]:
    """'0,2-3' -> [0, 2, 3]; nothing for a spec out of bounds."""
    found: list[int] = []
    for part in spec.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            return []
        a, b = int(low), int(high or low)
        if b < a or b >= MAX_TASK or len(found) + b - a >= MAX_RANGE_TASKS:
            return []
        found.extend(range(a, b + 1))
    return found


def task_ends(log: str) -> dict[tuple[str, int], int]:
    """Each task srun or mpirun said ended badly, by (the variable that numbers it,
    its number): its exit code, or minus its signal."""
    ends: dict[tuple[str, int], int] = {}
    for m in TASK_END.finditer(log):
        what = m[2].strip()
        exited = EXITED.fullmatch(what)
        code = int(exited[1]) if exited else _BY_TEXT.get(what)
        if code is None or not -64 < code < 256:
            continue
        for task in _tasks(m[1]):
            ends[(SRUN_TASK_ENV, task)] = code
    for m in MPI_SIGNALLED.finditer(log):
        if 0 < int(m[2]) < 64:
            ends[(MPI_TASK_ENV, int(m[1]))] = -int(m[2])
    return ends


def cancelled(log: str) -> str | None:
    """'by SLURM (scancel of job step 42.0)' where SLURM ended the tasks by a stop
    (scancel, the time limit, a preemption); None otherwise (a node's failure
    is a failure, not a stop)."""
    for m in CANCELLED.finditer(log):
        why = m[3].strip() if m[3] else None
        if why in STOPS:
            what = "job step" if m[1] == "STEP" else "job"
            return f"by SLURM ({STOPS[why]} of {what} {m[2]})"
    return None


def launcher_name(log: str) -> str:
    """Who ended a watched command's ranks, in words: torchrun where its output says
    it sent them a closing signal, else "its launcher"."""
    return "torchrun" if TORCHRUN_CLOSING.search(log) else "its launcher"
