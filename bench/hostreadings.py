"""What a straggler's host readings cost: training/hostreadings.py's `take` (the
training thread's schedstat and the process's /proc/self/stat), timed here on
this process, beside a 10 ms step of CPU work timed the same way in one run.

    .venv/bin/python bench/hostreadings.py [--rounds 2000]

The sender thread takes them once per Step message: at most every 0.1 s, so at
10 ms steps once per 10 steps. Prints the median cost of a take, of a 10 ms
step, and the share of a step's time the readings take (the target: at most
0.5%). Numbers in docs/performance.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from ddtop.training.hostreadings import HostReadings

STEP_S = 0.010
STEPS_PER_TAKE = 10  # a message every 0.1 s at 10 ms steps


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    readings = HostReadings()
    if readings.take() is None:
        raise SystemExit("this kernel gives no schedstat or /proc/self/stat: nothing to time")
    takes, steps = [], []
    for i in range(args.rounds):  # interleaved: both see the same machine
        start = time.perf_counter()
        readings.take()
        takes.append(time.perf_counter() - start)
        if i % 20 == 0:
            start = time.perf_counter()
            spin(STEP_S)
            steps.append(time.perf_counter() - start)
    take, step = statistics.median(takes), statistics.median(steps)
    share = take / STEPS_PER_TAKE / step
    print(f"{'what':<34} {'median':>10}")
    print(f"{'take (schedstat + stat)':<34} {take * 1e6:>8.1f} us")
    print(f"{'a 10 ms step of CPU work':<34} {step * 1e3:>8.2f} ms")
    print(f"{'share of a step (1 take / 10 steps)':<34} {100 * share:>8.3f} %   (target 0.5%)")
    return 0 if share <= 0.005 else 1


if __name__ == "__main__":
    sys.exit(main())
