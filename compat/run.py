"""torch's oldest and newest: the tests that start processes against other torch releases.

    make compat                                  # COMPAT_TORCH="2.13.0 2.15.0"
    make compat COMPAT_TORCH="2.5.1" COMPAT_TESTS="tests/test_watch.py tests/test_api.py"

For each torch release it makes a virtual environment of its own,
.compat/torch-<version>/ (git-ignored), with ddtop installed as `make test` installs
it (`pip install -e '.[train,test]'`) plus `torch==<version>` and the torchvision of
that release (`torchvision<0.<minor+16>`: pip takes the newest that accepts this
torch). A venv already holding that torch (and its stamp) is reused, not reinstalled.

Then it runs the tests marked `processes` (all of them, or the files given) with
the venv's Python, as `make test` runs the suite: on the pytest-xdist workers the
Makefile passes (`--xdist`), the tests marked `timing` afterwards, alone. It
prints a table: torch, passed, failed (errors included), skipped, minutes; the
pytest output of each release is kept in .compat/logs/.

The cap: pip's global configuration on these machines names a constraints file
(`constraint = /etc/xdg/pip/constraints.txt`: torch<=2.14.1). Only the pip
commands that fill these venvs run with PIP_CONSTRAINT=/dev/null, an empty
constraints file in its place. An empty PIP_CONSTRAINT does not do it: pip ignores
configuration values that are empty, so the file's cap would still apply.
The default PyPI wheels of torch pull NVIDIA's CUDA libraries: several GB a venv.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAMP = ".compat-installed"


@dataclass
class Result:
    torch: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    minutes: float = 0.0
    note: str = ""


def say(text: str) -> None:
    print(f"compat: {text}", flush=True)


def torchvision_bound(torch_version: str) -> str:
    """torchvision 0.(m+15) goes with torch 2.m: below 0.(m+16), pip picks the newest
    that this torch satisfies (a release not out yet falls back to the one before)."""
    major, minor = (int(part) for part in torch_version.split(".")[:2])
    if major != 2:
        raise SystemExit(f"compat: torch {torch_version}: only 2.x releases are known here")
    return f"torchvision<0.{minor + 16}"


def installed_torch(venv: Path) -> str | None:
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    probe = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"],
                           capture_output=True, text=True, check=False)
    return probe.stdout.strip().split("+")[0] if probe.returncode == 0 else None


def ensure_venv(version: str, base: Path, python: str, logs: Path) -> bool:
    venv = base / f"torch-{version}"
    if (venv / STAMP).exists() and installed_torch(venv) == version:
        say(f"torch {version}: {venv} is ready, reused")
        return True
    free = shutil.disk_usage(ROOT)
    say(f"torch {version}: installing into {venv} ({free.free / 2**30:.0f} GiB free; "
        "torch with its CUDA libraries is several GB: minutes)")
    if not (venv / "bin" / "python").exists():
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
    # PIP_CONSTRAINT=/dev/null: an empty constraints file instead of the machine's cap
    # (an empty value would be ignored by pip). For these pip commands only.
    env = {**os.environ, "PIP_CONSTRAINT": "/dev/null"}
    command = [str(venv / "bin" / "python"), "-m", "pip", "install", "--progress-bar", "off",
               "-e", ".[train,test]", f"torch=={version}", torchvision_bound(version)]
    log = logs / f"install-{version}.log"
    say(f"  {shlex.join(command)}  (output: {log.relative_to(ROOT)})")
    started = time.monotonic()
    with log.open("w") as out:
        pip = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
        assert pip.stdout is not None
        for line in pip.stdout:
            out.write(line)
            if line.startswith(("Collecting torch", "Collecting nvidia", "Downloading",
                                "  Downloading", "Installing collected", "Successfully")):
                say(f"  [{time.monotonic() - started:4.0f} s] {line.strip()[:110]}")
        pip.wait()
    got = installed_torch(venv)
    if pip.returncode != 0 or got != version:
        say(f"torch {version}: install failed (pip exit {pip.returncode}, torch {got}); "
            f"see {log.relative_to(ROOT)}")
        return False
    (venv / STAMP).write_text(version + "\n")
    say(f"torch {version}: installed in {(time.monotonic() - started) / 60:.1f} min")
    return True


def count(junit: Path, result: Result) -> None:
    if not junit.exists():
        return
    for suite in ET.parse(junit).getroot().iter("testsuite"):
        tests, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
        failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        result.failed += failed
        result.skipped += skipped
        result.passed += tests - failed - skipped


def run_tests(version: str, base: Path, logs: Path, xdist: list[str],
              tests: list[str]) -> Result:
    python = str(base / f"torch-{version}" / "bin" / "python")
    result = Result(version)
    started = time.monotonic()
    # As make test: the process tier on the workers, then its `timing` tests alone.
    passes = [("processes and not timing", xdist), ("processes and timing", [])]
    for number, (marks, workers) in enumerate(passes, 1):
        junit = logs / f"pytest-{version}-{number}.xml"
        junit.unlink(missing_ok=True)
        command = [python, "-m", "pytest", *workers, "-m", marks, "-p", "no:cacheprovider",
                   f"--junitxml={junit}", *tests]
        log = logs / f"pytest-{version}-{number}.log"
        say(f"torch {version}: {shlex.join(command[1:])}  (output: {log.relative_to(ROOT)})")
        with log.open("w") as out:
            rc = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                check=False).returncode
        if rc not in (0, 1, 5):  # 5: no test matched (no `timing` test among the files)
            result.note = f"pytest exit {rc} ({log.name})"
        count(junit, result)
        say(f"torch {version}: pass {number} done, {result.passed} passed, "
            f"{result.failed} failed, {result.skipped} skipped so far")
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(("FAILED ", "ERROR ")):
                say(f"  {line[:160]}")
    result.minutes = (time.monotonic() - started) / 60
    return result


def table(results: list[Result]) -> str:
    lines = [f"{'torch':<10} {'passed':>7} {'failed':>7} {'skipped':>8} {'minutes':>8}  note"]
    for r in results:
        lines.append(f"{r.torch:<10} {r.passed:>7} {r.failed:>7} {r.skipped:>8} "
                     f"{r.minutes:>8.1f}  {r.note}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--torch", default="2.13.0 2.15.0",
                        help="torch releases, spaces between (COMPAT_TORCH)")
    parser.add_argument("--xdist", default="", help="pytest-xdist options, as make test's")
    parser.add_argument("--python", default=sys.executable, help="the venvs' interpreter")
    parser.add_argument("--dir", default=str(ROOT / ".compat"), help="where the venvs go")
    parser.add_argument("tests", nargs="*", help="test files (default: the whole tier)")
    args = parser.parse_args()
    base, versions = Path(args.dir).resolve(), args.torch.split()
    logs = base / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    say("disk before installing:")
    subprocess.run(["df", "-h", "/"], check=False)
    results = []
    for version in versions:
        if not ensure_venv(version, base, args.python, logs):
            results.append(Result(version, note="install failed"))
            continue
        results.append(run_tests(version, base, logs, shlex.split(args.xdist), args.tests))
        say(f"torch {version}: {results[-1].minutes:.1f} min")
    summary = table(results)
    (logs / "summary.txt").write_text(summary + "\n")
    print("\n" + summary, flush=True)
    return 1 if any(r.failed or r.note for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
