"""torchrun's habits through the real `ddtrain start`: --nproc-per-node and
PET_NPROC_PER_NODE give the ranks, everything after the script is the script's,
a built-in trainer's flag with a script and an abbreviation are refused.
Real processes, real gloo process groups; each run checked for leftovers
(tests/test_startline.py covers the many cases in process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import ddtrain

pytestmark = pytest.mark.processes

# Each rank writes what it was given, and the sum of all ranks' numbers.
ARGV_SCRIPT = '''\
import json, os, sys
import torch, torch.distributed as dist

dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
with open(f"argv-{dist.get_rank()}.json", "w") as out:
    json.dump({"argv": sys.argv, "world": dist.get_world_size(), "sum": total.item()}, out)
dist.destroy_process_group()
'''


@pytest.fixture
def script(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text(ARGV_SCRIPT)
    return tmp_path


def seen(folder: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(path.read_text()) for path in sorted(folder.glob("argv-*.json"))]


def test_nproc_per_node_gives_the_ranks_and_the_script_gets_what_follows_it(
        script: Path) -> None:
    run = ddtrain("start", "--foreground", "--nproc-per-node", "2", "--run-id", "tr",
                  "train.py", "--lr", "3e-4", "--epochs", "5", cwd=script, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.leftovers == []
    assert "starting run tr with 2 ranks of train.py --lr 3e-4 --epochs 5" in run.stdout
    assert seen(script) == [{"argv": ["train.py", "--lr", "3e-4", "--epochs", "5"],
                             "world": 2, "sum": 3.0}] * 2


def test_pet_nproc_per_node_is_honoured_as_torchrun_honours_it(script: Path) -> None:
    run = ddtrain("start", "--foreground", "--run-id", "pet", "train.py", "--", "--x",
                  cwd=script, env={"PET_NPROC_PER_NODE": "2"}, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.leftovers == []
    assert seen(script) == [{"argv": ["train.py", "--x"], "world": 2, "sum": 3.0}] * 2


@pytest.mark.parametrize(("args", "line"), [
    (["-n", "2", "--model", "mlp", "train.py"],
     "ddtrain: error: --model is a flag of the built-in trainer, not of train.py"),
    (["-n", "2", "--batch", "32"], "ddtrain: error: unrecognized arguments: --batch"),
    (["-n", "4", "--nproc-per-node", "2", "train.py"],
     "ddtrain: error: -n 4 and --nproc-per-node 2 disagree"),
])
def test_what_torchrun_would_read_otherwise_is_one_line_exit_2_nothing_started(
        script: Path, args: list[str], line: str) -> None:
    run = ddtrain("start", *args, cwd=script, timeout=30)
    assert run.returncode == 2, run.stdout + run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr
    assert run.stderr.startswith(line)
    assert not (script / "runs").exists() and run.leftovers == []
