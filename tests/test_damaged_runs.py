"""A run directory whose run.json or config.json is damaged (a value of the wrong
kind, a list for an object, truncated, not text) never costs a traceback: every
command that reads a run (`ddtrain status`, `list`, `logs`, `stop`, `start
--resume`, `ddtop` live, replayed and headless) says in one line which file is
unreadable and goes on with what else is known (the journal), or refuses in
one line naming the file. Table-driven: every kind of damage x every command,
in-process; a few kinds again as real processes; and a live run damaged under
its daemon. Also: a journal that is a folder, or a logs/ that is a file, is one
line and exit 2 for the command that reads it; a renamed run folder replays its
journal, and pids read back from run.json are bounded before anything can
signal them."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from helpers import BIN, DDTRAIN, Run, detached, finish, start

from ddtop.core.rundir import RunPaths
from ddtop.core.runinfo import RunInfo
from ddtop.core.summary import RECORD_SCHEMA, decode_record, encode_record
from ddtop.daemon import cli as ddtrain_cli
from ddtop.dashboard import cli as ddtop_cli

FIXTURES = Path(__file__).parent / "fixtures" / "runs"
RUN = "recorded-ok"
DDTOP = str(BIN / "ddtop")


def current_record() -> dict[str, Any]:
    """The fixture's run.json in today's layout: the summary its journal tells,
    with daemon facts (a start time, so that no pid below is taken by itself)."""
    record = RunInfo.load(RunPaths(FIXTURES / RUN)).summary()
    record = msgspec.structs.replace(record, schema=RECORD_SCHEMA, daemon_start_ticks=1,
                                     boot_id="another-boot")
    data: dict[str, Any] = json.loads(encode_record(record))
    return data


def with_fields(**changes: Any) -> Callable[[bytes], bytes]:
    def damage(good: bytes) -> bytes:
        return json.dumps({**json.loads(good), **changes}).encode()
    return damage


def replaced(content: bytes) -> Callable[[bytes], bytes]:
    return lambda good: content


def nested_record(good: bytes) -> bytes:
    """A journal with a record, after its first, whose frame is 5 KB of arrays
    nested 5,000 deep (what a sender could have had journalled by an older daemon)."""
    (size,) = struct.unpack(">I", good[:4])
    frame = b"\x82\xa1v" + b"\x91" * 5000 + b"\xc0" + b"\xa3run\xa1x"  # {v: [[[...]]], run: x}
    record = msgspec.msgpack.encode([2, 0.0, frame])
    return good[:4 + size] + struct.pack(">I", len(record)) + record + good[4 + size:]


# (name, file, damage): what a crash, a bad edit or a full disk leaves behind.
DAMAGE: list[tuple[str, str, Callable[[bytes], bytes]]] = [
    ("run-int", "run.json", replaced(b"5")),
    ("run-list", "run.json", replaced(b"[]")),
    ("run-truncated", "run.json", lambda good: good[:120]),
    ("run-empty", "run.json", replaced(b"")),
    ("run-not-text", "run.json", replaced(b"\xff\xfe\x00garbage")),
    ("run-string-exit-code", "run.json", with_fields(exit_code="1")),
    ("run-int-for-failure", "run.json", with_fields(failure=3)),
    ("run-object-for-ranks", "run.json", with_fields(ranks={"0": 1})),
    ("run-unknown-status", "run.json", with_fields(status="exploded")),
    ("run-negative-pid", "run.json", with_fields(status="running", daemon_pid=-1)),
    ("run-huge-pid", "run.json", with_fields(status="running", daemon_pid=2**62)),
    ("run-huge-world", "run.json", with_fields(world_size=10**9)),
    ("run-nested", "run.json", replaced(b"[" * 5000 + b"]" * 5000)),
    ("run-nested-field", "run.json", replaced(b'{"schema": 2, "failure": ' + b"[" * 5000
                                              + b"]" * 5000 + b"}")),
    ("config-list", "config.json", replaced(b"[]")),
    ("config-int", "config.json", replaced(b"5")),
    ("config-truncated", "config.json", lambda good: good[:40]),
    ("config-not-text", "config.json", replaced(b"\xff\xfe")),
    ("config-string-world", "config.json", with_fields(world_size="two")),
    ("config-huge-world", "config.json", with_fields(world_size=10**9)),
    ("config-int-for-object", "config.json", with_fields(extra=5)),
    ("journal-nested-record", "telemetry.journal", nested_record),
    ("config-nested", "config.json", replaced(b'{"extra": ' + b"[" * 5000 + b"]" * 5000 + b"}")),
]
# Each command, and what it must do with a damaged finished run: (exit code, check).
COMMANDS: list[tuple[str, list[str], int]] = [
    ("status", ["status", RUN], 0),
    ("status-json", ["status", RUN, "--json"], 0),
    ("list", ["list"], 0),
    ("list-json", ["list", "--json"], 0),
    ("logs", ["logs", RUN], 0),
    ("logs-rank", ["logs", RUN, "--rank", "1"], 0),
    ("stop", ["stop", RUN, "--timeout", "1"], 0),
    ("resume", ["start", "--foreground", "--resume", "--run-id", RUN], 2),
    ("ddtop", ["@ddtop", RUN, "--headless"], 0),
    ("ddtop-jsonl", ["@ddtop", RUN, "--headless", "--format", "jsonl"], 0),
    ("ddtop-replay", ["@ddtop", RUN, "--headless", "--replay", "--speed", "0"], 0),
]


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    shutil.copytree(FIXTURES / RUN, tmp_path / "runs" / RUN)
    (tmp_path / "runs" / RUN / "run.json").write_text(json.dumps(current_record()))
    return tmp_path / "runs"


@pytest.fixture(autouse=True)
def umask() -> Iterator[None]:
    """`ddtrain start` makes this process's files owner-only: not for the tests after."""
    before = os.umask(0o022)
    os.umask(before)
    yield
    os.umask(before)


def damage(runs: Path, file: str, how: Callable[[bytes], bytes]) -> None:
    path = runs / RUN / file
    path.write_bytes(how(path.read_bytes()))


def check(name: str, file: str, code: int, returncode: int, out: str, err: str) -> None:
    where = f"{name} / {file}"
    assert "Traceback" not in out + err, where
    assert returncode == code, (where, out, err)
    for line in err.strip().splitlines():  # only our own one-line messages
        assert line.startswith(("ddtrain: ", "ddtop: ")), (where, err)
    if name == "resume":
        assert len(err.strip().splitlines()) == 1, (where, err)
        if file == "config.json":  # names the file; or the setting out of range in it
            assert (("config.json" in err and "start a new run" in err)
                    or "--world-size must be at most 1024" in err), (where, err)
    if name in ("status", "status-json") and file == "run.json":
        assert "run.json is unreadable" in err, (where, err)
    if name == "status-json":
        assert json.loads(out)["status"] == "succeeded"  # as the journal tells it
    if name in ("list", "list-json", "status"):
        assert RUN in out, (where, out)
    if name == "logs" and file == "run.json":
        assert "[rank 0] run recorded-ok" in out, (where, out)  # host unknown: not said
    if name.startswith("ddtop"):
        assert "succeeded" in out, (where, out)


@pytest.mark.parametrize(("kind", "file", "how"), DAMAGE, ids=[d[0] for d in DAMAGE])
def test_every_command_on_a_damaged_run_is_one_line_or_a_best_effort(
        runs: Path, kind: str, file: str, how: Callable[[bytes], bytes],
        capsys: pytest.CaptureFixture[str]) -> None:
    damage(runs, file, how)
    for name, args, code in COMMANDS:
        if args[0] == "@ddtop":
            returncode = ddtop_cli.main([*args[1:], "--runs-dir", str(runs)])
        else:
            returncode = ddtrain_cli.main([*args, "--runs-dir", str(runs)])
        out, err = capsys.readouterr()
        check(name, file, code, returncode, out, err)


# A file where a folder belongs, or a folder where a file does: each command that
# reads it refuses in one line naming it (exit 2), never a traceback.
WRONG_KIND: list[tuple[str, str, list[str]]] = [
    ("journal-is-a-folder", "telemetry.journal", ["@ddtop", RUN, "--headless"]),
    ("journal-is-a-folder-replay", "telemetry.journal",
     ["@ddtop", RUN, "--headless", "--replay", "--speed", "0"]),
    ("logs-is-a-file", "logs", ["logs", RUN]),
    ("rank-log-is-a-folder", "logs/rank-0.log", ["logs", RUN]),
]


@pytest.mark.parametrize(("kind", "file", "args"), WRONG_KIND, ids=[w[0] for w in WRONG_KIND])
def test_a_file_or_folder_of_the_wrong_kind_is_one_line_and_exit_2(
        runs: Path, kind: str, file: str, args: list[str],
        capsys: pytest.CaptureFixture[str]) -> None:
    path = runs / RUN / file
    if path.is_dir():
        shutil.rmtree(path)
        path.write_text("not a folder\n")
    else:
        path.unlink()
        path.mkdir()
    if args[0] == "@ddtop":
        returncode = ddtop_cli.main([*args[1:], "--runs-dir", str(runs)])
    else:
        returncode = ddtrain_cli.main([*args, "--runs-dir", str(runs)])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert returncode == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and file in err, err
    assert err.startswith(("ddtrain: error: ", "ddtop: error: ")), err


AS_PROCESSES = [d for d in DAMAGE
                if d[0] in ("run-int", "run-string-exit-code", "config-list", "config-truncated")]


@pytest.mark.parametrize(("kind", "file", "how"), AS_PROCESSES, ids=[d[0] for d in AS_PROCESSES])
@pytest.mark.processes
def test_the_same_as_real_processes(runs: Path, kind: str, file: str,
                                    how: Callable[[bytes], bytes]) -> None:
    damage(runs, file, how)
    started = [(name, code, start([DDTOP if args[0] == "@ddtop" else DDTRAIN,
                                   *(args[1:] if args[0] == "@ddtop" else args),
                                   "--runs-dir", str(runs)], runs.parent))
               for name, args, code in COMMANDS]  # side by side: each only reads
    for name, code, (proc, tag) in started:
        run: Run = finish(proc, tag, timeout=60)
        check(name, file, code, run.returncode, run.stdout, run.stderr)
        assert run.leftovers == []


@pytest.mark.processes
def test_a_live_run_with_damaged_files_is_watched_and_stopped(tmp_path: Path) -> None:
    with detached("-n", "2", "--epochs", "50",
                  "--step-delay", "0.05", "--run-id", "live", cwd=tmp_path) as run:
        assert run.started.returncode == 0, run.started.stderr
        root = tmp_path / "runs" / "live"
        (root / "config.json").write_text("[]")  # read at start only: nothing changes
        status = run.cli("status", "live")
        assert status.returncode == 0 and "live: running" in status.stdout, status.stderr
        for args in (["list"], ["logs", "live"], ["status", "live", "--json"]):
            result = run.cli(*args)
            assert result.returncode == 0 and "Traceback" not in result.stderr, args
        good = (root / "run.json").read_bytes()
        (root / "run.json").write_bytes(good[:100])  # torn under a live daemon
        status = run.cli("status", "live")
        assert status.returncode == 0, status.stderr
        assert status.stderr.startswith("ddtrain: warning: runs/live/run.json is unreadable")
        watched = subprocess.run([DDTOP, "--headless", "live"], cwd=tmp_path, text=True,
                                 capture_output=True, stdin=subprocess.DEVNULL, timeout=60)
        assert "Traceback" not in watched.stdout + watched.stderr
        refused = run.cli("stop", "live", "--timeout", "30")
        assert refused.returncode == 0 and "Traceback" not in refused.stderr
        assert "run.json is unreadable" in refused.stderr  # why the daemon is not found
        (root / "run.json").write_bytes(good)  # put back: the daemon is found again
        stopped = run.cli("stop", "live", "--timeout", "30")
        assert stopped.returncode == 0 and "run live stopped" in stopped.stdout, stopped.stderr
        assert run.leftovers() == []


def test_pids_read_back_from_run_json_are_bounded() -> None:
    """A damaged pid must never reach kill(): -1 would signal every process of the
    user, 0 this process group; beyond PID_MAX it is not a pid at all."""
    good = json.dumps({**current_record(), "daemon_start_ticks": None}).encode()
    for pid in (-1, -(2**31), 2**22 + 1, 2**62):
        for field in ("daemon_pid", "processes"):
            doc = json.loads(good)
            if field == "processes":
                doc["processes"] = [{"rank": 0, "pid": pid}]
            else:
                doc["daemon_pid"], doc["status"] = pid, "running"
            with pytest.raises(ValueError, match=field):
                decode_record(json.dumps(doc).encode())


@pytest.mark.processes
def test_a_renamed_run_folder_replays_its_journal(tmp_path: Path) -> None:
    """The journal's records carry the run id the run had; a folder renamed since
    is replayed all the same, and ddtop says so."""
    runs = tmp_path / "runs"
    shutil.copytree(FIXTURES / RUN, runs / "renamed")
    (runs / "renamed" / "run.json").unlink()  # nothing but the journal to tell
    # Without --replay, --wait 0: by default ddtop waits 10 s for the run.json a
    # starting daemon writes (its folder comes first); this folder never gets one.
    for args in (["--replay", "--speed", "0"], ["--wait", "0"]):
        result = subprocess.run([DDTOP, "--headless", "--format", "jsonl", "renamed", *args],
                                cwd=tmp_path, text=True, capture_output=True, timeout=60,
                                stdin=subprocess.DEVNULL)
        summary = json.loads(result.stdout.splitlines()[-1])
        assert [r["state"] for r in summary["ranks"]] == ["finished", "finished"], result.stdout
        assert summary["global_step"] > 0 and summary["model"] == "mlp"
        assert f"journal is of run {RUN!r}" in result.stderr, result.stderr
    info = RunInfo.load(RunPaths(runs / "renamed"))
    assert info.status == "lost"  # run.json is gone; the journal still tells the story
    assert [r.state for r in info.summary().ranks] == ["finished", "finished"]


def test_a_diverged_runs_metrics_survive_run_json() -> None:
    """JSON has no NaN: msgspec writes null, which is read back as NaN where a
    float must be (not as an unreadable run.json); the run's samples/s may be
    missing (a zero-code run reports none), so its null is read back as None."""
    doc = current_record()
    doc["samples_per_s"] = None
    assert doc["metrics"] is not None
    doc["metrics"]["train_loss"] = None
    record = decode_record(json.dumps(doc).encode())
    assert record.metrics is not None and math.isnan(record.metrics.train_loss)
    assert record.samples_per_s is None
    again = decode_record(encode_record(record))  # written as null, read as NaN again
    assert again.metrics is not None and math.isnan(again.metrics.train_loss)
