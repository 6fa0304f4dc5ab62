"""A rank killed by the kernel's OOM killer is named so, with its evidence
(daemon/oomkill.py), for real: the oom drill (`--inject 1:oom@step=3`) makes a
memory cgroup of its own beneath the rank's (256 MiB), joins it and allocates
until the kernel kills it. The fixture skips, saying why, where this process
cannot make a memory cgroup (not root, no memory controller, a container). A
SIGKILL sent by someone is not named so: a process killed here, and every kill
drill of tests/test_drills.py ("was killed by SIGKILL")."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import DDTRAIN, finish, start

from ddtop.core import memcg
from ddtop.core.processes import ProcessId
from ddtop.daemon import oomkill

pytestmark = pytest.mark.processes
RUN_TIMEOUT_S = 120


@pytest.fixture
def own_cgroup() -> Path:
    """This process's memory cgroup, where a cgroup can be made beneath it."""
    why = memcg.why_not_writable()
    here = memcg.of("self")
    if why or here is None:
        pytest.skip(why)
    return here


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_a_rank_the_oom_killer_killed_is_named_so_with_its_evidence(
        own_cgroup: Path, tmp_path: Path) -> None:
    proc, tag = start([DDTRAIN, "start", "--foreground", "--headless", "--run-id", "oom",
                       "-n", "2", "--epochs", "1", "--inject", "1:oom@step=3"],
                      tmp_path, {"OMP_NUM_THREADS": "1"})
    run = finish(proc, tag, timeout=RUN_TIMEOUT_S)
    assert run.returncode == 1, run.stderr[-3000:]
    assert run.leftovers == []
    record = json.loads((tmp_path / "runs" / "oom" / "run.json").read_text())
    failure = record["failure"]
    assert (failure["rank"], failure["signal"]) == (1, "SIGKILL"), failure
    pid = failure["pid"]
    words = failure["reason"]
    # Named, with the cgroup it hit (the drill's, its limit, the kill counted there)...
    assert words.startswith("was killed by the kernel's OOM killer (SIGKILL): memory cgroup "
                            f"{own_cgroup / f'ddtop-oom-{pid}'} (limit 256 MiB, its OOM "
                            "kills 0 -> 1); "), words
    # ... the kernel's own line for its pid, where the kernel log is readable ...
    if oomkill.KernelLog().fd is not None:
        assert f"; kernel: 'Memory cgroup out of memory: Killed process {pid} (" in words, words
    # ... and its RSS as the daemon last read it.
    assert re.search(r"; RSS [\d,]+ MiB .*before it died", words), words
    assert f"rank 1 (pid {pid}) {words}" in run.stderr, run.stderr[-3000:]
    # The drill's cgroup is gone with its rank.
    assert not (own_cgroup / f"ddtop-oom-{pid}").exists()


@pytest.mark.timeout(60)
def test_a_sigkill_sent_by_someone_is_not_named_an_oom_kill() -> None:
    watch = oomkill.Watch()
    try:
        if watch.log.fd is None:
            pytest.skip(f"the kernel log is not readable here ({watch.log.why_not}): without "
                        "it, a SIGKILL's cause is a likelihood")
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        process = ProcessId.of(proc.pid)
        assert process is not None
        watch.sample({3: process}, now=time.monotonic())
        assert watch.seen[3].rss, watch.seen  # read: its RSS
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert watch.verdict(3, proc.pid) is None
    finally:
        watch.close()
