"""How long a bundle of evidence takes: a live run of the built-in trainer under
`ddtrain start -n WORLD --step-delay 0.05`, asked `ddtrain evidence` --rounds
times.

    .venv/bin/python bench/evidence.py [--world-size 8] [--rounds 5]

Side by side, each round on the same live ranks:
  py-spy       `py-spy dump --native` of every rank, all at once, then one a core
               at a time (as daemon/nativestacks.py reads them): seconds until the
               last is done;
  evidence     `ddtrain evidence`: seconds from the command's start to its index
               printed, how many ranks' native stacks that index holds, and the
               seconds from the ranks asked to the last native stacks added to the
               bundle (its index's `late`; the index printed, where none is late).

`--stand-ins N`: instead, N plain Python processes standing for ranks (they take
the stacks signal as ranks do, but load no torch: py-spy reads each in a few
ms), gathered by daemon/evidence.py's begin, finish and complete in this
process: what the bundle's own machinery costs at 64 ranks and more, where 64
torch ranks would not fit this machine's memory.
Numbers in docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ddtop.daemon import nativestacks

DDTRAIN = str(Path(sys.executable).parent / "ddtrain")
RUN_ID = "evidence"


def status(root: Path) -> dict:  # type: ignore[type-arg]
    done = subprocess.run([DDTRAIN, "status", "--runs-dir", str(root), "--json", RUN_ID],
                          capture_output=True, text=True, check=False, timeout=30)
    return json.loads(done.stdout) if done.returncode == 0 else {}


def py_spy_all(tool: str, pids: list[int], jobs: int) -> float:
    """Seconds until every rank's native stacks are read, `jobs` at a time."""
    def one(pid: int) -> None:
        subprocess.run([tool, "dump", "--native", "--pid", str(pid)], capture_output=True,
                       check=False, timeout=nativestacks.DUMP_TIMEOUT_S)
    began = time.monotonic()
    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(one, pids))
    return time.monotonic() - began


def evidence(root: Path, world: int) -> tuple[float, int, float]:
    """(seconds to the index printed, ranks with native stacks in it, seconds from the
    ranks asked to the last native stacks added)."""
    began = time.monotonic()
    done = subprocess.run([DDTRAIN, "evidence", "--runs-dir", str(root), RUN_ID],
                          capture_output=True, text=True, check=False, timeout=60)
    printed = time.monotonic() - began
    if done.returncode != 0:
        raise SystemExit(f"ddtrain evidence failed: {done.stderr.strip()}")
    late_native = sum("no native stacks" in line for line in done.stdout.splitlines())
    bundle = Path(done.stdout.split(":")[0])
    deadline = time.monotonic() + 2 * nativestacks.DUMP_TIMEOUT_S
    while time.monotonic() < deadline:  # (the late ones are added on the daemon's thread)
        index = json.loads((bundle / "index.json").read_text())
        if not late_native or "late" in index:
            break
        time.sleep(0.1)
    last = max([float(line.split(", ")[1].split(" s ")[0]) for line in index.get("late", [])]
               or [printed])
    return printed, world - late_native, last


STAND_IN = ("import faulthandler, signal, sys, time\n"
            "faulthandler.register(signal.Signals({sig}), file=open(sys.argv[1], 'a'), "
            "all_threads=True)\n"
            "print('ready', flush=True)\n"
            "time.sleep(600)\n")


def stand_ins(n: int, rounds: int) -> None:
    from ddtop.core.contract import STACKS_SIGNAL
    from ddtop.core.processes import ProcessId
    from ddtop.core.rundir import RunPaths
    from ddtop.core.state import RunState
    from ddtop.daemon import evidence as bundles

    with tempfile.TemporaryDirectory() as tmp:
        paths = RunPaths(Path(tmp) / "stand-ins")
        paths.logs.mkdir(parents=True)
        script = STAND_IN.format(sig=int(STACKS_SIGNAL))
        procs = [subprocess.Popen([sys.executable, "-c", script, str(paths.rank_stacks(k))],
                                  stdout=subprocess.PIPE, text=True) for k in range(n)]
        try:
            for proc in procs:
                assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
            numbered = {k: ProcessId.of(proc.pid) for k, proc in enumerate(procs)}
            limit = bundles.budget(n)
            print(f"{n} stand-in ranks on {os.cpu_count()} cores (budget {limit:g} s); seconds")
            for _ in range(rounds):
                began = time.monotonic()
                g = bundles.begin(paths, RunState(run="stand-ins"), numbered,  # type: ignore[arg-type]
                                  "asked", "asked for", time.time())
                _, _, late = bundles.finish(g, limit)
                index_s = time.monotonic() - began
                bundles.complete(g, late, limit)
                print(f"  index {index_s:5.2f}, natives in it {n - len(late):3d} of {n}, "
                      f"every rank's in {time.monotonic() - began:5.2f}")
                time.sleep(1.0)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait(timeout=10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--stand-ins", type=int, default=0,
                        help="gather this many plain Python processes instead (0: a live run)")
    args = parser.parse_args()
    tool = nativestacks.py_spy()
    if tool is None:
        raise SystemExit("py-spy is not installed (make install installs the train extra)")
    if args.stand_ins:
        stand_ins(args.stand_ins, args.rounds)
        return 0
    jobs = nativestacks.jobs()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        started = subprocess.run(
            [DDTRAIN, "start", "-n", str(args.world_size), "--run-id", RUN_ID, "--runs-dir",
             str(root), "--step-delay", "0.05", "--epochs", "1000"],
            capture_output=True, text=True, check=False, timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        if started.returncode != 0:
            raise SystemExit(f"the run did not start: {started.stderr.strip()}")
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                ranks = status(root).get("ranks", [])
                if len(ranks) == args.world_size and all(r["global_step"] > 5 for r in ranks):
                    break
                time.sleep(0.5)
            else:
                raise SystemExit("the ranks did not step within 120 s")
            pids = [r["pid"] for r in ranks]
            print(f"{args.world_size} live ranks (--step-delay 0.05) on {os.cpu_count()} cores; "
                  f"seconds, median of {args.rounds}")
            rows: dict[str, list[float]] = {"py-spy, all at once": [],
                                            f"py-spy, {jobs} at a time": [],
                                            "evidence: index printed": [],
                                            "evidence: native stacks in it": [],
                                            "evidence: last native added": []}
            for _ in range(args.rounds):
                rows["py-spy, all at once"].append(py_spy_all(tool, pids, len(pids)))
                rows[f"py-spy, {jobs} at a time"].append(py_spy_all(tool, pids, jobs))
                printed, natives, last = evidence(root, args.world_size)
                rows["evidence: index printed"].append(printed)
                rows["evidence: native stacks in it"].append(natives)
                rows["evidence: last native added"].append(last)
                time.sleep(1.0)
            for name, values in rows.items():
                cells = " ".join(f"{v:5.2f}" if "native stacks in" not in name else f"{v:5.0f}"
                                 for v in values)
                print(f"  {name:32} {cells}   median {statistics.median(values):.2f}")
        finally:
            subprocess.run([DDTRAIN, "stop", "--runs-dir", str(root), RUN_ID],
                           capture_output=True, check=False, timeout=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
