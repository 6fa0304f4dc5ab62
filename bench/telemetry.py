"""What telemetry costs the training loop, and whether its comm timing is right.

    .venv/bin/python bench/telemetry.py [--repeats 5] [--samples 65536] [--only comm]

1. Throughput: the same 2-rank run (`ddtrain start --foreground`), telemetry
   off / on with a listener / on with nobody listening, interleaved, `--repeats`
   runs each; steps per second from rank 0's "training done" line; median and
   ratio to "off" (target: at least 0.99).
2. Cost on the training thread of one step's reporting calls, as the trainer
   makes them (4 `with ddtop.phase(...)` and `ddtop.step(loss=..., samples=...)`),
   in microseconds, off and with a live sender thread and listener.
3. The DDP comm hook's all-reduce time against `dist.all_reduce` of the same
   bytes on the same gloo group, timed side by side in the same 2 processes
   (target: within 10%). Per iteration the faster of the two ranks' figures
   is taken for both: that rank arrived last and waited for nobody.
   `--comm-backend nccl` does the same on the GPUs, one rank per GPU, where the
   hook times with CUDA events and `dist.all_reduce` is timed with CUDA events
   around it on the training stream (`--only comm --comm-backend nccl`).
4. The training thread's time per step while another thread calls
   `ddtop.step()` in a tight loop, against one that calls a no-op as often (the
   GIL shared the same way) and against none (`--only flood`).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import zmq

DDTRAIN = str(Path(sys.executable).parent / "ddtrain")
DONE = re.compile(r"training done: (\d+) steps in ([\d.]+) s")


class Listener:
    """A PULL socket drained by a thread, as the daemon would."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PULL)
        self.socket.bind("tcp://127.0.0.1:*")
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.count = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        while not self.stop.is_set():
            if self.socket.poll(100):
                self.socket.recv_multipart()
                self.count += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.socket.close(linger=0)
        self.context.term()


def steps_per_second(samples: int, env: dict[str, str], runs_dir: str) -> float:
    cmd = [DDTRAIN, "start", "--foreground", "-n", "2", "--epochs", "1",
           "--synthetic-train-samples", str(samples), "--synthetic-val-samples", "256",
           "--progress-every", "1000", "--runs-dir", runs_dir]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, **env}, check=False)
    match = DONE.search(run.stdout)
    if run.returncode or not match:
        sys.exit(f"run failed:\n{run.stdout}\n{run.stderr}")
    return int(match.group(1)) / float(match.group(2))


def throughput(repeats: int, samples: int) -> None:
    listener = Listener()
    with tempfile.TemporaryDirectory() as tmp:
        probe = zmq.Context().socket(zmq.PULL)
        deaf = f"tcp://127.0.0.1:{probe.bind_to_random_port('tcp://127.0.0.1')}"
        probe.close(linger=0)  # nobody listens there from now on
        configs = {"off": {}, "on, listener": {"DDTOP_TELEMETRY": listener.endpoint},
                   "on, no listener": {"DDTOP_TELEMETRY": deaf}}
        rates: dict[str, list[float]] = {name: [] for name in configs}
        for i in range(repeats):
            order = list(configs) if i % 2 == 0 else list(reversed(configs))
            for name in order:
                rates[name].append(steps_per_second(samples, configs[name], tmp))
                print(f"  run {i + 1} {name:<16} {rates[name][-1]:8.1f} steps/s",
                      file=sys.stderr)
    listener.close()
    base = statistics.median(rates["off"])
    print(f"\n1. Throughput, 2 ranks, {samples // 64} steps per run, median of {repeats}")
    print(f"{'telemetry':<17} | {'steps/s':>8} | {'min':>8} | {'max':>8} | {'ratio':>6}")
    print("-" * 58)
    for name, values in rates.items():
        med = statistics.median(values)
        print(f"{name:<17} | {med:8.1f} | {min(values):8.1f} | {max(values):8.1f} | "
              f"{med / base:6.3f}")
    print(f"(the listener received {listener.count} messages)")


def publish_cost() -> None:
    import torch

    import ddtop
    from ddtop.core import wire
    from ddtop.core.contract import TELEMETRY_ENV
    from ddtop.training import api

    listener = Listener()
    loss = torch.tensor(2.3)
    n = 100_000
    results = {}
    for name in ("off (no endpoint)", "on"):
        if name == "on":
            os.environ[TELEMETRY_ENV] = listener.endpoint
            live = api.start(run="bench", world_size=2)
        else:
            os.environ.pop(TELEMETRY_ENV, None)  # (ddtop's first call: off, until api.start)
            live = None
        start = time.perf_counter()
        for _ in range(n):
            with ddtop.phase("data"):
                pass
            with ddtop.phase("forward"):
                pass
            with ddtop.phase("backward"):
                pass
            with ddtop.phase("optimizer"):
                pass
            ddtop.step(loss=loss, samples=32)
        results[name] = (time.perf_counter() - start) / n * 1e6
        if live is not None:
            live.close(0)
    step = wire.Step(run="r", rank=0, epoch=0, step=1, steps_per_epoch=2, global_step=1,
                     steps=1, samples=8, loss_sum=1.0, lr=0.1, step_s=0.1, data_s=0,
                     forward_s=0, backward_s=0, optimizer_s=0, comm_s=0, comm_bytes=0,
                     comm_ops=0, algbw_gbps=0, busbw_gbps=0, sync_wait_s=0, rss=1)
    start = time.perf_counter()
    for _ in range(n):
        wire.encode(step)
    encode_us = (time.perf_counter() - start) / n * 1e6
    listener.close()
    print("\n2. Cost of one step's telemetry calls on the training thread")
    print(f"{'telemetry':<20} | {'us per step':>11}")
    print("-" * 35)
    for name, us in results.items():
        print(f"{name:<20} | {us:11.2f}")
    print(f"(encoding a Step message, done on the sender thread: {encode_us:.2f} us)")


def flood_cost(steps: int) -> None:
    import torch

    import ddtop
    from ddtop.core.contract import TELEMETRY_ENV
    from ddtop.training import api

    listener = Listener()
    os.environ[TELEMETRY_ENV] = listener.endpoint
    weight = torch.randn(128, 128)

    def noop() -> None:
        pass

    spinners: dict[str, Any] = {"none": None, "calling a no-op": noop,
                                "calling ddtop.step()": ddtop.step}
    results = {}
    for name, call in spinners.items():
        live = api.start(run="bench", world_size=2)
        stop = threading.Event()
        calls = 0

        def spin(call: Any = call, stop: threading.Event = stop) -> None:
            nonlocal calls
            while not stop.is_set():
                call()
                calls += 1

        thread = threading.Thread(target=spin)
        if call is not None:
            thread.start()
        start = time.perf_counter()
        for _ in range(steps):
            with ddtop.phase("forward"):
                loss = (weight @ weight).sum()
            ddtop.step(loss=loss, samples=1)
        took = time.perf_counter() - start
        stop.set()
        if call is not None:
            thread.join()
        if live is not None:
            live.close(0)
        results[name] = (took / steps * 1e6, calls / took)
    listener.close()
    print(f"\n4. The training thread's time per step ({steps} steps of a 128x128 matmul, "
          "telemetry on) with another thread spinning")
    print(f"{'other thread':<22} | {'us per step':>11} | {'its calls/s':>11}")
    print("-" * 51)
    for name, (us, rate) in results.items():
        print(f"{name:<22} | {us:11.1f} | {rate:11,.0f}")


def _comm_rank(rank: int, port: int, steps: int, width: int, out: str, backend: str,
               world: int) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddtop.training.commtimer import CommTimer
    from ddtop.training.telemetry import Telemetry

    class Recording(Telemetry):
        def __init__(self) -> None:
            self.ops: list[tuple[float, int]] = []

        def comm_done(self, seconds: float, nbytes: int) -> None:
            self.ops.append((seconds, nbytes))

    torch.set_num_threads(1)
    cuda = backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)  # before the group, as the trainer does
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world,
                            device_id=device if cuda else None)
    torch.manual_seed(0)
    # One weight matrix: one gradient bucket, ready when backward ends, so the
    # hook times the all-reduce alone (nothing else computes meanwhile).
    ddp = DDP(nn.Linear(width, width, bias=False, device=device), bucket_cap_mb=1024,
              device_ids=[rank] if cuda else None)
    recording = Recording()
    timer = CommTimer(recording, cuda=cuda)
    timer.attach(ddp)
    x = torch.randn(8, width, device=device)
    tensor = torch.zeros(width * width, device=device)
    direct = []
    for i in range(steps):
        def ddp_step() -> None:
            dist.barrier()
            ddp.zero_grad()
            ddp(x).sum().backward()
            if cuda:
                torch.cuda.synchronize()
                timer.harvest()

        def direct_step() -> None:
            dist.barrier()
            if cuda:  # as the hook: events on the training stream around the collective
                begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                begin.record()
                dist.all_reduce(tensor)
                end.record()
                end.synchronize()
                direct.append(begin.elapsed_time(end) / 1000.0)
                return
            start = time.perf_counter()
            dist.all_reduce(tensor)
            direct.append(time.perf_counter() - start)

        first, second = (ddp_step, direct_step) if i % 2 == 0 else (direct_step, ddp_step)
        first()
        second()
    # Per iteration, the rank that reached the collective last waited for
    # nobody: its time is the transfer alone. Take that (the minimum over
    # ranks) for both measurements, so compute skew between the ranks does
    # not count against either.
    mine = ([s for s, _ in recording.ops], direct)
    every: list[tuple[list[float], list[float]]] = [([], [])] * world
    dist.all_gather_object(every, mine)
    warm = steps // 10
    if rank == 0:
        hook = [min(t) for t in zip(*(r[0] for r in every), strict=True)][warm:]
        plain = [min(t) for t in zip(*(r[1] for r in every), strict=True)][warm:]
        nbytes = recording.ops[-1][1]
        Path(out).write_text(f"{nbytes} {statistics.median(hook)} {statistics.median(plain)}")
    dist.barrier()
    dist.destroy_process_group()


def comm_timing(steps: int, widths: list[int], backend: str) -> None:
    import socket

    import torch
    import torch.multiprocessing as mp

    from ddtop.core.text import count_of
    from ddtop.core.wire import algbw_busbw

    if backend == "nccl" and not torch.cuda.is_available():
        sys.exit("--comm-backend nccl: no GPU is visible (use gloo, the default)")
    world = torch.cuda.device_count() if backend == "nccl" else 2
    where = f"{count_of(world, 'GPU')}, CUDA events" if backend == "nccl" else "CPU"
    print(f"\n3. All-reduce of one gradient bucket, {count_of(world, backend + ' rank')} "
          f"({where}), DDP comm hook vs dist.all_reduce interleaved, median of "
          f"{steps - steps // 10} each")
    # One rank moves no bytes between GPUs (busbw is 0 by its definition): algbw.
    bw, bw_name = (1, "busbw") if world > 1 else (0, "algbw")
    print(f"{'bucket':>8} | {'hook ms':>8} | {'direct ms':>9} | {'hook ' + bw_name:>10} | "
          f"{'direct ' + bw_name:>12} | {'hook/direct':>11}")
    print("-" * 75)
    for width in widths:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.NamedTemporaryFile(suffix=".txt") as out:
            mp.start_processes(_comm_rank, args=(port, steps, width, out.name, backend, world),
                               nprocs=world, start_method="spawn")
            nbytes_s, hook_s, direct_s = Path(out.name).read_text().split()
        nbytes, hook, direct = int(nbytes_s), float(hook_s), float(direct_s)
        hook_bus = algbw_busbw(nbytes, hook, world)[bw]
        direct_bus = algbw_busbw(nbytes, direct, world)[bw]
        print(f"{nbytes / 1e6:5.1f} MB | {hook * 1e3:8.3f} | {direct * 1e3:9.3f} | "
              f"{hook_bus:6.2f} GB/s | {direct_bus:8.2f} GB/s | {hook / direct:11.3f}")
    print("(target: hook/direct within 0.9 .. 1.1)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samples", type=int, default=65536)
    parser.add_argument("--comm-steps", type=int, default=200)
    parser.add_argument("--comm-widths", type=int, nargs="+", default=[1024, 2048],
                        help="each bucket is a width x width float32 gradient "
                             "(1024: 4.2 MB, 2048: 16.8 MB)")
    parser.add_argument("--comm-backend", choices=["gloo", "nccl"], default="gloo",
                        help="part 3: gloo, 2 ranks on the CPU (default); nccl, one rank "
                             "per GPU, timed with CUDA events")
    parser.add_argument("--flood-steps", type=int, default=3000)
    parser.add_argument("--only", choices=["throughput", "publish", "flood", "comm"],
                        help="run one part only")
    args = parser.parse_args()
    if args.only in (None, "throughput"):
        throughput(args.repeats, args.samples)
    if args.only in (None, "publish"):
        publish_cost()
    if args.only in (None, "flood"):
        flood_cost(args.flood_steps)
    if args.only in (None, "comm"):
        comm_timing(args.comm_steps, args.comm_widths, args.comm_backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())
