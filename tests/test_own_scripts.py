"""`ddtrain start train.py -- ARGS` and `-m pkg.mod`: the user's own program as
every rank, with torchrun's environment, under the daemon. Real processes,
real gloo process groups; each run checked for leftovers. The foreground runs
start together (a module fixture), each in a folder of its own."""

from __future__ import annotations

import json
import signal
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import DDTRAIN, Together, ddtrain, detached, together

# What a rank sees of its world, printed as JSON, then a few DDP steps of its own.
DDP_SCRIPT = '''\
import json, os, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

if __name__ == "__main__":
    print("SEEN " + json.dumps({"name": __name__, "argv": sys.argv, "cwd": os.getcwd(),
          "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                  "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")},
          "path0": sys.path[0]}), flush=True)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(int(sys.argv[sys.argv.index("--steps") + 1])):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    weights = [p.detach().sum().item() for p in model.parameters()]
    print("WEIGHTS " + json.dumps(weights), flush=True)
    dist.destroy_process_group()
'''


def seen(root: Path, rank: int) -> dict:  # type: ignore[type-arg]
    log = (root / "logs" / f"rank-{rank}.log").read_text()
    line = next(line for line in log.splitlines() if line.startswith("SEEN "))
    data: dict = json.loads(line[5:])  # type: ignore[type-arg]
    return data


def weights(root: Path, rank: int) -> list[float]:
    log = (root / "logs" / f"rank-{rank}.log").read_text()
    line = next(line for line in log.splitlines() if line.startswith("WEIGHTS "))
    found: list[float] = json.loads(line[8:])
    return found


def make_project(folder: Path) -> Path:
    """A user's folder: a script in a subfolder, and a package with a module."""
    (folder / "scripts").mkdir(parents=True)
    (folder / "scripts" / "train.py").write_text(DDP_SCRIPT)
    (folder / "mypkg").mkdir()
    (folder / "mypkg" / "__init__.py").write_text("")
    (folder / "mypkg" / "train.py").write_text(DDP_SCRIPT)
    return folder


# A rank that raises before its process group: rank 1's own traceback names it.
BOOM = '''\
import os, time
def load(rank):
    if rank == "1":
        raise ValueError("bad shard " + rank)
load(os.environ["RANK"])
time.sleep(60)
'''

# Rank 1 killed in the first attempt, then both through a barrier.
FLAKY = '''\
import os
import torch.distributed as dist
dist.init_process_group("gloo")
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
if attempt == "0" and dist.get_rank() == 1:
    os.kill(os.getpid(), 9)
dist.barrier()
print("attempt", attempt, "done", flush=True)
'''

# A script with its own ddtop lines: steps, loss and scalars.
LOGS = '''\
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import ddtop
dist.init_process_group("gloo")
ddtop.init(total_steps=20)
model = DDP(torch.nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(20):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    ddtop.step(loss=loss, samples=8)
    ddtop.log(grad_norm=float(dist.get_rank() + 1), lr=0.1)
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Together]:
    """The foreground runs, started together with the module's first process test
    (they run beside the tests before theirs), each in a folder of its own; each
    test waits for its own and checks for leftovers."""
    with together(tmp_path_factory.mktemp("own")) as started:
        for name in ("own", "mod-torchrun", "mod-spawn", "zero"):
            make_project(started.cwd(name))
        for name, file, text in (("boom", "boom.py", BOOM), ("fl", "flaky.py", FLAKY),
                                 ("lg", "logs.py", LOGS)):
            started.cwd(name).mkdir()
            (started.cwd(name) / file).write_text(text)
        fg = [DDTRAIN, "start", "--foreground", "-n", "2"]
        started.start("own", [*fg, "--run-id", "own", "scripts/train.py",
                              "--", "--steps", "3", "--name", "a b"])
        for name, launch in (("mod-torchrun", ["--launcher", "torchrun"]),
                             ("mod-spawn", ["--start-method", "spawn"])):
            started.start(name, [*fg, *launch, "--run-id", "mod",
                                 "-m", "mypkg.train", "--", "--steps", "2"])
        started.start("boom", [*fg, "--run-id", "boom", "boom.py"], timeout=90)
        started.start("fl", [*fg, "--max-restarts", "1", "--run-id", "fl", "flaky.py"],
                      timeout=120)
        started.start("zero", [*fg, "--headless", "--format", "jsonl", "--interval", "0.2",
                               "--run-id", "zero", "scripts/train.py", "--", "--steps", "30"])
        started.start("lg", [*fg, "--headless", "--run-id", "lg", "logs.py", "--", "--x", "1"])
        yield started


@pytest.mark.parametrize(("args", "fragments"), [
    (["bad.py"], ["bad.py:1: invalid syntax", "fix the script"]),
    (["missing.py"], ["missing.py: no such file", "-m MODULE"]),
    (["-m", "nosuchpkg.train"], ["no module 'nosuchpkg'", "install it"]),
    (["-m", "not a module"], ["not a module name"]),
    (["--", "--lr", "1"], ["arguments after -- (--lr 1) are for a script"]),
    # What follows the script is its own, -m too (as torchrun passes it): the script
    # is checked, not refused as "a script and a module".
    (["bad.py", "-m", "x"], ["bad.py:1: invalid syntax"]),
])
@pytest.mark.usefixtures("runs")  # started now, to run beside the tests up to theirs
@pytest.mark.processes
def test_a_program_that_cannot_run_is_one_line_and_starts_nothing(
        tmp_path: Path, args: list[str], fragments: list[str]) -> None:
    (tmp_path / "bad.py").write_text("def f(:\n    pass\n")
    run = ddtrain("start", "-n", "2", *args, cwd=tmp_path, timeout=30)
    assert run.returncode == 2, run.stdout + run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr
    for fragment in fragments:
        assert fragment in run.stderr
    assert not (tmp_path / "runs").exists() and run.leftovers == []


@pytest.mark.processes
def test_a_detached_script_is_stopped_with_sigterm(tmp_path: Path) -> None:
    (tmp_path / "long.py").write_text(textwrap.dedent('''\
        import time
        import torch.distributed as dist
        dist.init_process_group("gloo")
        print("training", flush=True)
        while True:
            time.sleep(0.1)
        '''))
    with detached("-n", "2", "--run-id", "long", "long.py", cwd=tmp_path) as run:
        assert run.started.returncode == 0, run.started.stderr
        run.wait_for("long", lambda s: len(s["ranks"]) == 2
                       and all(r["pid"] is not None for r in s["ranks"]))
        stopped = run.cli("stop", "long", "--timeout", "10")
        assert "its ranks get SIGTERM" in stopped.stdout and "run long stopped" in stopped.stdout
        assert run.leftovers() == []
    record = json.loads((tmp_path / "runs/long/run.json").read_text())
    assert (record["status"], record["exit_code"], record["failure"]) == ("stopped", 130, None)
    assert {(r["signal"], r["stopped_by_daemon"]) for r in record["ranks"]} == {
        (signal.Signals.SIGTERM.name, True)}


@pytest.mark.processes
def test_a_script_runs_as_every_rank_with_torchruns_environment(runs: Together) -> None:
    run, project = runs.result("own"), runs.cwd("own")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.leftovers == []
    assert "starting run own with 2 ranks of scripts/train.py --steps 3 --name 'a b'" in run.stdout
    root = project / "runs" / "own"
    for rank in (0, 1):
        got = seen(root, rank)
        assert got["name"] == "__main__"
        assert got["argv"] == ["scripts/train.py", "--steps", "3", "--name", "a b"]
        assert got["cwd"] == str(project)
        assert got["path0"] == str(project / "scripts")  # as `python scripts/train.py`
        env = got["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert (env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == ("2", "0")
    assert weights(root, 0) == weights(root, 1)  # DDP kept them in step
    record = json.loads((root / "run.json").read_text())
    assert (record["status"], record["exit_code"]) == ("succeeded", 0)
    assert [r["exit_code"] for r in record["ranks"]] == [0, 0]
    config = json.loads((root / "config.json").read_text())
    assert (config["program"], config["program_args"]) == ("scripts/train.py",
                                                           ["--steps", "3", "--name", "a b"])


@pytest.mark.parametrize("launch", ["mod-torchrun", "mod-spawn"])  # --launcher torchrun, spawn
@pytest.mark.processes
def test_a_module_runs_under_torchrun_and_spawn_too(runs: Together, launch: str) -> None:
    run, project = runs.result(launch), runs.cwd(launch)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.leftovers == []
    root = project / "runs" / "mod"
    got = seen(root, 1)
    assert got["name"] == "__main__" and got["cwd"] == str(project)
    assert got["argv"] == [str(project / "mypkg" / "train.py"), "--steps", "2"]  # as python -m
    assert weights(root, 0) == weights(root, 1)


@pytest.mark.processes
def test_a_script_that_raises_is_named_with_its_own_traceback(runs: Together) -> None:
    run, tmp_path = runs.result("boom"), runs.cwd("boom")
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.leftovers == []
    assert "failed: rank 1 (pid" in run.stderr and "ValueError: bad shard 1" in run.stderr
    tail = run.stderr.split("ValueError: bad shard 1", 1)[1]
    assert f'  |   File "{tmp_path}/boom.py", line 5, in <module>' in tail  # as python shows it
    assert "runpy" not in tail and "ddtop" not in tail.split("  log:")[0]  # only the user's frames
    record = json.loads((tmp_path / "runs/boom/run.json").read_text())
    assert record["failure"]["rank"] == 1
    assert "ValueError: bad shard 1" in record["failure"]["message"]


@pytest.mark.processes
def test_max_restarts_runs_the_script_again(runs: Together) -> None:
    run = runs.result("fl")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.leftovers == []
    assert "restart 1/1: rank 1 was killed by SIGKILL" in run.stderr
    assert "the program resumes by its own means" in run.stderr
    assert "[rank 0] attempt 1 done" in run.stdout and "[rank 1] attempt 1 done" in run.stdout


@pytest.mark.processes
def test_a_script_with_no_ddtop_line_shows_steps_and_comm_for_every_rank(runs: Together
                                                                         ) -> None:
    run = runs.result("zero")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.leftovers == []
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert (summary["kind"], summary["status"], summary["program"]) == (
        "summary", "succeeded", "train.py --steps 30")
    assert [(r["rank"], r["state"], r["global_step"]) for r in summary["ranks"]] == [
        (0, "finished", 30), (1, "finished", 30)]  # optimizer steps, counted by the hook
    assert all(r["comm_share"] and r["comm_share"] > 0 for r in summary["ranks"])  # DDP timed
    assert summary["hang"] is None and summary["telemetry_loss"] == 0
    # No sampler set_epoch'd, no epochs given: the epoch is not known (null), never 1.
    progress = [json.loads(line) for line in run.stdout.splitlines()
                if line.startswith('{"kind":"progress"')]
    ranks = [r for p in progress for r in p["ranks"]]
    assert ranks and all(r["epoch"] is None for r in ranks), progress
    assert [r["epoch"] for r in summary["ranks"]] == [None, None]
    record = json.loads((runs.cwd("zero") / "runs" / "zero" / "run.json").read_text())
    assert [r["epoch"] for r in record["ranks"]] == [None, None]


@pytest.mark.processes
def test_a_scripts_own_lines_show_in_the_headless_summary_and_status(runs: Together) -> None:
    run, tmp_path = runs.result("lg"), runs.cwd("lg")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.leftovers == []
    assert "step 20/20" in run.stdout and "  program: logs.py --x 1" in run.stdout
    assert "  scalar grad_norm: mean 1.5 (min 1 rank 0, max 2 rank 1)" in run.stdout
    assert "  scalar lr: mean 0.1" in run.stdout
    status = ddtrain("status", "lg", cwd=tmp_path)
    assert "  logs.py --x 1, gloo; step 20/20 (100.0%)" in status.stdout
    assert "  scalar grad_norm: mean 1.5 (min 1 rank 0, max 2 rank 1)" in status.stdout
