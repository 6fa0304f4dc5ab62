"""What `--metrics` costs: a live run scraped every second against one without, and
the exporter's CPU per scrape at 1,024 ranks.

    .venv/bin/python bench/metrics.py [--rounds 24] [--seconds 4] [--ranks 1024]

1. Training. Two runs of the built-in trainer start side by side (`ddtrain start
   -n 2`, detached, the same flags): one with `--metrics 0`, one without. Rounds
   of --seconds alternate: in a *scraped* round a thread here GETs the first run's
   /metrics every second (as Prometheus would, with its parser's work left out),
   in an *idle* round nothing is scraped. Each round's steps of each run are read
   from its daemon (a status request to each, the same for both), and each round
   gives the paired ratio steps(--metrics) / steps(without): 1.0 is no cost. The
   idle rounds are the noise floor (the two runs differ in nothing but the flag,
   served and not asked); the scraped rounds, the cost. Median of the rounds'
   ratios with the sign test's 95% interval (bench/stats.py). On a few shared
   cores the steps of two runs side by side swing by tens of percent a round, so
   the daemons' CPU (each daemon process's, per second, from /proc; the mean over
   the rounds) is given too: where the work of a scrape lands.

2. The exporter at --ranks ranks, in process: a RunState fed each rank's hello,
   20 step messages and a heartbeat (what the daemon folds), then per scrape the
   CPU of the daemon's loop (`read`: the reading a scrape waits for; the loop's only
   work for it), of the server's thread (`families` and daemon/exposition.py's
   text, OpenMetrics as Prometheus asks; beside it, the same families through
   prometheus_client's OpenMetrics encoder, which served them before), and a whole
   scrape over HTTP through the real server (`Exporter`, a thread playing the loop):
   its wall time and the process's CPU. Medians of --repeats.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from stats import median_interval  # bench/stats.py, beside this script

DDTRAIN = str(Path(sys.executable).parent / "ddtrain")
TRAIN = ("-n", "2", "--epochs", "1000", "--synthetic-train-samples", "8192")
WARM_S = 5.0
SCRAPE_EVERY_S = 1.0


def ddtrain(runs: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DDTRAIN, *args, "--runs-dir", str(runs)], text=True,
                          capture_output=True, timeout=120, check=False)


def steps(runs: Path, run: str) -> int:
    from ddtop.core import control, protocol

    record = json.loads((runs / run / "run.json").read_text())
    summary = control.request(record["endpoints"]["control"], protocol.Status(), 5.0).summary
    assert summary is not None
    return summary.global_step


def cpu_s(runs: Path, run: str) -> float:
    """CPU seconds the run's daemon process has used (user and system)."""
    pid = json.loads((runs / run / "run.json").read_text())["daemon_pid"]
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def training(rounds: int, seconds: float) -> dict[str, list[float]]:
    """Each kind of round's paired ratios, steps(--metrics) / steps(without), and
    each run's daemon CPU in ms per second (`KIND cpu with`, `KIND cpu without`)."""
    ratios: dict[str, list[float]] = {f"{kind}{what}": [] for kind in ("idle", "scraped")
                                      for what in ("", " cpu with", " cpu without")}
    with tempfile.TemporaryDirectory(prefix="ddtop-bench-metrics-") as folder:
        runs = Path(folder)
        started = [ddtrain(runs, "start", *TRAIN, "--run-id", "with", "--metrics", "0"),
                   ddtrain(runs, "start", *TRAIN, "--run-id", "without")]
        try:
            for done in started:
                assert done.returncode == 0, done.stdout + done.stderr
            url = json.loads((runs / "with" / "run.json").read_text())["endpoints"]["metrics"]
            time.sleep(WARM_S)
            scraping = threading.Event()
            over = threading.Event()

            def scraper() -> None:
                while not over.wait(SCRAPE_EVERY_S):
                    if scraping.is_set():
                        with urllib.request.urlopen(url, timeout=10) as reply:
                            reply.read()

            thread = threading.Thread(target=scraper, daemon=True)
            thread.start()
            for n in range(rounds):
                kind = "scraped" if n % 2 else "idle"
                (scraping.set if kind == "scraped" else scraping.clear)()
                before = steps(runs, "with"), steps(runs, "without")
                cpu = cpu_s(runs, "with"), cpu_s(runs, "without")
                time.sleep(seconds)
                after = steps(runs, "with"), steps(runs, "without")
                ratios[kind].append((after[0] - before[0]) / max(1, after[1] - before[1]))
                ratios[f"{kind} cpu with"].append(1e3 * (cpu_s(runs, "with") - cpu[0]) / seconds)
                ratios[f"{kind} cpu without"].append(
                    1e3 * (cpu_s(runs, "without") - cpu[1]) / seconds)
            over.set()
            thread.join()
        finally:
            for run in ("with", "without"):
                ddtrain(runs, "stop", run, "--timeout", "10")
            for run in ("with", "without"):  # a daemon that did not stop: ended here
                with contextlib.suppress(OSError, ValueError, KeyError, ProcessLookupError):
                    pid = json.loads((runs / run / "run.json").read_text())["daemon_pid"]
                    deadline = time.monotonic() + 30
                    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                        time.sleep(0.2)
                    if Path(f"/proc/{pid}").exists():
                        os.kill(pid, signal.SIGKILL)
    return ratios


def fed_state(ranks: int) -> object:
    """A RunState as the daemon holds it for `ranks` ranks mid-run."""
    from ddtop.core import wire
    from ddtop.core.state import RunState

    state = RunState(run="bench")
    t = time.time()
    for rank in range(ranks):
        state.apply(wire.Hello(run="bench", rank=rank, seq=0, t=t, host=f"node{rank // 8}",
                               pid=10_000 + rank, local_rank=rank % 8, world_size=ranks,
                               device=f"cuda:{rank % 8}", backend="nccl", model="mlp",
                               dataset="synthetic", epochs=1, global_batch=64 * ranks,
                               config_digest=""), t)
        for k in range(1, 21):
            state.apply(wire.Step(run="bench", rank=rank, seq=k, t=t + k, epoch=0, step=k,
                                  global_step=k, steps=1, steps_per_epoch=1000, samples=64,
                                  loss_sum=64.0, lr=0.1, step_s=0.1, data_s=0.01,
                                  forward_s=0.02, backward_s=0.04, optimizer_s=0.01,
                                  comm_s=0.03, comm_bytes=1 << 20, comm_ops=4, algbw_gbps=5.0,
                                  busbw_gbps=9.0, sync_wait_s=0.0), t + k)
        state.apply(wire.Heartbeat(run="bench", rank=rank, seq=21, t=t + 20, phase="forward",
                                   epoch=0, global_step=20, phase_s=0.01), t + 20)
    return state


def exporter_cpu(ranks: int, repeats: int) -> dict[str, float]:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric
    from prometheus_client.openmetrics.exposition import generate_latest

    from ddtop.daemon.exporter import Exporter
    from ddtop.daemon.exposition import encode
    from ddtop.daemon.metricreading import read
    from ddtop.daemon.metrictable import families

    state = fed_state(ranks)
    now = time.time()
    loop_s, server_s, client_s, size = [], [], [], 0

    class Once:  # the same families in prometheus_client's types, for its encoder
        def __init__(self, reading: object) -> None:
            self.reading = reading

        def collect(self) -> object:
            for family in families(self.reading, now):  # type: ignore[arg-type]
                metric = Metric(family.name, family.doc, family.kind)
                for suffix, values, more, value in family.samples:
                    metric.add_sample(family.name + suffix,
                                      {**dict(zip(family.labels, values, strict=True)),
                                       **dict(more)}, value)
                yield metric

    for _ in range(repeats):
        t0 = time.thread_time()
        reading = read(state, now)  # type: ignore[arg-type]
        t1 = time.thread_time()
        text = encode(families(reading, now), openmetrics=True)  # type: ignore[arg-type]
        t2 = time.thread_time()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(Once(reading))  # type: ignore[arg-type]
        generate_latest(registry)
        t3 = time.thread_time()
        loop_s.append(t1 - t0)
        server_s.append(t2 - t1)
        client_s.append(t3 - t2)
        size = len(text)
    exporter = Exporter("127.0.0.1:0")
    over = threading.Event()

    def loop() -> None:  # the daemon's loop: a pass every 0.1 s, or when a scrape wakes it
        while not over.is_set():
            select.select(exporter.fds, [], [], 0.1)
            exporter.serve(state)  # type: ignore[arg-type]

    thread = threading.Thread(target=loop)
    thread.start()
    wall, cpu = [], []
    try:
        for _ in range(repeats):
            w0, c0 = time.perf_counter(), time.process_time()
            with urllib.request.urlopen(exporter.url, timeout=30) as reply:
                reply.read()
            wall.append(time.perf_counter() - w0)
            cpu.append(time.process_time() - c0)
    finally:
        over.set()
        thread.join()
        exporter.close()
    return {"loop_ms": 1e3 * statistics.median(loop_s),
            "server_ms": 1e3 * statistics.median(server_s),
            "client_ms": 1e3 * statistics.median(client_s),
            "ratio": statistics.median(s / c for s, c in zip(server_s, client_s, strict=True)),
            "http_wall_ms": 1e3 * statistics.median(wall),
            "http_cpu_ms": 1e3 * statistics.median(cpu), "bytes": size,
            "series": sum(1 for line in text.splitlines() if not line.startswith(b"#"))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--skip-training", action="store_true",
                        help="only the exporter's CPU (no runs)")
    args = parser.parse_args(argv)
    print(f"# bench/metrics.py on {platform.node()}: {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}")
    if not args.skip_training:
        ratios = training(args.rounds, args.seconds)
        print(f"\n2-rank runs side by side, rounds of {args.seconds:g} s; steps(--metrics) / "
              "steps(without), median [95% interval]")
        print(f"{'rounds':<34}{'n':>4}  {'steps ratio':<24}daemon CPU ms/s (mean): with, without")
        for kind, label in (("idle", "idle (served, not scraped): floor"),
                            ("scraped", "scraped every second")):
            estimate = median_interval(ratios[kind])
            # The mean over the rounds: /proc counts CPU in ticks of 10 ms.
            cpu = (statistics.fmean(ratios[f"{kind} cpu with"]),
                   statistics.fmean(ratios[f"{kind} cpu without"]))
            print(f"{label:<34}{estimate.n:>4}  {estimate.cell():<24}{cpu[0]:.1f}, {cpu[1]:.1f}")
    cost = exporter_cpu(args.ranks, args.repeats)
    print(f"\nthe exporter at {args.ranks:,} ranks ({cost['series']:,} samples, "
          f"{cost['bytes'] / 1e6:.2f} MB a scrape); median of {args.repeats}")
    print(f"{'daemon loop: the reading (CPU)':<40}{cost['loop_ms']:>8.1f} ms")
    print(f"{'server thread: families + text (CPU)':<40}{cost['server_ms']:>8.1f} ms")
    print(f"{'  the same, prometheus_client encoding':<40}{cost['client_ms']:>8.1f} ms"
          f"   (ours / theirs: {cost['ratio']:.3f}, paired median)")
    print(f"{'a scrape over HTTP (wall)':<40}{cost['http_wall_ms']:>8.1f} ms")
    print(f"{'a scrape over HTTP (process CPU)':<40}{cost['http_cpu_ms']:>8.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
