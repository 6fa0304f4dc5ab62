"""What a run's end keeps and how it reads: the frames the daemon rejected are
still counted once the run is over (run.json, `ddtrain status`, `ddtop
--headless` live to the end and afterwards), and a failure is one line in the
same words everywhere (status, the headless summary, the Markdown summary),
with no stray colon, also for a lost run that no rank is blamed for."""

from __future__ import annotations

import json
import select
import shutil
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from helpers import BIN, detached, tagged_env

from ddtop.core import journal
from ddtop.core.summary import RECORD_SCHEMA, Failure, RunRecord, encode_record

FIXTURES = Path(__file__).parent / "fixtures" / "runs"
DDTOP = str(BIN / "ddtop")
JUNK = 5


def ddtop(*args: str, cwd: Path, env: dict[str, str] | None = None
          ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DDTOP, *args], cwd=cwd, text=True, capture_output=True,
                          stdin=subprocess.DEVNULL, timeout=60, env=env)


def last_json(text: str) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(text.strip().splitlines()[-1])
    return found


@pytest.mark.processes
def test_rejected_counts_outlive_the_run(tmp_path: Path) -> None:
    with detached("-n", "2", "--epochs", "50",
                  "--step-delay", "0.05", "--run-id", "rj", cwd=tmp_path) as run:
        assert run.started.returncode == 0, run.started.stderr
        watcher = subprocess.Popen([DDTOP, "--headless", "--format", "jsonl", "rj"],
                                   cwd=tmp_path, env=tagged_env(run.tag), text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   stdin=subprocess.DEVNULL)
        assert watcher.stdout is not None
        ready, _, _ = select.select([watcher.stdout], [], [], 30.0)
        assert ready, "ddtop --headless printed nothing in 30 s"
        # Attached, its snapshot taken before any junk is sent: its first progress line
        # (after the snapshot's events). Read until it comes (the test's timeout bounds it).
        first = ""
        while True:
            line = watcher.stdout.readline()
            assert line, "ddtop --headless ended before its first progress line"
            first += line
            if json.loads(line).get("kind") == "progress":
                break
        endpoints = json.loads((tmp_path / "runs/rj/run.json").read_text())["endpoints"]
        context = zmq.Context()
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        push.connect(endpoints["telemetry"])
        for _ in range(JUNK):
            push.send(b"\xc1 not msgpack")
        push.close()
        context.term()
        run.wait_for("rj", lambda s: s["rejected"] == {"malformed": JUNK}, timeout=30)
        stopped = run.cli("stop", "rj", "--timeout", "30")
        assert stopped.returncode == 0, stopped.stderr
        out, err = watcher.communicate(timeout=60)
        out = first + out
        assert watcher.returncode == 130, err  # stopped
        assert last_json(out)["rejected"] == {"malformed": JUNK}  # live, to the end
        assert run.leftovers() == []
    record = json.loads((tmp_path / "runs/rj/run.json").read_text())
    assert record["rejected"] == {"malformed": JUNK}
    status = run.cli("status", "rj")
    assert f"rejected by the daemon: {JUNK} malformed" in status.stdout, status.stdout
    after = ddtop("--headless", "--format", "jsonl", "rj", cwd=tmp_path)
    assert last_json(after.stdout)["rejected"] == {"malformed": JUNK}  # from the journal
    text = ddtop("--headless", "rj", cwd=tmp_path)
    assert f"  rejected by the daemon: {JUNK} malformed" in text.stdout.splitlines()


@pytest.mark.processes
def test_a_failure_is_one_line_without_a_stray_colon(tmp_path: Path) -> None:
    assert Failure(rank=1, exit_code=1, message="RuntimeError: boom").line() == (
        "rank 1 exit code 1: RuntimeError: boom")
    assert Failure(rank=1, signal="SIGKILL").line() == "rank 1 killed by SIGKILL"
    runs = tmp_path / "runs"
    shutil.copytree(FIXTURES / "recorded-failed", runs / "recorded-failed")
    summary = tmp_path / "summary.md"
    text = ddtop("--headless", "recorded-failed", cwd=tmp_path,
                 env={**tagged_env("x"), "GITHUB_STEP_SUMMARY": str(summary)})
    status = subprocess.run([str(BIN / "ddtrain"), "status", "recorded-failed"], cwd=tmp_path,
                            text=True, capture_output=True, timeout=60)
    assert "  failure: rank 1 killed by SIGKILL" in text.stdout.splitlines()
    assert "failure: rank 1 killed by SIGKILL" in status.stdout.splitlines()
    assert "| failure | rank 1 killed by SIGKILL |" in summary.read_text().splitlines()
    for out in (text.stdout, status.stdout, summary.read_text()):
        assert " : " not in out and ": :" not in out


@pytest.mark.processes
def test_a_lost_runs_failure_is_the_reason_alone(tmp_path: Path) -> None:
    """The daemon was killed mid-run: nobody's exit to blame, the reason is the line."""
    root = tmp_path / "runs" / "cut"
    shutil.copytree(FIXTURES / "recorded-ok", root)
    records = list(journal.read(root / "telemetry.journal"))
    with (root / "telemetry.journal").open("wb") as f:  # the first half: still running
        for record in records[: len(records) // 2]:
            data = msgspec.msgpack.encode(record)
            f.write(journal.LENGTH.pack(len(data)) + data)
    gone = subprocess.Popen(["true"])
    gone.wait()
    (root / "run.json").write_bytes(encode_record(RunRecord(
        run_id="cut", status="running", daemon_pid=gone.pid, schema=RECORD_SCHEMA)))
    text = ddtop("--headless", "cut", cwd=tmp_path)
    assert text.returncode == 1
    failure = [line for line in text.stdout.splitlines() if "failure:" in line]
    assert failure == [f"  failure: the daemon (pid {gone.pid}) is gone and the run did not "
                       "finish: it was killed"], text.stdout
