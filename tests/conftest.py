"""Shared fixtures, the line between the two tiers of the suite, and its order
in parallel.

A test that starts a process (a `ddtrain` or `torchrun` subprocess, a forkserver,
any fork) carries `@pytest.mark.processes` (or its module's `pytestmark`); one
that starts a process without it fails, naming the mark. `make test-fast` runs
the others (`-m "not processes"`): lint, types and the in-process tests, for
the edit loop; `make test` runs everything.

In parallel (pytest-xdist, `--dist loadfile`: `make test-fast`, or `make test`
with PYTEST_WORKERS) a module's tests run on one worker, so that its module
fixtures are started once. Each worker collects the
modules with the most process tests first: the long ones start at once and the
in-process modules fill the gaps at the end.
"""

from __future__ import annotations

import json
import multiprocessing.util
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

sys.path.insert(0, str(Path(__file__).parent))

from helpers import Run, ddtrain

# A small run shared by several tests: 2 ranks, 2 epochs of 8 steps, a
# checkpoint after every step, global metrics every 4 steps, and a validation
# set that does not split evenly.
REFERENCE_ARGS = (
    "--world-size", "2", "--epochs", "2", "--batch-size", "32", "--lr", "0.05", "--seed", "3",
    "--synthetic-train-samples", "256", "--synthetic-val-samples", "101",
    "--checkpoint-every", "1", "--keep-checkpoints", "0", "--sync-every", "4",
)


class ReferenceRun:
    def __init__(self, run: Run, root: Path) -> None:
        self.run, self.root = run, root


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> ReferenceRun:
    """Run once for the whole session: under xdist the first worker to need it runs
    it (holding a lock in the folder all workers share) and the others read it."""
    shared = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        shared = shared.parent  # each worker's base is a folder in the session's
    cwd, result = shared / "reference", shared / "reference.json"
    with FileLock(str(shared / "reference.lock")):
        if not result.exists():
            cwd.mkdir()
            run = ddtrain("start", "--foreground", *REFERENCE_ARGS, "--run-id", "ref", cwd=cwd,
                          env={"DDTOP_TELEMETRY": "off"})  # no comm hook: the baseline
            result.write_text(json.dumps(vars(run)))
    run = Run(**json.loads(result.read_text()))
    assert run.returncode == 0, run.stdout + run.stderr
    return ReferenceRun(run, cwd / "runs" / "ref")


# -- the tiers ---------------------------------------------------------------------
PROCESSES = "processes"
_running: list[pytest.Item] = []  # the test whose set-up, call or tear-down runs now


def _checked(start: Callable[..., Any]) -> Callable[..., Any]:
    def guarded(*args: Any, **kwargs: Any) -> Any:
        item = _running[-1] if _running else None
        if item is not None and item.get_closest_marker(PROCESSES) is None:
            pytest.fail(f"{item.nodeid} starts a process: mark it @pytest.mark.{PROCESSES} "
                        "(make test-fast leaves such tests out)", pytrace=False)
        return start(*args, **kwargs)
    return guarded


def pytest_configure(config: pytest.Config) -> None:
    """Every way a test can start a process goes through a check of its mark:
    subprocess, multiprocessing's forkserver and spawn (spawnv_passfds), fork.
    torch is imported first: its first import runs `ldconfig -p` (looking for CUDA's
    libraries), a process no test starts, whichever test happens to import it first."""
    import torch  # noqa: F401 -- for the start-up process it runs, before the check
    subprocess.Popen._execute_child = _checked(  # type: ignore[attr-defined]
        subprocess.Popen._execute_child)  # type: ignore[attr-defined]
    multiprocessing.util.spawnv_passfds = _checked(multiprocessing.util.spawnv_passfds)
    os.fork = _checked(os.fork)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _running.append(item)
    try:
        yield
    finally:
        _running.pop()


# -- the order under xdist ----------------------------------------------------------------
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker: modules in order of their process tests, most first (a
    stable sort: each module's tests keep their order; every worker sorts alike)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    weight = Counter(item.path for item in items if item.get_closest_marker(PROCESSES))
    items.sort(key=lambda item: -weight[item.path])
