"""ddtop installed without its `train` extra, to watch: no torch, and what
watching needs works.

A fresh virtual environment gets ddtop's own wheel (built from this tree) and,
for its dependencies, the very packages this environment has (pyzmq, textual,
rich, msgspec and what they require, linked, not downloaded): exactly what
`pip install ddtop` brings, and no torch. There `ddtop --help`, a headless
replay of a recorded run and `ddtrain status` work, the dashboard's app and
charts import, `import torch` fails, and `ddtrain start` and `ddtop export
--tensorboard` (without the tensorboard extra) say in one line what to install."""

from __future__ import annotations

import importlib.metadata as metadata
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from helpers import tagged_env
from packaging.requirements import Requirement

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures" / "runs"
WATCHING = ["pyzmq", "textual", "rich", "msgspec", "textual-plotext"]  # pyproject's dependencies
TIMEOUT_S = 180


def requirements(names: list[str]) -> set[str]:
    """`names` and every distribution they require (extras left out), as installed."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        dist = metadata.distribution(todo.pop())
        name = dist.metadata["Name"].lower()
        if name in seen:
            continue
        seen.add(name)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def link_packages(names: set[str], into: Path) -> None:
    """Each distribution's top-level files and folders, linked into `into`."""
    into.mkdir()
    for name in names:
        dist = metadata.distribution(name)
        for file in dist.files or []:
            top = file.parts[0]
            if top in ("..", "__pycache__"):  # scripts in bin/, compiled files
                continue
            target = into / top
            if not target.exists():
                target.symlink_to(Path(str(dist.locate_file(top))))


def run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=tagged_env("light-install"))


@pytest.fixture(scope="module")
def light(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment with ddtop as `pip install ddtop` leaves it: its bin/."""
    root = tmp_path_factory.mktemp("light")
    wheels = root / "wheels"
    built = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                "-q", "-w", wheels, REPO, cwd=root)
    assert built.returncode == 0, built.stderr
    venv = root / "venv"
    made = run(sys.executable, "-m", "venv", venv, cwd=root)
    assert made.returncode == 0, made.stderr
    (wheel,) = wheels.glob("ddtop-*.whl")
    installed = run(venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps",
                    "--no-index", wheel, cwd=root)
    assert installed.returncode == 0, installed.stderr
    link_packages(requirements(WATCHING), root / "deps")
    (site,) = (venv / "lib").glob("python3.*/site-packages")
    (site / "watching-deps.pth").write_text(f"{root / 'deps'}\n")
    return venv / "bin"


def test_the_light_install_has_no_torch_and_asks_for_it_only_as_an_extra(light: Path) -> None:
    found = run(light / "python", "-c", "import torch", cwd=light)
    assert found.returncode != 0 and "No module named 'torch'" in found.stderr
    requires = run(light / "python", "-c",
                   "import importlib.metadata as m; print('\\n'.join(m.requires('ddtop')))",
                   cwd=light)
    lines = requires.stdout.splitlines()
    torch = [line for line in lines if line.startswith(("torch", "torchvision"))]
    assert len(torch) == 2 and all('extra == "train"' in line for line in torch), lines


def test_the_light_install_gets_exactly_pyprojects_dependencies() -> None:
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert sorted(Requirement(d).name for d in declared) == sorted(WATCHING)


def test_watching_works_without_torch(light: Path, tmp_path: Path) -> None:
    shutil.copytree(FIXTURES, tmp_path / "runs")
    helped = run(light / "ddtop", "--help", cwd=tmp_path)
    assert helped.returncode == 0 and "usage: ddtop" in helped.stdout, helped.stderr
    replayed = run(light / "ddtop", "--headless", "--replay", "recorded-ok", cwd=tmp_path)
    assert replayed.returncode == 0, replayed.stderr
    assert "succeeded" in replayed.stdout
    status = run(light / "ddtrain", "status", "recorded-failed", cwd=tmp_path)
    assert "failure: rank 1 killed by SIGKILL" in status.stdout, status.stdout + status.stderr
    app = run(light / "python", "-c", "import ddtop.dashboard.app, ddtop.dashboard.charts",
              cwd=tmp_path)
    assert (app.returncode, app.stderr) == (0, ""), app.stderr


def test_export_without_tensorboard_says_what_to_install_in_one_line(
        light: Path, tmp_path: Path) -> None:
    shutil.copytree(FIXTURES, tmp_path / "runs")
    exported = run(light / "ddtop", "export", "recorded-ok", "--tensorboard", "tb", cwd=tmp_path)
    assert (exported.returncode, exported.stdout) == (2, "")
    assert exported.stderr.splitlines() == [
        "ddtop: error: ddtop export --tensorboard writes TensorBoard files, which needs the "
        "tensorboard package, not installed here: pip install 'ddtop[tensorboard]'"]
    assert not (tmp_path / "tb").exists()


def test_ddtrain_start_without_torch_is_one_line_and_starts_nothing(
        light: Path, tmp_path: Path) -> None:
    started = run(light / "ddtrain", "start", "-n", "2", "--foreground", cwd=tmp_path)
    assert started.returncode == 2, started.stderr
    assert started.stderr.strip().splitlines() == [
        "ddtrain: error: ddtrain start runs ranks, which need torch, not installed here: "
        "pip install 'ddtop[train]' (ddtop alone only watches)"]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_the_start_up_hook_is_installed_and_needs_no_torch(light: Path, tmp_path: Path) -> None:
    """The wheel puts ddtop-starthook.pth at the top of site-packages; in the watch
    environment it arms there without torch (a watching machine's own tools, a
    launcher's agent), and `python -m ddtop.run` runs a script as python does."""
    (site,) = (light.parent / "lib").glob("python3.*/site-packages")
    assert (site / "ddtop-starthook.pth").read_text() == (
        REPO / "training" / "ddtop-starthook.pth").read_text()
    assert not (site / "ddtop" / "training" / "ddtop-starthook.pth").exists()
    loaded = "import sys; print(sorted(m for m in sys.modules if m.startswith('ddtop')))"
    armed = subprocess.run([light / "python", "-c", loaded], cwd=tmp_path, capture_output=True,
                           text=True, timeout=TIMEOUT_S,
                           env=tagged_env("light-install", {"DDTOP_TELEMETRY": "tcp://127.0.0.1:9"}))
    assert (armed.returncode, armed.stderr) == (0, "")
    assert armed.stdout == "['ddtop', 'ddtop.training', 'ddtop.training.starthook']\n"
    (tmp_path / "train.py").write_text("import sys\nprint(sys.argv)\nsys.exit(3)\n")
    ran = run(light / "python", "-m", "ddtop.run", "train.py", "--lr", "3", cwd=tmp_path)
    assert (ran.returncode, ran.stdout, ran.stderr) == (3, "['train.py', '--lr', '3']\n", "")
