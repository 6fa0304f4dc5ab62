"""srun's and mpirun's words of their tasks, as daemon/launcherwords.py reads them
from a watched command's output: the lines are SLURM 22.05's and Open MPI 4.1's
own (seen in tests/test_slurm.py's and tests/test_watch.py's runs), the rest is
what a user's program might print among them."""

from __future__ import annotations

import signal

import pytest

from ddtop.daemon import launcherwords
from ddtop.daemon.launcherwords import MPI_TASK_ENV as MPI
from ddtop.daemon.launcherwords import SRUN_TASK_ENV as SRUN


def test_each_task_end_is_its_code_or_minus_its_signal() -> None:
    log = "\n".join([
        "[rank0]: RuntimeError: Connection reset by peer",
        "srun: error: vm: task 1: Killed",
        "srun: error: vm: task 0: Exited with exit code 1",
        "srun: error: node-7: tasks 2-3,5: Terminated",
        "srun: error: node-8: task 6: Segmentation fault (core dumped)",
        "srun: Force Terminated StepId=3.0",
    ])
    assert launcherwords.task_ends(log) == {
        (SRUN, 1): -signal.SIGKILL, (SRUN, 0): 1, (SRUN, 2): -signal.SIGTERM,
        (SRUN, 3): -signal.SIGTERM, (SRUN, 5): -signal.SIGTERM, (SRUN, 6): -signal.SIGSEGV}


def test_mpiruns_word_of_a_signalled_process_is_minus_its_signal() -> None:
    log = ("--------------------------------------------------------------------------\n"
           "mpirun noticed that process rank 1 with PID 0 on node vm exited on signal 9 "
           "(Killed).\n"
           "mpirun noticed that process rank 3 with PID 4242 on node n2 exited on signal 11 "
           "(Segmentation fault).\n"
           "  mpirun noticed that process rank 2 with PID 1 on node vm exited on signal 9\n"
           "mpirun noticed that process rank 4 with PID 1 on node vm exited on signal 99\n")
    assert launcherwords.task_ends(log) == {(MPI, 1): -signal.SIGKILL,
                                            (MPI, 3): -signal.SIGSEGV}


@pytest.mark.parametrize("line", [
    "srun: error: vm: task 1: Killed by a bear",  # not a signal's text
    "  srun: error: vm: task 1: Killed",  # not at a line's start: a program's echo
    "srun: error: vm: task 1: Exited with exit code 999",
    "srun: error: vm: tasks 5-2: Killed",  # a range backwards
    "srun: error: vm: tasks 0-99999999: Killed",  # more tasks than any job
    "srun: error: vm: tasks 0--1: Killed",
    "srun: error: vm: task 1:",
])
def test_a_line_not_srun_s_own_is_ignored(line: str) -> None:
    assert launcherwords.task_ends(line) == {}


def test_a_cancel_by_scancel_the_time_limit_or_a_preemption_is_a_stop() -> None:
    step = "slurmstepd-vm: error: *** STEP 4.0 ON vm CANCELLED AT 2026-12-06T22:23:17 ***"
    assert launcherwords.cancelled(f"srun: Job step aborted\n{step}\n") == (
        "by SLURM (scancel of job step 4.0)")
    job = ("slurmstepd: error: *** JOB 42 ON n1 CANCELLED AT 2026-12-06T22:23:17 "
           "DUE TO TIME LIMIT ***")
    assert launcherwords.cancelled(job) == "by SLURM (the time limit of job 42)"
    assert launcherwords.cancelled(job.replace("TIME LIMIT", "PREEMPTION")) == (
        "by SLURM (a preemption of job 42)")


def test_a_node_failure_or_no_cancel_is_not_a_stop() -> None:
    failed = "*** JOB 42 ON n1 CANCELLED AT 2026-12-06T22:23:17 DUE TO NODE FAILURE ***"
    assert launcherwords.cancelled(failed) is None
    assert launcherwords.cancelled("srun: error: vm: task 1: Killed\n") is None
    assert launcherwords.cancelled("*** STEP 4.0 ON vm CANCELLED") is None


def test_ranks_a_launcher_stopped_after_another_failed_are_said_to_be_its_doing() -> None:
    """torchrun's words as it ends its other workers name it; the ranks it ended with
    SIGTERM (victims, as a daemon's stop makes them) are said to be stopped by it,
    after the ranks that failed; with no failed rank, or a reason already known
    (SLURM's cancel), nothing changes."""
    from ddtop.core.processes import ExitedProcess
    from ddtop.daemon.starters import Rank, stopped_by_launcher

    log = ("W1207 19:30:37.537000 946 torch/distributed/elastic/multiprocessing/api.py:1028] "
           "Sending process 953 closing signal SIGTERM\n")
    assert launcherwords.launcher_name(log) == "torchrun"
    assert launcherwords.launcher_name("[rank0]: Sending process 9 closing signal SIGTERM "
                                       "soon\n") == "its launcher"

    def ranks() -> list[Rank]:
        codes = {0: -signal.SIGTERM, 1: -signal.SIGKILL, 2: 1, 3: -signal.SIGTERM, 4: 0}
        return [Rank(k, ExitedProcess(900 + k, code), exitcode=code,
                     stopped_by_us=code in (0, -signal.SIGTERM), noted=True)
                for k, code in codes.items()]

    ended = ranks()
    ended[3].reason = "was stopped by SLURM (scancel of job step 42.0)"
    stopped_by_launcher(ended, "torchrun")
    assert [r.reason for r in ended] == [
        "was stopped by torchrun (SIGTERM) after ranks 1-2 failed", None, None,
        "was stopped by SLURM (scancel of job step 42.0)", None]
    calm = [r for r in ranks() if r.rank in (0, 4)]  # nobody failed: a stop, not a launcher's
    stopped_by_launcher(calm, "its launcher")
    assert [r.reason for r in calm] == [None, None]
