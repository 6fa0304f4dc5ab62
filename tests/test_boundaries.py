"""Import rules (checked, not hoped for).

One rule holds the parts apart: every part (training, daemon, dashboard and the public
API) may import `ddtop.core`, what every side shares; `ddtop.core` imports none of them;
no part imports another, but for the public API's one bridge, declared below with its
reason. Every import in core/, training/, daemon/, dashboard/ and api/ (module level or
inside a function) is checked. No module imports itself through others: a cycle, also
one closed by an import under TYPE_CHECKING or inside a function, fails; and none but the
public API sets the public API's state. The heavy libraries stay where they belong:
torch only in training, textual only in the dashboard's app, so `ddtrain` and `ddtop`
answer instantly. docs/development.md draws the same picture.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import DDTRAIN

ROOT = Path(__file__).resolve().parent.parent
CORE = "core"
PARTS = (CORE, "training", "daemon", "dashboard")
# The last part, api/, is the `ddtop` package itself (the public API), with its
# modules beside it (`ddtop.run`).
API = "ddtop"

# The arrows between parts other than core: the public API and the rank side it drives.
BRIDGE = {
    # The built-in trainer reports through the public API, as a user's script does (one path).
    "training": {API},
    # `import ddtop` imports the live implementation (torch, zmq) only when an endpoint is set;
    # `python -m ddtop.run` arms the start-up hook and runs the program as a rank does (both
    # light: no torch).
    "api": {"ddtop.training.api", "ddtop.training.asmain", "ddtop.training.starthook"},
}
# Third-party packages only some modules may import.
HEAVY = {
    "torch": lambda module: module.startswith("ddtop.training."),
    "torchvision": lambda module: module.startswith("ddtop.training."),
    "textual": lambda module: module in {"ddtop.dashboard.app", "ddtop.dashboard.widgets",
                                         "ddtop.dashboard.screens", "ddtop.dashboard.charts",
                                         "ddtop.dashboard.rankmap",
                                         "ddtop.dashboard.mainpanels"},
    # The charts are drawn by plotext through textual-plotext, in their own module.
    "textual_plotext": lambda module: module == "ddtop.dashboard.charts",
    "plotext": lambda module: False,
    # ddtop --serve's web server: loaded only when serving (dashboard/serve.py imports it late).
    "textual_serve": lambda module: module == "ddtop.dashboard.sessions",
    "aiohttp": lambda module: module == "ddtop.dashboard.sessions",
    # The framework callbacks, each in its own module, imported only by a script that uses it.
    "lightning": lambda module: module == "ddtop.lightning",
    "transformers": lambda module: module == "ddtop.transformers",
    # TensorBoard's writer (an optional extra), imported when a writer is made.
    "tensorboard": lambda module: module == "ddtop.core.tbwriter",
    "tensorboardX": lambda module: False,  # it imports torch where torch is installed
}


def imports(source: str, module: str) -> set[str]:
    """Every module `source` imports, with `from pkg import name` resolved to
    `pkg.name` where that names one of our modules."""
    found = set()
    package = module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names
                         if base in ("ddtop", *(f"ddtop.{p}" for p in PARTS)))
    return found


def part_of(module: str) -> str:
    """`api` for `ddtop` and its own modules (ddtop.run), else the folder's name."""
    name = module.split(".")
    return name[1] if len(name) > 1 and name[1] in PARTS else "api"


def violations(module: str, imported: set[str]) -> list[str]:
    """The imports of `module` the rule refuses: a heavy library out of its place, or an
    arrow to another part that is neither core (from outside core) nor the bridge."""
    part = part_of(module)
    bad = []
    for name in sorted(imported):
        top = name.split(".")[0]
        if top in HEAVY and not HEAVY[top](module):
            bad.append(f"{module} imports {name}")
        if top != API:
            continue
        target = part_of(name)
        if target != "api" and name.count(".") < 2:
            continue  # the package of `from ddtop.core import x`: ddtop.core.x is checked
        if target == part or (target == CORE and part != CORE):
            continue
        if name not in BRIDGE.get(part, set()):
            bad.append(f"{module} -> {name}")
    return bad


def our_modules() -> dict[str, str]:
    modules = {f"ddtop.{path.parent.name}.{path.stem}": path.read_text()
               for part in PARTS for path in sorted((ROOT / part).glob("*.py"))}
    api = {API if path.stem == "__init__" else f"{API}.{path.stem}": path.read_text()
           for path in sorted((ROOT / "api").glob("*.py"))}
    return {**modules, **api}


def test_every_import_follows_the_declared_arrows() -> None:
    bad = [v for module, source in our_modules().items()
           for v in violations(module, imports(source, module))]
    assert bad == [], "undeclared import arrows (declare them in this file, with a reason):\n" + (
        "\n".join(bad))


def test_every_declared_arrow_is_used() -> None:
    """A bridge that nothing needs any more is removed, so the list stays true."""
    edges = {(m, name) for m, source in our_modules().items() for name in imports(source, m)}
    for part, allowed in BRIDGE.items():
        for name in allowed:
            assert any(part_of(m) == part and n == name for m, n in edges), (
                f"{part} -> {name} is declared but not used")


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (anywhere in it); a package's
    `__init__` is the package."""
    sources = {m.removesuffix(".__init__"): (m, s) for m, s in our_modules().items()}
    return {name: {n for n in imports(source, module) if n in sources and n != name}
            for name, (module, source) in sources.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted
    (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def test_no_import_cycle() -> None:
    found = cycles(import_graph())
    assert found == [], "import cycles (a module below both, or a Protocol, breaks one):\n" + (
        "\n".join(" <-> ".join(c) for c in found))


@pytest.mark.parametrize(("graph", "expected"), [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_the_check_finds_a_cycle(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert cycles(graph) == expected


def test_an_import_under_type_checking_or_in_a_function_closes_a_cycle() -> None:
    state = imports("if TYPE_CHECKING:\n    from ddtop.core.summary import RunSummary\n",
                    "ddtop.core.state")
    summary = imports("def f():\n    from ddtop.core import state\n", "ddtop.core.summary")
    graph = {"ddtop.core.state": state & {"ddtop.core.summary"},
             "ddtop.core.summary": summary & {"ddtop.core.state"}}
    assert cycles(graph) == [["ddtop.core.state", "ddtop.core.summary"]]


@pytest.mark.parametrize(("module", "source"), [
    ("ddtop.core.state", "from ddtop.dashboard import format"),
    ("ddtop.daemon.relay", "import torch"),
    ("ddtop.training.trainer", "from ddtop.daemon.supervisor import Supervisor"),
    ("ddtop.dashboard.headless", "def f():\n    import textual.app\n"),
    ("ddtop.daemon.cli", "from ddtop.dashboard.app import DashboardApp"),
    ("ddtop.daemon.cli", "def f():\n    from ddtop.dashboard.headless import watch\n"),
    ("ddtop", "import torch"),
    ("ddtop.run", "import torch"),
    ("ddtop", "import lightning"),
    ("ddtop.callbacks", "from transformers import TrainerCallback"),
    ("ddtop.training.api", "import lightning.pytorch"),
    ("ddtop.run", "from ddtop.training import trainer"),
    ("ddtop.training.trainer", "from ddtop.run import main"),
    ("ddtop", "from ddtop.training.trainer import train"),
    ("ddtop.core.state", "import ddtop"),
    ("ddtop.dashboard.app", "def f():\n    import ddtop\n"),
    ("ddtop.core.state", "from ddtop.daemon import relay"),
    ("ddtop.core.wire", "from ddtop.training import sender"),
    ("ddtop.core.printer", "import textual"),
    ("ddtop.core.config", "import torch"),
    ("ddtop.dashboard.live", "from ddtop.daemon.relay import Relay"),
    ("ddtop.training.sender", "from ddtop.dashboard import feed"),
    ("ddtop.daemon.cli", "def f():\n    from ddtop.training import worker\n"),
])
def test_the_check_catches_a_new_arrow(module: str, source: str) -> None:
    assert violations(module, imports(source, module)) != []


def writes_to_the_api(source: str) -> list[str]:
    """The attributes of the `ddtop` module that `source` sets or deletes."""
    return [node.attr for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del)
            and isinstance(node.value, ast.Name) and node.value.id == "ddtop"]


def test_only_the_public_api_sets_its_own_state() -> None:
    """`import ddtop` forwards to the live rank training/api.py owns, which tells
    it of each new rank; nothing else reaches in to set what it holds."""
    assert {m: writes_to_the_api(s) for m, s in our_modules().items()
            if m != API and writes_to_the_api(s)} == {}
    assert writes_to_the_api("import ddtop\ndef f():\n    ddtop._live = None\n") == ["_live"]


TORCH_FREE = ["ddtop.daemon.cli", "ddtop.daemon.supervisor", "ddtop.core.config",
              "ddtop.core.flags",
              "ddtop.core.rundir", "ddtop.daemon.local", "ddtop.daemon.torchrun",
              "ddtop.dashboard.cli", "ddtop.dashboard.app", "ddtop.dashboard.headless",
              "ddtop.dashboard.feed"]


def loaded(module: str, packages: tuple[str, ...]) -> list[str]:
    """The modules of `packages` that importing `module` loads, in a fresh interpreter."""
    code = (f"import sys, {module}; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {packages!r}))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    found: list[str] = ast.literal_eval(run.stdout.strip())
    return found


@pytest.mark.parametrize("module", TORCH_FREE)
@pytest.mark.processes
def test_module_does_not_import_torch(module: str) -> None:
    assert loaded(module, ("torch", "torchvision")) == []


@pytest.mark.processes
def test_import_ddtop_loads_no_torch_zmq_or_textual() -> None:
    """A user's script imports ddtop, and so does every ddtop.* import: it stays tiny."""
    assert loaded("ddtop", ("torch", "torchvision", "zmq", "textual", "msgspec")) == []


@pytest.mark.processes
def test_ddtop_run_loads_no_torch_zmq_or_textual() -> None:
    """`python -m ddtop.run` starts every rank of a launcher: torch comes with the program."""
    assert loaded("ddtop.run", ("torch", "torchvision", "zmq", "textual")) == []


@pytest.mark.parametrize("module", ["ddtop.daemon.cli", "ddtop.dashboard.cli",
                                    "ddtop.dashboard.headless"])
@pytest.mark.processes
def test_command_lines_load_without_textual(module: str) -> None:
    assert loaded(module, ("textual",)) == []


@pytest.mark.parametrize("args", [["--help"], ["start", "--help"], ["--version"]])
@pytest.mark.processes
def test_ddtrain_help(args: list[str]) -> None:
    run = subprocess.run([DDTRAIN, *args], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0 and "ddtrain" in run.stdout


@pytest.mark.processes
def test_start_help_documents_every_flag() -> None:
    run = subprocess.run([DDTRAIN, "start", "--help"], capture_output=True, text=True, timeout=30)
    for flag in ("--world-size", "--backend", "--device", "--model", "--dataset", "--data-dir",
                 "--download", "--epochs", "--batch-size", "--lr", "--seed", "--sync-every",
                 "--checkpoint-every", "--resume", "--runs-dir", "--foreground"):
        assert flag in run.stdout, flag
