"""What one rank costs its node on the wire: messages and bytes a second.

    .venv/bin/python bench/rank_wire.py [--seconds 10] [--repeats 3]

One rank's real sender (training/telemetry.py's LiveTelemetry, its thread and
PUSH socket) sends to a PULL socket over ipc, as a rank sends to its node's
daemon; a thread plays the training loop: a step is four phases and one
all-reduce, at 10 steps/s and at 1 step/s, or the rank sleeps in a phase
(idle, a slow data loader), or sits blocked in a collective. Each scenario
runs under two heartbeat rules, interleaved in the same run: *before*, a
heartbeat every second regardless; *after*, training/beats.py's (only when no
Step message went out for a second, or the phase moved into or out of work
outside the steps). Counted from the second second on (hello and the first
heartbeat left out). Bytes are ZeroMQ's on the socket: each frame and its
ZMTP header (2 bytes, 9 from 256 bytes of payload); TCP to another host adds
its own headers. The medians of `--repeats` runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from ddtop.core import wire
from ddtop.training.beats import HEARTBEAT_INTERVAL_S, Beats
from ddtop.training.telemetry import LiveTelemetry

WARMUP_S = 1.0  # hello, the first heartbeat and the first step left out
JOB_RANKS = 16_384  # the job size the last column scales one rank to
HELLO = wire.Hello(run="bench", rank=0, local_rank=0, host="h", pid=1, device="cpu",
                   backend="gloo", world_size=8, config_digest="", model="", dataset="",
                   epochs=0, global_batch=0)


class EverySecond(Beats):
    """The rule before: a heartbeat every second, whatever went out meanwhile."""

    def due(self, now: float, phase: wire.Phase) -> bool:
        return now - self.last >= HEARTBEAT_INTERVAL_S

    def stepped(self, now: float) -> None:
        pass


RULES: dict[str, Callable[[], Beats]] = {"before": EverySecond, "after": Beats}


class Counter:
    """A PULL socket drained by a thread: messages and wire bytes by kind, with
    the sender's time."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(endpoint)
        self.got: list[tuple[float, str, int]] = []  # (sent at, kind, bytes on the wire)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        while not self.stop.is_set():
            if self.socket.poll(50):
                frames = self.socket.recv_multipart()
                m = wire.decode(frames)
                size = sum(len(f) + (2 if len(f) < 256 else 9) for f in frames)
                self.got.append((m.t, type(m).__name__, size))

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.socket.close()
        self.context.term()


def step(tel: LiveTelemetry, n: int, step_s: float) -> None:
    tel.phase("data")
    time.sleep(step_s * 0.2)
    tel.phase("forward")
    time.sleep(step_s * 0.2)
    tel.phase("backward")
    with tel.collective("allreduce", 1 << 20):
        time.sleep(step_s * 0.4)
    tel.phase("optimizer")
    time.sleep(step_s * 0.2)
    tel.count_step(0, n, 0, n, 0.1, loss=1.0, samples=32)


def stepping(steps_per_s: float) -> Callable[[LiveTelemetry, float], None]:
    def loop(tel: LiveTelemetry, until: float) -> None:
        n = 0
        while time.monotonic() < until:
            n += 1
            step(tel, n, 1.0 / steps_per_s)
    return loop


def idle(tel: LiveTelemetry, until: float) -> None:
    step(tel, 1, 0.1)
    tel.phase("data")  # a data loader that does not come back
    time.sleep(max(0.0, until - time.monotonic()))


def blocked(tel: LiveTelemetry, until: float) -> None:
    step(tel, 1, 0.1)
    tel.phase("backward")
    with tel.collective("allreduce", 1 << 20):  # the others never come
        time.sleep(max(0.0, until - time.monotonic()))


SCENARIOS: dict[str, Callable[[LiveTelemetry, float], None]] = {
    "10 steps/s": stepping(10.0), "1 step/s": stepping(1.0), "idle": idle,
    "blocked": blocked}


def measure(scenario: str, rule: str, seconds: float, folder: Path) -> dict[str, float]:
    """Per second, from WARMUP_S on: messages, bytes, heartbeats, Step messages."""
    endpoint = f"ipc://{folder / f'{rule}.sock'}"
    counter = Counter(endpoint)
    try:
        tel = LiveTelemetry(endpoint, HELLO, beats=RULES[rule]())
        start = time.time()
        SCENARIOS[scenario](tel, time.monotonic() + WARMUP_S + seconds)
        end = time.time()
        tel.close(0)
        time.sleep(0.3)
    finally:
        counter.close()
    window = [(kind, size) for t, kind, size in counter.got
              if start + WARMUP_S <= t < end and kind != "Bye"]
    span = end - start - WARMUP_S
    return {"messages": len(window) / span, "bytes": sum(s for _, s in window) / span,
            "heartbeats": sum(k == "Heartbeat" for k, _ in window) / span,
            "steps": sum(k == "Step" for k, _ in window) / span,
            "heartbeat_bytes": statistics.mean([s for k, s in window if k == "Heartbeat"] or [0]),
            "step_bytes": statistics.mean([s for k, s in window if k == "Step"] or [0])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per scenario and rule")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="ddtop-rank-wire-") as tmp:
        for _ in range(args.repeats):
            for scenario in SCENARIOS:
                for rule in RULES:  # side by side: before, then after, each repeat
                    got = measure(scenario, rule, args.seconds, Path(tmp))
                    results.setdefault((scenario, rule), []).append(got)
    print(f"one rank's telemetry to its node, {args.seconds:g} s a run, median of "
          f"{args.repeats}; the last column: a {JOB_RANKS:,}-rank job before any node "
          "folds it")
    print(f"{'scenario':<12} {'rule':<7} {'messages/s':>10} {'bytes/s':>8} "
          f"{'heartbeats/s':>12} {'Step/s':>7} {'job messages/s':>15}")
    for (scenario, rule), runs in results.items():
        med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        print(f"{scenario:<12} {rule:<7} {med['messages']:>10.2f} {med['bytes']:>8,.0f} "
              f"{med['heartbeats']:>12.2f} {med['steps']:>7.2f} "
              f"{med['messages'] * JOB_RANKS:>15,.0f}")
    sizes = [r for runs in results.values() for r in runs]
    beat = statistics.median(r["heartbeat_bytes"] for r in sizes if r["heartbeat_bytes"])
    step_bytes = statistics.median(r["step_bytes"] for r in sizes if r["step_bytes"])
    print(f"a heartbeat {beat:.0f} bytes, a Step message {step_bytes:.0f} bytes on the wire")
    return 0


if __name__ == "__main__":
    sys.exit(main())
