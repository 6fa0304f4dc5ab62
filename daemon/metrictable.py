"""The table of every metric family /metrics serves, and a reading spelled in it.

`SERIES` has a row per family, in the order served: a `Series` (a gauge or a counter
per rank or per run, its help, and how a reading gives its value), or the name of one
labelled by what it counts, built in `families`. `families` turns one Reading
(daemon/exporter.py) into `Family` records, which daemon/exposition.py writes out; pure,
tested without a server.
docs/monitoring.md lists the same families for users.
"""

from __future__ import annotations

import itertools
import platform
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Literal

from ddtop.core import causes, endings
from ddtop.core.rankview import STEP_BUCKETS
from ddtop.daemon.metricreading import (
    RANK_LABELS,
    RANK_STATES,
    RUN_STATUSES,
    RankReading,
    Reading,
)

# One sample of a family: the suffix of its name (counters' "_total", histograms'
# "_bucket", ...), the values of its family's identity labels, the labels it adds (names
# and values: a state, a cause, a bucket's bound), and its number.
Sample = tuple[str, tuple[str, ...], tuple[tuple[str, str], ...], float]


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family of a scrape: its name, type (OpenMetrics': gauge, counter,
    histogram, info), help text, the names of the labels every sample of it has
    (RANK_LABELS, the run's, none), and its samples."""

    name: str
    kind: Literal["gauge", "counter", "histogram", "info"]
    doc: str
    labels: tuple[str, ...]
    samples: list[Sample]


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

# Every family /metrics serves, in the order served; "state", "straggler_cause",
# "rank_info", "step_duration" (a histogram), "status", "outcome", "failures", "info",
# "build" and "rejected" are labelled by what they count, "age" by the moment of the
# scrape (built in `families`). A new series is a row.
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
    Series("rank", "gauge", "samples_per_second", "the rank's training samples per second, "
           "newest window; 0 while it takes no step (stalled, silent, dead)",
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
    Series("rank", "gauge", "hung", "1 when the run hangs and the others wait for this rank",
           _rank("waited_for")),
    "rank_info",
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
    Series("rank", "counter", "step_forward_seconds", "seconds of its steps in the forward "
           "pass", _rank("forward_total")),
    Series("rank", "counter", "step_backward_seconds", "seconds of its steps in the backward "
           "pass", _rank("backward_total")),
    Series("rank", "counter", "step_optimizer_seconds", "seconds of its steps in the "
           "optimizer", _rank("optimizer_total")),
    "step_duration",
    Series("rank", "gauge", "learning_rate", "the learning rate of its newest step (where "
           "known)", _rank("lr")),
    Series("rank", "gauge", "epoch", "the epoch it is in, counted from 1 (where known)",
           _rank("epoch")),
    Series("rank", "counter", "restarts", "restarts of the run this rank's failures caused",
           _rank("restarts")),
    Series("rank", "counter", "messages_lost", "telemetry messages of the rank lost on the way",
           _rank("lost")),
    "status",
    "outcome",
    Series("run", "gauge", "end_timestamp_seconds", "when the run ended (Unix time, the "
           "daemon's clock); no sample while it runs", lambda r: r.ended),
    "failures",
    Series("run", "gauge", "last_checkpoint_timestamp_seconds", "when the newest checkpoint "
           "was written (Unix time, its rank's clock)", lambda r: r.last_checkpoint),
    "age",
    "info",
    "build",
    Series("run", "gauge", "world_size", "ranks of the run", lambda r: r.world_size),
    Series("run", "gauge", "global_step", "optimizer steps done by the slowest rank",
           lambda r: r.global_step),
    Series("run", "gauge", "total_steps", "optimizer steps the run will take (when known)",
           lambda r: r.total_steps or None),
    Series("run", "gauge", "samples_per_second", "training samples per second, all ranks; "
           "0 while the run hangs",
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


def families(reading: Reading, now: float | None = None) -> list[Family]:
    """The metric families of one reading (SERIES walked), in the order served; pure.
    daemon/exposition.py writes them out in Prometheus' text formats."""
    run = (reading.run,)

    def family(series: Series) -> Family:
        name = f"ddtop_{series.per}_{series.name}"
        suffix = "_total" if series.kind == "counter" else ""
        rows = ([(rank.labels, series.value(rank)) for rank in reading.ranks]
                if series.per == "rank" else [(run, series.value(reading))])
        # A number not known yet: no sample (never a made-up 0).
        return Family(name, series.kind, series.doc,
                      RANK_LABELS if series.per == "rank" else ("run",),
                      [(suffix, labels, (), float(number)) for labels, number in rows
                       if number is not None])

    def labelled(name: str) -> Family:
        if name == "state":
            return Family("ddtop_rank_state", "gauge", "1 for the state the rank is in, 0 for "
                          "the others", RANK_LABELS,
                          [("", rank.labels, (("state", each),), float(rank.state == each))
                           for rank in reading.ranks for each in RANK_STATES])
        if name == "straggler_cause":
            return Family("ddtop_rank_straggler_cause", "gauge", "a straggler's cause: 1 for "
                          "it, 0 for the others (docs/monitoring.md)", RANK_LABELS,
                          [("", rank.labels, (("cause", each),), float(rank.cause == each))
                           for rank in reading.ranks if rank.cause is not None
                           for each in causes.CAUSES])
        if name == "rank_info":
            return Family("ddtop_rank", "info", "the rank's process now: its pid, its index "
                          "on its machine and its device (a restart may change them)",
                          RANK_LABELS,
                          [("_info", rank.labels, (("pid", rank.pid),
                                                   ("local_rank", rank.local_rank),
                                                   ("device", rank.device)), 1.0)
                           for rank in reading.ranks if rank.pid])
        if name == "status":
            return Family("ddtop_run_status", "gauge", "1 for the run's status, 0 for the "
                          "others", ("run",),
                          [("", run, (("status", each),), float(reading.status == each))
                           for each in RUN_STATUSES])
        if name == "outcome":
            return Family("ddtop_run_outcome", "info", "how the run ended (succeeded, failed "
                          "or stopped) and a failed run's cause; no sample while it runs",
                          ("run",),
                          [] if reading.outcome is None else
                          [("_info", run, (("outcome", reading.outcome[0]),
                                           ("cause", reading.outcome[1])), 1.0)])
        if name == "step_duration":
            return Family("ddtop_rank_step_duration_seconds", "histogram", "its steps by time "
                          "(each Step message's steps at their mean)", RANK_LABELS,
                          [sample for rank in reading.ranks if rank.step_buckets
                           for sample in _histogram(rank)])
        if name == "age":
            return Family("ddtop_run_reading_age_seconds", "gauge", "how old the numbers of "
                          "this scrape are: 0 but while the daemon's loop is busy (starting "
                          "or stopping ranks), or after the run's end", ("run",),
                          [] if now is None else [("", run, (), max(0.0, now - reading.taken))])
        if name == "failures":
            return Family("ddtop_run_failures", "counter", "failures of the run by cause "
                          "(docs/monitoring.md): every restart's, and the last's of a failed "
                          "run", ("run",),
                          [("_total", run, (("cause", each),),
                            float(reading.failures.get(each, 0))) for each in endings.CAUSES])
        if name == "info":
            return Family("ddtop_run", "info", "what the run trains", ("run",),
                          [("_info", run, tuple(reading.info.items()), 1.0)])
        if name == "build":
            return Family("ddtop_build", "info", "the ddtop, Python and torch versions of "
                          "this daemon's environment", (), [("_info", (), tuple(BUILD.items()),
                                                             1.0)])
        return Family("ddtop_run_messages_rejected", "counter", "frames the daemon refused, "
                      "by reason", ("run",),
                      [("_total", run, (("reason", reason),), float(count))
                       for reason, count in sorted(reading.rejected.items())])

    return [labelled(row) if isinstance(row, str) else family(row) for row in SERIES]


def _histogram(rank: RankReading) -> list[Sample]:
    """A rank's step-time histogram: a sample per bucket (counted up to its bound), then
    its count and its sum."""
    counts = list(itertools.accumulate(rank.step_buckets))
    return [*(("_bucket", rank.labels, (("le", bound),), float(count))
              for bound, count in zip(_BOUNDS, counts, strict=True)),
            ("_count", rank.labels, (), float(counts[-1])),
            ("_sum", rank.labels, (), rank.step_seconds_total)]


def _canonical(bound: float) -> str:
    """A bucket's `le` label as OpenMetrics spells it, and as Prometheus 3 stores every
    scrape's: a whole number keeps its `.0` (`1.0`, not `1`: another series)."""
    text = format(bound, "g")
    return text if any(c in text for c in ".en") else text + ".0"


_BOUNDS = (*(_canonical(b) for b in STEP_BUCKETS), "+Inf")  # the histogram's `le` labels
