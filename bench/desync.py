"""How soon a desync is named: tests/scripts/desync.py under `ddtrain start
--foreground -n WORLD`, rank WORLD-1 all-gathering on the world group where the
others all-reduce, at step 30 of 40 (steps of 50 ms), --repeats times.

    .venv/bin/python bench/desync.py [--repeats 5] [--world-size 4]

Every rank writes to its log the wall clock as it enters its collective of that
step; the second side has entered when the last of them has. The state is
rebuilt from the run's telemetry journal, every record folded at the time the
daemon received it, and asked every 50 ms (bench/faults.py's `first`) whether
its hang names the desync. Prints each run's seconds from the last rank's entry
to the desync named, and the median. Also: whether the daemon said it once (the
warning event in the journal).

`--clean-steps N`: then a clean run (every rank alike, `--pairs`: a pair's
all_reduce after each step, besides DDP's) of N steps, --world-size ranks: the
signed collectives its ranks entered (two a step each: DDP's gradient
all-reduce, on the world group, and the pair's all_reduce), and the desyncs named,
in the journal's warning events and at every 50 ms of the state replayed from
it (0 is right). Numbers in docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from faults import first, moments  # bench/faults.py, beside this script

from ddtop.core import desync, journal, wire
from ddtop.core.rundir import RunPaths

DDTRAIN = str(Path(sys.executable).parent / "ddtrain")
SCRIPT = str(Path(__file__).resolve().parent.parent / "tests" / "scripts" / "desync.py")
TIMEOUT_S = 300


def one(world: int, root: Path, index: int) -> tuple[float | None, int]:
    run_id = f"desync{index}"
    cmd = [DDTRAIN, "start", "--foreground", "-n", str(world), "--run-id", run_id,
           "--runs-dir", str(root), "--hang-timeout", "3", SCRIPT, "--steps", "40",
           "--step-s", "0.05", "--at", "30", "--odd-rank", str(world - 1), "--odd", "all_gather"]
    subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    paths = RunPaths(root / run_id)
    entered = []
    for rank in range(world):
        for line in paths.rank_log(rank).read_text().splitlines():
            if line.startswith("entering "):
                entered.append(float(line.split()[1]))
    if len(entered) != world:
        raise SystemExit(f"run {run_id}: {len(entered)} of {world} ranks entered the step")
    since = max(entered)
    named = first(paths.journal, run_id, since - 1.0,
                  lambda t, state: desync.named(state.hang(t)))
    told = sum(1 for r in journal.read(paths.journal)
               if isinstance(m := wire.decode([r.frame]), wire.Event)
               and m.type == "warning" and desync.named(m.message))
    return (None if named is None else named - 1.0), told


def clean(world: int, root: Path, steps: int) -> tuple[int, int, int]:
    """(signed collectives entered, desync events, 50 ms moments naming a desync)."""
    run_id = "clean"
    cmd = [DDTRAIN, "start", "--foreground", "-n", str(world), "--run-id", run_id,
           "--runs-dir", str(root), SCRIPT, "--steps", str(steps), "--pairs", "--odd", "none"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S * 4,
                          check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"the clean run failed: {done.stderr[-2000:]}")
    paths = RunPaths(root / run_id)
    told = sum(1 for r in journal.read(paths.journal)
               if isinstance(m := wire.decode([r.frame]), wire.Event)
               and m.type == "warning" and desync.named(m.message))
    named = sum(1 for t, state in moments(paths.journal, run_id, until_s=0)
                if desync.named(state.hang(t)))
    return 2 * world * steps, told, named


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--clean-steps", type=int, default=0,
                        help="then a clean run of this many steps (0: none)")
    args = parser.parse_args()
    times: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        print(f"world {args.world_size}: rank {args.world_size - 1} all_gather against "
              f"all_reduce at step 30; seconds from the last rank's entry to the desync named")
        for i in range(args.repeats):
            named, told = one(args.world_size, Path(tmp), i)
            print(f"  run {i + 1}: {'never' if named is None else f'{named:.2f} s'}, "
                  f"said {told} time(s)", flush=True)
            if named is not None:
                times.append(named)
        if times:
            print(f"median {statistics.median(times):.2f} s, max {max(times):.2f} s "
                  f"({len(times)} of {args.repeats} named)")
        false = 0
        if args.clean_steps:
            entered, told, named = clean(args.world_size, Path(tmp), args.clean_steps)
            false = told + named
            print(f"clean run, {args.clean_steps} steps of {args.world_size} ranks: {entered:,} "
                  f"signed collectives entered; desyncs said {told}, moments naming one {named}")
    return 0 if len(times) == args.repeats and not false else 1


if __name__ == "__main__":
    sys.exit(main())
