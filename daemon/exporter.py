"""`--metrics [HOST:]PORT`: the run's state served to Prometheus at /metrics.

Nothing is done per message: the daemon folds its messages into the RunState as
always, and a scrape reads that state. The state belongs to the daemon's loop
(one thread; the fold is not thread-safe), so a scrape, on the HTTP server's
thread, asks the loop for a reading, wakes it (a byte on a pipe the loop waits
on with its sockets), and waits: at once, not at its next pass (every 0.1 s),
the loop copies the numbers a scrape shows into a `Reading`, plain and frozen,
between two messages, so that every number of one scrape comes from the same
moment; no lock is held while it is copied or formatted. A loop that does not
pass within ANSWER_S (stopping ranks, waiting for other nodes) is answered
for with the previous reading. Between scrapes the loop checks one flag a pass.

`read` and `families` are pure (tested without a server; `families` walks SERIES, the
table of every family served); `Exporter` is the hand-off, and the server
(daemon/metricserver.py: bounded threads and connections, timeouts, and the doors of
--metrics-auth and --metrics-cert/--metrics-key; bound to 127.0.0.1 unless a host is
given); the text is prometheus_client's encoder's. `NoExporter` stands in without
--metrics. docs/monitoring.md lists what is served.
"""

from __future__ import annotations

import contextlib
import os
import platform
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Literal, TextIO, get_args

import msgspec

from ddtop.core import causes, desync, outlets, wire
from ddtop.core.config import TrainConfig
from ddtop.core.contract import UsageError
from ddtop.core.outlets import parse_listen, url
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
    cause: str | None  # a straggler's (core/causes.py), where judged
    waited_for: bool
    restarts: int  # restarts its failure caused
    lost: int
    rss: int | None = None  # bytes, as the rank last read them
    rss_peak: int | None = None
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    cuda_peak: int | None = None
    creep: float | None = None  # bytes a second its memory grows by, while it creeps
    # Counters, from its Step messages added up: steps, samples, and seconds of its steps
    # outside communication, in it, and in the data phase.
    steps_total: int | None = None
    samples_total: int | None = None
    compute_total: float | None = None
    comm_total: float | None = None
    data_total: float | None = None


class Reading(msgspec.Struct, frozen=True, kw_only=True):
    """The run's numbers at one moment: what one scrape shows."""

    run: str
    status: str
    world_size: int
    restarts: int
    global_step: int
    total_steps: int
    samples_per_s: float | None
    hung: bool
    desync: bool
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
    why = state.straggler_causes()
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
                                     straggler=False, cause=None, waited_for=r in waited,
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
            cause=why[r][0] if r in why else None, waited_for=r in waited,
            restarts=blamed.get(r, 0), lost=v.lost, rss=v.rss, rss_peak=v.rss_peak,
            cuda_allocated=v.cuda_allocated, cuda_reserved=v.cuda_reserved,
            cuda_peak=v.cuda_peak, creep=v.creep.rate(), steps_total=v.global_step,
            samples_total=v.samples, compute_total=max(0.0, v.step_s_total - v.comm_s_total),
            comm_total=v.comm_s_total, data_total=v.data_s_total))
    done, total = state.progress()
    info = {"model": state.model, "dataset": state.dataset, "backend": state.backend,
            "strategy": state.strategy, "program": state.program}
    return Reading(
        run=state.run, status=state.status, world_size=state.world_size,
        restarts=state.restarts, global_step=done, total_steps=total,
        samples_per_s=state.throughput(now), hung=hung is not None,
        desync=hung is not None and desync.named(hung[1]),
        lost=sum(v.lost for v in state.ranks.values()), rejected=dict(state.rejected),
        journal_dropped=state.journal_dropped, info=info, aggregate=state.aggregate,
        ranks=ranks)


def _text(value: int | None) -> str:
    return "" if value is None else str(value)


@dataclass(frozen=True)
class Series:
    """One metric family of a table row: `ddtop_<per>_<name>`, a gauge or a counter, its
    help text, and how a reading gives its value (a rank's or the run's; None: no sample,
    never a made-up 0)."""

    per: Literal["rank", "run"]
    kind: Literal["gauge", "counter"]
    name: str
    doc: str
    value: Callable[[Any], float | None]


def _rank(field: str) -> Callable[[RankReading], float | None]:
    return lambda rank: getattr(rank, field)


def _agg(field: str) -> Callable[[Reading], float | None]:
    return lambda reading: None if reading.aggregate is None else getattr(reading.aggregate, field)


def _build() -> dict[str, str]:
    """ddtop's, Python's and torch's versions (torch's from its metadata: not imported)."""
    found = {"python": platform.python_version()}
    for package in ("ddtop", "torch"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "unknown"
    return {"version": found["ddtop"], "python": found["python"], "torch": found["torch"]}


BUILD = _build()

# Every family /metrics serves, in the order served; "state", "straggler_cause", "status",
# "info", "build" and "rejected" are labelled by what they count (built in `families`). A new series
# is a row.
SERIES: tuple[Series | str, ...] = (
    Series("rank", "gauge", "global_step", "optimizer steps the rank has done",
           _rank("global_step")),
    Series("rank", "gauge", "last_step_timestamp_seconds", "when the rank's newest step ended "
           "(Unix time, the rank's clock); frozen while the rank takes no step",
           _rank("last_step_t")),
    Series("rank", "gauge", "step_seconds", "seconds per step, newest window", _rank("step_s")),
    Series("rank", "gauge", "compute_seconds", "seconds per step outside exposed communication",
           _rank("compute_s")),
    Series("rank", "gauge", "comm_seconds", "seconds per step in collectives", _rank("comm_s")),
    Series("rank", "gauge", "comm_share_ratio", "comm seconds over step seconds, 0 to 1",
           _rank("comm_share")),
    Series("rank", "gauge", "bus_bandwidth_bytes_per_second", "collectives' bus bandwidth "
           "(nccl-tests' busbw)", _rank("busbw_bytes")),
    Series("rank", "gauge", "samples_per_second", "the rank's training samples per second",
           _rank("samples_per_s")),
    Series("rank", "gauge", "loss", "the rank's training loss, newest window", _rank("loss")),
    Series("rank", "gauge", "rss_bytes", "the rank's resident memory", _rank("rss")),
    Series("rank", "gauge", "rss_peak_bytes", "the rank's resident memory at its peak so far",
           _rank("rss_peak")),
    Series("rank", "gauge", "cuda_allocated_bytes", "CUDA memory the rank has allocated",
           _rank("cuda_allocated")),
    Series("rank", "gauge", "cuda_reserved_bytes", "CUDA memory the rank's allocator holds",
           _rank("cuda_reserved")),
    Series("rank", "gauge", "cuda_peak_bytes", "CUDA memory allocated at its peak so far",
           _rank("cuda_peak")),
    Series("rank", "gauge", "memory_creep_bytes_per_second", "while the rank's memory creeps "
           "(grows steadily for 5 minutes or more): how fast", _rank("creep")),
    "state",
    Series("rank", "gauge", "straggler", "1 when the others persistently wait for this rank",
           _rank("straggler")),
    "straggler_cause",
    Series("rank", "gauge", "hang", "1 when the run hangs and the others wait for this rank",
           _rank("waited_for")),
    Series("rank", "counter", "steps", "optimizer steps the rank has done (rate(): steps a "
           "second, 0 in a stall)", _rank("steps_total")),
    Series("rank", "counter", "samples", "training samples the rank has stepped through",
           _rank("samples_total")),
    Series("rank", "counter", "step_compute_seconds", "seconds of its steps outside "
           "communication", _rank("compute_total")),
    Series("rank", "counter", "step_comm_seconds", "seconds of its steps in collectives",
           _rank("comm_total")),
    Series("rank", "counter", "data_wait_seconds", "seconds of its steps in the data phase "
           "(waiting for its batches)", _rank("data_total")),
    Series("rank", "counter", "restarts", "restarts of the run this rank's failures caused",
           _rank("restarts")),
    Series("rank", "counter", "messages_lost", "telemetry messages of the rank lost on the way",
           _rank("lost")),
    "status",
    "info",
    "build",
    Series("run", "gauge", "world_size", "ranks of the run", lambda r: r.world_size),
    Series("run", "gauge", "global_step", "optimizer steps done by the slowest rank",
           lambda r: r.global_step),
    Series("run", "gauge", "total_steps", "optimizer steps the run will take (when known)",
           lambda r: r.total_steps or None),
    Series("run", "gauge", "samples_per_second", "training samples per second, all ranks",
           lambda r: r.samples_per_s),
    Series("run", "gauge", "hung", "1 while ranks are stalled in a collective",
           lambda r: r.hung),
    Series("run", "gauge", "desync", "1 while ranks of a process group are inside different "
           "collectives at the same point of the group (a hang: hung is 1 too)",
           lambda r: r.desync),
    Series("run", "gauge", "loss", "global training loss, newest metric sync",
           _agg("train_loss")),
    Series("run", "gauge", "accuracy_ratio", "global training accuracy, newest metric sync",
           _agg("train_accuracy")),
    Series("run", "gauge", "val_loss", "validation loss, newest epoch", _agg("val_loss")),
    Series("run", "gauge", "val_accuracy_ratio", "validation accuracy, newest epoch",
           _agg("val_accuracy")),
    Series("run", "counter", "restarts", "restarts of every rank after a failure",
           lambda r: r.restarts),
    Series("run", "counter", "messages_lost", "telemetry messages lost on the way, all ranks",
           lambda r: r.lost),
    "rejected",
    Series("run", "counter", "journal_dropped", "records not written to the journal "
           "(a full disk)", lambda r: r.journal_dropped),
)


def families(reading: Reading) -> list[Any]:
    """The metric families of one reading (SERIES walked), in prometheus_client's types
    (imported here: only a daemon serving --metrics needs prometheus_client)."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        InfoMetricFamily,
    )

    run = (reading.run,)

    def family(series: Series) -> Any:
        kind = GaugeMetricFamily if series.kind == "gauge" else CounterMetricFamily
        labelled = (RANK_LABELS if series.per == "rank" else ("run",))
        made = kind(f"ddtop_{series.per}_{series.name}", series.doc, labels=labelled)
        rows = ([(rank.labels, series.value(rank)) for rank in reading.ranks]
                if series.per == "rank" else [(run, series.value(reading))])
        for labels, number in rows:
            if number is not None:  # not known yet: no sample (never a made-up 0)
                made.add_metric(labels, float(number))
        return made

    def labelled(name: str) -> Any:
        if name == "state":
            state = GaugeMetricFamily("ddtop_rank_state", "1 for the state the rank is in, 0 "
                                      "for the others", labels=(*RANK_LABELS, "state"))
            for rank in reading.ranks:
                for each in RANK_STATES:
                    state.add_metric((*rank.labels, each), float(rank.state == each))
            return state
        if name == "straggler_cause":
            cause = GaugeMetricFamily("ddtop_rank_straggler_cause", "a straggler's cause: 1 for "
                                      "it, 0 for the others (docs/monitoring.md)",
                                      labels=(*RANK_LABELS, "cause"))
            for rank in reading.ranks:
                if rank.cause is not None:
                    for each in causes.CAUSES:
                        cause.add_metric((*rank.labels, each), float(rank.cause == each))
            return cause
        if name == "status":
            status = GaugeMetricFamily("ddtop_run_status", "1 for the run's status, 0 for the "
                                       "others", labels=("run", "status"))
            for each in RUN_STATUSES:
                status.add_metric((*run, each), float(reading.status == each))
            return status
        if name == "info":
            info = InfoMetricFamily("ddtop_run", "what the run trains", labels=("run",))
            info.add_metric(run, reading.info)
            return info
        if name == "build":
            build = InfoMetricFamily("ddtop_build", "the ddtop, Python and torch versions of "
                                     "this daemon's environment", labels=())
            build.add_metric((), BUILD)
            return build
        rejected = CounterMetricFamily("ddtop_run_messages_rejected", "frames the daemon "
                                       "refused, by reason", labels=("run", "reason"))
        for reason, count in sorted(reading.rejected.items()):
            rejected.add_metric((*run, reason), float(count))
        return rejected

    return [labelled(row) if isinstance(row, str) else family(row) for row in SERIES]


class Exporter:
    """The /metrics server (daemon/metricserver.py), and the hand-off of readings from
    the daemon's loop (`serve`, every pass) to scrapes (`collect`, the server's render
    workers). `auth`, `cert` and `key`: the files of --metrics-auth, --metrics-cert and
    --metrics-key (core/outlets.py reads them), or none."""

    def __init__(self, address: str, auth: str = "", cert: str = "", key: str = "") -> None:
        try:
            from prometheus_client import CollectorRegistry
            from prometheus_client.exposition import choose_encoder
        except ImportError:
            raise UsageError("--metrics needs prometheus_client, not installed here: "
                             "pip install 'ddtop[metrics]'") from None
        from ddtop.daemon.metricserver import MetricServer

        try:  # checked by config.py already; read again here, as the server uses them
            host, port = parse_listen("--metrics", address)
            credential = outlets.read_metrics_auth(auth) if auth else None
            tls = outlets.metrics_tls(cert, key) if cert or key else None
        except ValueError as e:  # a config.json written by hand, a file changed since
            raise UsageError(str(e)) from None
        self._asked = threading.Event()  # a scrape waits for a reading
        self._fresh = threading.Event()  # the loop has taken it
        self._one = threading.Lock()  # one scrape at a time asks
        # Written by a scrape, read by the daemon's loop, which waits on it with its
        # sockets (`fds`): a scrape wakes the loop at once, not at its next pass.
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.fds: tuple[int, ...] = (self._wake_read,)
        self._reading: Reading | None = None
        self._closed = False
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)

        def render(accept: str) -> tuple[bytes, str]:  # a render worker: the text asked for
            encoder, content_type = choose_encoder(accept)
            return encoder(registry), content_type

        try:
            self.server = MetricServer(host, port, render, credential, tls)
        except OSError as e:
            raise UsageError(f"--metrics {address}: cannot listen there "
                             f"({e.strerror or e})") from None
        self.url = url(host, self.server.port, "/metrics", "https" if tls else "http")

    @property
    def endpoints(self) -> dict[str, str]:
        return {"metrics": self.url}

    def serve(self, state: RunState) -> None:
        """The daemon's loop: a reading for the scrape waiting, if one is."""
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_read, 4096)
        if self._asked.is_set():
            self._asked.clear()
            self._reading = read(state, time.time())
            self._fresh.set()

    def collect(self) -> Iterator[Any]:
        """A scrape (a render worker): the loop's next reading, as metrics."""
        with self._one:
            if not self._closed:
                self._fresh.clear()
                self._asked.set()
                with contextlib.suppress(BlockingIOError):  # full: the loop is waking anyway
                    os.write(self._wake_write, b"!")
                self._fresh.wait(ANSWER_S)
            reading = self._reading
        if reading is not None:
            yield from families(reading)

    def close(self) -> None:
        self._closed = True
        self._fresh.set()  # a scrape waiting is answered now
        self.server.close()
        for fd in (self._wake_read, self._wake_write):
            os.close(fd)


class NoExporter:
    """Without --metrics: nothing served, nothing done."""

    url = ""
    fds: tuple[int, ...] = ()

    @property
    def endpoints(self) -> dict[str, str]:
        return {}

    def serve(self, state: RunState) -> None:
        pass

    def close(self) -> None:
        pass


def open_exporter(config: TrainConfig, err: TextIO) -> Exporter | NoExporter:
    """The server for `--metrics ADDRESS` (and its --metrics-auth, --metrics-cert and
    --metrics-key), its address said on `err` (UsageError: a bad address, a port in
    use, a credential or certificate refused), or the stand-in without it."""
    if not config.metrics:
        return NoExporter()
    exporter = Exporter(config.metrics, config.metrics_auth, config.metrics_cert,
                        config.metrics_key)
    print(f"ddtrain: metrics at {exporter.url}", file=err, flush=True)
    return exporter
