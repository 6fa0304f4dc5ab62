"""Interpreter start-up with and without ddtop's start-up hook (the .pth file the
package installs in site-packages: training/starthook.py), measured side by side.

    .venv/bin/python bench/starthook.py [--rounds 300]

Each round starts `python -c pass` four ways, in a fresh random order:
  without   a bare virtual environment of this interpreter (no packages)
  inactive  the same environment with ddtop-starthook.pth in its site-packages, no
            DDTOP_TELEMETRY: what every interpreter on a machine with ddtop pays
  project   this project's environment (.venv: ddtop, torch, ...), no DDTOP_TELEMETRY
  armed     the same with DDTOP_TELEMETRY set: the hook imports its module and waits
            for torch (a process of a watched job that never imports torch pays this)
and reads two times for each start: *CPU*, the child's user + system time
(getrusage), which other work on the machine does not stretch, and *wall*, the
whole `subprocess.run`, which it does (on a shared machine by whole scheduling
periods: read the CPU time first). It prints their medians, and the median of
the paired differences (inactive - without, armed - project) with the sign
test's 95% interval (bench/stats.py): an interval that holds 0 is a cost too
small to see. Last, what `site` spends on the file alone in an interpreter that
is not watched (open, read, compile and run its line: site.addpackage, timed
inside 100 fresh interpreters). The interpreters run as Python does by default,
their bytecode cached after the first start (PYTHONDONTWRITEBYTECODE is left
out of their environment).
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

from stats import Estimate, median_interval, percentile  # bench/stats.py, beside this script

PTH = Path(__file__).resolve().parent.parent / "training" / "ddtop-starthook.pth"
ENDPOINT = "tcp://127.0.0.1:9"  # never connected to: nothing here imports torch
VARIANTS = ("without", "inactive", "project", "armed")


def bare_environment(root: Path, with_hook: bool) -> str:
    """A virtual environment of this interpreter with nothing installed (but the
    hook's .pth, if asked); its python."""
    venv.create(root, with_pip=False, symlinks=True)
    if with_hook:
        (site,) = (root / "lib").glob("python3.*/site-packages")
        (site / PTH.name).write_text(PTH.read_text())
    return str(root / "bin" / "python")


ALONE = """\
import site, sys, time
exec("import os")  # (the parser's first use, which site pays on a start anyway)
began = time.perf_counter()
site.addpackage(sys.argv[1], sys.argv[2], set())
print((time.perf_counter() - began) * 1e6)
"""


def pth_alone_us(python: str, site_packages: Path, env: dict[str, str],
                 starts: int = 100) -> float:
    """The median microseconds `site` spends on the hook's .pth when not watched, in a
    fresh interpreter each time (`python -S`: site imported, nothing processed yet)."""
    return statistics.median(float(subprocess.run(
        [python, "-S", "-c", ALONE, str(site_packages), PTH.name], env=env, check=True,
        capture_output=True, text=True, timeout=60).stdout) for _ in range(starts))


def start_up_s(python: str, env: dict[str, str]) -> tuple[float, float]:
    """(CPU, wall) seconds of one `python -c pass`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    subprocess.run([python, "-c", "pass"], env=env, check=True, timeout=60)
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    unwatched = {k: v for k, v in os.environ.items()
                 if not k.startswith("DDTOP_") and k != "PYTHONDONTWRITEBYTECODE"}
    with tempfile.TemporaryDirectory(prefix="ddtop-starthook-") as tmp:
        runs = {
            "without": (bare_environment(Path(tmp, "without"), False), unwatched),
            "inactive": (bare_environment(Path(tmp, "inactive"), True), unwatched),
            "project": (sys.executable, unwatched),
            "armed": (sys.executable, {**unwatched, "DDTOP_TELEMETRY": ENDPOINT}),
        }
        (hooked_site,) = Path(tmp, "inactive", "lib").glob("python3.*/site-packages")
        alone = pth_alone_us(runs["inactive"][0], hooked_site, unwatched)
        times: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
        for name in VARIANTS:  # warm the caches once each (and write the bytecode)
            start_up_s(*runs[name])
        for i in range(args.rounds):
            for name in random.sample(VARIANTS, len(VARIANTS)):
                times[name].append(start_up_s(*runs[name]))
            if (i + 1) % 50 == 0:
                print(f"  round {i + 1}/{args.rounds}", file=sys.stderr)
    print(f"\n{'python -c pass':<16} | {'CPU median':>10} | {'wall p10':>8} | {'median':>8} | "
          f"{'p90':>8}")
    print("-" * 65)
    for name in VARIANTS:
        cpu, wall = [t[0] for t in times[name]], [t[1] for t in times[name]]
        print(f"{name:<16} | {percentile(cpu, 50) * 1000:>7.1f} ms | " + " | ".join(
            f"{percentile(wall, p) * 1000:>5.1f} ms" for p in (10, 50, 90)))
    print(f"\n{'paired difference':<20} | {'CPU: median [95% interval]':>28} | "
          f"{'wall: median [95% interval]':>28}")
    print("-" * 83)
    for label, a, b in (("inactive - without", "inactive", "without"),
                        ("armed - project", "armed", "project")):
        cells = [cell_us(median_interval(x[k] - y[k] for x, y in
                                         zip(times[a], times[b], strict=True)))
                 for k in (0, 1)]
        print(f"{label:<20} | {cells[0]:>28} | {cells[1]:>28}")
    print(f"\nsite on ddtop-starthook.pth alone, not watched: {alone:.0f} us a start "
          "(median of 100 fresh interpreters)")
    print(f"{args.rounds} rounds, the four in a fresh random order each round")
    return 0


def cell_us(e: Estimate) -> str:
    return f"{e.median * 1e6:+.0f} us [{e.low * 1e6:+.0f}, {e.high * 1e6:+.0f}]"


if __name__ == "__main__":
    sys.exit(main())
