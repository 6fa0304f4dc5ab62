"""`--metrics [HOST:]PORT`: the run's state served to Prometheus at /metrics.

Nothing is done per message: the daemon folds its messages into the RunState as
always, and a scrape reads that state. The state belongs to the daemon's loop
(one thread; the fold is not thread-safe), so a scrape, on the HTTP server's
thread, asks the loop for a reading and waits: at its next pass (every 0.1 s)
the loop copies the numbers a scrape shows into a `Reading`, plain and frozen,
between two messages, so that every number of one scrape comes from the same
moment; no lock is held while it is copied or formatted. A loop that does not
pass within ANSWER_S (stopping ranks, waiting for other nodes) is answered
for with the previous reading. Between scrapes the loop checks one flag a pass.

`read` and `families` are pure (tested without a server); `Exporter` is the
server (prometheus_client's, bound to 127.0.0.1 unless a host is given) and
the hand-off; `NoExporter` stands in without --metrics. docs/monitoring.md
lists what is served.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any, TextIO, get_args

import msgspec

from ddtop.core import wire
from ddtop.core.contract import UsageError
from ddtop.core.listen import parse_listen, url
from ddtop.core.rankview import RankState
from ddtop.core.state import RunState
from ddtop.core.summary import LOST

# Seconds a scrape waits for the daemon's loop to take a reading before it is
# answered with the previous one.
ANSWER_S = 1.0
RANK_LABELS = ("run", "rank", "node", "host", "pid", "local_rank")
RANK_STATES: tuple[str, ...] = get_args(RankState)
RUN_STATUSES: tuple[str, ...] = (*get_args(wire.RunStatusName), LOST)


class RankReading(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's numbers at the moment of a reading."""

    labels: tuple[str, ...]  # RANK_LABELS' values
    state: str
    global_step: int
    last_step_t: float | None  # the rank's own clock: its newest step message's time
    step_s: float | None
    comm_s: float | None
    compute_s: float | None
    comm_share: float | None
    busbw_bytes: float | None
    samples_per_s: float | None
    loss: float | None
    straggler: bool
    waited_for: bool
    restarts: int  # restarts its failure caused
    lost: int


class Reading(msgspec.Struct, frozen=True, kw_only=True):
    """The run's numbers at one moment: what one scrape shows."""

    run: str
    status: str
    world_size: int
    restarts: int
    global_step: int
    total_steps: int
    samples_per_s: float
    hung: bool
    lost: int
    rejected: dict[str, int]
    journal_dropped: int
    info: dict[str, str]
    aggregate: wire.Aggregate | None
    ranks: list[RankReading]


def read(state: RunState, now: float) -> Reading:
    """The numbers of `state` at `now` (the daemon's loop calls it, between messages)."""
    states = state.rank_states(now)
    _, _, stragglers = state.stragglers()
    hung = state.hung(now)
    waited = set(hung[0]) if hung is not None else set()
    blamed: dict[int, int] = {}
    for entry in state.timeline:
        blamed[entry.rank] = blamed.get(entry.rank, 0) + 1
    ranks = []
    for r, rank_state in states.items():
        v = state.ranks.get(r)
        node = str(state.rank_nodes.get(r, 0))
        if v is None:
            ranks.append(RankReading(labels=(state.run, str(r), node, "", "", ""),
                                     state=rank_state, global_step=0, last_step_t=None,
                                     step_s=None, comm_s=None, compute_s=None, comm_share=None,
                                     busbw_bytes=None, samples_per_s=None, loss=None,
                                     straggler=False, waited_for=r in waited,
                                     restarts=blamed.get(r, 0), lost=0))
            continue
        compute = None
        if v.step_time_s is not None and v.comm_s is not None:
            exposed = v.comm_s - (v.comm_overlap_s or 0.0)  # overlapped comm is compute time
            compute = max(0.0, v.step_time_s - exposed)
        ranks.append(RankReading(
            labels=(state.run, str(r), node, v.host, _text(v.pid), _text(v.local_rank)),
            state=rank_state, global_step=v.global_step, last_step_t=v.last_step_t,
            step_s=v.step_time_s, comm_s=v.comm_s, compute_s=compute, comm_share=v.comm_share,
            busbw_bytes=None if v.busbw_gbps is None else v.busbw_gbps * 1e9,
            samples_per_s=v.samples_per_s, loss=v.loss, straggler=r in stragglers,
            waited_for=r in waited, restarts=blamed.get(r, 0), lost=v.lost))
    done, total = state.progress()
    info = {"model": state.model, "dataset": state.dataset, "backend": state.backend,
            "strategy": state.strategy, "program": state.program}
    return Reading(
        run=state.run, status=state.status, world_size=state.world_size,
        restarts=state.restarts, global_step=done, total_steps=total,
        samples_per_s=state.throughput(now), hung=hung is not None,
        lost=sum(v.lost for v in state.ranks.values()), rejected=dict(state.rejected),
        journal_dropped=state.journal_dropped, info=info, aggregate=state.aggregate,
        ranks=ranks)


def _text(value: int | None) -> str:
    return "" if value is None else str(value)


def families(reading: Reading) -> list[Any]:
    """The metric families of one reading, in prometheus_client's types (imported
    here: only a daemon serving --metrics needs prometheus_client)."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        InfoMetricFamily,
    )

    def rank_gauge(name: str, doc: str, value: str) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"ddtop_rank_{name}", doc, labels=RANK_LABELS)
        for rank in reading.ranks:
            number = getattr(rank, value)
            if number is not None:  # not known yet: no sample (never a made-up 0)
                family.add_metric(rank.labels, float(number))
        return family

    def rank_counter(name: str, doc: str, value: str) -> CounterMetricFamily:
        family = CounterMetricFamily(f"ddtop_rank_{name}", doc, labels=RANK_LABELS)
        for rank in reading.ranks:
            family.add_metric(rank.labels, float(getattr(rank, value)))
        return family

    run = (reading.run,)
    state = GaugeMetricFamily("ddtop_rank_state", "1 for the state the rank is in, 0 for "
                              "the others", labels=(*RANK_LABELS, "state"))
    for rank in reading.ranks:
        for name in RANK_STATES:
            state.add_metric((*rank.labels, name), float(rank.state == name))
    status = GaugeMetricFamily("ddtop_run_status", "1 for the run's status, 0 for the others",
                               labels=("run", "status"))
    for name in RUN_STATUSES:
        status.add_metric((*run, name), float(reading.status == name))
    rejected = CounterMetricFamily("ddtop_run_messages_rejected", "frames the daemon refused, "
                                   "by reason", labels=("run", "reason"))
    for reason, count in sorted(reading.rejected.items()):
        rejected.add_metric((*run, reason), float(count))
    info = InfoMetricFamily("ddtop_run", "what the run trains", labels=("run",))
    info.add_metric(run, reading.info)

    def run_gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"ddtop_run_{name}", doc, labels=("run",))
        if value is not None:
            family.add_metric(run, float(value))
        return family

    def run_counter(name: str, doc: str, value: int) -> CounterMetricFamily:
        family = CounterMetricFamily(f"ddtop_run_{name}", doc, labels=("run",))
        family.add_metric(run, float(value))
        return family

    agg = reading.aggregate
    return [
        rank_gauge("global_step", "optimizer steps the rank has done", "global_step"),
        rank_gauge("last_step_timestamp_seconds", "when the rank's newest step ended (Unix "
                   "time, the rank's clock); frozen while the rank takes no step",
                   "last_step_t"),
        rank_gauge("step_seconds", "seconds per step, newest window", "step_s"),
        rank_gauge("compute_seconds", "seconds per step outside exposed communication",
                   "compute_s"),
        rank_gauge("comm_seconds", "seconds per step in collectives", "comm_s"),
        rank_gauge("comm_share_ratio", "comm seconds over step seconds, 0 to 1", "comm_share"),
        rank_gauge("bus_bandwidth_bytes_per_second", "collectives' bus bandwidth "
                   "(nccl-tests' busbw)", "busbw_bytes"),
        rank_gauge("samples_per_second", "the rank's training samples per second",
                   "samples_per_s"),
        rank_gauge("loss", "the rank's training loss, newest window", "loss"),
        state,
        rank_gauge("straggler", "1 when the others persistently wait for this rank",
                   "straggler"),
        rank_gauge("hang", "1 when the run hangs and the others wait for this rank",
                   "waited_for"),
        rank_counter("restarts", "restarts of the run this rank's failures caused",
                     "restarts"),
        rank_counter("messages_lost", "telemetry messages of the rank lost on the way",
                     "lost"),
        status,
        info,
        run_gauge("world_size", "ranks of the run", reading.world_size),
        run_gauge("global_step", "optimizer steps done by the slowest rank",
                  reading.global_step),
        run_gauge("total_steps", "optimizer steps the run will take (when known)",
                  reading.total_steps or None),
        run_gauge("samples_per_second", "training samples per second, all ranks",
                  reading.samples_per_s),
        run_gauge("hung", "1 while ranks are stalled in a collective", float(reading.hung)),
        run_gauge("loss", "global training loss, newest metric sync",
                  agg.train_loss if agg else None),
        run_gauge("accuracy_ratio", "global training accuracy, newest metric sync",
                  agg.train_accuracy if agg else None),
        run_gauge("val_loss", "validation loss, newest epoch", agg.val_loss if agg else None),
        run_gauge("val_accuracy_ratio", "validation accuracy, newest epoch",
                  agg.val_accuracy if agg else None),
        run_counter("restarts", "restarts of every rank after a failure", reading.restarts),
        run_counter("messages_lost", "telemetry messages lost on the way, all ranks",
                    reading.lost),
        rejected,
        run_counter("journal_dropped", "records not written to the journal (a full disk)",
                    reading.journal_dropped),
    ]


class Exporter:
    """prometheus_client's HTTP server, and the hand-off of readings from the
    daemon's loop (`serve`, every pass) to scrapes (`collect`, its threads)."""

    def __init__(self, address: str) -> None:
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError:
            raise UsageError("--metrics needs prometheus_client, not installed here: "
                             "pip install 'ddtop[metrics]'") from None
        try:
            host, port = parse_listen("--metrics", address)
        except ValueError as e:  # a config.json written by hand
            raise UsageError(str(e)) from None
        self._asked = threading.Event()  # a scrape waits for a reading
        self._fresh = threading.Event()  # the loop has taken it
        self._one = threading.Lock()  # one scrape at a time asks
        self._reading: Reading | None = None
        self._closed = False
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        try:
            self.server, self._thread = start_http_server(port, host, registry)
        except OSError as e:
            raise UsageError(f"--metrics {address}: cannot listen there "
                             f"({e.strerror or e})") from None
        self.url = url(host, self.server.server_address[1], "/metrics")

    @property
    def endpoints(self) -> dict[str, str]:
        return {"metrics": self.url}

    def serve(self, state: RunState) -> None:
        """The daemon's loop: a reading for the scrape waiting, if one is."""
        if self._asked.is_set():
            self._asked.clear()
            self._reading = read(state, time.time())
            self._fresh.set()

    def collect(self) -> Iterator[Any]:
        """A scrape (the server's thread): the loop's next reading, as metrics."""
        with self._one:
            if not self._closed:
                self._fresh.clear()
                self._asked.set()
                self._fresh.wait(ANSWER_S)
            reading = self._reading
        if reading is not None:
            yield from families(reading)

    def close(self) -> None:
        self._closed = True
        self._fresh.set()  # a scrape waiting is answered now
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()


class NoExporter:
    """Without --metrics: nothing served, nothing done."""

    url = ""

    @property
    def endpoints(self) -> dict[str, str]:
        return {}

    def serve(self, state: RunState) -> None:
        pass

    def close(self) -> None:
        pass


def open_exporter(address: str, err: TextIO) -> Exporter | NoExporter:
    """The server for `--metrics ADDRESS`, its address said on `err` (UsageError: a
    bad address or a port in use), or the stand-in without it."""
    if not address:
        return NoExporter()
    exporter = Exporter(address)
    print(f"ddtrain: metrics at {exporter.url}", file=err, flush=True)
    return exporter
