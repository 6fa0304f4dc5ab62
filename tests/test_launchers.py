"""The two ways ranks start: ddtrain's forkserver launcher (here at world size
8, the demo's size) and torchrun running `python -m ddtop.training`. The two
`ddtrain start` runs start together (a module fixture)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from dataset_files import write_mnist_like
from helpers import DDTRAIN, Together, collecting, metric_records, together, torchrun

from ddtop.core import wire


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Together]:
    """The two `ddtrain start` runs, started together (their start-ups overlap):
    8 ranks (`w8`), and 2 ranks on MNIST-like files (`m`)."""
    with together(tmp_path_factory.mktemp("launchers")) as started:
        started.start("w8", [DDTRAIN, "start", "--foreground", "--world-size", "8", "--epochs",
                             "1", "--synthetic-train-samples", "1024",
                             "--synthetic-val-samples", "100", "--run-id", "w8"])
        write_mnist_like(started.cwd("m") / "data", "MNIST", n_train=64, n_test=30)
        started.start("m", [DDTRAIN, "start", "--foreground", "-n", "2", "--dataset", "mnist",
                            "--model", "cnn", "--data-dir", "data", "--epochs", "1",
                            "--batch-size", "16", "--run-id", "m",
                            "--workers", "2"])  # one data-loader worker process per rank
        yield started


@pytest.mark.slow
@pytest.mark.processes
def test_eight_ranks(runs: Together) -> None:
    run, tmp_path = runs.result("w8"), runs.cwd("w8")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.leftovers == []
    assert "8 ranks, backend gloo on cpu" in run.stdout
    for rank in range(8):
        assert (tmp_path / f"runs/w8/logs/rank-{rank}.log").is_file()
    (record,) = metric_records(tmp_path / "runs/w8")
    assert (record["train_samples"], record["val_samples"]) == (1024, 100)
    status = json.loads((tmp_path / "runs/w8/run.json").read_text())
    assert [r["exit_code"] for r in status["ranks"]] == [0] * 8
    assert re.search(r"first step done [\d.]+ s after launch", run.stdout)


@pytest.mark.processes
def test_torchrun_runs_the_training_module(tmp_path: Path) -> None:
    with collecting() as telemetry:  # DDTOP_TELEMETRY set by hand, as a torchrun user would
        run = torchrun("--standalone", "--nproc-per-node", "2", "-m", "ddtop.training",
                       "--epochs", "1", "--synthetic-train-samples", "256",
                       "--synthetic-val-samples", "50", "--batch-size", "32", cwd=tmp_path,
                       env={"DDTOP_TELEMETRY": telemetry.endpoint})
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.leftovers == []
    (root,) = (tmp_path / "runs").iterdir()  # one run id, agreed by both ranks
    config = json.loads((root / "config.json").read_text())
    assert config["world_size"] == 2  # taken from torchrun's WORLD_SIZE
    (record,) = metric_records(root)
    assert (record["train_samples"], record["val_samples"]) == (256, 50)
    assert [p.name for p in (root / "checkpoints").iterdir()] == ["step-00000008.pt"]
    for rank in (0, 1):  # every rank published, start to finish, under the shared run id
        assert [m.run for m in telemetry.of(wire.Hello, rank)] == [root.name]
        assert sum(m.steps for m in telemetry.of(wire.Step, rank)) == 8
        assert [m.exit_code for m in telemetry.of(wire.Bye, rank)] == [0]


@pytest.mark.processes
def test_a_ranks_imports_are_out_of_the_collectors_sight() -> None:
    """Every launcher's rank imports ddtop.training.worker (the forkserver once, for
    all its ranks): what that loaded (torch, dynamo) is frozen, so a full collection
    in the rank walks only what came after (docs/training.md)."""
    code = ("import gc; before = gc.get_freeze_count(); import ddtop.training.worker; "
            "print(before, gc.get_freeze_count(), len(gc.get_objects()))")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert got.returncode == 0, got.stderr
    before, frozen, walked = map(int, got.stdout.split())
    assert before == 0 and frozen > 100_000 and walked < frozen / 100, (before, frozen, walked)


@pytest.mark.processes
def test_training_module_outside_torchrun_says_how_to_launch(tmp_path: Path) -> None:
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "ddtop.training"], cwd=tmp_path, text=True,
                         capture_output=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin"})
    assert run.returncode == 2
    assert "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set" in run.stderr
    assert "torchrun" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.processes
def test_mnist_files_train_end_to_end(runs: Together) -> None:
    run, tmp_path = runs.result("m"), runs.cwd("m")
    assert run.returncode == 0, run.stdout + run.stderr
    (record,) = metric_records(tmp_path / "runs/m")
    assert (record["train_samples"], record["val_samples"]) == (64, 30)
