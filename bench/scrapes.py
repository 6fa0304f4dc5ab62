"""How fast /metrics answers through a whole run: start-up, training, a failure and its
restart, the end, and the linger after it.

    .venv/bin/python bench/scrapes.py [--ranks 2] [--every 0.1] [--runs 2]

A run of the built-in trainer (`ddtrain start -n RANKS`, detached, `--metrics` on a
port picked here, so that it is scraped from the daemon's first moment) whose rank 1
kills itself at step 40 and is restarted once (`--max-restarts 1`), with
`--metrics-linger 3`. A thread GETs /metrics every --every seconds (timeout 5 s)
from the start until the daemon has exited, and puts each answer in the phase the
run's status in it says (`ddtop_run_status`), or `refused` while nothing listens.
Per phase: scrapes, median, p99 and the slowest answer in ms, and how many took
over 100 ms (the target: none). --runs runs, one after another; the table adds them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
DDTRAIN = str(Path(sys.executable).with_name("ddtrain"))
TARGET_MS = 100.0
STATUS = re.compile(r'^ddtop_run_status\{[^}]*status="(\w+)"\} 1\.0$', re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def one_run(ranks: int, every: float, runs: Path) -> list[tuple[str, float]]:
    """(phase, ms) of every scrape of one run."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    found: list[tuple[str, float]] = []
    over = threading.Event()

    def scrape() -> None:
        while not over.is_set():
            started = time.monotonic()
            try:
                with urllib.request.urlopen(url, timeout=5) as reply:
                    body = reply.read().decode()
                match = STATUS.search(body)
                phase = match.group(1) if match else "no status"
            except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
                phase = "refused" if "refused" in str(e) else f"error: {e}"
            found.append((phase, (time.monotonic() - started) * 1000))
            time.sleep(max(0.0, every - (time.monotonic() - started)))

    thread = threading.Thread(target=scrape, daemon=True)
    thread.start()
    run_id = f"scrapes-{port}"
    started = subprocess.run(
        [DDTRAIN, "start", "-n", str(ranks), "--epochs", "2", "--max-restarts", "1",
         "--inject", "1:kill@step=40", "--metrics", str(port), "--metrics-linger", "3",
         "--run-id", run_id, "--runs-dir", str(runs)],
        capture_output=True, text=True, timeout=120)
    if started.returncode != 0:
        over.set()
        raise SystemExit(f"ddtrain start failed: {started.stderr.strip()}")
    pid_file = runs / run_id / "run.json"
    deadline = time.monotonic() + 600
    daemon = None
    while daemon is None and time.monotonic() < deadline:
        match = re.search(r'"daemon_pid": (\d+)', pid_file.read_text()) if pid_file.exists() \
            else None
        daemon = int(match.group(1)) if match else None
        time.sleep(0.1)
    while daemon is not None and Path(f"/proc/{daemon}").exists() \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    over.set()
    thread.join(10)
    record = json.loads(pid_file.read_text())
    print(f"  {record['status']}, {record['restarts']} restart(s)", file=sys.stderr)
    # Scrapes refused after the daemon has gone are not of the run.
    while found and found[-1][0] == "refused":
        found.pop()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--every", type=float, default=0.1, help="seconds between scrapes")
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args(argv)
    every: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for n in range(args.runs):
            print(f"run {n + 1} of {args.runs} ...", file=sys.stderr, flush=True)
            for phase, ms in one_run(args.ranks, args.every, Path(folder)):
                every.setdefault(phase, []).append(ms)
    print(f"/metrics answers through a run ({args.ranks} ranks, a failure and a restart; "
          f"{os.cpu_count()} cores), ms")
    print(f"{'phase':<12} {'scrapes':>8} {'median':>8} {'p99':>8} {'max':>8} "
          f"{'>' + format(TARGET_MS, 'g') + ' ms':>8}")
    for phase, times in every.items():
        ordered = sorted(times)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        slow = sum(1 for t in times if t > TARGET_MS)
        print(f"{phase:<12} {len(times):>8} {statistics.median(times):>8.1f} {p99:>8.1f} "
              f"{max(times):>8.1f} {slow:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
