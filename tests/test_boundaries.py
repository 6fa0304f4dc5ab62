"""Import rules (checked, not hoped for).

The arrows between the three parts are declared here, and every import in
training/, daemon/ and dashboard/ (module level or inside a function) is
checked against them: a new arrow fails this test until it is declared, with
a reason. No module imports itself through others (a cycle), and none but the
public API sets the public API's state. The heavy libraries stay where they
belong: torch only in training, textual only in the dashboard's app, so
`ddtrain` and `ddtop` answer instantly. docs/development.md draws the same
picture.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import DDTRAIN

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("training", "daemon", "dashboard")
# The fourth part, api/, is the `ddtop` package itself (the public API).
API = "ddtop"

# What each part may import from the other parts (its own modules are free).
ALLOWED = {
    # A rank reads its config, run directory and the process contract, and publishes on the wire;
    # the built-in trainer reports through the public API, as a user's script does (one path);
    # a rank reads its fault drills with the parser `ddtrain start --inject` checks them with.
    "training": {"ddtop.daemon.config", "ddtop.daemon.contract", "ddtop.daemon.flags",
                 "ddtop.daemon.inject",
                 "ddtop.daemon.keys", "ddtop.daemon.processes", "ddtop.daemon.runs",
                 "ddtop.daemon.wire", API},
    # The daemon starts ranks by module name (a string), never by import.
    "daemon": set(),
    # `import ddtop` reads the telemetry variable's name from the contract, and
    # imports the live implementation (torch, zmq) only when an endpoint is set.
    "api": {"ddtop.daemon.contract", "ddtop.training.api"},
    # The dashboard folds the same wire into the same state, and finds runs as ddtrain does.
    "dashboard": {"ddtop.daemon.config", "ddtop.daemon.contract", "ddtop.daemon.control",
                  "ddtop.daemon.flags",
                  "ddtop.daemon.journal", "ddtop.daemon.keys", "ddtop.daemon.rankview",
                  "ddtop.daemon.runinfo", "ddtop.daemon.runs", "ddtop.daemon.state",
                  "ddtop.daemon.summary", "ddtop.daemon.wire"},
}
# The one arrow that runs back up, declared: `ddtrain start --foreground --headless`
# prints the run with the dashboard's headless printer, and `ddtrain start --help`
# lists that printer's flags. Only the CLI, never the supervisor, relay or state.
UPWARD = {("ddtop.daemon.cli", "ddtop.dashboard.headless"),
          ("ddtop.daemon.cli", "ddtop.dashboard.feed")}
# Third-party packages only some modules may import.
HEAVY = {
    "torch": lambda module: module.startswith("ddtop.training."),
    "torchvision": lambda module: module.startswith("ddtop.training."),
    "textual": lambda module: module in {"ddtop.dashboard.app", "ddtop.dashboard.widgets",
                                         "ddtop.dashboard.screens"},
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


def violations(module: str, imported: set[str]) -> list[str]:
    part = "api" if module == API else module.split(".")[1]
    bad = []
    for name in sorted(imported):
        top = name.split(".")[0]
        if top in HEAVY and not HEAVY[top](module):
            bad.append(f"{module} imports {name}")
        if name == API and part != "api":  # the public API is a part of its own
            if name not in ALLOWED[part]:
                bad.append(f"{module} -> {name}")
            continue
        if not name.startswith("ddtop."):
            continue
        target = name.split(".")[1]
        if name.count(".") < 2 or target == part:
            continue
        if name not in ALLOWED[part] and (module, name) not in UPWARD:
            bad.append(f"{module} -> {name}")
    return bad


def our_modules() -> dict[str, str]:
    modules = {f"ddtop.{path.parent.name}.{path.stem}": path.read_text()
               for part in PARTS for path in sorted((ROOT / part).glob("*.py"))}
    return {**modules, API: (ROOT / "api" / "__init__.py").read_text()}


def test_every_import_follows_the_declared_arrows() -> None:
    bad = [v for module, source in our_modules().items()
           for v in violations(module, imports(source, module))]
    assert bad == [], "undeclared import arrows (declare them in this file, with a reason):\n" + (
        "\n".join(bad))


def test_every_declared_arrow_is_used() -> None:
    """A declaration that nothing needs any more is removed, so the list stays true."""
    edges = {(m, name) for m, source in our_modules().items() for name in imports(source, m)}
    for part, allowed in ALLOWED.items():
        for name in allowed:
            assert any((m == API if part == "api" else m.startswith(f"ddtop.{part}."))
                       and n == name for m, n in edges), (
                f"{part} -> {name} is declared but not used")
    assert edges >= UPWARD, f"declared but not used: {UPWARD - edges}"


@pytest.mark.parametrize(("module", "source"), [
    ("ddtop.daemon.state", "from ddtop.dashboard import format"),
    ("ddtop.daemon.relay", "import torch"),
    ("ddtop.training.trainer", "from ddtop.daemon.supervisor import Supervisor"),
    ("ddtop.dashboard.headless", "def f():\n    import textual.app\n"),
    ("ddtop.daemon.cli", "from ddtop.dashboard.app import DashboardApp"),
    ("ddtop", "import torch"),
    ("ddtop", "from ddtop.training.trainer import train"),
    ("ddtop.daemon.state", "import ddtop"),
    ("ddtop.dashboard.app", "def f():\n    import ddtop\n"),
])
def test_the_check_catches_a_new_arrow(module: str, source: str) -> None:
    assert violations(module, imports(source, module)) != []


def cycles(sources: dict[str, str]) -> list[list[str]]:
    """The import cycles among `sources` (module -> its source): each a group
    of modules that import one another, whichever way round, by any import
    (inside functions and under TYPE_CHECKING too), sorted."""
    graph = {m: sorted(n for n in imports(source, m) if n in sources and n != m)
             for m, source in sources.items()}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        order[module] = low[module] = len(order)
        stack.append(module)
        for other in graph[module]:
            if other not in order:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], order[other])
        if low[module] == order[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return sorted(found)


@pytest.mark.parametrize("part", [
    "training", "api", "dashboard",
    pytest.param("daemon", marks=pytest.mark.xfail(
        strict=True, reason="state <-> summary and relay <-> requests, being untied")),
])
def test_no_import_cycle(part: str) -> None:
    """A cycle "broken" by an import inside a function is still a cycle: the
    piece both sides need belongs in a module both import."""
    def in_part(module: str) -> bool:
        return module == API if part == "api" else module.startswith(f"ddtop.{part}.")

    assert [c for c in cycles(our_modules()) if any(map(in_part, c))] == []


def test_the_check_catches_a_cycle() -> None:
    assert cycles({
        "ddtop.training.api": "from ddtop.training.telemetry import LiveTelemetry\n",
        "ddtop.training.telemetry": "import torch\n",
        "ddtop.training.autowatch": "from ddtop.training.api import current\n",
        "ddtop.training.watched": "def f():\n    from ddtop.training import autowatch\n",
        "ddtop.training.x": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                            "    from ddtop.training.api import LiveRank\n",
    }) == []
    assert cycles({
        "ddtop.training.api": "def f():\n    from ddtop.training import autowatch\n",
        "ddtop.training.autowatch": "from ddtop.training.watched import x\n",
        "ddtop.training.watched": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                  "    from ddtop.training.api import LiveRank\n",
        "ddtop": "def f():\n    from ddtop.training.api import current\n",
        "ddtop.training.telemetry": "import ddtop\n",
    }) == [["ddtop.training.api", "ddtop.training.autowatch", "ddtop.training.watched"]]


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


TORCH_FREE = ["ddtop.daemon.cli", "ddtop.daemon.supervisor", "ddtop.daemon.config",
              "ddtop.daemon.flags",
              "ddtop.daemon.runs", "ddtop.daemon.local", "ddtop.daemon.torchrun",
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
