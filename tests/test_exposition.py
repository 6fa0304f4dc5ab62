"""/metrics' text (daemon/exposition.py) held to prometheus_client's own encoders and
parsers: the same families, types, help, samples and numbers, in the text format and in
OpenMetrics, for a reading with every kind of family and labels that need escaping;
`promtool check metrics` finds nothing to say; the Accept header picks the format as
Prometheus expects."""

from __future__ import annotations

import math
import subprocess
from typing import Any

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om
from prometheus_client.parser import text_string_to_metric_families as parse_text
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString
from promserver import PROMTOOL, need

from ddtop.core import wire
from ddtop.core.state import RunState
from ddtop.daemon.exposition import OPENMETRICS_TYPE, TEXT_TYPE, _number, encode, negotiate
from ddtop.daemon.metricreading import RankReading, Reading, read
from ddtop.daemon.metrictable import Family, families

# Prometheus 2.42's scrape Accept header (its default scrape protocols).
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                     "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def _rank(rank: int, host: str) -> RankReading:
    return RankReading(
        labels=('run "x"', str(rank), "0", host), pid=str(100 + rank), local_rank=str(rank),
        device="cpu", state="running" if rank else "stalled", global_step=40 + rank,
        last_step_t=1.7e9 + rank, step_s=0.25, comm_s=0.1, compute_s=0.15, comm_share=0.4,
        busbw_bytes=1.25e9, samples_per_s=0.0 if rank == 0 else 12345678.5,
        loss=float("nan") if rank == 2 else 2.5, straggler=rank == 1,
        cause="input" if rank == 1 else None, waited_for=False, restarts=rank, lost=0,
        rss=3 * 2**30, rss_peak=4 * 2**30, creep=None if rank else 1e6,
        steps_total=40, samples_total=1280, compute_total=6.0, comm_total=4.0,
        data_total=0.5, forward_total=2.0, backward_total=3.0, optimizer_total=1.0,
        step_buckets=(0,) * 6 + (30, 10, 0) + (0,) * 5 if rank else (),
        step_seconds_total=9.5, lr=1e-4, epoch=2)


def _reading() -> Reading:
    """Every kind of family: gauges and counters per rank and per run, states, a cause, a
    histogram, info series with labels that need escaping (quotes, a backslash, a
    newline, UTF-8), NaN, a huge and an unknown number."""
    hosts = ("node-a", 'we"ird\\host\nname', "n\u00e9ud")
    base = read(RunState(run="x"), 100.0)
    ranks = [_rank(rank, host) for rank, host in enumerate(hosts)]
    return Reading(run='run "x"', status="failed", world_size=3, restarts=2, global_step=40,
                   total_steps=100, samples_per_s=float("inf"), hung=True, desync=False,
                   lost=3, rejected={"bad frame": 2, "too big": 1}, journal_dropped=0,
                   info={**base.info, "model": "mlp\\v2", "dataset": 'data "set"'},
                   aggregate=None, ranks=ranks, taken=90.0, last_checkpoint=1.7e9,
                   ended=95.0, outcome=("failed", "signal"), failures={"signal": 2})


def _client_text(made: list[Family], openmetrics: bool) -> str:
    """The same families through prometheus_client's own encoder."""

    class Once:
        def collect(self) -> Any:
            for family in made:
                metric = Metric(family.name, family.doc, family.kind)
                for suffix, values, more, value in family.samples:
                    metric.add_sample(family.name + suffix,
                                      {**dict(zip(family.labels, values, strict=True)),
                                       **dict(more)}, value)
                yield metric

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Once())  # type: ignore[arg-type]
    return (generate_openmetrics if openmetrics else generate_latest)(registry).decode()


def _parsed(text: str, openmetrics: bool) -> list[tuple[Any, ...]]:
    """Each family as parsed: name, type, help, and its samples (NaN spelled, to compare)."""
    return [(f.name, f.type, f.documentation,
             [(s.name, s.labels, "NaN" if math.isnan(s.value) else s.value) for s in f.samples])
            for f in (parse_om if openmetrics else parse_text)(text)]


@pytest.mark.parametrize("openmetrics", [True, False], ids=["openmetrics", "text"])
def test_the_text_reads_as_prometheus_clients_own(openmetrics: bool) -> None:
    # And a help text with what each format escapes its own way.
    made = [*families(_reading(), 100.0),
            Family("ddtop_test_help", "gauge", 'a "quoted" \\ path\nand a line', ("run",),
                   [("", ("r",), (), 1.0)])]
    ours = encode(made, openmetrics).decode()
    theirs = _client_text(made, openmetrics)
    assert _parsed(ours, openmetrics) == _parsed(theirs, openmetrics)
    # Not empty, and with what needs escaping in it.
    kinds = {f[1] for f in _parsed(ours, openmetrics)}
    assert kinds == ({"gauge", "counter", "histogram", "info"} if openmetrics
                     else {"gauge", "counter", "histogram"})
    assert 'host="we\\"ird\\\\host\\nname"' in ours
    assert 'host="n\u00e9ud"' in ours
    assert ours.endswith("# EOF\n") == openmetrics
    # A sample where its number is known (rank 0's creep); none where it is not.
    creep = [line for line in ours.splitlines()
             if line.startswith("ddtop_rank_memory_creep_bytes_per_second{")]
    assert len(creep) == 1 and 'rank="0"' in creep[0] and creep[0].endswith(" 1e+06")


def test_numbers_are_spelled_as_prometheus_spells_them() -> None:
    spelled = {0.0: "0.0", 1.0: "1.0", 0.25: "0.25", 1e-7: "1e-07",
               123456.0: "123456.0", 1234567.0: "1.234567e+06", 1234567.5: "1.2345675e+06",
               1e6: "1e+06", 2.5e15: "2.5e+15", 1e16: "1e+16", 1.7e9 + 0.125: "1.700000000125e+09",
               -1234567.0: "-1234567.0", float("inf"): "+Inf", float("-inf"): "-Inf",
               3 * 2.0**30: "3.221225472e+09", 12345678.5: "1.23456785e+07"}
    for value, words in spelled.items():
        assert _number(value) == words, value
        assert floatToGoString(value) == words, value  # prometheus_client's, alike
    assert _number(float("nan")) == "NaN" and _number(-0.0) == "-0.0"


def test_the_accept_header_picks_the_format() -> None:
    assert negotiate(PROMETHEUS_ACCEPT) == (True, OPENMETRICS_TYPE)
    assert negotiate("application/openmetrics-text") == (True, OPENMETRICS_TYPE)
    assert negotiate("Application/OpenMetrics-Text; version=1.0.0") == (True, OPENMETRICS_TYPE)
    assert negotiate('application/openmetrics-text; version="1.0.0"') == (True,
                                                                          OPENMETRICS_TYPE)
    for accept in ("", "*/*", "text/plain", "text/plain;version=0.0.4",
                   "application/openmetrics-text;version=0.0.1", "application/json",
                   "application/openmetrics-text;q=0,text/plain;q=0.5",
                   "application/openmetrics-text;version=1.0.0;q=0.0"):
        assert negotiate(accept) == (False, TEXT_TYPE), accept


def test_a_run_with_no_rank_yet_is_served_whole() -> None:
    state = RunState(run="r")
    state.apply(wire.RunStatus(run="r", rank=-1, seq=1, t=50.0, status="starting",
                               world_size=2), 50.0)
    for openmetrics in (True, False):
        text = encode(families(read(state, 50.5), 51.0), openmetrics).decode()
        names = [f[0] for f in _parsed(text, openmetrics)]
        assert "ddtop_run_status" in names and "ddtop_build" in " ".join(names)


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_promtool_finds_nothing_to_say() -> None:
    need(PROMTOOL)  # it reads the text format
    text = encode(families(_reading(), 100.0), openmetrics=False)
    checked = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                             timeout=60, check=False)
    assert checked.returncode == 0 and not checked.stdout.strip(), (
        checked.stdout.decode() + checked.stderr.decode())
