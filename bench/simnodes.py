"""Simulated nodes of a multi-node job, for a real hub: tests/test_nodesummary.py
and bench/hub.py.

    python bench/simnodes.py --folder DIR --run RUN --world W --per P --first K --count N
                             [--seconds S] [--step-hz 10] [--steps-per-message 1]
                             [--scenario JSON]

DIR holds the hub's endpoints (hub.json: control, nodes) and the job's keys
(keys/). Nodes K .. K+N-1, each of P ranks (node k: ranks (k-1)P .. kP-1;
node 0, the hub, runs none here), run in this one process: per node a
real `daemon/summariser.Summariser` takes its ranks' synthetic messages as a
node's relay would hand them on, and its summaries go to the hub's `nodes`
socket (one CURVE PUSH for all of them, each forward naming its node), with a
`node` heartbeat per node every second on one CURVE DEALER, as
daemon/forwarder.Forwarder sends them. What a node daemon does for its own ranks
(their sockets, its journal) is not simulated: it costs the node, not the hub.

The ranks step together, STEP_HZ steps a second, --steps-per-message at a
time, each node on a clock of its own (node i of n a share i/n of a tick
later), so the nodes' summaries come spread as from real nodes; a rank's compute is 70% of a
step, its slow factor times that (the others wait for the slowest in the
all-reduce: their comm time grows). `--scenario` (JSON) adds faults:
- "slow": {"rank": factor}: a straggler from the start;
- "dead": [rank, at_s]: its node says the rank's process exited (code 1);
- "silent": [node, at_s]: the node sends nothing more;
- "hang": [rank, at_s]: the rank stops in forward; every other rank waits in the
  all-reduce it has not reached (heartbeats once a second, no steps).
The process prints one line when every hello is sent, then writes the wall
clock time the scenario's clock starts at to DIR/simstart.K, and stops after
--seconds or when DIR/done appears.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

BASE_STEP_S = 0.1
COMPUTE_SHARE = 0.7


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--per", type=int, default=8)
    parser.add_argument("--first", type=int, default=1)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--step-hz", type=float, default=10.0)
    parser.add_argument("--steps-per-message", type=int, default=1)
    parser.add_argument("--scenario", default="{}")
    args = parser.parse_args(argv)
    sim = SimNodes(Path(args.folder), args.run, args.world, args.per,
                   range(args.first, args.first + args.count), args.step_hz,
                   args.steps_per_message, json.loads(args.scenario))
    try:
        sim.run(args.seconds)
    finally:
        sim.close()
    return 0


class SimNodes:
    def __init__(self, folder: Path, run: str, world: int, per: int, nodes: range,
                 step_hz: float, steps_per_message: int, scenario: dict[str, Any]) -> None:
        import zmq

        from ddtop.core.keys import RunKeys
        from ddtop.core.rankview import RankView
        from ddtop.daemon import summariser

        hub = json.loads((folder / "hub.json").read_text())
        keys = RunKeys.load(folder / "keys")
        self.folder, self.run_id, self.world, self.per, self.nodes = folder, run, world, per, nodes
        self.step_hz, self.batch = step_hz, steps_per_message
        self.context = zmq.Context()
        self.push = self.context.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.setsockopt(zmq.SNDHWM, 100_000)
        keys.client(self.push)
        self.push.connect(hub["nodes"])
        self.dealer = self.context.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.SNDHWM, 100_000)
        keys.client(self.dealer)
        self.dealer.connect(hub["control"])
        # A summary as often as a node of this job sends one, or each tick where ticks
        # are longer (a little less, so that a tick on time finds it due).
        every = max(summariser.every_s(world // per + 1), steps_per_message / step_hz) * 0.95
        self.summarisers = {k: summariser.Summariser(run, k, every) for k in nodes}
        self.views = {k: {r: RankView(rank=r) for r in self.ranks(k)} for k in nodes}
        self.seq = {r: 0 for k in nodes for r in self.ranks(k)}
        self.daemon_seq = dict.fromkeys(nodes, 0)
        self.slow = {int(r): float(f) for r, f in scenario.get("slow", {}).items()}
        self.dead: tuple[int, float] | None = tuple(scenario["dead"]) if "dead" in scenario \
            else None  # type: ignore[assignment]
        self.silent: tuple[int, float] | None = tuple(scenario["silent"]) \
            if "silent" in scenario else None  # type: ignore[assignment]
        self.hang: tuple[int, float] | None = tuple(scenario["hang"]) if "hang" in scenario \
            else None  # type: ignore[assignment]
        self.gone: set[int] = set()  # ranks that exited
        self.sent = 0  # summary frames

    def ranks(self, node: int) -> range:
        """Node k's ranks: node 0, the hub, runs none here."""
        return range((node - 1) * self.per, node * self.per)

    def run(self, seconds: float) -> None:
        from ddtop.core import wire

        start = time.monotonic()
        t0 = time.time()
        for k in self.nodes:
            for r in self.ranks(k):
                self._take(k, self._hello(r, t0), t0)
                self._take(k, wire.Heartbeat(run=self.run_id, rank=r, seq=self._next(r), t=t0,
                                             phase="setup", epoch=0, global_step=0,
                                             phase_s=0.0), t0)
        self._flush(t0, every=True)
        print(f"simnodes: {len(self.nodes)} nodes, {len(self.seq)} ranks said hello",
              flush=True)
        start = time.monotonic()  # the scenario's clock: its faults' times count from here
        (self.folder / f"simstart.{self.nodes[0]}").write_text(repr(time.time()))
        # Each node on a clock of its own, as real nodes are (not in step): node i
        # of n steps (and sums up) period * i / n after the first.
        period = self.batch / self.step_hz
        due = {k: start + period * i / len(self.nodes) for i, k in enumerate(self.nodes)}
        ticks = dict.fromkeys(self.nodes, 0)
        next_beat, next_look, hang_step = 0.0, 0.0, None
        slowest = max([1.0, *self.slow.values()])
        while (elapsed := time.monotonic() - start) < seconds:
            if elapsed >= next_look:
                next_look = elapsed + 0.5
                if (self.folder / "done").exists():
                    break
            now, mono = time.time(), time.monotonic()
            hanging = self.hang is not None and elapsed >= self.hang[1]
            if hanging and hang_step is None:
                hang_step = max(ticks.values()) * self.batch
            for k in self._live_nodes(elapsed):
                if due[k] > mono:
                    continue
                if not hanging:
                    for r in self.ranks(k):
                        if r not in self.gone:
                            self._take(k, self._step(r, now, ticks[k], slowest), now)
                ticks[k] += 1
                due[k] += period
                summariser = self.summarisers[k]
                if summariser.due(mono):
                    self._send(k, summariser.frames(self.views[k], mono, now))
            if (self.dead is not None and elapsed >= self.dead[1] and self.dead[0] not in self.gone
                    and self.dead[0] // self.per + 1 in self.nodes):  # its node is simulated here
                rank = self.dead[0]
                self.gone.add(rank)
                self._daemon_says(rank // self.per + 1, wire.RankExit(
                    run=self.run_id, rank=wire.DAEMON_RANK, seq=0, t=now, exited=rank,
                    pid=10_000 + rank, exit_code=1, signal=None,
                    message="RuntimeError: simulated"))
            if elapsed >= next_beat:
                next_beat = elapsed + 1.0
                if hanging:
                    assert hang_step is not None
                    for k in self._live_nodes(elapsed):
                        for r in self.ranks(k):
                            if r not in self.gone:
                                waited = elapsed - self.hang[1]  # type: ignore[index]
                                self._take(k, self._waiting(r, now, hang_step, waited), now)
                self._node_beats(elapsed)
            self._drain(max(0.0, min(min(due.values()), mono + 0.05) - time.monotonic()))

    def _live_nodes(self, elapsed: float) -> list[int]:
        if self.silent is None or elapsed < self.silent[1]:
            return list(self.nodes)
        return [k for k in self.nodes if k != self.silent[0]]

    def _take(self, node: int, message: Any, received: float) -> None:
        view = self.views[node][message.rank]
        view.received += 1
        if self.summarisers[node].take(message, received):
            self._send(node, self.summarisers[node].frames({}, time.monotonic(), received))

    def _flush(self, t: float, elapsed: float = 0.0, every: bool = False) -> None:
        now = time.monotonic()
        for k in self._live_nodes(elapsed):
            summariser = self.summarisers[k]
            if every or summariser.due(now):
                if every:
                    summariser.last = 0.0
                self._send(k, summariser.frames(self.views[k], now, t))

    def _send(self, node: int, frames: list[bytes]) -> None:
        import zmq

        from ddtop.core import protocol

        for frame in frames:
            self.push.send_multipart(protocol.forward_frames(node, frame), zmq.NOBLOCK)
            self.sent += 1

    def _daemon_says(self, node: int, message: Any) -> None:
        from ddtop.core import wire

        message = type(message)(**{**{f: getattr(message, f) for f in message.__struct_fields__},
                                   "seq": self.daemon_seq[node]})
        self.daemon_seq[node] += 1
        self._send(node, wire.encode(message))

    def _node_beats(self, elapsed: float) -> None:
        import zmq

        from ddtop.core import protocol

        for k in self._live_nodes(elapsed):
            beat = protocol.NodeHeartbeat(node=k, host=f"node{k:04d}", pid=os.getpid(),
                                          ranks=list(self.ranks(k)), status="running")
            self.dealer.send(protocol.encode(beat), zmq.NOBLOCK)

    def _drain(self, wait_s: float) -> None:
        """The hub's replies to the nodes' heartbeats: the ranks open on a dashboard
        (a real node's Forwarder.take_reply does the same)."""
        import zmq

        from ddtop.core import protocol

        deadline = time.monotonic() + wait_s
        while True:
            try:
                body = self.dealer.recv(zmq.NOBLOCK)
                reply = protocol.decode_reply(protocol.NodeReply, body)
                for summariser in self.summarisers.values():
                    summariser.focus = set(reply.focus)
                continue
            except protocol.ProtocolError:
                continue
            except zmq.Again:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.dealer.poll(left * 1000)

    # -- the ranks' messages ------------------------------------------------------
    def _next(self, rank: int) -> int:
        self.seq[rank] += 1
        return self.seq[rank]

    def _hello(self, rank: int, t: float) -> Any:
        from ddtop.core import wire

        return wire.Hello(run=self.run_id, rank=rank, seq=self._next(rank), t=t,
                          local_rank=rank % self.per, host=f"node{rank // self.per:04d}",
                          pid=10_000 + rank, device=f"cuda:{rank % self.per}", backend="nccl",
                          world_size=self.world, config_digest="sim", model="mlp",
                          dataset="synthetic", epochs=1, global_batch=32 * self.world)

    def _step(self, rank: int, t: float, tick: int, slowest: float) -> Any:
        from ddtop.core import wire

        n = self.batch
        step_s = BASE_STEP_S * (COMPUTE_SHARE * slowest + 1 - COMPUTE_SHARE)
        compute = BASE_STEP_S * COMPUTE_SHARE * self.slow.get(rank, 1.0)
        global_step = (tick + 1) * n
        return wire.Step(run=self.run_id, rank=rank, seq=self._next(rank), t=t, epoch=0,
                         step=global_step % 1000, steps_per_epoch=1000,
                         global_step=global_step, steps=n, samples=32 * n,
                         loss_sum=32 * n * (2.0 - global_step * 1e-4), lr=0.1,
                         step_s=step_s * n, data_s=0.01 * n, forward_s=compute * 0.4 * n,
                         backward_s=compute * 0.5 * n, optimizer_s=compute * 0.1 * n,
                         comm_s=(step_s - compute) * n, comm_bytes=25_000_000 * n,
                         comm_ops=4 * n, algbw_gbps=0.8, busbw_gbps=1.6, sync_wait_s=0.0,
                         rss=2 * 10**9, compute_trim_s=compute if n >= 3 else None)

    def _waiting(self, rank: int, t: float, step: int, for_s: float) -> Any:
        """The hang: `rank` in forward of step+1; every other rank inside the
        all-reduce of step+1, which the hung rank has not reached."""
        from ddtop.core import wire

        done = wire.Collective(seq=4 * step, op="allreduce", bytes=6_250_000)
        assert self.hang is not None
        if rank == self.hang[0]:
            return wire.Heartbeat(run=self.run_id, rank=rank, seq=self._next(rank), t=t,
                                  phase="forward", epoch=0, global_step=step, phase_s=for_s,
                                  coll_started=done, coll_completed=done)
        waits = wire.Collective(seq=4 * step + 1, op="allreduce", bytes=6_250_000)
        return wire.Heartbeat(run=self.run_id, rank=rank, seq=self._next(rank), t=t,
                              phase="backward", epoch=0, global_step=step, phase_s=for_s,
                              coll_started=waits, coll_completed=done)

    def close(self) -> None:
        print(f"simnodes: {self.sent} summary frames sent", flush=True)
        self.push.close()
        self.dealer.close()
        self.context.term()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
