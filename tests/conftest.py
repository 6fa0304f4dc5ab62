from __future__ import annotations

import sys
from pathlib import Path

import pytest

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
    cwd = tmp_path_factory.mktemp("reference")
    run = ddtrain("start", "--foreground", *REFERENCE_ARGS, "--run-id", "ref", cwd=cwd,
                  env={"DDTOP_TELEMETRY": "off"})  # no comm hook: the baseline
    assert run.returncode == 0, run.stdout + run.stderr
    return ReferenceRun(run, cwd / "runs" / "ref")
