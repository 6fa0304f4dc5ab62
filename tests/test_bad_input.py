"""Bad input: one clear line on stderr naming the flag, exit code 2, no
traceback, and no process left behind. The three runs whose ranks start start
together with the module's first test (a module fixture)."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import BIN, DDTRAIN, Run, Together, ddtrain, together

from ddtop.core.contract import FAULT_ENV
from ddtop.daemon import cli

SMALL = ("--epochs", "1", "--synthetic-train-samples", "64")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Together]:
    """The runs whose bad input only the ranks can find (`nccl`, `fashion`), and
    the run `r1` a resume is then refused for, started together with the module's
    first test, to run beside the tests up to theirs."""
    with together(tmp_path_factory.mktemp("ranks")) as runs:
        fg = [DDTRAIN, "start", "--foreground", "-n", "2"]
        if not torch.cuda.is_available():  # its test needs a machine without GPUs
            runs.start("nccl", [*fg, "--backend", "nccl", *SMALL])
        (runs.cwd("fashion") / "data").mkdir(parents=True)
        runs.start("fashion", [*fg, "--dataset", "fashion-mnist", *SMALL])
        runs.start("r1", [*fg, *SMALL, "--run-id", "r1"])
        yield runs


def assert_usage_error(run: Run, *fragments: str) -> None:
    assert run.returncode == 2, run.stdout + run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("ddtrain"), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert "Traceback" not in run.stdout + run.stderr
    assert run.leftovers == []


@pytest.mark.parametrize(("args", "fragments"), [
    (("--world-size", "0"), ("--world-size must be at least 1",)),
    (("--world-size", "-3"), ("--world-size must be at least 1",)),
    (("-n", "3", "--batch-size", "64"), ("--batch-size 64", "--world-size 3", "63 or 66")),
    (("--model", "vit"), ("--model", "invalid choice: 'vit'")),
    (("--dataset", "imagenet"), ("--dataset", "invalid choice")),
    (("--epochs", "two"), ("--epochs", "invalid int value")),
    (("--dataset", "mnist", "--data-dir", "no/such/dir"), ("--data-dir no/such/dir", "--download")),
    (("--lr", "0"), ("--lr must be positive",)),
    (("--run-id", "../escape"), ("--run-id",)),
    (("--backend", "nccl", "--device", "cpu"), ("--backend gloo",)),
    (("--resume",), ("no runs under runs/",)),
    # Upper bounds, each naming its limit (docs/cli.md).
    (("--world-size", "100000"), ("--world-size must be at most 1024 (got 100000)",
                                  "every rank runs on this machine")),
    (("--workers", "5000"), ("--workers must be at most 1024 (got 5000)",)),
    (("--threads-per-rank", "1000"), ("--threads-per-rank must be at most 256 (got 1000)",)),
    (("--synthetic-train-samples", "100000000"),
     ("--synthetic-train-samples must be at most 1000000", "in memory")),
    (("--epochs", "10000000"), ("--epochs must be at most 1000000",)),
    (("--lr", "inf"), ("--lr must be positive and finite (got inf)",)),
    (("--lr", "nan"), ("--lr must be positive and finite (got nan)",)),
    (("--step-delay", "-1"), ("--step-delay must be 0 to 3600 seconds (got -1.0)",)),
    (("--step-delay", "nan"), ("--step-delay must be 0 to 3600 seconds (got nan)",)),
    (("--run-id", "r" * 300), ("--run-id is 300 characters long", "at most 100")),
    (("--runs-dir", "d" * 300), ("--runs-dir", "longer than 255 bytes")),
])
@pytest.mark.usefixtures("ranks")  # started now, to run beside the tests up to theirs
@pytest.mark.processes
def test_rejected_before_any_rank_starts(tmp_path: Path, args: tuple[str, ...],
                                         fragments: tuple[str, ...]) -> None:
    run = ddtrain("start", "--foreground", *args, cwd=tmp_path, timeout=30)
    assert_usage_error(run, *fragments)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """`ddtrain` in this process, typed in tmp_path: `start` sets the owner-only umask
    and reads DDTOP_FAULT, both given back afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(FAULT_ENV, raising=False)
    monkeypatch.delenv("DDTOP_RUNS_DIR", raising=False)
    umask = os.umask(0o022)
    os.umask(umask)
    yield tmp_path
    os.umask(umask)


def usage_error_in_process(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """`ddtrain ARGS` in this process: exit 2 with one line on stderr (returned), no
    traceback, and no run folder left in the working directory."""
    try:
        code = cli.main(list(args))
    except SystemExit as e:  # argparse's own errors
        code = e.code  # type: ignore[assignment]
    out, err = capsys.readouterr()
    assert code == 2, (args, out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in out + err, err
    assert not Path("runs").exists() or not any(Path("runs").iterdir())
    return err.strip()


LONG = "1" + "0" * 20  # 10^20: an int, not argparse's 'invalid int value'


@pytest.mark.parametrize(("args", "fragments"), [
    # Every integer flag has its range (core/bounds.py), named with the flag.
    (("--seed", "1" + "0" * 23), ("--seed must be at most 4294967295 (got 10000000..., 24 "
                                  "digits): give 0 to 4294967295", "64 bits")),
    (("--seed", "-1"), ("--seed must be at least 0 (got -1): give 0 to 4294967295",)),
    (("--seed", "1e23"), ("argument --seed: invalid int value: '1e23'",)),
    (("--max-restarts", LONG), ("--max-restarts must be at most 1000", "give 0 to 1000")),
    (("--checkpoint-every", LONG), ("--checkpoint-every must be at most 1000000000",
                                    "give 0 to 1000000000")),
    (("--keep-checkpoints", LONG), ("--keep-checkpoints must be at most 10000",
                                    "give 0 to 10000 (0 keeps all)")),
    (("--sync-every", LONG), ("--sync-every must be at most 1000000000",)),
    (("--batch-size", LONG), ("--batch-size must be at most 1000000",)),
    (("--master-port", "70000"), ("--master-port must be at most 65535 (got 70000): give 0 "
                                  "to 65535",)),
    # An empty value is not the default.
    (("--runs-dir", ""), ("argument --runs-dir: an empty value",)),
    (("--bind", ""), ("argument --bind: an empty value",)),
    (("--data-dir", ""), ("argument --data-dir: an empty value",)),
    (("--master-addr", ""), ("argument --master-addr: an empty value",)),
])
def test_bounds_and_empty_values_in_process(in_tmp: Path, capsys: pytest.CaptureFixture[str],
                                            args: tuple[str, ...],
                                            fragments: tuple[str, ...]) -> None:
    line = usage_error_in_process(capsys, "start", "--foreground", *args)
    for fragment in fragments:
        assert fragment in line, line


def test_a_directory_as_the_program_is_named_as_one(in_tmp: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    (in_tmp / "project").mkdir()
    line = usage_error_in_process(capsys, "start", "--foreground", "project")
    assert line == ("ddtrain: error: project is a directory: give the path of your training "
                    "script in it (or -m MODULE for a module)")
    assert "is a directory" in usage_error_in_process(capsys, "start", str(in_tmp))


def test_list_without_a_runs_folder_says_so_as_status_does(
        in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert usage_error_in_process(capsys, "list", "--runs-dir", "missing") == (
        "ddtrain: error: no runs under missing/: start one first, or pass --runs-dir")
    assert usage_error_in_process(capsys, "status", "--runs-dir", "missing") == (
        "ddtrain: error: no runs under missing/: start one first, or pass --runs-dir")
    (in_tmp / "afile").write_text("not a folder")
    assert "afile/: it is not a folder" in usage_error_in_process(
        capsys, "list", "--runs-dir", "afile")
    assert "argument --runs-dir: an empty value" in usage_error_in_process(
        capsys, "list", "--runs-dir", "")
    (in_tmp / "empty").mkdir()  # a folder with no runs yet: an empty listing
    assert cli.main(["list", "--runs-dir", "empty"]) == 0
    assert capsys.readouterr().out == "no runs under empty/ (start one with: ddtrain start)\n"


@pytest.mark.parametrize("where", ["folder", "no-folder/s.json", "proc"])
def test_summary_json_that_cannot_be_written_is_refused_before_the_run(
        in_tmp: Path, capsys: pytest.CaptureFixture[str], where: str) -> None:
    path = {"folder": str(in_tmp), "no-folder/s.json": "no-folder/s.json",
            "proc": "/proc/self/summary.json"}[where]  # /proc: not writable, also as root
    line = usage_error_in_process(capsys, "start", "--foreground", "--headless",
                                  "--summary-json", path, *SMALL)
    says = {"folder": f"--summary-json {in_tmp} is a folder: give the path of a file",
            "no-folder/s.json": "folder no-folder does not exist",
            "proc": "--summary-json /proc/self/summary.json cannot be written"}[where]
    assert says in line, line
    assert not (in_tmp / "no-folder").exists()


@pytest.mark.processes
def test_summary_json_of_a_folder_as_typed(tmp_path: Path) -> None:
    """The command line of the report: one line, exit 2, and no rank started."""
    run = ddtrain("start", "--foreground", "--headless", "--summary-json", str(tmp_path),
                  *SMALL, cwd=tmp_path, timeout=30)
    assert_usage_error(run, f"--summary-json {tmp_path} is a folder")
    assert not list(tmp_path.glob("runs/*/logs/rank-*.log"))


@pytest.mark.processes
def test_port_already_in_use(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        run = ddtrain("start", "--foreground", "--master-port", str(port), *SMALL, cwd=tmp_path,
                      timeout=30)
    assert_usage_error(run, f"--master-port {port} is already in use")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
@pytest.mark.processes
def test_nccl_without_gpus_is_named_by_the_ranks(ranks: Together) -> None:
    run = ranks.result("nccl")
    assert_usage_error(run, "--backend nccl needs one GPU per local rank", "--backend gloo")


@pytest.mark.processes
def test_dataset_missing_from_data_dir_is_named_by_the_ranks(ranks: Together) -> None:
    run = ranks.result("fashion")  # its data/ folder empty
    assert_usage_error(run, "fashion-mnist not found", "--download")


@pytest.mark.processes
def test_resume_with_other_settings_is_refused(ranks: Together) -> None:
    first, tmp_path = ranks.result("r1"), ranks.cwd("r1")
    assert first.returncode == 0, first.stderr
    run = ddtrain("start", "--foreground", "--resume", "-n", "4", cwd=tmp_path, timeout=30)
    assert_usage_error(run, "run r1 cannot be resumed", "--world-size 2 -> 4")
    again = ddtrain("start", "--foreground", "--run-id", "r1", *SMALL, cwd=tmp_path, timeout=30)
    assert_usage_error(again, "run r1 already exists", "--resume")


@pytest.mark.processes
def test_runs_dir_that_cannot_be_written(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a folder")
    run = ddtrain("start", "--foreground", "--runs-dir", "afile", *SMALL, cwd=tmp_path, timeout=30)
    assert_usage_error(run, "cannot write the run directory afile/", "--runs-dir")


@pytest.mark.processes
def test_resume_of_a_damaged_run_config(tmp_path: Path) -> None:
    (tmp_path / "runs/r1").mkdir(parents=True)
    (tmp_path / "runs/r1/config.json").write_text("{truncated")
    run = ddtrain("start", "--foreground", "--resume", cwd=tmp_path, timeout=30)
    assert_usage_error(run, "cannot read runs/r1/config.json", "start a new run")


@pytest.mark.parametrize(("args", "fragments"), [
    (("status",), ("no runs under runs/",)),
    (("stop", "nope"), ("no runs under runs/",)),
    (("logs", "-f"), ("no runs under runs/",)),
    (("status", "--runs-dir", "elsewhere"), ("no runs under elsewhere/",)),
    (("stop", "--timeout", "soon"), ("--timeout", "invalid float value")),
    # NaN would never escalate to SIGKILL; inf neither; a negative time is no time.
    (("stop", "--timeout", "nan"), ("--timeout must be a number of seconds", "(got nan)")),
    (("stop", "--timeout", "inf"), ("--timeout must be a number of seconds", "(got inf)")),
    (("stop", "--timeout", "-1"), ("--timeout must be a number of seconds", "(got -1)")),
    (("status", "r" * 300), ("File name too long",)),
    (("logs", "r" * 300), ("File name too long",)),
    (("stop", "r" * 300), ("File name too long",)),
    (("list", "--runs-dir", "d" * 300), ("File name too long",)),
    (("explode",), ("invalid choice: 'explode'",)),
])
@pytest.mark.processes
def test_commands_without_a_run(tmp_path: Path, args: tuple[str, ...],
                                fragments: tuple[str, ...]) -> None:
    assert_usage_error(ddtrain(*args, cwd=tmp_path, timeout=30), *fragments)


@pytest.mark.processes
def test_unknown_run_and_ambiguous_prefix(tmp_path: Path) -> None:
    for rid in ("20261122-100000-aaaa", "20261122-100000-bbbb"):
        (tmp_path / "runs" / rid).mkdir(parents=True)
        (tmp_path / "runs" / rid / "config.json").write_text("{}")
    assert_usage_error(ddtrain("status", "nope", cwd=tmp_path, timeout=30), "no run 'nope'")
    assert_usage_error(ddtrain("logs", "2026", cwd=tmp_path, timeout=30), "ambiguous")
    listed = ddtrain("list", cwd=tmp_path, timeout=30)  # damaged runs are listed, not fatal
    assert listed.returncode == 0 and listed.stdout.count("lost") + listed.stdout.count(
        "unknown") == 2


@pytest.mark.processes
def test_detached_start_reports_bad_input_at_once(tmp_path: Path) -> None:
    run = ddtrain("start", "-n", "3", "--batch-size", "64", cwd=tmp_path, timeout=30)
    assert_usage_error(run, "--batch-size 64")


@pytest.mark.processes
def test_the_limits_are_in_the_help(tmp_path: Path) -> None:
    run = ddtrain("start", "--help", cwd=tmp_path, timeout=30)
    text = " ".join(run.stdout.split())
    for says in ("number of ranks (processes) to launch; at most 1024",
                 "split across ranks; at most 1024", "at most 256", "--fail-on-nan",
                 "up to K times; at most 1000", "0 keeps all; at most 10000"):
        assert says in text, says


@pytest.mark.processes
def test_ddtop_on_a_run_name_too_long_for_the_file_system(tmp_path: Path) -> None:
    run = subprocess.run([str(BIN / "ddtop"), "--headless", "r" * 300], cwd=tmp_path,
                         text=True, capture_output=True, stdin=subprocess.DEVNULL, timeout=30)
    assert run.returncode == 2
    assert run.stderr.startswith("ddtop: error: cannot look for runs there: File name too long")
    assert len(run.stderr.splitlines()) == 1 and "Traceback" not in run.stderr
