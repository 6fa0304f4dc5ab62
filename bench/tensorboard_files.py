"""What TensorBoard files cost: `--tensorboard` on a live run, and `ddtop export`'s speed.

    .venv/bin/python bench/tensorboard_files.py [--pairs 6] [--world-size 2] [--samples 16384]
                                          [--messages 50000] [--ranks 8]

Part 1, a live run, paired. --pairs pairs of real runs (`ddtrain start --foreground
-n WORLD --epochs 1`, the built-in trainer on --samples synthetic samples), one with
`--tensorboard DIR` and one without, back to back in a random order, so that both of a
pair see the same load. Each run's speed is its steps per second between rank 0's first
and last Step message (the journal's sender times: start-up and the end are left out):
the median of the pairs' ratios, with --tensorboard over without (1.0: no cost; the
target is at least 0.99), with the sign test's 95% interval, and the mean with Student's
t (bench/stats.py). The writer runs in the daemon, not in the ranks: the daemon's own
CPU (its process's threads, read from /proc until it exits) with and without, the
difference per pair and per Step message, is what it takes from the ranks' cores.

Part 2, the daemon's CPU per message. The messages of a --ranks-rank run (a journal of
--messages records written with the daemon's own JournalWriter: per rank a Step every
0.1 s and a heartbeat every 1 s, as the ranks send them) are folded into a RunState as
the relay folds them, with and without the daemon's TensorBoard writer taking each one
(flushed every 5 s of the run's time, as live); the CPU time it adds per message, and what
that is a second of a run at 8 and at 1,024 ranks (10 Step messages a second each).

Part 3, export. `ddtop export --tensorboard`'s work on that journal: Step messages
written per second of CPU (and the clock's time), and the event files' size. CPU time
(time.process_time) where the machine's other load would blur the clock's.

Numbers in docs/performance.md. (Not bench/tensorboard.py: a script of that name, first
on its own sys.path, would be what `import tensorboard` finds.)
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stats import mean_interval, median_interval  # bench/stats.py, beside this script

from ddtop.core import journal, wire
from ddtop.core.rundir import RunPaths
from ddtop.core.state import RunState
from ddtop.core.tbwriter import TensorBoardTap
from ddtop.dashboard import export

BIN = Path(sys.executable).parent
DDTRAIN = str(BIN / "ddtrain")
RUN_TIMEOUT_S = 600
CPU_POLL_S = 0.05
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# -- part 1 -------------------------------------------------------------------------------
def own_cpu(pid: int) -> float | None:
    """The CPU seconds of the process's own threads (not its children's); None once gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def live_run(root: Path, run_id: str, world: int, samples: int,
             tensorboard: bool) -> tuple[float, float, int]:
    """Rank 0's steps per second between its first and last Step message; the CPU of
    the daemon (`--foreground`: the supervisor runs in the command's own process, its
    ranks in others), read until it exits; the run's Step messages."""
    extra = ["--tensorboard", str(root / "tb")] if tensorboard else []
    proc = subprocess.Popen([DDTRAIN, "start", "--foreground", "-n", str(world), "--epochs", "1",
                             "--synthetic-train-samples", str(samples), "--run-id", run_id,
                             "--runs-dir", str(root / "runs"), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    cpu = 0.0
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        reading = own_cpu(proc.pid)
        cpu = reading if reading is not None else cpu
        time.sleep(CPU_POLL_S)
    _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    if proc.returncode != 0:
        raise SystemExit(f"run {run_id} failed:\n{err}")
    steps = [m for r in journal.read(root / "runs" / run_id / "telemetry.journal")
             if isinstance(m := wire.decode([r.frame]), wire.Step)]
    if tensorboard and not any((root / "tb" / run_id / "rank0").iterdir()):
        raise SystemExit(f"run {run_id} wrote no TensorBoard files")
    mine = [m for m in steps if m.rank == 0]
    first, last = mine[0], mine[-1]
    return (last.global_step - first.global_step) / (last.t - first.t), cpu, len(steps)


def part_live(pairs: int, world: int, samples: int) -> None:
    print(f"Part 1: --tensorboard on a live run: {pairs} pairs of {world}-rank runs "
          f"({samples} samples, 1 epoch), in a random order within each pair")
    ratios, added, per_step = [], [], []
    with tempfile.TemporaryDirectory(prefix="ddtop-bench-tb-") as tmp:
        for i in range(pairs):
            order = [False, True]
            random.shuffle(order)
            got = {on: live_run(Path(tmp), f"p{i}-{'on' if on else 'off'}", world, samples, on)
                   for on in order}
            (off, off_cpu, _), (on, on_cpu, messages) = got[False], got[True]
            ratios.append(on / off)
            added.append(on_cpu - off_cpu)
            per_step.append((on_cpu - off_cpu) / messages)
            print(f"  pair {i}: steps/s without {off:7.1f}, with {on:7.1f} (ratio "
                  f"{ratios[-1]:.3f}); the daemon's CPU without {off_cpu:5.2f} s, with "
                  f"{on_cpu:5.2f} s ({messages} Step messages)", flush=True)
    est = median_interval(ratios)
    mean, half = mean_interval(ratios) if len(ratios) > 1 else (ratios[0], float("nan"))
    print(f"  steps/s, with / without: median {est.cell()} ({est.verdict()}); "
          f"mean {mean:.3f} ± {half:.3f}")
    cpu = median_interval(added)
    print(f"  the daemon's CPU added: median {cpu.median:+.3f} s a run [{cpu.low:+.3f}, "
          f"{cpu.high:+.3f}], {1e6 * statistics.median(per_step):+.0f} us a Step message\n")


# -- parts 2 and 3 ------------------------------------------------------------------------
def synthetic_journal(path: Path, ranks: int, messages: int) -> int:
    """A run of `ranks` ranks as the daemon journals it; the Step messages written."""
    writer = journal.JournalWriter(path)
    seq, steps, t0 = 0, 0, 1.8e9
    hello = {"local_rank": 0, "host": "node", "pid": 1, "device": "cpu", "backend": "gloo",
             "world_size": ranks, "config_digest": "", "model": "mlp", "dataset": "synthetic",
             "epochs": 1, "global_batch": 64 * ranks}
    for rank in range(ranks):
        seq += 1
        writer.append(seq, t0, wire.encode(wire.Hello(run="big", rank=rank, seq=0, t=t0,
                                                      **{**hello, "local_rank": rank,
                                                         "pid": 1000 + rank}))[0])
    tick = 0
    while seq < messages:
        tick += 1
        t = t0 + tick * 0.1
        for rank in range(ranks):
            sent = tick * 2
            step = wire.Step(run="big", rank=rank, seq=sent, t=t, epoch=0, step=tick * 10,
                             steps_per_epoch=10**6, global_step=tick * 10, steps=10,
                             samples=640, loss_sum=640 * (1 + random.random()), lr=0.1,
                             step_s=0.1 + random.random() * 0.01, data_s=0.001,
                             forward_s=0.02, backward_s=0.04, optimizer_s=0.01,
                             comm_s=0.03 + random.random() * 0.01, comm_bytes=10**6,
                             comm_ops=10, algbw_gbps=1.0, busbw_gbps=1.5, sync_wait_s=0.0,
                             compute_trim_s=0.07)
            seq += 1
            steps += 1
            writer.append(seq, t, wire.encode(step)[0])
            if tick % 10 == 0:
                beat = wire.Heartbeat(run="big", rank=rank, seq=sent + 1, t=t, phase="forward",
                                      epoch=0, global_step=tick * 10, phase_s=0.01)
                seq += 1
                writer.append(seq, t, wire.encode(beat)[0])
    writer.close()
    return steps


def fold(records: list[tuple[wire.Message, float]]) -> float:
    """Seconds to fold every message into a RunState, as the relay does."""
    state = RunState(run="big")
    start = time.process_time()
    for message, received in records:
        state.apply(message, received)
    return time.process_time() - start


def part_daemon_and_export(ranks: int, messages: int) -> None:
    with tempfile.TemporaryDirectory(prefix="ddtop-bench-tb-") as tmp:
        root = Path(tmp)
        run = root / "runs" / "big"
        run.mkdir(parents=True)
        (run / "config.json").write_text("{}\n")
        steps = synthetic_journal(run / "telemetry.journal", ranks, messages)
        records = [(wire.decode([r.frame]), r.received)
                   for r in journal.read(run / "telemetry.journal")]
        clock = [0.0]

        def run_clock() -> float:
            return clock[0]

        bare, tapped = [], []
        for i in range(5):
            bare.append(fold(records))
            folder = root / f"tb{i}"
            tap = TensorBoardTap(folder / "big", clock=run_clock)
            start = time.process_time()
            state = RunState(run="big")
            for message, received in records:
                clock[0] = received
                state.apply(message, received)
                tap.take(message, state, received)
            said = tap.close()
            tapped.append(time.process_time() - start)
            if said is not None:
                raise SystemExit(said)
            shutil.rmtree(folder)
        per_message = (statistics.median(tapped) - statistics.median(bare)) / len(records)
        fold_us = statistics.median(bare) / len(records) * 1e6
        print(f"Part 2: the daemon's writer, {len(records):,} messages of {ranks} ranks "
              f"({steps:,} Step messages), median of 5")
        per_step = per_message * len(records) / steps
        print(f"  fold alone {fold_us:.1f} us a message; with the TensorBoard writer "
              f"+{per_message * 1e6:.1f} us a message (+{per_step * 1e6:.1f} us a Step "
              "message, heartbeats included)")
        for world in (8, 1024):
            share = per_step * 10 * world
            print(f"  at {world:>5} ranks (10 Step messages a second each): "
                  f"{100 * share:.2f}% of one core")
        print()
        times, walls = [], []
        for i in range(3):
            out = root / f"export{i}"
            start, wall = time.process_time(), time.perf_counter()
            done = export.export(RunPaths(run), out / "big")
            times.append(time.process_time() - start)
            walls.append(time.perf_counter() - wall)
            size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
            if done.steps != steps:
                raise SystemExit(f"exported {done.steps} of {steps} Step messages")
            shutil.rmtree(out)
        elapsed = statistics.median(times)
        megabytes = (run / "telemetry.journal").stat().st_size / 1e6
        print(f"Part 3: ddtop export, the same journal ({megabytes:.1f} MB), median of 3")
        print(f"  {elapsed:.2f} s of CPU ({statistics.median(walls):.2f} s by the clock): "
              f"{steps / elapsed:,.0f} Step messages a second of CPU ({len(records) / elapsed:,.0f}"
              f" records); event files {size / 1e6:.1f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--samples", type=int, default=16384)
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--ranks", type=int, default=8)
    args = parser.parse_args()
    if args.messages:  # 0: part 1 alone
        part_daemon_and_export(args.ranks, args.messages)
    if args.pairs:
        part_live(args.pairs, args.world_size, args.samples)


if __name__ == "__main__":
    main()
