"""What ddtop's TUI costs in CPU while it watches a live run.

    .venv/bin/python bench/tui_cpu.py [--ranks 4] [--repeats 3] [--warmup 8] [--seconds 20]
                                      [--fps 5] [--baseline GIT-REF] [--detail]

Starts a run of the built-in trainer (`ddtrain start -n RANKS`, detached, in a
temporary folder), opens `ddtop RUN` in a 120x40 pseudo-terminal (TERM
xterm-256color; the screen it writes is read and thrown away), lets it settle
for --warmup seconds, then reads the TUI process's CPU time from /proc over
--seconds: the whole process, its main (asyncio, drawing) thread and the rest
(the feed's worker thread, Textual's and ZeroMQ's threads), in % of one core,
and the frames it drew (counted from the screen updates it wrote: a burst of output after 50 ms
of quiet). Then `q`,
and the next repeat. The run is stopped at the end. --detail measures the rank
detail screen instead (Enter on the first row, 3 s into the warm-up).

--baseline REF measures ddtop's dashboard package as it was at a git commit
too (the package's parts from `git archive`, as that commit laid them
out), alternating with this tree's repeat by repeat, so that both see the
same load; the table gives each repeat and the medians. On a machine whose
cores the ranks keep busy the numbers move by tens of percent with the load:
compare only runs measured together.

Numbers in docs/performance.md.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import platform
import pty
import select
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DDTRAIN, DDTOP = str(BIN / "ddtrain"), str(BIN / "ddtop")
COLUMNS, LINES = 120, 40
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(whole process, main thread) CPU seconds, user + system."""

    def read(path: str) -> float:
        fields = Path(path).read_text().rsplit(")", 1)[-1].split()
        return (int(fields[11]) + int(fields[12])) / TICK

    return read(f"/proc/{pid}/stat"), read(f"/proc/{pid}/task/{pid}/stat")


def baseline_tree(ref: str, into: Path) -> Path:
    """A package tree importing as `ddtop` that is `ref`'s whole: every part as that
    commit lays it out (api/ as `ddtop`, core/ where it has one, daemon/, dashboard/,
    training/), so a baseline from before a move imports as it did. Returns the folder
    for PYTHONPATH."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", ref],
                            capture_output=True, text=True, check=True).stdout.split()
    parts = [p for p in ("api", "core", "daemon", "dashboard", "training") if p in listed]
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, *parts],
                             capture_output=True, check=True).stdout
    src = into / "src"
    src.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    package = into / "pkg" / "ddtop"
    package.mkdir(parents=True)
    for module in (src / "api").iterdir():
        (package / module.name).symlink_to(module)
    for part in parts:
        if part != "api":
            (package / part).symlink_to(src / part)
    return into / "pkg"


def measure(run_id: str, cwd: Path, warmup: float, seconds: float, fps: float,
            pythonpath: str | None, detail: bool = False) -> dict[str, float]:
    """One TUI in a pseudo-terminal: CPU % of a core (process, main thread) and fps."""
    env = dict(os.environ, TERM="xterm-256color", COLUMNS=str(COLUMNS), LINES=str(LINES))
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath  # ahead of the editable install's finder
    # The console script imports ddtop.dashboard.cli: run it as a module so that
    # PYTHONPATH picks which package that is.
    command = [sys.executable, "-c", "import sys; from ddtop.dashboard.cli import main; "
               "sys.exit(main())", run_id, "--fps", f"{fps:g}"]
    pid, fd = pty.fork()
    if pid == 0:  # the child: the TUI
        os.chdir(cwd)
        os.execve(sys.executable, command, env)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", LINES, COLUMNS, 0, 0))

    def read_for(duration: float) -> int:
        """Read what the TUI writes for `duration` s; the screen updates seen (a
        frame is one write: output after 50 ms of quiet starts the next one)."""
        frames, last, end = 0, 0.0, time.monotonic() + duration
        while time.monotonic() < end:
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                try:
                    os.read(fd, 1 << 16)
                except OSError:
                    break
                now = time.monotonic()
                frames += now - last > 0.05
                last = now
        return frames

    try:
        if detail:
            read_for(min(3.0, warmup))
            os.write(fd, b"\r")  # Enter: the first row's rank detail
            read_for(max(0.0, warmup - 3.0))
        else:
            read_for(warmup)
        (cpu0, main0), t0 = cpu_seconds(pid), time.monotonic()
        frames = read_for(seconds)
        (cpu1, main1), t1 = cpu_seconds(pid), time.monotonic()
        os.write(fd, b"q")
        read_for(3.0)
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone after its `q`
            os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
        os.close(fd)
    span = t1 - t0
    return {"cpu": 100 * (cpu1 - cpu0) / span, "main": 100 * (main1 - main0) / span,
            "other": 100 * ((cpu1 - cpu0) - (main1 - main0)) / span, "fps": frames / span}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4, help="world size of the run (default 4)")
    parser.add_argument("--repeats", type=int, default=3, help="TUIs measured in turn (default 3)")
    parser.add_argument("--warmup", type=float, default=8.0, help="seconds before measuring")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds measured")
    parser.add_argument("--fps", type=float, default=5.0, help="ddtop --fps (default 5)")
    parser.add_argument("--baseline", metavar="GIT-REF",
                        help="also measure the dashboard as it was at this commit")
    parser.add_argument("--detail", action="store_true",
                        help="measure the rank detail screen instead of the main view")
    options = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="ddtop-tui-cpu-"))
    run_id = f"tui-cpu-{os.getpid()}"
    variants: list[tuple[str, str | None]] = [("this tree", None)]
    if options.baseline:
        variants.insert(0, (options.baseline, str(baseline_tree(options.baseline, tmp / "base"))))
    print(f"ddtop TUI CPU: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"{options.ranks} ranks, {COLUMNS}x{LINES}, --fps {options.fps:g}, "
          f"{'rank detail screen, ' if options.detail else ''}"
          f"{options.warmup:g} s warm-up, {options.seconds:g} s measured", flush=True)
    per_rank_epochs = 1000  # longer than the benchmark: it is stopped at the end
    started = subprocess.run([DDTRAIN, "start", "-n", str(options.ranks), "--epochs",
                              str(per_rank_epochs), "--run-id", run_id], cwd=tmp,
                             capture_output=True, text=True, check=False)
    if started.returncode != 0:
        print(started.stdout + started.stderr, file=sys.stderr)
        return 1
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in variants}
    try:
        print(f"{'dashboard':<24} {'repeat':>6} {'CPU %':>6} {'main %':>7} {'other %':>8} "
              f"{'fps':>5}")
        for repeat in range(options.repeats):
            for name, pythonpath in variants:
                r = measure(run_id, tmp, options.warmup, options.seconds, options.fps,
                            pythonpath, options.detail)
                results[name].append(r)
                print(f"{name:<24} {repeat + 1:>6} {r['cpu']:>6.1f} {r['main']:>7.1f} "
                      f"{r['other']:>8.1f} {r['fps']:>5.1f}", flush=True)
        for name, _ in variants:
            rs = results[name]
            med = {k: statistics.median(r[k] for r in rs) for k in ("cpu", "main", "other", "fps")}
            print(f"{name:<24} {'median':>6} {med['cpu']:>6.1f} {med['main']:>7.1f} "
                  f"{med['other']:>8.1f} {med['fps']:>5.1f}")
    finally:
        subprocess.run([DDTRAIN, "stop", run_id, "--timeout", "20"], cwd=tmp,
                       capture_output=True, check=False)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
