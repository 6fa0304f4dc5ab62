"""RunSummary, the one description of how a run stands or ended: derived from
RunState, written into run.json, read back (a run.json of another layout is
unreadable, and the run told from its journal), and shown by `ddtrain status`.
Pure code and files; no processes but a finished one's pid."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import msgspec
import pytest
from test_state import RUN, fold, hello, step

from ddtop.daemon import cli, wire
from ddtop.daemon.runinfo import RunInfo
from ddtop.daemon.runs import RunPaths
from ddtop.daemon.state import RunState
from ddtop.daemon.summary import (
    RECORD_SCHEMA,
    Failure,
    RankSummary,
    Restart,
    RunRecord,
    decode_record,
    encode_record,
)

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
    from ddtop.daemon import printer, run_commands
    from ddtop.daemon.summary import metrics_words

    s = fold(hello(0), step(0, 1, 4, steps=4), wire.Aggregate(
        run=RUN, rank=0, seq=2, t=101.0, scope="epoch", epoch=1, global_step=4,
        train_loss=0.5, train_accuracy=0.8125, train_samples=64))
    m = s.aggregate
    assert m is not None
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
    assert f"  global {words}" in run_commands.status_lines(info, record)
