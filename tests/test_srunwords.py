"""srun's words of its tasks, as daemon/srunwords.py reads them from a watched
command's output: the lines are SLURM 22.05's own (seen in tests/test_slurm.py's
runs), the rest is what a user's program might print among them."""

from __future__ import annotations

import signal

import pytest

from ddtop.daemon import srunwords


def test_each_task_end_is_its_code_or_minus_its_signal() -> None:
    log = "\n".join([
        "[rank0]: RuntimeError: Connection reset by peer",
        "srun: error: vm: task 1: Killed",
        "srun: error: vm: task 0: Exited with exit code 1",
        "srun: error: node-7: tasks 2-3,5: Terminated",
        "srun: error: node-8: task 6: Segmentation fault (core dumped)",
        "srun: Force Terminated StepId=3.0",
    ])
    assert srunwords.task_ends(log) == {
        1: -signal.SIGKILL, 0: 1, 2: -signal.SIGTERM, 3: -signal.SIGTERM,
        5: -signal.SIGTERM, 6: -signal.SIGSEGV}


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
    assert srunwords.task_ends(line) == {}


def test_a_cancel_by_scancel_the_time_limit_or_a_preemption_is_a_stop() -> None:
    step = "slurmstepd-vm: error: *** STEP 4.0 ON vm CANCELLED AT 2026-12-06T22:23:17 ***"
    assert srunwords.cancelled(f"srun: Job step aborted\n{step}\n") == (
        "by SLURM (scancel of job step 4.0)")
    job = ("slurmstepd: error: *** JOB 42 ON n1 CANCELLED AT 2026-12-06T22:23:17 "
           "DUE TO TIME LIMIT ***")
    assert srunwords.cancelled(job) == "by SLURM (the time limit of job 42)"
    assert srunwords.cancelled(job.replace("TIME LIMIT", "PREEMPTION")) == (
        "by SLURM (a preemption of job 42)")


def test_a_node_failure_or_no_cancel_is_not_a_stop() -> None:
    failed = "*** JOB 42 ON n1 CANCELLED AT 2026-12-06T22:23:17 DUE TO NODE FAILURE ***"
    assert srunwords.cancelled(failed) is None
    assert srunwords.cancelled("srun: error: vm: task 1: Killed\n") is None
    assert srunwords.cancelled("*** STEP 4.0 ON vm CANCELLED") is None
