"""RunSummary, the one description of how a run stands or ended: derived from
RunState, written into run.json, read back (a run.json of another layout is
unreadable, and the run told from its journal), and shown by `ddtrain status`.
Pure code and files; no processes but a finished one's pid."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
from pathlib import Path

import msgspec
import pytest
from test_state import RUN, fold, hello, step

from ddtop.core import wire
from ddtop.core.rundir import RunPaths
from ddtop.core.runinfo import RunInfo
from ddtop.core.state import RunState
from ddtop.core.summary import (
    RECORD_SCHEMA,
    Failure,
    RankSummary,
    Restart,
    RunRecord,
    decode_record,
    encode_record,
)
from ddtop.daemon import cli

FIXTURES = Path(__file__).parent / "fixtures" / "runs"
# recorded-failed's run.json in the layout of a development version before
# RECORD_SCHEMA (`exitcode`, negative for a signal; `launcher_pid`), which no
# released version wrote and none reads.
FIRST_LAYOUT = json.dumps({
    "run_id": "recorded-failed", "status": "failed", "exit_code": 1, "world_size": 2,
    "restarts": 0, "timeline": [], "daemon_pid": 4526, "launcher_pid": 4526, "host": "vm",
    "started": 1795396158.2018273, "ended": 1795396163.7216914,
    "failure": {"rank": 1, "pid": 4534, "exitcode": -9, "signal": "SIGKILL",
                "stopped_by_launcher": False},
    "ranks": [{"rank": 0, "pid": 4533, "exitcode": -15, "signal": "SIGTERM",
               "stopped_by_launcher": True},
              {"rank": 1, "pid": 4534, "exitcode": -9, "signal": "SIGKILL",
               "stopped_by_launcher": False}]}).encode()


def daemon(kind: type[wire.RankExit] | type[wire.RunStatus] | type[wire.Event]
           | type[wire.Restarting], seq: int, **fields: object) -> wire.Message:
    return kind(run=RUN, rank=wire.DAEMON_RANK, seq=seq, t=101.0, **fields)  # type: ignore[arg-type]


def failed_run() -> RunState:
    """Rank 1 killed by SIGKILL at step 20, rank 0 stopped by the daemon."""
    s = fold(hello(0), hello(1), step(0, 1, 20), step(1, 1, 20),
             wire.Aggregate(run=RUN, rank=0, seq=2, scope="sync", epoch=0, global_step=20,
                            train_loss=1.25, train_accuracy=0.5, train_samples=1280))
    for m in (daemon(wire.RankExit, 0, exited=1, pid=1001, exit_code=None, signal="SIGKILL",
                     culprit=True),
              daemon(wire.RankExit, 1, exited=0, pid=1000, exit_code=None, signal="SIGTERM",
                     stopped_by_daemon=True),
              daemon(wire.RunStatus, 2, status="failed", world_size=2, message="run failed",
                     exit_code=1)):
        s.apply(m, 101.0)
    return s


def test_the_last_culprit_is_the_failure_a_left_early_rank_or_a_lost_node() -> None:
    """The daemon publishes the culprit after exits it named first: a rank that
    left early (its exit 0 said plainly, then as the culprit), a node lost as a
    whole (exited -1 with its node): the summary's failure is that one, in
    status's words, and no rank -1 appears."""
    s = fold(hello(0), hello(1), step(0, 1, 20), step(1, 1, 20))
    early = "left early at step 20: exit code 0 while the other ranks still trained"
    for m in (daemon(wire.RankExit, 0, exited=1, pid=1001, exit_code=0, signal=None),
              daemon(wire.RankExit, 1, exited=1, pid=1001, exit_code=0, signal=None,
                     culprit=True, left_early=True, reason=early),
              daemon(wire.RankExit, 2, exited=0, pid=1000, exit_code=1, signal=None,
                     message="RuntimeError: Connection reset by peer")):
        s.apply(m, 101.0)
    summary = s.summary(102.0)
    assert summary.failure is not None
    assert summary.failure.line() == f"rank 1 {early}"
    assert [(r.rank, r.state) for r in summary.ranks] == [(0, "dead"), (1, "dead")]
    lost = "lost: its daemon (pid 4242) stopped answering the hub; ranks 2, 3 unreachable"
    s.apply(daemon(wire.RankExit, 3, exited=-1, pid=4242, exit_code=None, signal=None,
                   culprit=True, reason=lost, node=1), 101.0)
    summary = s.summary(102.0)
    assert summary.failure is not None and summary.failure.line() == f"node 1 {lost}"
    assert (summary.failure.rank, summary.failure.node) == (-1, 1)
    assert sorted(s.ranks) == [0, 1]


def test_summary_is_derived_from_the_state() -> None:
    summary = failed_run().summary(102.0)
    assert (summary.run_id, summary.status, summary.exit_code) == (RUN, "failed", 1)
    assert summary.failure == Failure(rank=1, pid=1001, signal="SIGKILL", global_step=20)
    assert summary.failure.how() == "killed by SIGKILL"
    assert [(r.rank, r.state, r.signal, r.stopped_by_daemon) for r in summary.ranks] == [
        (0, "dead", "SIGTERM", True), (1, "dead", "SIGKILL", False)]
    assert summary.metrics is not None and summary.metrics.train_loss == 1.25
    assert (summary.global_step, summary.total_steps, summary.model) == (20, 200, "mlp")


def test_the_exit_code_belongs_to_the_final_status_only() -> None:
    s = failed_run()
    s.apply(daemon(wire.RunStatus, 3, status="restarting", world_size=2, restarts=1), 102.0)
    assert (s.exit_code, s.failure) == (None, None)


def test_a_malformed_restart_entry_stays_out_of_the_timeline() -> None:
    s = fold(hello(0))
    good = Restart(restart=1, rank=1, reason="was killed by SIGKILL", checkpoint=None)
    s.apply(daemon(wire.Restarting, 0, message="restart 1", restart=good), 101.0)
    # A restart as journals written before the Restarting message carry it: an
    # event with the entry as untyped data, shown as it is.
    s.apply(daemon(wire.Event, 1, type="restart", message="restart 2", data={"rank": "x"}), 101.0)
    assert s.timeline == [Restart(restart=1, rank=1, reason="was killed by SIGKILL")]
    assert sum(e.type == "restart" for e in s.events) == 2  # both still shown
    # A Restarting message with a malformed entry is refused whole, by the wire's decoder.
    bad = msgspec.to_builtins(daemon(wire.Restarting, 2, message="restart 3", restart=good))
    bad["restart"]["rank"] = "x"
    with pytest.raises(wire.Malformed, match=r"\$\.restart\.rank"):
        wire.decode([msgspec.msgpack.encode(bad)], RUN)


def test_run_record_round_trips_with_daemon_facts_and_the_summary() -> None:
    record = RunRecord(run_id=RUN, daemon_pid=42, host="node", started=90.0, master_port=1234,
                       endpoints={"control": "tcp://127.0.0.1:5"})
    record = record.with_summary(failed_run().summary(102.0))
    assert (record.started, record.daemon_pid, record.status) == (90.0, 42, "failed")
    data = encode_record(record)
    assert decode_record(data) == record
    plain = json.loads(data)
    assert plain["schema"] == RECORD_SCHEMA and plain["failure"]["signal"] == "SIGKILL"
    assert [r["exit_code"] for r in plain["ranks"]] == [None, None]


def test_the_recorded_runs_run_json_is_read() -> None:
    record = decode_record((FIXTURES / "recorded-failed" / "run.json").read_bytes())
    assert (record.schema, record.status, record.exit_code, record.daemon_pid) == (
        RECORD_SCHEMA, "failed", 1, 4526)
    assert record.failure == Failure(rank=1, pid=4534, signal="SIGKILL", global_step=599)
    assert [(r.rank, r.state, r.signal, r.stopped_by_daemon) for r in record.ranks] == [
        (0, "dead", "SIGTERM", True), (1, "dead", "SIGKILL", False)]
    ok = decode_record((FIXTURES / "recorded-ok" / "run.json").read_bytes())
    assert [(r.state, r.exit_code) for r in ok.ranks] == [("finished", 0), ("finished", 0)]


def test_a_finished_run_is_summarised_from_its_run_json() -> None:
    info = RunInfo.load(RunPaths(FIXTURES / "recorded-failed"))
    assert (info.status, info.live, info.problem) == ("failed", False, None)
    summary = info.summary()
    assert (summary.status, summary.exit_code, summary.model) == ("failed", 1, "mlp")
    assert summary.failure is not None and summary.failure.rank == 1
    assert summary.global_step > 0 and summary.daemon_pid == 4526


def test_a_run_json_of_the_first_layout_is_unreadable_and_the_journal_tells_the_run(
        tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="missing required field `state`"):
        decode_record(FIRST_LAYOUT)
    root = tmp_path / "recorded-failed"
    shutil.copytree(FIXTURES / "recorded-failed", root)
    (root / "run.json").write_bytes(FIRST_LAYOUT)
    info = RunInfo.load(RunPaths(root))
    assert info.problem is not None and "run.json is unreadable" in info.problem
    assert (info.status, info.live) == ("failed", False)
    summary = info.summary()
    # The journal's final status predates its exit code; the daemon's pid was run.json's.
    assert (summary.status, summary.exit_code, summary.model) == ("failed", None, "mlp")
    assert summary.failure is not None and summary.failure.rank == 1
    assert summary.global_step > 0 and summary.daemon_pid is None


@pytest.mark.processes
def test_a_run_whose_daemon_is_gone_is_lost_and_told_from_its_journal(tmp_path: Path) -> None:
    root = tmp_path / "recorded-failed"
    shutil.copytree(FIXTURES / "recorded-failed", root)
    gone = subprocess.Popen(["true"])
    gone.wait()
    record = RunRecord(run_id="recorded-failed", status="running", daemon_pid=gone.pid,
                       world_size=3, ranks=[RankSummary(rank=2, state="running")])
    (root / "run.json").write_bytes(encode_record(record))
    info = RunInfo.load(RunPaths(root))
    assert (info.status, info.live) == ("lost", False)
    summary = info.summary()
    assert summary.status == "lost" and summary.model == "mlp"
    # The journal saw both ranks exit; a rank it never heard of is lost with the daemon.
    assert [r.state for r in summary.ranks] == ["dead", "dead", "lost"]


@pytest.mark.parametrize("content", [
    b"{not json", b"[1, 2]", b'{"schema": 2, "status": 7}',
    # The first layout (FIRST_LAYOUT), with values of the wrong kind.
    b'{"status": "failed", "ranks": 5}', b'{"status": "failed", "ranks": [{"exitcode": "x"}]}',
    b'{"status": "failed", "failure": {"exitcode": "x"}}', b'{"timeline": [3]}'])
def test_an_unreadable_run_json_is_named_not_a_traceback(
        tmp_path: Path, content: bytes, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "recorded-ok"
    shutil.copytree(FIXTURES / "recorded-ok", root)
    (root / "run.json").write_bytes(content)
    info = RunInfo.load(RunPaths(root))
    assert info.problem is not None and "run.json is unreadable" in info.problem
    assert info.status == "succeeded"  # as its journal says, and as ddtop shows it
    assert cli.main(["status", str(root)]) == 0
    out, err = capsys.readouterr()
    assert "run.json is unreadable" in err and "Traceback" not in err
    assert out.startswith("run recorded-ok: succeeded")
    assert "finished     " in out  # rank rows, from the journal
    (root / "telemetry.journal").unlink()  # nothing else to go by: the run is lost
    assert RunInfo.load(RunPaths(root)).status == "lost"


def test_status_json_has_the_summary_field_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", str(FIXTURES / "recorded-failed"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {f.name for f in msgspec.structs.fields(RunRecord)} <= set(doc)
    assert (doc["status"], doc["exit_code"], doc["failure"]["exit_code"]) == ("failed", 1, None)
    assert "exitcode" not in json.dumps(doc)


@pytest.mark.parametrize("content", [b"[1]", b'{"world_size": "two"}', b'{"model": "gpt"}'])
def test_an_unreadable_config_json_is_named_not_a_traceback(
        tmp_path: Path, content: bytes, capsys: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs"
    shutil.copytree(FIXTURES / "recorded-ok", runs / "recorded-ok")
    (runs / "recorded-ok" / "config.json").write_bytes(content)
    assert RunInfo.load(RunPaths(runs / "recorded-ok")).config is None
    for command in (["list"], ["status"], ["logs"]):
        assert cli.main([*command, "--runs-dir", str(runs)]) == 0, command
    assert "recorded-ok" in capsys.readouterr().out
    # Resuming it needs its settings: one line naming the file.
    assert cli.main(["start", "--resume", "--runs-dir", str(runs), "--run-id", "recorded-ok",
                     "--foreground"]) == 2
    err = capsys.readouterr().err
    assert "cannot read" in err and "config.json" in err and "Traceback" not in err


def test_the_global_metrics_are_said_the_same_by_status_and_the_headless_summary() -> None:
    from ddtop.core import printer
    from ddtop.core.summary import metrics_words
    from ddtop.daemon import statuscmds

    s = fold(hello(0), step(0, 1, 4, steps=4), wire.Aggregate(
        run=RUN, rank=0, seq=2, t=101.0, scope="epoch", epoch=1, global_step=4,
        train_loss=0.5, train_accuracy=0.8125, train_samples=64))
    m = s.summary(102.0).metrics  # the wire's epoch 1, counted from 1 in a summary
    assert m is not None and m.epoch == 2 and s.aggregate is not None and s.aggregate.epoch == 1
    words = "(epoch 2, step 4): train loss 0.5000 acc 81.25%"
    assert metrics_words(m) == words
    with_val = msgspec.structs.replace(m, val_loss=0.25, val_accuracy=0.5)
    assert metrics_words(with_val) == words + ", val loss 0.2500 acc 50.00%"
    # Validation loss without its accuracy (a metric sync): no val part, no traceback.
    assert metrics_words(msgspec.structs.replace(m, val_loss=0.25)) == words
    summary = s.summary(102.0)
    assert f"  global metrics {words}" in printer.summary_text(
        printer.final_summary(s, 102.0), 102.0)
    record = RunRecord(run_id=RUN).with_summary(summary)
    info = RunInfo(paths=RunPaths(Path("/nonexistent/runs/r1")), record=record, config=None)
    assert f"  global {words}" in statuscmds.status_lines(info, record)


def test_epochs_count_from_one_where_a_user_reads_them() -> None:
    from ddtop.core import printer
    from ddtop.daemon import statuscmds

    s = fold(hello(0), hello(1), step(0, 1, 20), step(1, 1, 20))  # the wire's epoch 0
    assert [v.epoch for v in s.ranks.values()] == [0, 0]  # the fold keeps the wire's count
    summary = s.summary(102.0)
    assert [r.epoch for r in summary.ranks] == [1, 1]
    assert [r["epoch"] for r in printer.progress_record(s, 102.0)["ranks"]] == [1, 1]
    assert [r["epoch"] for r in printer.summary_record(
        printer.final_summary(s, 102.0))["ranks"]] == [1, 1]
    record = RunRecord(run_id=RUN).with_summary(summary)
    assert decode_record(encode_record(record)) == record  # run.json keeps them from 1
    info = RunInfo(paths=RunPaths(Path("/nonexistent/runs/r1")), record=record, config=None)
    header, row = statuscmds.status_lines(info, record)[-3:-1]
    assert row.split()[header.split().index("EPOCH")] == "1"


def unknown_epochs() -> RunState:
    """A script's ranks that never set_epoch'd a sampler, then rank 0's did (epoch 2)."""
    s = fold(hello(0), hello(1), *(msgspec.structs.replace(step(r, 1, 20), epoch=None, step=0,
                                                           steps_per_epoch=0) for r in (0, 1)))
    return s


def test_an_epoch_not_known_is_null_where_a_user_reads_it_never_1() -> None:
    from ddtop.core import printer

    s = unknown_epochs()
    assert [v.epoch for v in s.ranks.values()] == [None, None]
    assert [r.epoch for r in s.summary(102.0).ranks] == [None, None]
    assert [r["epoch"] for r in printer.progress_record(s, 102.0)["ranks"]] == [None, None]
    s.apply(msgspec.structs.replace(step(0, 2, 30), epoch=2, step=10, steps_per_epoch=0), 102.0)
    summary = s.summary(103.0)
    assert [r.epoch for r in summary.ranks] == [3, None]  # counted from 1 where known
    assert [r["epoch"] for r in printer.summary_record(
        printer.final_summary(s, 103.0))["ranks"]] == [3, None]
    record = RunRecord(run_id=RUN).with_summary(summary)
    assert decode_record(encode_record(record)) == record  # run.json: null stays null
    assert [r["epoch"] for r in json.loads(encode_record(record))["ranks"]] == [3, None]
    # A rank never heard from knows no epoch either.
    assert [r.epoch for r in fold(hello(0)).summary(100.0).ranks] == [None, None]


def test_status_shows_an_epoch_not_known_as_a_dash() -> None:
    from ddtop.daemon import statuscmds

    s = unknown_epochs()
    s.apply(msgspec.structs.replace(step(0, 2, 30), epoch=2, step=10, steps_per_epoch=0), 102.0)
    record = RunRecord(run_id=RUN).with_summary(s.summary(103.0))
    info = RunInfo(paths=RunPaths(Path("/nonexistent/runs/r1")), record=record, config=None)
    header, *rows = statuscmds.status_lines(info, record)[-3:]
    column = header.split().index("EPOCH")
    assert [row.split()[column] for row in rows] == ["3", "-"]


def test_a_run_json_of_another_layout_is_unreadable_and_the_journal_tells() -> None:
    """The layouts before RECORD_SCHEMA were never released: one is refused in one
    line naming both layouts, and the run is told from its journal (epochs from 1)."""
    data = (FIXTURES / "recorded-failed" / "run.json").read_bytes()
    assert json.loads(data)["schema"] == RECORD_SCHEMA == 3
    old = json.loads(data)
    old["schema"] = 2
    with pytest.raises(ValueError, match="layout 2, this ddtop reads layout 3"):
        decode_record(json.dumps(old).encode())
    del old["schema"]  # a layout that named none
    with pytest.raises(ValueError, match="layout 1, this ddtop reads layout 3"):
        decode_record(json.dumps(old).encode())
    info = RunInfo.load(RunPaths(FIXTURES / "recorded-ok"))
    assert info.problem is None and info.record.samples_per_s is not None
    assert info.record.samples_per_s > 1000  # an ended run's average, not 0
    summary = info.summary()
    assert summary.samples_per_s is not None and summary.samples_per_s > 1000
    assert [r.epoch for r in summary.ranks] == [2, 2]
    assert summary.metrics is not None and summary.metrics.epoch == 2
    from ddtop.daemon import statuscmds
    assert " samples/s on average" in statuscmds.status_lines(info, summary)[1]


def test_telemetry_messages_lost_are_not_called_a_loss() -> None:
    from ddtop.core import printer
    from ddtop.dashboard import panels

    s = fold(hello(0), hello(1), step(0, 1, 20), step(0, 4, 30), step(1, 1, 20))  # 2 lost
    first = printer.summary_text(printer.final_summary(s, 102.0), 102.0)[0]
    assert "messages lost 28.57%" in first and "telemetry loss" not in first
    header = panels.header(s, 102.0).plain
    assert "messages lost 28.57%" in header and "telemetry loss" not in header
    # The JSON field keeps its name: the fraction of messages lost.
    assert printer.progress_record(s, 102.0)["telemetry_loss"] == pytest.approx(2 / 7)


def test_an_ended_run_shows_its_average_rate_not_zero() -> None:
    from ddtop.core import printer
    from ddtop.daemon import statuscmds
    from ddtop.dashboard import panels

    s = fold(hello(0), hello(1), step(0, 1, 10, t=101.0), step(1, 1, 10, t=101.0),
             step(0, 2, 20, t=103.0), step(1, 2, 20, t=103.0))
    # Running: the ranks' newest rates (320 samples over 2 s each), summed.
    assert s.throughput(103.0) == pytest.approx(2 * 320 / 2.0)
    assert "320 samples/s;" in printer.progress_text(s, 103.0)
    s.apply(daemon(wire.RunStatus, 0, status="succeeded", world_size=2, exit_code=0), 104.0)
    # Ended: each rank's 640 samples over the 1 s of its first message and the 2 s to
    # its second, summed; before, no rank was running and this was 0.
    assert s.throughput(200.0) == pytest.approx(2 * 640 / 3.0)
    assert s.eta(200.0) is None
    summary = s.summary(200.0)
    assert summary.samples_per_s == pytest.approx(2 * 640 / 3.0)
    record = RunRecord(run_id=RUN).with_summary(summary)
    info = RunInfo(paths=RunPaths(Path("/nonexistent/runs/r1")), record=record, config=None)
    assert "; 427 samples/s on average" in statuscmds.status_lines(info, record)[1]
    assert "427 samples/s on average" in panels.header(s, 200.0).plain
    assert "427 samples/s on average" in printer.progress_text(s, 200.0)


def test_every_json_record_names_its_layout() -> None:
    from ddtop.core import printer

    s = failed_run()
    records = [printer.progress_record(s, 102.0),
               printer.summary_record(printer.final_summary(s, 102.0)),
               *(printer.event_record(e) for e in s.events)]
    assert len(records) > 2
    assert all(r["schema"] == printer.JSONL_SCHEMA == 1 for r in records)
    out = io.StringIO()
    printer.Printer("jsonl", out=out).finish(s, 102.0)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines and all(line["schema"] == 1 for line in lines)


def test_a_zero_code_run_reports_no_loss_and_no_rate_never_zero() -> None:
    """A zero-code rank knows its steps, not its loss nor its batch: its loss, its
    samples/s and the run's are missing everywhere, shown as '-' or 'not reported',
    never as 0 (a chart at 0.0000, '0 samples/s' in the progress line)."""
    from ddtop.core import printer
    from ddtop.dashboard import panels, series

    def unreported(rank: int, seq: int, global_step: int) -> wire.Step:
        return msgspec.structs.replace(step(rank, seq, global_step), samples=0, loss_sum=0.0)

    s = fold(hello(0), hello(1), unreported(0, 1, 10), unreported(1, 1, 10),
             unreported(0, 2, 20), unreported(1, 2, 20))
    assert [v.loss for v in s.ranks.values()] == [None, None]
    assert [v.samples_per_s for v in s.ranks.values()] == [None, None]
    assert all(p.loss is None and p.samples_per_s is None
               for v in s.ranks.values() for p in v.history)
    assert s.throughput(103.0) is None and s.summary(103.0).samples_per_s is None
    assert s.eta(103.0) is None
    assert "samples/s not reported" in printer.progress_text(s, 103.0)
    assert "0 samples/s" not in printer.progress_text(s, 103.0)
    assert "samples/s not reported" in panels.header(s, 103.0).plain
    assert printer.progress_record(s, 103.0)["samples_per_s"] is None
    loss = series.rank_loss(s, 0)
    assert loss.empty and loss.title == "loss: rank 0 not reported"
    rate = series.throughput(s, 120)
    assert rate.empty and rate.title == "samples/s not reported"
    # The comm share was measured: it is charted as before.
    assert not series.comm_share(s, 120).empty
    # One rank that reports its loss and samples: its numbers, the other's still missing.
    s.apply(step(0, 3, 30, t=104.0), 104.0)
    assert s.ranks[0].loss == pytest.approx(2.0) and s.ranks[1].loss is None
    assert series.rank_loss(s, 0).lines[0].ys == (pytest.approx(2.0),)
    assert s.throughput(104.0) == pytest.approx(s.ranks[0].samples_per_s)
    # Ended: the average over the ranks that reported samples only.
    s.apply(daemon(wire.RunStatus, 0, status="succeeded", world_size=2, exit_code=0), 105.0)
    assert s.throughput(200.0) == pytest.approx(320 / s.ranks[0].stepping_s)
