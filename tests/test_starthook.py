"""Zero-code watching in ranks that ddtrain did not start: the start-up hook the
package installs (training/starthook.py, through ddtop-starthook.pth) and
`python -m ddtop.run`, for real: torchrun (`python -m torch.distributed.run`)
of an unchanged 2-rank gloo DDP script, a parent with no RANK that starts its
second rank itself as Lightning does, exit codes, and the processes that must
send nothing; received by a real ZeroMQ PULL socket on loopback."""

from __future__ import annotations

import ast
import importlib
import sys
import sysconfig
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import Collector, Run, collecting, finish, start, torch_aborted_at_exit
from test_api import PARAM_BYTES, SCRIPTS, free_port, wait_for

from ddtop.core import wire
from ddtop.training import starthook

REPO = Path(__file__).resolve().parent.parent
PTH = REPO / "training" / "ddtop-starthook.pth"
TIMEOUT_S = 120
STEPS = 4
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None,
        timeout: float = TIMEOUT_S) -> tuple[int, str, str]:
    """`cmd`, its own processes tagged and timed out; nothing left behind."""
    proc, tag = start(cmd, cwd, {"OMP_NUM_THREADS": "1", **(env or {})})
    done = finish(proc, tag, timeout)
    assert done.leftovers == []
    return done.returncode, done.stdout, done.stderr


def assert_watched(collector: Collector, ranks: int, steps: int, step_bytes: int) -> None:
    """Each rank said hello as itself, counted `steps` optimizer steps with their
    all-reduces timed, said goodbye with 0, and warned of nothing."""
    wait_for(collector, wire.Bye, ranks)
    assert collector.errors == 0
    for rank in range(ranks):
        hello = collector.of(wire.Hello, rank)[-1]
        assert (hello.world_size, hello.local_rank, hello.model) == (ranks, rank, "Sequential")
        sent = collector.of(wire.Step, rank)
        assert sum(s.steps for s in sent) == steps and sent[-1].global_step == steps
        assert sum(s.comm_bytes for s in sent) == steps * step_bytes
        assert sum(s.comm_ops for s in sent) >= steps and sum(s.comm_s for s in sent) > 0
        assert [b.exit_code for b in collector.of(wire.Bye, rank)] == [0]
    assert {m.rank for m in collector.messages} == set(range(ranks))
    assert len({h.pid for h in collector.of(wire.Hello)}) == ranks
    assert [e.message for e in collector.of(wire.Event)] == []


# -- the hook, in process ----------------------------------------------------------------------
def test_the_package_installed_the_hook_in_site_packages() -> None:
    installed = Path(sysconfig.get_paths()["purelib"]) / PTH.name
    assert installed.is_file(), (
        f"{installed} is missing: install the package again (pip install -e .)")
    assert installed.read_text() == PTH.read_text()
    (line,) = PTH.read_text().splitlines()
    assert line.startswith("import os; ")  # `site` runs a line that starts so


@pytest.fixture
def a_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The name of a new module (in tmp_path, on the path) nobody has imported yet."""
    name = f"probe_{uuid.uuid4().hex}"
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_after_import_calls_back_once_the_module_ran_and_leaves_its_loader(
        tmp_path: Path, a_module: str) -> None:
    (tmp_path / f"{a_module}.py").write_text("VALUE = 41 + 1\n")
    seen: list[int] = []
    finder = starthook.AfterImport(a_module, lambda: seen.append(sys.modules[a_module].VALUE))
    sys.meta_path.insert(0, finder)
    try:
        module = importlib.import_module(a_module)
    finally:
        leftover = finder in sys.meta_path
        if leftover:
            sys.meta_path.remove(finder)
    assert seen == [42] and not leftover
    assert type(module.__loader__).__name__ == "SourceFileLoader"
    assert "exec_module" not in vars(module.__loader__)  # its own method again


def test_after_import_waits_on_through_a_failed_import(tmp_path: Path, a_module: str) -> None:
    script = tmp_path / f"{a_module}.py"
    script.write_text("raise ImportError('not yet')\n")
    seen: list[str] = []
    finder = starthook.AfterImport(a_module, lambda: seen.append("imported"))
    sys.meta_path.insert(0, finder)
    try:
        with pytest.raises(ImportError, match="not yet"):
            importlib.import_module(a_module)
        assert seen == [] and finder in sys.meta_path
        script.write_text("VALUE = 1\n")
        importlib.invalidate_caches()
        importlib.import_module(a_module)
        assert seen == ["imported"] and finder not in sys.meta_path
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)


@pytest.mark.parametrize(("status", "code"), [(None, 0), (0, 0), (3, 3), ("bad input", 1),
                                              (True, 1)])
def test_the_exit_code_a_system_exit_gives(status: object, code: int) -> None:
    assert starthook.exit_code(status) == code


# -- a fresh interpreter ---------------------------------------------------------------------------
LOADED = ("import sys; print(sorted(m for m in sys.modules "
          "if m.split('.')[0] in ('ddtop', 'torch', 'zmq', 'msgspec')))")


@pytest.mark.parametrize(("value", "loaded"), [
    (None, []), ("", []), ("off", []),
    ("tcp://127.0.0.1:9", ["ddtop", "ddtop.training", "ddtop.training.starthook"]),
])
@pytest.mark.processes
def test_the_hook_loads_only_in_the_watch_environment_and_nothing_heavy(
        tmp_path: Path, value: str | None, loaded: list[str]) -> None:
    code, out, err = run([sys.executable, "-c", LOADED], tmp_path,
                         None if value is None else {"DDTOP_TELEMETRY": value}, timeout=30)
    assert (code, err) == (0, "")
    assert ast.literal_eval(out) == loaded


# -- ranks started by another launcher -----------------------------------------------------------
@pytest.mark.parametrize("runner", [[], ["-m", "ddtop.run"]], ids=["hook", "ddtop.run"])
@pytest.mark.processes
def test_torchrun_ranks_of_an_unchanged_script_are_watched(tmp_path: Path,
                                                           runner: list[str]) -> None:
    for attempt in (1, 2):  # a second only after torch's abort at exit (helpers.py)
        with collecting() as collector:
            code, out, err = run([*TORCHRUN, *runner, str(SCRIPTS / "ddp_accum.py"), "--steps",
                                  str(STEPS), "--accum", "2"], tmp_path,
                                 {"DDTOP_TELEMETRY": collector.endpoint, "DDTOP_RUN_ID": "tr"})
            if attempt == 1 and torch_aborted_at_exit(Run(code, out, err, []), "torchrun's ranks"):
                continue
            assert code == 0, err[-3000:]
            assert_watched(collector, 2, STEPS, PARAM_BYTES)
        break
    assert {m.run for m in collector.messages} == {"tr"}
    hello = collector.of(wire.Hello, 1)[-1]
    assert hello.program == f"ddp_accum.py --steps {STEPS} --accum 2"


# Lightning's way (without Lightning): the user's `python train.py` is rank 0, with
# no RANK or LOCAL_RANK at start; it starts rank 1 itself, sets LOCAL_RANK, and both
# initialise the group with rank and world size given.
SPAWNS_ITS_OWN_RANK = f"""\
import os, subprocess, sys, torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
child = sys.argv[1:] == ["child"]
if not child:
    assert not {{"RANK", "LOCAL_RANK", "WORLD_SIZE"}} & set(os.environ)
    second = subprocess.Popen([sys.executable, __file__, "child"],
                              env={{**os.environ, "LOCAL_RANK": "1"}})
    os.environ["LOCAL_RANK"] = "0"
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"],
                        rank=1 if child else 0, world_size=2)
model = DDP(nn.Sequential(nn.Linear(8, 2)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range({STEPS}):
    model(torch.ones(4, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
dist.destroy_process_group()
if not child:
    sys.exit(second.wait())
"""


@pytest.mark.processes
def test_a_script_that_starts_its_own_second_rank_is_two_ranks(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SPAWNS_ITS_OWN_RANK)
    for attempt in (1, 2):  # a second only after torch's abort at exit (helpers.py)
        with collecting() as collector:
            code, out, err = run([sys.executable, str(script)], tmp_path,
                                 {"DDTOP_TELEMETRY": collector.endpoint,
                                  "PORT": str(free_port())})
            if attempt == 1 and torch_aborted_at_exit(Run(code, out, err, []),
                                                      "a script's own second rank"):
                continue
            assert code == 0, err[-3000:]
            assert_watched(collector, 2, STEPS, (8 * 2 + 2) * 4)
        break


ONE_RANK = """\
import os, sys, torch, torch.distributed as dist, ddtop
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
{before}
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"],
                        rank=0, world_size=1)
model = DDP(nn.Sequential(nn.Linear(8, 2)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.ones(4, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
print("wrapped", hasattr(dist.init_process_group, "__wrapped__"))
{end}
"""


def one_rank(tmp_path: Path, collector: Collector, end: str, before: str = "",
             runner: tuple[str, ...] = (), env: dict[str, str] | None = None
             ) -> tuple[int, str, str]:
    script = tmp_path / "train.py"
    script.write_text(ONE_RANK.format(before=before, end=end))
    return run([sys.executable, *runner, str(script)], tmp_path,
               {"DDTOP_TELEMETRY": collector.endpoint, "PORT": str(free_port()), **(env or {})})


@pytest.mark.parametrize(("runner", "end", "code"), [
    ((), "sys.exit(3)", 3),
    (("-m", "ddtop.run"), "raise SystemExit(4)", 4),
    ((), "raise ValueError('boom')", 1),
    (("-m", "ddtop.run"), "raise ValueError('boom')", 1),
])
@pytest.mark.processes
def test_a_rank_says_goodbye_with_its_exit_code(tmp_path: Path, runner: tuple[str, ...],
                                                end: str, code: int) -> None:
    with collecting() as collector:
        returned, out, err = one_rank(tmp_path, collector, end, runner=runner)
        assert returned == code, err
        wait_for(collector, wire.Bye)
    assert out == "wrapped True\n"
    assert [b.exit_code for b in collector.of(wire.Bye)] == [code]
    assert sum(s.steps for s in collector.of(wire.Step)) == 3
    errors = [e for e in collector.of(wire.Event) if e.type == "error"]
    if "ValueError" in end:
        assert [e.message for e in errors] == ["ValueError: boom"], errors
        # The traceback Python prints starts at the script, with ddtop.run too (torch's
        # own excepthook puts the rank in front of each line once a group exists).
        lines = [line.removeprefix("[rank0]: ") for line in err.splitlines()]
        assert lines[1].startswith(f'  File "{tmp_path / "train.py"}"'), err
    else:
        assert errors == [] and err == ""


@pytest.mark.processes
def test_a_script_that_reports_already_keeps_its_one_rank(tmp_path: Path) -> None:
    """ddtop.init() before the process group: the hook instruments that rank (its
    optimizer steps are counted) and starts no second one."""
    with collecting() as collector:
        code, _, err = one_rank(tmp_path, collector, "", before="ddtop.init(total_steps=3)",
                                env={"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
        assert code == 0, err
        wait_for(collector, wire.Bye)
        assert_watched(collector, 1, 3, (8 * 2 + 2) * 4)
    assert collector.of(wire.Hello)[-1].total_steps == 3


NO_GROUP = """\
import torch, torch.distributed as dist
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0).step()
print("wrapped", hasattr(dist.init_process_group, "__wrapped__"))
"""


@pytest.mark.parametrize("asks_for_none", [False, True], ids=["no-group", "zero-code-off"])
@pytest.mark.processes
def test_a_process_that_is_no_rank_or_asks_for_none_sends_nothing(
        tmp_path: Path, asks_for_none: bool) -> None:
    """Armed all the same (init_process_group is wrapped), but no group (torchrun's
    agent, a data loader worker), or DDTOP_ZERO_CODE=off and no ddtop call: silence."""
    with collecting() as collector:
        if asks_for_none:
            code, out, err = one_rank(tmp_path, collector, "", env={"DDTOP_ZERO_CODE": "off"})
        else:
            (tmp_path / "train.py").write_text(NO_GROUP)
            code, out, err = run([sys.executable, str(tmp_path / "train.py")], tmp_path,
                                 {"DDTOP_TELEMETRY": collector.endpoint})
        assert (code, out, err) == (0, "wrapped True\n", "")
    assert collector.messages == []


# -- python -m ddtop.run ---------------------------------------------------------------------------
SHOWS_ITSELF = """\
import sys
print(__name__, sys.argv, sys.path[0], "torch" in sys.modules)
sys.exit(5)
"""


@pytest.mark.processes
def test_ddtop_run_runs_a_script_or_a_module_as_python_does(tmp_path: Path) -> None:
    folder = tmp_path / "scripts"
    folder.mkdir()
    (folder / "train.py").write_text(SHOWS_ITSELF)
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "train.py").write_text(SHOWS_ITSELF)
    code, out, err = run([sys.executable, "-m", "ddtop.run", "scripts/train.py", "--lr", "3"],
                         tmp_path)
    assert (code, err) == (5, "")  # and unwatched without DDTOP_TELEMETRY: nothing said
    assert out == f"__main__ ['scripts/train.py', '--lr', '3'] {folder.resolve()} False\n"
    code, out, err = run([sys.executable, "-m", "ddtop.run", "-m", "mypkg.train", "-x"], tmp_path)
    assert (code, err) == (5, "")
    module_file = tmp_path / "mypkg" / "train.py"
    assert out.startswith(f"__main__ ['{module_file}', '-x'] {tmp_path} "), out


@pytest.mark.parametrize(("args", "says"), [
    ([], "give the script to run"),
    (["missing.py"], "missing.py: no such file"),
    (["-m"], "-m needs a module name"),
    (["-m", "nosuchpackage.train"], "no module 'nosuchpackage'"),
    (["--lr", "3", "train.py"], "--lr: python -m ddtop.run takes no options"),
])
@pytest.mark.processes
def test_ddtop_run_without_a_program_it_can_run_is_one_line(tmp_path: Path, args: list[str],
                                                            says: str) -> None:
    code, out, err = run([sys.executable, "-m", "ddtop.run", *args], tmp_path, timeout=30)
    assert (code, out) == (2, "")
    (line,) = err.splitlines()
    assert line.startswith("ddtop.run: error: ") and says in line, err


@pytest.mark.processes
def test_ddtop_run_help_is_the_manual(tmp_path: Path) -> None:
    code, out, err = run([sys.executable, "-m", "ddtop.run", "--help"], tmp_path, timeout=30)
    assert (code, err) == (0, "")
    assert "torchrun --nproc-per-node 8 -m ddtop.run train.py" in out
    assert out.startswith("`python -m ddtop.run SCRIPT")
