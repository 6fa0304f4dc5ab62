"""Bad input: one clear line on stderr naming the flag, exit code 2, no
traceback, and no process left behind."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import BIN, Run, ddtrain

SMALL = ("--epochs", "1", "--synthetic-train-samples", "64")


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
    (("--run-id", "r" * 300), ("--run-id is 300 characters long", "at most 100")),
    (("--runs-dir", "d" * 300), ("--runs-dir", "longer than 255 bytes")),
])
def test_rejected_before_any_rank_starts(tmp_path: Path, args: tuple[str, ...],
                                         fragments: tuple[str, ...]) -> None:
    run = ddtrain("start", "--foreground", *args, cwd=tmp_path, timeout=30)
    assert_usage_error(run, *fragments)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_port_already_in_use(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        run = ddtrain("start", "--foreground", "--master-port", str(port), *SMALL, cwd=tmp_path,
                      timeout=30)
    assert_usage_error(run, f"--master-port {port} is already in use")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_nccl_without_gpus_is_named_by_the_ranks(tmp_path: Path) -> None:
    run = ddtrain("start", "--foreground", "-n", "2", "--backend", "nccl", *SMALL, cwd=tmp_path)
    assert_usage_error(run, "--backend nccl needs one GPU per local rank", "--backend gloo")


def test_dataset_missing_from_data_dir_is_named_by_the_ranks(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    run = ddtrain("start", "--foreground", "-n", "2", "--dataset", "fashion-mnist", *SMALL,
                  cwd=tmp_path)
    assert_usage_error(run, "fashion-mnist not found", "--download")


def test_resume_with_other_settings_is_refused(tmp_path: Path) -> None:
    first = ddtrain("start", "--foreground", "-n", "2", *SMALL, "--run-id", "r1", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    run = ddtrain("start", "--foreground", "--resume", "-n", "4", cwd=tmp_path, timeout=30)
    assert_usage_error(run, "run r1 cannot be resumed", "--world-size 2 -> 4")
    again = ddtrain("start", "--foreground", "--run-id", "r1", *SMALL, cwd=tmp_path, timeout=30)
    assert_usage_error(again, "run r1 already exists", "--resume")


def test_runs_dir_that_cannot_be_written(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a folder")
    run = ddtrain("start", "--foreground", "--runs-dir", "afile", *SMALL, cwd=tmp_path, timeout=30)
    assert_usage_error(run, "cannot write the run directory afile/", "--runs-dir")


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
def test_commands_without_a_run(tmp_path: Path, args: tuple[str, ...],
                                fragments: tuple[str, ...]) -> None:
    assert_usage_error(ddtrain(*args, cwd=tmp_path, timeout=30), *fragments)


def test_unknown_run_and_ambiguous_prefix(tmp_path: Path) -> None:
    for rid in ("20261122-100000-aaaa", "20261122-100000-bbbb"):
        (tmp_path / "runs" / rid).mkdir(parents=True)
        (tmp_path / "runs" / rid / "config.json").write_text("{}")
    assert_usage_error(ddtrain("status", "nope", cwd=tmp_path, timeout=30), "no run 'nope'")
    assert_usage_error(ddtrain("logs", "2026", cwd=tmp_path, timeout=30), "ambiguous")
    listed = ddtrain("list", cwd=tmp_path, timeout=30)  # damaged runs are listed, not fatal
    assert listed.returncode == 0 and listed.stdout.count("lost") + listed.stdout.count(
        "unknown") == 2


def test_detached_start_reports_bad_input_at_once(tmp_path: Path) -> None:
    run = ddtrain("start", "-n", "3", "--batch-size", "64", cwd=tmp_path, timeout=30)
    assert_usage_error(run, "--batch-size 64")


def test_the_limits_are_in_the_help(tmp_path: Path) -> None:
    run = ddtrain("start", "--help", cwd=tmp_path, timeout=30)
    text = " ".join(run.stdout.split())
    for says in ("number of ranks (processes) to launch; at most 1024",
                 "split across ranks; at most 1024", "at most 256", "--fail-on-nan"):
        assert says in text, says


def test_ddtop_on_a_run_name_too_long_for_the_file_system(tmp_path: Path) -> None:
    run = subprocess.run([str(BIN / "ddtop"), "--headless", "r" * 300], cwd=tmp_path,
                         text=True, capture_output=True, stdin=subprocess.DEVNULL, timeout=30)
    assert run.returncode == 2
    assert run.stderr.startswith("ddtop: error: cannot look for runs there: File name too long")
    assert len(run.stderr.splitlines()) == 1 and "Traceback" not in run.stderr
