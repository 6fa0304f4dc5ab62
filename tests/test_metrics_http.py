"""`--metrics`: the run's state served to Prometheus at /metrics, read back for real.

In process (fast): the address grammar; bad values and a port in use refused with
one line and exit 2 before anything starts (`ddtrain start`, `ddtrain watch`); the
exporter's server scraped over HTTP while a thread plays the daemon's loop.

With processes: one live 2-rank run (`--metrics 0`, rank 1 slowed so that its steps
are seen one by one, then frozen with `--inject 1:stop@step=K`), shared by the tests
in order: its URL in the start line, run.json and `ddtrain status`; one series per
rank, parsed with prometheus_client's own parser; the step advancing between two
scrapes; then, rank 1 frozen: both ranks' last-step timestamps stay as they were
(rank 0 waits in the step's all-reduce for rank 1, so it takes no step either),
rank 1 silent and named as the rank the hang waits for, rank 0 stalled; and a real
Prometheus server (Debian's `prometheus`, skipped where it is absent) scraping the
run and answering for the rank series through its query API.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from helpers import Detached, detached, terminate
from prometheus_client.parser import text_string_to_metric_families
from promserver import prometheus, quick_rules, served
from test_bad_input import in_tmp, usage_error_in_process

from ddtop.core import wire
from ddtop.core.outlets import parse_listen
from ddtop.core.state import RunState
from ddtop.daemon.exporter import ANSWER_S, Exporter
from ddtop.daemon.metricreading import read

__all__ = ["in_tmp"]  # a fixture of test_bad_input's, used here

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
STOP_STEP = 15  # rank 1 freezes after this step
WAIT_S = 60.0
RANK_SERIES = "ddtop_rank_global_step"


# -- in process --------------------------------------------------------------------
@pytest.mark.parametrize(("value", "expected"), [
    ("9400", ("127.0.0.1", 9400)), ("0", ("127.0.0.1", 0)),
    ("0.0.0.0:9400", ("0.0.0.0", 9400)), ("[::1]:0", ("::1", 0)),
    ("node-3.example:65535", ("node-3.example", 65535))])
def test_an_address_is_loopback_unless_a_host_is_given(value: str,
                                                       expected: tuple[str, int]) -> None:
    assert parse_listen("--metrics", value) == expected


@pytest.mark.parametrize(("args", "said"), [
    (("start", "--metrics", "http://x:9"), "--metrics 'http://x:9': give [HOST:]PORT"),
    (("start", "--metrics", "65536"), "the port must be a number from 0"),
    (("start", "--metrics", "127.0.0.1:"), "the port must be a number from 0"),
    (("start", "--metrics", "a b:9"), "give [HOST:]PORT"),
    (("start", "--metrics", ""), "argument --metrics: an empty value"),
    (("watch", "--metrics", "-1", "--", "true"), "the port must be a number from 0"),
    (("start", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h:29400",
      "--run-id", "j", "--metrics", "9400"), "--metrics is served by node 0 (the hub)")])
def test_bad_metrics_values_are_one_line_and_exit_2(
        in_tmp: Path, capsys: pytest.CaptureFixture[str], args: tuple[str, ...],
        said: str) -> None:
    assert said in usage_error_in_process(capsys, *args)


def test_a_port_in_use_is_refused_before_any_rank_starts(
        in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for command, after in ((["start", "--foreground", "-n", "2"], []),
                               (["watch"], ["--", "true"])):
            line = usage_error_in_process(capsys, *command, "--metrics", f"127.0.0.1:{port}",
                                          *after)
            assert line.startswith(f"ddtrain: error: --metrics 127.0.0.1:{port}: cannot "
                                   "listen there ("), line


def _step(rank: int, seq: int, t: float, global_step: int) -> wire.Step:
    return wire.Step(run="r", rank=rank, seq=seq, t=t, epoch=0, step=global_step,
                     global_step=global_step, steps=1, steps_per_epoch=100, samples=32,
                     loss_sum=64.0, step_s=0.25, data_s=0.0, forward_s=0.05, backward_s=0.05,
                     optimizer_s=0.0, comm_s=0.1, comm_bytes=1000, comm_ops=1, lr=0.1,
                     algbw_gbps=0.5, busbw_gbps=0.5, sync_wait_s=0.0)


def _state(t0: float) -> RunState:
    state = RunState(run="r")
    for rank in (0, 1):
        state.apply(wire.Hello(run="r", rank=rank, seq=0, t=t0, host="h", pid=100 + rank,
                               local_rank=rank, world_size=2, device="cpu", backend="gloo",
                               model="mlp", dataset="synthetic", epochs=1, global_batch=64,
                               config_digest=""), t0)
        state.apply(_step(rank, 1, t0 + 1, 1), t0 + 1)
    return state


def scrape(url: str) -> dict[str, list[Any]]:
    """/metrics over HTTP, parsed by prometheus_client: name -> its samples."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def by_rank(samples: list[Any], name: str) -> dict[str, float]:
    """One sample per rank of metric `name` (a rank twice fails)."""
    found: dict[str, float] = {}
    for sample in samples:
        if sample.name == name:
            assert sample.labels["rank"] not in found, samples
            found[sample.labels["rank"]] = sample.value
    return found


def test_a_scrape_reads_the_state_the_loop_hands_over() -> None:
    t0 = time.time() - 10
    state = _state(t0)
    exporter = Exporter("127.0.0.1:0")
    stop, stepped = threading.Event(), threading.Event()

    def loop() -> None:  # the daemon's loop: a pass every 0.05 s or when a scrape wakes it
        n = 2
        while not stop.is_set():
            select.select(exporter.fds, [], [], 0.05)
            if n < 5:
                state.apply(_step(0, n, t0 + n, n), t0 + n)  # rank 0 steps on, rank 1 not
                n += 1
            else:
                stepped.set()
            exporter.serve(state)

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        assert exporter.url.startswith("http://127.0.0.1:") and exporter.url.endswith(
            "/metrics")
        first = scrape(exporter.url)
        assert stepped.wait(10)
        second = scrape(exporter.url)
        # A loop that did not pass within ANSWER_S (a loaded machine) is answered for with
        # the reading before, its age said: scrape again for the loop's own.
        for _ in range(20):
            if second["ddtop_run_reading_age_seconds"][0].value < ANSWER_S:
                break
            second = scrape(exporter.url)
    finally:
        stop.set()
        thread.join()
        exporter.close()
    steps = by_rank(second["ddtop_rank_global_step"], "ddtop_rank_global_step")
    assert steps == {"0": 4.0, "1": 1.0}
    assert by_rank(first["ddtop_rank_global_step"], "ddtop_rank_global_step")["1"] == 1.0
    stamps = second["ddtop_rank_last_step_timestamp_seconds"]
    assert by_rank(stamps, "ddtop_rank_last_step_timestamp_seconds") == {
        "0": t0 + 4, "1": t0 + 1}
    one = next(s for s in stamps if s.labels["rank"] == "1")
    # Its identity only (the same across restarts); its process is on ddtop_rank_info.
    assert one.labels == {"run": "r", "rank": "1", "node": "0", "host": "h"}
    [info] = [s for s in second["ddtop_rank_info"] if s.labels["rank"] == "1"]
    assert info.labels == {"run": "r", "rank": "1", "node": "0", "host": "h", "pid": "101",
                           "local_rank": "1", "device": "cpu"} and info.value == 1.0
    assert by_rank(second["ddtop_rank_comm_share_ratio"], "ddtop_rank_comm_share_ratio") == {
        "0": 0.4, "1": 0.4}
    assert by_rank(second["ddtop_rank_bus_bandwidth_bytes_per_second"],
                   "ddtop_rank_bus_bandwidth_bytes_per_second") == {"0": 5e8, "1": 5e8}
    assert [s.value for s in second["ddtop_run_world_size"]] == [2.0]
    running = [s for s in second["ddtop_run_status"] if s.value == 1.0]
    assert [s.labels["status"] for s in running] == ["running"]
    assert second["ddtop_run_messages_lost"][0].name == "ddtop_run_messages_lost_total"
    with pytest.raises(urllib.error.URLError):  # closed: nothing listens any more
        scrape(exporter.url)


def test_a_loop_that_does_not_pass_is_answered_for_with_its_last_reading() -> None:
    state = _state(time.time() - 10)
    exporter = Exporter("127.0.0.1:0")
    busy = threading.Event()

    def loop() -> None:  # the daemon's loop, until it is busy elsewhere for good
        while not busy.wait(0.01):
            exporter.serve(state)

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        first = scrape(exporter.url)
        busy.set()
        thread.join()
        state.apply(_step(0, 2, time.time(), 2), time.time())  # not read: nobody passes
        started = time.monotonic()
        second = scrape(exporter.url)
        waited = time.monotonic() - started
    finally:
        busy.set()
        thread.join()
        exporter.close()
    assert waited >= ANSWER_S
    name = "ddtop_rank_global_step"
    assert by_rank(second[name], name) == by_rank(first[name], name) == {"0": 1.0, "1": 1.0}
    # The age of what is served says so: fresh at first, the older reading's age after.
    [fresh], [old] = first["ddtop_run_reading_age_seconds"], second[
        "ddtop_run_reading_age_seconds"]
    assert fresh.value < old.value and old.value >= ANSWER_S


def test_a_scrape_before_the_loop_runs_gets_the_first_reading() -> None:
    """Primed as soon as the run's state exists: while the ranks start (the loop not
    passing yet), a scrape is answered with it, not with nothing."""
    state = RunState(run="r")
    state.apply(wire.RunStatus(run="r", rank=-1, seq=1, t=time.time(), status="starting",
                               world_size=2), time.time())
    exporter = Exporter("127.0.0.1:0")
    try:
        exporter.prime(state)
        found = scrape(exporter.url)  # no loop: nobody passes
    finally:
        exporter.close()
    starting = [s.labels["status"] for s in found["ddtop_run_status"] if s.value == 1.0]
    assert starting == ["starting"]
    assert sorted(s.labels["state"] for s in found["ddtop_rank_state"] if s.value == 1.0) == [
        "starting", "starting"]


def test_a_reading_is_what_the_fold_says_at_that_moment() -> None:
    t0 = 1000.0
    state = _state(t0)
    reading = read(state, t0 + 1.5)
    assert [(r.labels[1], r.state, r.global_step, r.last_step_t) for r in reading.ranks] == [
        ("0", "running", 1, t0 + 1), ("1", "running", 1, t0 + 1)]
    assert reading.ranks[0].compute_s == pytest.approx(0.15)  # the step outside comm
    later = read(state, t0 + 60)  # nothing since: silent, the timestamp as it was
    assert [(r.state, r.last_step_t) for r in later.ranks] == [("silent", t0 + 1)] * 2


def test_counters_add_up_the_steps_so_a_stall_reads_as_one() -> None:
    from ddtop.daemon.exposition import encode
    from ddtop.daemon.metrictable import families

    t0 = 1000.0
    state = _state(t0)
    for seq, t in ((2, t0 + 2), (3, t0 + 3)):
        state.apply(msgspec.structs.replace(_step(0, seq, t, seq), data_s=0.05), t)
    zero = {r.labels[1]: r for r in read(state, t0 + 3.5).ranks}["0"]
    assert (zero.steps_total, zero.samples_total) == (3, 96)
    assert zero.compute_total == pytest.approx(3 * 0.15)
    assert zero.comm_total == pytest.approx(0.3) and zero.data_total == pytest.approx(0.1)
    # A stall: no step, the counters as they were (rate() of them: 0), unlike a gauge.
    assert {r.labels[1]: r for r in read(state, t0 + 60).ranks}["0"].steps_total == 3

    text = encode(families(read(state, t0 + 3.5)), openmetrics=False).decode()
    # What this daemon runs: ddtop's, Python's and torch's versions (ddtop_build_info).
    build = next(line for line in text.splitlines() if line.startswith("ddtop_build_info{"))
    assert 'python="3.' in build and 'torch="2.' in build and 'version="' in build, build
    for name in ("steps", "samples", "step_compute_seconds", "step_comm_seconds",
                 "data_wait_seconds"):
        assert f"# TYPE ddtop_rank_{name}_total counter" in text, name
        assert f"\nddtop_rank_{name}_total{{" in text, name


def test_a_step_with_seconds_that_are_no_number_leaves_every_counter_as_it_was() -> None:
    """A rank's Step message is trusted for display only: a NaN, an infinity or a
    negative time is not added to a counter (one NaN would read NaN for good)."""
    t0 = 1000.0
    state = _state(t0)
    before = {r.labels[1]: r for r in read(state, t0 + 1.5).ranks}["0"]
    for seq, bad in enumerate((float("nan"), float("inf"), -1.0), start=2):
        state.apply(msgspec.structs.replace(
            _step(0, seq, t0 + seq, seq), step_s=bad, comm_s=bad, data_s=bad, forward_s=bad,
            backward_s=bad, optimizer_s=bad), t0 + seq)
    after = {r.labels[1]: r for r in read(state, t0 + 5).ranks}["0"]
    fields = ("compute_total", "comm_total", "data_total", "forward_total", "backward_total",
              "optimizer_total", "step_seconds_total")
    assert [getattr(after, f) for f in fields] == [getattr(before, f) for f in fields]
    assert after.steps_total == 4 and sum(after.step_buckets) == sum(before.step_buckets)


def test_steps_by_time_phases_and_a_stall_read_as_they_are() -> None:
    t0 = 1000.0
    state = _state(t0)  # each rank: a step of 0.25 s
    # Rank 0: four more steps of 0.05 s each, in one message; then a checkpoint.
    state.apply(msgspec.structs.replace(_step(0, 2, t0 + 2, 5), steps=4, step_s=0.2), t0 + 2)
    state.apply(wire.Event(run="r", rank=0, seq=3, t=t0 + 2.5, type="checkpoint",
                           message="checkpoint written"), t0 + 2.5)

    found = served(read(state, t0 + 3), openmetrics=False)
    buckets = {s.labels["le"]: s.value for s in found["ddtop_rank_step_duration_seconds"]
               if s.name.endswith("_bucket") and s.labels["rank"] == "0"}
    assert (buckets["0.025"], buckets["0.05"], buckets["0.1"], buckets["0.25"],
            buckets["+Inf"]) == (0, 4, 4, 5, 5)
    # `le` as OpenMetrics and Prometheus 3 spell it (and prometheus_client writes it).
    assert list(buckets) == ["0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1.0",
                             "2.5", "5.0", "10.0", "30.0", "60.0", "+Inf"]
    totals = {s.name: s.value for s in found["ddtop_rank_step_duration_seconds"]
              if s.labels["rank"] == "0" and not s.name.endswith("_bucket")}
    assert totals["ddtop_rank_step_duration_seconds_count"] == 5
    assert totals["ddtop_rank_step_duration_seconds_sum"] == pytest.approx(0.45)
    assert by_rank(found["ddtop_rank_step_forward_seconds"],
                   "ddtop_rank_step_forward_seconds_total")["0"] == pytest.approx(0.1)
    assert by_rank(found["ddtop_rank_learning_rate"], "ddtop_rank_learning_rate") == {
        "0": 0.1, "1": 0.1}
    assert by_rank(found["ddtop_rank_epoch"], "ddtop_rank_epoch") == {"0": 1, "1": 1}
    assert [s.value for s in found["ddtop_run_last_checkpoint_timestamp_seconds"]] == [t0 + 2.5]
    assert min(by_rank(found["ddtop_rank_samples_per_second"],
                       "ddtop_rank_samples_per_second").values()) > 0
    # A minute with no step: the ranks are silent, and their rate reads 0, not the last.
    stalled = served(read(state, t0 + 60), openmetrics=False)
    assert by_rank(stalled["ddtop_rank_samples_per_second"],
                   "ddtop_rank_samples_per_second") == {"0": 0.0, "1": 0.0}


# -- a live run --------------------------------------------------------------------
@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Detached, str]]:
    """A 2-rank run serving /metrics on a free port; rank 1 takes 20 times its step
    time (a step every few tenths of a second), then freezes after STOP_STEP."""
    cwd = tmp_path_factory.mktemp("metrics")
    with detached("-n", "2", "--epochs", "50",
                  "--step-delay", "0.05", "--metrics", "0", "--metrics-linger", "0",
                  "--run-id", "prom",
                  "--inject", "1:slow=20x", "--inject", f"1:stop@step={STOP_STEP}",
                  cwd=cwd) as run:
        assert run.started.returncode == 0, run.started.stdout + run.started.stderr
        url = json.loads((cwd / "runs" / "prom" / "run.json").read_text())["endpoints"][
            "metrics"]
        status = run.wait_for("prom", lambda s: all(r["global_step"] > 0 for r in s["ranks"]))
        yield run, url
        # Rank 1 continued first (else its SIGTERM waits, and the daemon's SIGKILL after it).
        with contextlib.suppress(ProcessLookupError):
            os.kill(status["ranks"][1]["pid"], signal.SIGCONT)
        stopped = run.cli("stop", "prom", "--timeout", "1")
        assert stopped.returncode in (0, 130), stopped.stdout + stopped.stderr
        assert run.leftovers() == []


def until(what: str, check: Any, timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_the_url_is_said_where_users_look(live: tuple[Detached, str]) -> None:
    run, url = live
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
    assert f"  metrics    {url}" in run.started.stdout.splitlines()
    assert f"  metrics {url}" in run.cli("status", "prom").stdout.splitlines()
    assert run.status("prom")["endpoints"]["metrics"] == url


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_one_series_per_rank_and_the_step_advances(live: tuple[Detached, str]) -> None:
    _, url = live

    def stepping() -> dict[str, float] | None:
        steps = by_rank(scrape(url)[RANK_SERIES], RANK_SERIES)
        return steps if len(steps) == 2 and min(steps.values()) >= 1 else None

    first = until("both ranks' first step", stepping)
    assert set(first) == {"0", "1"}
    assert max(first.values()) < STOP_STEP, first  # seen before rank 1 froze
    # Both ranks a step more (rank 0 may be a step ahead of rank 1 at the first scrape).
    second = until("a step more", lambda: (s := stepping()) and s["1"] > first["1"]
                   and s["0"] > first["0"] and s)
    assert second["0"] > first["0"]
    found = scrape(url)
    labels = [s.labels for s in found[RANK_SERIES]]
    assert sorted(label["rank"] for label in labels) == ["0", "1"]
    assert all(label["run"] == "prom" and label["host"] and label["node"] == "0"
               and set(label) == {"run", "rank", "node", "host"} for label in labels), labels
    infos = [s.labels for s in found["ddtop_rank_info"]]
    assert sorted(info["rank"] for info in infos) == ["0", "1"]
    assert all(info["pid"].isdigit() and info["local_rank"] == info["rank"]
               for info in infos), infos


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_frozen_rank_keeps_its_last_step_timestamp(live: tuple[Detached, str]) -> None:
    _, url = live

    def frozen() -> dict[str, list[Any]] | None:
        found = scrape(url)
        states = {s.labels["rank"]: s.labels["state"] for s in found["ddtop_rank_state"]
                  if s.value == 1.0}
        return found if states == {"0": "stalled", "1": "silent"} else None

    before = until("rank 1 silent, rank 0 stalled", frozen)
    time.sleep(1.5)
    after = scrape(url)
    name = "ddtop_rank_last_step_timestamp_seconds"
    stamps = by_rank(after[name], name)
    assert stamps == by_rank(before[name], name)
    assert time.time() - max(stamps.values()) > 4  # no step for seconds: alertable
    steps = by_rank(after[RANK_SERIES], RANK_SERIES)
    assert steps == by_rank(before[RANK_SERIES], RANK_SERIES)
    assert STOP_STEP - 2 <= steps["1"] <= STOP_STEP  # its newest Step message, sent or not
    assert by_rank(after["ddtop_rank_hung"], "ddtop_rank_hung") == {"0": 0.0, "1": 1.0}
    assert [s.value for s in after["ddtop_run_hung"]] == [1.0]
    # A stall reads as one: no samples a second, the run's and each rank's.
    assert [s.value for s in after["ddtop_run_samples_per_second"]] == [0.0]
    assert set(by_rank(after["ddtop_rank_samples_per_second"],
                       "ddtop_rank_samples_per_second").values()) == {0.0}


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_prometheus_server_reads_the_rank_series_back(
        live: tuple[Detached, str], tmp_path: Path) -> None:
    if not Path(PROMETHEUS).is_file():
        pytest.skip(f"no Prometheus server at {PROMETHEUS} (Debian's prometheus package)")
    _, url = live
    target = urllib.parse.urlsplit(url).netloc
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    config = tmp_path / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\nscrape_configs:\n"
                      f"  - job_name: ddtop\n    static_configs:\n"
                      f"      - targets: ['{target}']\n")
    server = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("w"),
        stdin=subprocess.DEVNULL)
    try:
        query = urllib.parse.urlencode({"query": f'{RANK_SERIES}{{run="prom"}}'})

        def answered() -> list[dict[str, Any]] | None:
            with contextlib.suppress(OSError, ValueError):
                api = f"http://127.0.0.1:{port}/api/v1/query?{query}"
                with urllib.request.urlopen(api, timeout=5) as reply:
                    result: list[dict[str, Any]] = json.load(reply)["data"]["result"]
                return result if len(result) == 2 else None
            return None

        result = until("Prometheus to answer for both ranks", answered)
    finally:
        terminate(server)
    series = {r["metric"]["rank"]: r for r in result}
    assert set(series) == {"0", "1"}
    ours = scrape(url)[RANK_SERIES]
    for sample in ours:
        theirs = series[sample.labels["rank"]]["metric"]
        assert theirs["host"] == sample.labels["host"] and theirs["job"] == "ddtop"
        assert theirs["__name__"] == RANK_SERIES and theirs["node"] == sample.labels["node"]
        # Frozen since the test before: Prometheus holds the number served.
        assert float(series[sample.labels["rank"]]["value"][1]) == sample.value


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_the_shipped_alerts_fire_on_the_frozen_rank(live: tuple[Detached, str],
                                                    tmp_path: Path) -> None:
    """examples/prometheus/ddtop-alerts.yml (its waits cut to 1 s) in a real Prometheus:
    rank 1, frozen since the tests before, is hung on and silent; rank 0 neither, and
    nothing failed."""
    _, url = live
    wanted = {("DdtopRankHung", "1"), ("DdtopRankSilent", "1")}
    with prometheus(tmp_path, [urllib.parse.urlsplit(url).netloc],
                    quick_rules(tmp_path)) as server:
        fired = until("the hang and silence alerts", lambda: wanted <= (
            found := {(a["alertname"], a.get("rank", "")) for a in server.firing()}) and found)
    assert wanted <= fired and not {name for name, rank in fired if rank == "0"}, fired
    assert not {name for name, _ in fired} & {"DdtopRunFailed", "DdtopRankFailed"}, fired
