"""Under a real SLURM: a one-machine cluster (tests/slurmfix.py: Debian's munged,
slurmctld and slurmd under a temp folder) runs the examples/slurm batch scripts
(a one-node variant of each) and `ddtrain watch -- srun -n 2 ...` over an
unchanged gloo DDP script (tests/scripts/plain_ddp.py).

Every rank's steps are counted; a rank killed with SIGKILL is named with its
signal (srun's own words of its tasks: daemon/launcherwords.py); scancel stops the
run with no failure recorded; nothing is left behind. The runs start together
(a module fixture) and each test waits for its own. Skipped, saying why, where
the cluster cannot be had (not root, or the packages missing: .ci/run installs
them)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import BIN, DDTRAIN, Together, together
from tests.slurmfix import Slurm, skip_reason

pytestmark = pytest.mark.processes

SCRIPT = Path(__file__).parent / "scripts" / "plain_ddp.py"
EXAMPLES = Path(__file__).parent.parent / "examples" / "slurm"
# srun's two tasks made ranks as examples/slurm/watch-srun.sbatch makes them.
SRUN_TASKS = ["bash", "-c", 'RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID '
              'WORLD_SIZE=$SLURM_NTASKS exec python "$@"', "srun-task", str(SCRIPT)]
# One node of this machine for the examples' two: no GPUs, 2 CPUs a task.
ONE_NODE = ["--wait", "--nodes=1", "--gpus-per-node=0"]
SCANCELLED = "ddtop-scancel"  # the job step the scancel test cancels, by its name
RUN_TIMEOUT_S = 150


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    cluster = Slurm.up(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.down()


@pytest.fixture(scope="module")
def jobs(slurm: Slurm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Together]:
    root = tmp_path_factory.mktemp("jobs")
    base = {"SLURM_CONF": str(slurm.conf), "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
            "RUNS": str(root / "runs"), "MASTER_ADDR": "127.0.0.1"}
    with together(root) as runs:
        runs.start("sbatch-watch", ["sbatch", *ONE_NODE, "--ntasks-per-node=2",
                                    "--output=job.out", str(EXAMPLES / "watch-srun.sbatch"),
                                    str(SCRIPT)],
                   {**base, "STEPS": "6", "MASTER_PORT": str(free_port())}, RUN_TIMEOUT_S)
        runs.start("sbatch-ddtrain", ["sbatch", *ONE_NODE, "--cpus-per-task=2",
                                      "--output=job.out", str(EXAMPLES / "ddtrain.sbatch"),
                                      "--epochs", "1", "--synthetic-train-samples", "256",
                                      "--synthetic-val-samples", "64"],
                   {**base, "NPROC_PER_NODE": "2", "RDZV_PORT": str(free_port())},
                   RUN_TIMEOUT_S)
        runs.start("sbatch-torchrun", ["sbatch", *ONE_NODE, "--cpus-per-task=2",
                                       "--output=job.out", str(EXAMPLES / "watch.sbatch"),
                                       str(SCRIPT)],
                   {**base, "STEPS": "6", "NPROC_PER_NODE": "2", "RDZV_PORT": str(free_port())},
                   RUN_TIMEOUT_S)
        runs.start("killed", [DDTRAIN, "watch", "--run-id", "killed", "--", "srun", "-n", "2",
                              *SRUN_TASKS],
                   {**base, "MASTER_PORT": str(free_port()), "STEPS": "400", "SLEEP": "0.02",
                    "DIE_RANK": "1", "DIE_STEP": "5"}, RUN_TIMEOUT_S)
        runs.start("scancel", [DDTRAIN, "watch", "--headless", "--run-id", "scancel", "--",
                               "srun", "-n",
                               "2", "-J", SCANCELLED, *SRUN_TASKS],
                   {**base, "MASTER_PORT": str(free_port()), "STEPS": "4000",
                    "SLEEP": "0.05"}, RUN_TIMEOUT_S)
        yield runs


def status(cwd: Path, run: str) -> dict[str, Any]:
    done = subprocess.run([DDTRAIN, "status", run, "--json"], cwd=cwd, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def job_id(out: str) -> str:
    """sbatch's 'Submitted batch job N'."""
    return out.split()[-1]


def steps(got: dict[str, Any]) -> list[tuple[int, str, int]]:
    return [(r["rank"], r["state"], r["global_step"]) for r in got["ranks"]]


def batch_job(jobs: Together, name: str, steps_each: int) -> None:
    """One of the examples as a one-node batch job: sbatch --wait exits 0, the run
    (slurm-JOBID) succeeded with each of its two ranks at `steps_each`, nothing left."""
    run = jobs.result(name)
    out = (jobs.cwd(name) / "job.out").read_text()
    assert run.returncode == 0, (run.stderr, out)
    got = status(jobs.cwd(name), str(jobs.root / "runs" / f"slurm-{job_id(run.stdout)}"))
    assert got["status"] == "succeeded", out
    assert steps(got) == [(0, "finished", steps_each), (1, "finished", steps_each)], out
    assert not run.leftovers


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_the_srun_watch_example_counts_every_step_of_both_tasks(jobs: Together) -> None:
    batch_job(jobs, "sbatch-watch", 6)


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_the_ddtrain_example_trains_the_built_in_model_on_one_node(jobs: Together) -> None:
    batch_job(jobs, "sbatch-ddtrain", 4)


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_the_torchrun_watch_example_counts_every_step(jobs: Together) -> None:
    batch_job(jobs, "sbatch-torchrun", 6)


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_a_task_killed_under_srun_is_named_with_its_signal(jobs: Together) -> None:
    run = jobs.result("killed")
    assert run.returncode != 0, run.stderr
    said = (jobs.cwd("killed") / "runs" / "killed" / "logs" / "command.log").read_text()
    assert "task 1: Killed" in said, said  # srun's words of it, which ddtrain read
    assert "rank 1 (pid" in run.stderr and "was killed by SIGKILL" in run.stderr, run.stderr
    got = status(jobs.cwd("killed"), "killed")
    failure = got["failure"]
    assert (failure["rank"], failure["signal"], failure["reason"]) == (1, "SIGKILL", None), got
    assert 0 <= failure["global_step"] <= 5, failure  # the last step heard of it
    assert not run.leftovers


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_scancel_stops_the_run_with_no_failure(jobs: Together, slurm: Slurm) -> None:
    cwd = jobs.cwd("scancel")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:  # both ranks training before the cancel
        if (cwd / "runs" / "scancel" / "run.json").exists():
            got = status(cwd, "scancel")
            if [r["state"] for r in got["ranks"]] == ["running", "running"] and all(
                    r["global_step"] >= 2 for r in got["ranks"]):
                break
        time.sleep(0.5)
    else:
        pytest.fail(f"the ranks never trained: {jobs.result('scancel').stderr}")
    cancelled = subprocess.run(["scancel", "--name", SCANCELLED], env=slurm.env,
                               capture_output=True, text=True, timeout=30)
    assert cancelled.returncode == 0, cancelled.stderr
    run = jobs.result("scancel")
    assert "stopped after" in run.stderr and "by SLURM (scancel of job step" in run.stderr, \
        run.stderr
    got = status(cwd, "scancel")
    assert got["status"] == "stopped" and got["failure"] is None, got
    assert [(r["state"], r["signal"], r["stopped_by_daemon"]) for r in got["ranks"]] == [
        ("dead", "SIGTERM", True)] * 2, got["ranks"]
    said = run.stdout + run.stderr  # --headless: every event a line
    assert said.count("was stopped by SLURM (scancel of job step") == 2, said
    assert "] error:" not in said and "failed" not in said, said
    assert not run.leftovers
