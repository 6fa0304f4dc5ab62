"""Headless output for CI and scripts, with real runs: `ddtrain start --foreground
--headless` and `ddtop --headless` attached to a detached run, a killed rank,
replays of recorded journals, summary files, and bad input; a script's ddtop.log
scalars through a real relay into the progress lines and the summary."""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import BIN, DDTRAIN, RUN_TIMEOUT_S, Together, ddtrain, detached, tagged_env, together
from test_app import a_script_with_scalars, relay_thread
from test_scalars import scalars

from ddtop.core import wire

DDTOP = str(BIN / "ddtop")
FIXTURES = Path(__file__).parent / "fixtures" / "runs"
SHORT = ("-n", "2", "--epochs", "1")


def jsonl(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def ddtop(*args: str, cwd: Path, env: dict[str, str] | None = None,
          timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DDTOP, *args], cwd=cwd, env=tagged_env("ddtop", env), text=True,
                          capture_output=True, stdin=subprocess.DEVNULL, timeout=timeout)


@pytest.mark.usefixtures("foreground")  # started now, to run beside the tests up to theirs
@pytest.mark.processes
def test_ddtop_headless_follows_a_detached_run_to_its_end(tmp_path: Path) -> None:
    # 3 epochs of 128 steps: a few seconds, several lines at --interval 0.5
    with detached("-n", "2", "--epochs", "3", "--synthetic-train-samples", "8192",
                  "--run-id", "bg", cwd=tmp_path) as run:
        assert run.started.returncode == 0, run.started.stderr
        watch = ddtop("--headless", "--interval", "0.5", cwd=tmp_path)  # the newest live run
        assert watch.returncode == 0, watch.stdout + watch.stderr
        lines = watch.stdout.splitlines()
        assert any(" running: step " in line for line in lines)  # interval lines
        assert any("epoch 3 done" in line for line in lines)
        assert "run bg succeeded" in lines[-4]
        assert run.leftovers() == []


@pytest.mark.processes
def test_ddtop_headless_says_lost_when_the_daemon_is_killed(tmp_path: Path) -> None:
    """The daemon SIGKILLed while `ddtop --headless` watches: its summary says
    `lost`, for the run and for each rank, as `ddtrain status` does; exit 1."""
    # --step-delay: it steps while the module's other runs do, without taking their cores.
    with detached("-n", "2", "--epochs", "40", "--run-id", "gone", "--step-delay", "0.05",
                  cwd=tmp_path) as run:
        assert run.started.returncode == 0, run.started.stderr
        pid = json.loads((tmp_path / "runs" / "gone" / "run.json").read_text())["daemon_pid"]
        watcher = subprocess.Popen(
            [DDTOP, "--headless", "--format", "jsonl", "--interval", "0.2", "gone"],
            cwd=tmp_path, env=tagged_env("ddtop"), text=True, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        try:
            assert watcher.stdout is not None
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while time.monotonic() < deadline:  # watching a run whose ranks step
                ready, _, _ = select.select([watcher.stdout], [], [], 1.0)
                line = watcher.stdout.readline() if ready else ""
                if line.startswith("{") and json.loads(line).get("kind") == "progress" and (
                        json.loads(line)["global_step"] > 0):
                    break
                assert watcher.poll() is None, watcher.stderr.read() if watcher.stderr else ""
            os.kill(pid, signal.SIGKILL)
            out, err = watcher.communicate(timeout=60)
        finally:
            if watcher.poll() is None:
                watcher.kill()
                watcher.wait(timeout=10)
        assert run.leftovers(timeout=5.0) == []  # the ranks died with their daemon
        status = run.status("gone")
    summary = jsonl(out)[-1]
    assert watcher.returncode == 1, out[-2000:] + err
    assert (summary["kind"], summary["status"], summary["run_status"], summary["exit_code"]) == (
        "summary", "lost", "lost", 1)
    assert status["status"] == "lost"
    assert [r["state"] for r in summary["ranks"]] == [r["state"] for r in status["ranks"]] == [
        "lost", "lost"]
    assert f"the daemon (pid {pid}) is gone" in summary["failure"]["message"]


@pytest.mark.processes
def test_replay_of_a_recorded_journal(tmp_path: Path) -> None:
    shutil.copytree(FIXTURES, tmp_path / "runs")
    ok = ddtop("--headless", "--replay", "--format", "jsonl", "recorded-ok", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    lines = jsonl(ok.stdout)
    summary = lines[-1]
    assert summary["status"] == "succeeded" and summary["global_step"] == 1024
    assert round(summary["metrics"]["train_accuracy"], 4) == 0.8211
    assert sum(1 for line in lines if line.get("type") == "epoch_end") == 2
    # Replayed in journal time: a progress line per 10 s of the run would be none here;
    # at --interval 0.5 there are a few.
    fast = ddtop("--headless", "--replay", "--format", "jsonl", "--interval", "0.5",
                 str(tmp_path / "runs" / "recorded-ok"), cwd=tmp_path)
    assert [line["kind"] for line in jsonl(fast.stdout)].count("progress") >= 2
    failed = ddtop("--headless", "--replay", "recorded-failed", cwd=tmp_path)
    assert failed.returncode == 1
    assert "failure: rank 1 killed by SIGKILL" in failed.stdout
    # Without a terminal, plain `ddtop` prints the same lines instead of drawing.
    plain = ddtop("recorded-failed", cwd=tmp_path)
    assert plain.returncode == 1 and plain.stdout == failed.stdout


@pytest.mark.processes
def test_no_run_to_watch_is_exit_2_within_wait(tmp_path: Path) -> None:
    started = time.monotonic()
    none = ddtop("--headless", "--wait", "0.5", cwd=tmp_path)
    assert none.returncode == 2 and time.monotonic() - started < 10
    assert none.stderr.splitlines() == [
        "ddtop: waiting up to 0.5 s for a run to appear under runs/ (--wait)",
        "ddtop: error: no run appeared under runs/ within 0.5 s: start one, or pass "
        "--runs-dir (--wait S waits longer)"]
    once = ddtop("--headless", "--wait", "0", cwd=tmp_path)  # looks once: one line
    assert once.returncode == 2 and once.stderr.splitlines() == [
        "ddtop: error: no runs under runs/: start one first, or pass --runs-dir"]


@pytest.mark.processes
def test_unreachable_daemon_is_exit_2(tmp_path: Path) -> None:
    nobody = ddtop("--headless", "--connect", "tcp://127.0.0.1:9", "--wait", "1", cwd=tmp_path)
    assert nobody.returncode == 2
    assert "cannot be reached within 1 s" in nobody.stderr


@pytest.mark.processes
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    for args, says in [
        (["--interval", "0"], "--interval must be"),
        (["--format", "xml"], "invalid choice"),
        (["--speed", "-1"], "--speed must be"),
        (["--fps", "0"], "--fps must be a number > 0 and at most 30 (got 0)"),
        (["--fps", "1e9"], "--fps must be a number > 0 and at most 30 (got 1e+09)"),
        (["--connect", "localhost:5"], "expected tcp://HOST:PORT"),
        (["--rank", "-1"], "--rank must be a rank number from 0 to 65535 (got -1)"),
        (["--rank", "2"], "--rank and --view open a view of the dashboard: drop --headless"),
        (["--view", "grid"], "invalid choice"),
        (["--summary-json", "/nonexistent/dir/s.json"], "does not exist"),
        (["nosuchrun", "--runs-dir", str(tmp_path), "--wait", "0"], "no runs under"),
    ]:
        result = ddtop("--headless", *args, cwd=tmp_path, timeout=30)
        assert result.returncode == 2, (args, result.stderr)
        assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1, args
        assert "Traceback" not in result.stderr
    nofg = ddtrain("start", "--headless", *SHORT, cwd=tmp_path, timeout=30)
    assert nofg.returncode == 2 and "add --foreground" in nofg.stderr


@pytest.mark.processes
def test_ddtop_help_is_quick_and_imports_no_torch_or_textual() -> None:
    code = ("import sys, time; t = time.perf_counter(); from ddtop.dashboard.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'textual'))\n"
            "sys.stderr.write(repr(bad)); sys.exit(1 if bad else 0)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "--headless" in run.stdout and "Exit codes" in run.stdout


@pytest.mark.processes
def test_on_a_terminal_text_output_is_a_progress_bar(tmp_path: Path) -> None:
    """Under a pseudo-terminal, --headless draws a rich progress bar (not repeated
    progress lines) with the events above it, then the summary."""
    import os
    import pty

    shutil.copytree(FIXTURES, tmp_path / "runs")
    leader, follower = pty.openpty()
    proc = subprocess.Popen([DDTOP, "--headless", "--replay", "--speed", "8", "recorded-ok"],
                            cwd=tmp_path, env=tagged_env("tty", {"COLUMNS": "120"}),
                            stdin=follower, stdout=follower, stderr=follower)
    os.close(follower)
    chunks = []
    try:
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: the other side closed
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(leader)
    out = b"".join(chunks).decode(errors="replace")
    assert "━" in out and "step 1024/1024" in out  # the bar, filled
    assert not re.search(r"\d\d:\d\d:\d\d running: step", out)  # no interval lines
    assert "epoch 2 done" in out and "run recorded-ok succeeded" in out


@pytest.mark.timeout(120)
@pytest.mark.processes
def test_a_scripts_scalars_are_in_the_progress_lines_and_the_summary(tmp_path: Path) -> None:
    """Two `ddtop --headless --connect` (text and jsonl) on a real relay fed a
    script's messages: each progress line and record carries the scalars across
    ranks, and so does the summary (text, JSON and the Markdown for CI)."""
    formats = ("text", "jsonl")
    with relay_thread("r1", tmp_path / "telemetry.journal") as relay:
        relay.send(*a_script_with_scalars(), scalars(0, 2, grad_norm=1.5, lr=3e-4),
                   scalars(1, 2, grad_norm=2.5))
        out = {f: tmp_path / f"{f}.out" for f in formats}
        procs = []
        try:
            for f in formats:
                env = tagged_env("scalars", {"GITHUB_STEP_SUMMARY": str(tmp_path / f"{f}.md")})
                with out[f].open("w") as sink:
                    procs.append(subprocess.Popen(
                        [DDTOP, "--headless", "--connect", relay.control, "--format", f,
                         "--interval", "0.2"], cwd=tmp_path, stdout=sink, stderr=subprocess.PIPE,
                        stdin=subprocess.DEVNULL, text=True, env=env))
            deadline = time.monotonic() + 60
            while not ("scalars: grad_norm" in out["text"].read_text()
                       and '"kind":"progress"' in out["jsonl"].read_text()):
                assert time.monotonic() < deadline, "no progress line with the scalars"
                ended = [p.communicate()[1] for p in procs if p.poll() is not None]
                assert not ended, ended
                time.sleep(0.1)
            relay.emit(wire.RunStatus, status="succeeded", world_size=3, exit_code=0,
                       message="run succeeded")
            for p in procs:
                assert p.wait(timeout=60) == 0, p.communicate()[1]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    text = out["text"].read_text().splitlines()
    progress = next(line for line in text if " running: step " in line)
    assert progress.endswith("; scalars: grad_norm 2 (1.5..2.5) · lr 0.0003")
    assert "  program: train.py" in text
    assert "  scalar grad_norm: mean 2 (min 1.5 rank 0, max 2.5 rank 1)" in text
    assert "  scalar lr: mean 0.0003" in text
    lines = jsonl(out["jsonl"].read_text())
    summary, record = lines[-1], [line for line in lines if line["kind"] == "progress"][-1]
    assert summary["kind"] == "summary" and summary["status"] == "succeeded"
    assert record["scalars"] == summary["scalars"]  # one shape: ScalarSummary's fields
    assert [(c["name"], c["mean"], c["min_rank"], c["max_rank"], c["ranks"])
            for c in summary["scalars"]] == [("grad_norm", 2.0, 0, 1, 2), ("lr", 3e-4, 0, 0, 1)]
    markdown = (tmp_path / "text.md").read_text()
    assert "| program | `train.py` |" in markdown
    assert "| scalar | grad_norm: mean 2 (min 1.5 rank 0, max 2.5 rank 1) |" in markdown


# -- the foreground runs, started together with the module's first process test --------
@pytest.fixture(scope="module")
def foreground(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Together]:
    """The two foreground runs, started together with the module's first process
    test (they run beside the tests before theirs, which are last in the module):
    `ok` to its end, `bad` with rank 1 killed."""
    with together(tmp_path_factory.mktemp("headless")) as runs:
        ok = runs.cwd("ok")
        runs.start("ok", [DDTRAIN, "start", "--foreground", "--headless", "--format", "jsonl",
                          "--interval", "0.5", "--run-id", "ok", "--summary-json",
                          str(ok / "summary.json"), *SHORT],
                   {"GITHUB_STEP_SUMMARY": str(ok / "step.md")})
        runs.start("bad", [DDTRAIN, "start", "--foreground", "--headless", "--run-id", "bad",
                           *SHORT, "--inject", "1:kill@step=40"])
        yield runs


@pytest.mark.processes
def test_foreground_headless_jsonl_ends_with_a_summary_and_exit_0(foreground: Together) -> None:
    run, tmp_path = foreground.result("ok"), foreground.cwd("ok")
    assert run.returncode == 0, run.stderr
    assert run.leftovers == []
    lines = jsonl(run.stdout)  # stdout holds JSON lines only; ddtrain's own lines go to stderr
    kinds = [line["kind"] for line in lines]
    assert kinds[-1] == "summary" and kinds.count("summary") == 1
    assert "progress" in kinds and "event" in kinds
    summary = lines[-1]
    assert summary["status"] == "succeeded" and summary["exit_code"] == 0
    assert summary["global_step"] == summary["total_steps"] == 512
    assert [r["state"] for r in summary["ranks"]] == ["finished", "finished"]
    # The first epoch, counted from 1 as metrics.jsonl and the ranks' lines count it.
    assert summary["metrics"]["epoch"] == 1 and 0 < summary["metrics"]["train_loss"] < 3
    assert [r["epoch"] for r in summary["ranks"]] == [1, 1]
    assert all(line["schema"] == 1 for line in lines)
    progress = next(line for line in lines if line["kind"] == "progress")
    assert {r["rank"] for r in progress["ranks"]} == {0, 1}
    assert set(progress["ranks"][0]) >= {"rank", "state", "epoch", "step", "loss",
                                         "samples_per_s", "comm_share"}
    types = [line["type"] for line in lines if line["kind"] == "event"]
    assert "join" in types and "epoch_end" in types and "checkpoint" in types
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    markdown = (tmp_path / "step.md").read_text()
    assert "run `ok` succeeded" in markdown and "| 1 | finished | 512 |" in markdown
    assert "succeeded" in run.stderr  # the daemon's own closing line


@pytest.mark.processes
def test_killed_rank_fails_the_headless_run_naming_rank_and_signal(foreground: Together
                                                                   ) -> None:
    run, tmp_path = foreground.result("bad"), foreground.cwd("bad")
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.leftovers == []
    out = run.stdout.splitlines()
    assert any("[rank 1] error: rank 1" in line and "SIGKILL" in line for line in out)
    assert any(line.startswith("  failure: rank 1 killed by SIGKILL") for line in out)
    assert time.strftime("%Y-%m-%d") in out[0]  # lines start with a timestamp
    # The same run, read back from its journal by ddtop --headless: same verdict.
    again = ddtop("--headless", "--format", "jsonl", "bad", cwd=tmp_path)
    assert again.returncode == 1, again.stderr
    summary = jsonl(again.stdout)[-1]
    assert summary["status"] == "failed"
    assert summary["failure"]["rank"] == 1 and summary["failure"]["signal"] == "SIGKILL"
    assert summary["ranks"][1]["signal"] == "SIGKILL"
