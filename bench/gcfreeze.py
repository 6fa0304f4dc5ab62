"""What a rank process gains from freezing what it imported (training/worker.py's
`gc.freeze()`), measured side by side in fresh interpreters.

    .venv/bin/python bench/gcfreeze.py [--repeats 7]

Each round starts two processes in turn, one per mode, each importing what a rank
imports ahead of training (torch, torch._dynamo, DDP, ddtop.training.trainer):
  plain    as a rank was before;
  frozen   then gc.freeze(), as ddtop.training.worker does.
Each process then times one full collection (what a rank's training loop pays
whenever Python's collector reaches its oldest generation) and exits as a rank
under torchrun or --start-method spawn does, through the interpreter's
finalisation. The parent times the exit (from the child's last line to its
reaping) and reads the child's CPU seconds from the kernel (wait4). Prints
medians and the frozen / plain ratio of each, paired by round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

CHILD = """\
import gc, sys, time
import torch, torch._dynamo
from torch.nn.parallel import DistributedDataParallel
import ddtop.training.trainer
if sys.argv[1] == "frozen":
    gc.freeze()
tracked = len(gc.get_objects())
start = time.perf_counter()
gc.collect()
print(tracked, time.perf_counter() - start, flush=True)
"""
MODES = ("plain", "frozen")


def one(mode: str) -> tuple[int, float, float, float]:
    """(objects the collector tracks, a full collection's s, exit s, CPU s)."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, mode], stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout is not None
    line = child.stdout.readline()
    said = time.perf_counter()
    _, status, usage = os.wait4(child.pid, 0)
    exit_s = time.perf_counter() - said
    child.returncode = os.waitstatus_to_exitcode(status)
    child.stdout.close()
    if child.returncode != 0 or not line:
        raise SystemExit(f"the {mode} child failed (exit {child.returncode})")
    tracked, collect_s = line.split()
    return int(tracked), float(collect_s), exit_s, usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="rounds (default 7)")
    args = parser.parse_args()
    got: dict[str, list[tuple[int, float, float, float]]] = {m: [] for m in MODES}
    for round_ in range(args.repeats):
        for mode in MODES if round_ % 2 == 0 else reversed(MODES):
            got[mode].append(one(mode))
        print(f"round {round_ + 1}/{args.repeats} done", file=sys.stderr)

    def median(mode: str, i: int) -> float:
        return statistics.median(r[i] for r in got[mode])

    def ratio(i: int) -> float:
        return statistics.median(f[i] / p[i] for p, f in zip(got["plain"], got["frozen"],
                                                              strict=True) if p[i] > 0)

    print("| mode | objects the collector walks | a full collection | exit | CPU of the "
          "process |")
    print("| --- | --- | --- | --- | --- |")
    for mode in MODES:
        print(f"| {mode} | {median(mode, 0):,.0f} | {median(mode, 1) * 1000:.1f} ms | "
              f"{median(mode, 2):.2f} s | {median(mode, 3):.2f} s |")
    print(f"| frozen / plain | | {ratio(1):.4f} | {ratio(2):.2f} | {ratio(3):.2f} |")


if __name__ == "__main__":
    main()
