"""Import rules (checked, not hoped for): the daemon and the dashboard never
import torch, so `ddtrain` and `ddtop` answer instantly."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import DDTRAIN

TORCH_FREE = ["ddtop.daemon.cli", "ddtop.daemon.launcher", "ddtop.daemon.config",
              "ddtop.daemon.runs", "ddtop.dashboard.cli", "ddtop.dashboard.app",
              "ddtop.dashboard.headless", "ddtop.dashboard.feed"]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_does_not_import_torch(module: str) -> None:
    code = (f"import sys, {module}; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchvision')); "
            "print(bad); sys.exit(1 if bad else 0)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("args", [["--help"], ["start", "--help"], ["--version"]])
def test_ddtrain_help(args: list[str]) -> None:
    run = subprocess.run([DDTRAIN, *args], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0 and "ddtrain" in run.stdout


def test_start_help_documents_every_flag() -> None:
    run = subprocess.run([DDTRAIN, "start", "--help"], capture_output=True, text=True, timeout=30)
    for flag in ("--world-size", "--backend", "--device", "--model", "--dataset", "--data-dir",
                 "--download", "--epochs", "--batch-size", "--lr", "--seed", "--sync-every",
                 "--checkpoint-every", "--resume", "--runs-dir", "--foreground"):
        assert flag in run.stdout, flag
