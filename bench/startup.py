"""Start-up time of a run: forkserver (torch imported once, ranks forked) against
spawn (every rank imports torch itself), measured side by side.

    .venv/bin/python bench/startup.py [--world-sizes 2 8] [--repeats 3]

For each world size and start method it runs a tiny training job (one epoch of
the synthetic dataset, a handful of steps) through `ddtrain start --foreground`,
interleaving the methods, and reads two times:
  first step  seconds from the daemon's start until every rank has finished
              its first DDP step (rank 0 prints it; DDP's first backward is an
              all-reduce across all ranks, so no rank can be behind);
  wall        seconds for the whole command, start-up to exit.
Prints medians and the spawn / forkserver ratio.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DDTRAIN = str(Path(sys.executable).parent / "ddtrain")
FIRST_STEP = re.compile(r"first step done ([\d.]+) s after launch")
METHODS = ("forkserver", "spawn")


def one_run(world_size: int, method: str, runs_dir: Path) -> tuple[float, float]:
    samples = str(world_size * 8 * 4)  # 4 steps of 8 samples per rank
    cmd = [DDTRAIN, "start", "--foreground", "--world-size", str(world_size),
           "--start-method", method, "--epochs", "1", "--batch-size", str(8 * world_size),
           "--synthetic-train-samples", samples, "--synthetic-val-samples", samples,
           "--runs-dir", str(runs_dir)]
    start = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    wall = time.perf_counter() - start
    match = FIRST_STEP.search(run.stdout)
    if run.returncode != 0 or match is None:
        sys.exit(f"run failed ({run.returncode}):\n{run.stdout}\n{run.stderr}")
    return float(match.group(1)), wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.world_sizes:
            samples: dict[str, list[tuple[float, float]]] = {m: [] for m in METHODS}
            for i in range(args.repeats):
                for method in METHODS if i % 2 == 0 else reversed(METHODS):
                    samples[method].append(one_run(n, method, Path(tmp)))
                    print(f"  world {n} {method:<10} run {i + 1}: first step "
                          f"{samples[method][-1][0]:.2f} s, wall {samples[method][-1][1]:.2f} s",
                          file=sys.stderr)
            med = {m: (statistics.median(s[0] for s in v), statistics.median(s[1] for s in v))
                   for m, v in samples.items()}
            rows.append((n, med))
    print(f"\n{'world':>5} | {'forkserver first step':>21} | {'spawn first step':>16} | "
          f"{'ratio':>5} | {'forkserver wall':>15} | {'spawn wall':>10}")
    print("-" * 90)
    for n, med in rows:
        fs, sp = med["forkserver"], med["spawn"]
        print(f"{n:>5} | {fs[0]:>19.2f} s | {sp[0]:>14.2f} s | {sp[0] / fs[0]:>4.1f}x | "
              f"{fs[1]:>13.2f} s | {sp[1]:>8.2f} s")
    print(f"\nmedians of {args.repeats} interleaved runs each; ratio = spawn / forkserver")
    return 0


if __name__ == "__main__":
    sys.exit(main())
