"""A runs directory on a disk that fills up (issue 13): bookkeeping never takes
training down, and a checkpoint that does not fit says so.

Each test mounts a small tmpfs of its own (root only; skipped where mounting
is not possible) and fills it for real: a filler file written until the file
system says ENOSPC, or checkpoints that do not fit. The unit tests drive the
writers directly; the others are real 2-rank runs.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from helpers import DDTRAIN, finish, start, wait_until_gone

from ddtop.core import control, journal, protocol, wire
from ddtop.core.config import TrainConfig
from ddtop.core.contract import ErrorReport
from ddtop.core.rundir import RunPaths, log_stream
from ddtop.core.runinfo import RunInfo
from ddtop.core.state import RunState, decode_snapshot
from ddtop.core.summary import RunSummary, decode_record
from ddtop.daemon.relay import Relay
from ddtop.daemon.report import RESERVE_NAME, RunReport
from ddtop.training import checkpoint
from ddtop.training.progress import append_whole
from ddtop.training.worker import run_reported, write_error_report

NO_SPACE = os.strerror(errno.ENOSPC)  # "No space left on device"
decode_error_report = msgspec.json.Decoder(ErrorReport).decode
WAIT_S = 60.0


@contextlib.contextmanager
def small_disk(where: Path, megabytes: int) -> Iterator[Path]:
    """A tmpfs of `megabytes` MiB mounted at `where`, unmounted at the end."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m,mode=0700",
                              "tmpfs", str(where)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(disk: Path, *also: Path) -> Path:
    """Write a file until the disk has no room left; then top off the files
    `also` (each holds room up to the end of its last page) with blank lines."""
    filler = disk / "filler"
    _write_until_full(filler, b"\1")
    for path in also:
        _write_until_full(path, b"\n")
    return filler


def _write_until_full(path: Path, byte: bytes) -> None:
    with path.open("ab", buffering=0) as f:
        for size in (1 << 20, 1 << 12, 1):
            while True:
                try:
                    f.write(byte * size)
                except OSError as e:
                    assert e.errno == errno.ENOSPC, e
                    break


def records(frames: int, start: int = 1) -> list[tuple[int, float, bytes]]:
    return [(seq, 100.0 + seq, wire.encode(wire.Heartbeat(
        run="r", rank=0, seq=seq, phase="forward", epoch=0, phase_s=0.0,
        global_step=seq))[0])
        for seq in range(start, start + frames)]


# -- the writers, one at a time -------------------------------------------------------
@pytest.mark.processes
def test_journal_drops_and_counts_whole_records_then_writes_again(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", 1) as disk:
        now = [0.0]
        writer = journal.JournalWriter(disk / "telemetry.journal", clock=lambda: now[0])
        for record in records(20):
            writer.append(*record)
        writer.flush()
        assert writer.dropped == 0 and writer.error is None
        filler = fill(disk)
        for record in records(3000, start=21):  # ~100 KB: more than any room left
            writer.append(*record)
        writer.flush()
        assert writer.error is not None and writer.error.errno == errno.ENOSPC
        dropped = writer.dropped
        assert dropped > 0 and writer.dropped_bytes > 0
        kept = [r.seq for r in journal.read(writer.path)]
        assert kept == list(range(1, len(kept) + 1))  # whole records, none torn
        assert len(kept) + dropped == 3020
        writer.append(*records(1, start=3021)[0])  # within RETRY_S: not even tried
        assert writer.dropped == dropped + 1
        filler.unlink()
        now[0] += journal.RETRY_S
        writer.append(*records(1, start=3022)[0])
        writer.flush()
        assert writer.error is None and writer.dropped == dropped + 1
        writer.close()
        state, last = journal.replay(writer.path, "r")
        assert last == 3022 and state.journal_dropped == dropped + 1  # the gaps, counted


@pytest.mark.processes
def test_every_journal_outage_is_counted_and_said(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Three outages of a relay's journal, the second and third within a minute of
    the first warning: only the first is warned about, each end says what that
    outage cost and what all did ('1 record ... was'), and the line at close
    the final total, which is run.json's and the replay's count."""
    with small_disk(tmp_path / "disk", 1) as disk:
        now = [0.0]
        relay = Relay("r", disk / "telemetry.journal", tmp_path / "sockets")
        writer = relay.journal
        writer.clock = lambda: now[0]
        path = writer.path

        def outage(frames: int) -> int:
            """The disk full while `frames` records come, then room again; the
            records that outage dropped."""
            before = writer.dropped
            filler = fill(disk)
            for seq, received, frame in records(frames, start=relay.seq + 1):
                relay.seq = seq
                writer.append(seq, received, frame)
            for _ in range(10_000):  # one at a time until the journal file's last page is full
                relay.emit(wire.Event, type="info", message="during")
                if writer.error is not None:
                    break
            filler.unlink()
            now[0] += journal.RETRY_S
            relay.emit(wire.Event, type="info", message="after")  # written: the outage ends
            return writer.dropped - before

        try:
            relay.emit(wire.Event, type="info", message="before")
            first = outage(3000)
            now[0] += 10.0  # within WARN_EVERY_S of the first warning: not warned again
            second = outage(3000)
            now[0] += 10.0
            third = outage(0)  # the one event that did not fit
        finally:
            relay.close()
        total = first + second + third
        assert first > 1 and second > 1 and third == 1 and writer.outages == 3
        said = [e.message for e in relay.state.events if e.message.startswith("journal")]
        bytes_ = [e.data["dropped_bytes"] for e in relay.state.events
                  if e.message.startswith("journal: writing again")]
        warned = next(e.data["dropped"] for e in relay.state.events
                      if e.type == "warning")  # so far: the warning itself is dropped too
        assert 0 < warned < first
        assert said == [
            f"journal: {NO_SPACE} on {path}: {warned} records not written; the run goes on, "
            "and the journal is written again when there is room",
            f"journal: writing again to {path}; {first} records ({bytes_[0]:,} bytes) were "
            "not written",
            f"journal: writing again to {path}; {second} records "
            f"({bytes_[1] - bytes_[0]:,} bytes) were not written ({first + second} records in "
            "all, 2 outages)",
            f"journal: writing again to {path}; 1 record ({bytes_[2] - bytes_[1]:,} bytes) was "
            f"not written ({total} records in all, 3 outages)"]
        err = capsys.readouterr().err.splitlines()
        assert err == [f"ddtrain: {'warning: ' * (m == said[0])}{m}" for m in said] + [
            f"ddtrain: warning: journal: {total} records ({writer.dropped_bytes:,} bytes) not "
            f"written to {path} in all (3 outages); a replay misses them"]
        assert relay.state.journal_dropped == total == writer.dropped
        replayed, _ = journal.replay(path, "r")
        assert replayed.journal_dropped == total


@pytest.mark.processes
def test_an_error_report_on_a_full_disk_is_whole_or_absent(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A rank that fills the disk and fails of it (as a checkpoint that does not
    fit): its report is written whole into the room held from its start; a
    report with no room held is absent, never an empty file, and said on stderr."""
    with small_disk(tmp_path / "disk", 1) as disk:
        path = disk / "rank-0.error.json"

        def fails_of_a_full_disk() -> None:
            fill(disk)
            raise checkpoint.CheckpointWriteError(
                disk / "step-00000004.pt", OSError(errno.ENOSPC, NO_SPACE))

        assert run_reported(fails_of_a_full_disk, 0, path) == 1
        report = decode_error_report(path.read_bytes())
        assert report.message == (f"CheckpointWriteError: cannot write checkpoint "
                                  f"{disk / 'step-00000004.pt'}: {NO_SPACE}")
        assert "fails_of_a_full_disk" in report.traceback
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "rank-0.error.json"]
        assert (path.stat().st_mode & 0o777) == 0o600

        path.unlink()
        fill(disk)  # a full disk and no room held: no file at all
        capsys.readouterr()
        write_error_report(path, ErrorReport(rank=0, message="boom"))
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]
        assert (f"could not write error report {path}: {NO_SPACE}; the report was: boom"
                in capsys.readouterr().err)


@pytest.mark.processes
def test_the_final_run_json_is_written_from_the_reserve(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", 4) as disk:
        paths = RunPaths(disk / "r").create()
        report = RunReport(TrainConfig(world_size=2), paths)
        state = RunState(run="r", status="running", world_size=2)
        report.write(state, {}, 0, [])
        assert (paths.root / RESERVE_NAME).stat().st_size > 0
        fill(disk)
        state.status = "stopping"
        report.write(state, {}, 0, [])  # not written, not raised
        assert report.unwritten is not None
        assert decode_record(paths.status.read_bytes()).status == "running"
        state.status, state.exit_code, state.journal_dropped = "succeeded", 0, 7
        report.write(state, {}, 0, [], ended=True)
        record = decode_record(paths.status.read_bytes())
        assert record.status == "succeeded" and record.journal_dropped == 7
        assert record.ended is not None and not (paths.root / RESERVE_NAME).exists()
        assert [p.name for p in paths.root.glob(".run.json.*.tmp")] == []


@pytest.mark.processes
def test_logs_and_metrics_lose_lines_not_the_process(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", 1) as disk:
        log = disk / "rank-0.log"
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        stream = log_stream(fd)
        print("before", file=stream)
        filler = fill(disk)
        for i in range(1000):
            print(f"line {i} of a full disk", file=stream)
        stream.flush()
        metrics = disk / "metrics.jsonl"
        with pytest.raises(OSError) as full:
            append_whole(metrics, b'{"kind": "sync"}\n' * 10_000)
        assert full.value.errno == errno.ENOSPC
        assert not metrics.exists() or metrics.stat().st_size == 0  # no half record
        filler.unlink()
        print("after", file=stream)
        stream.close()
        os.close(fd)
        lines = log.read_text().splitlines()
        assert lines[0] == "before" and lines[-1] == "after"
        assert f"bytes of output not written here: {NO_SPACE}]" in lines[-2]


@pytest.mark.processes
def test_a_checkpoint_that_does_not_fit_names_the_disk_and_leaves_nothing(
        tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", 2) as disk:
        folder = disk / "checkpoints"
        folder.mkdir()
        stale = folder / ".step-00000003.pt.k1ll3d.tmp"  # a writer killed mid-write
        stale.write_bytes(b"\0" * 1000)
        state = {"global_step": 4, "model": {"w": torch.zeros(1024, 1024)}}  # 4 MiB
        with pytest.raises(checkpoint.CheckpointWriteError) as failed:
            checkpoint.save(folder, state, keep=0)
        path = folder / "step-00000004.pt"
        assert str(failed.value) == f"cannot write checkpoint {path}: {NO_SPACE}"
        assert failed.value.errno == errno.ENOSPC
        assert list(folder.iterdir()) == []  # neither the stale temp nor a partial one
        small = {"global_step": 5, "model": {"w": torch.zeros(16)}}
        stale.write_bytes(b"\0")
        assert checkpoint.save(folder, small, keep=0).name == "step-00000005.pt"
        assert [p.name for p in folder.iterdir()] == ["step-00000005.pt"]


# -- real runs ----------------------------------------------------------------------
def live(root: Path, request: Any) -> Any:
    endpoint = RunInfo.load(RunPaths(root)).control
    assert endpoint is not None
    reply = control.request(endpoint, request, 5.0)
    assert reply.ok, reply
    return reply


def wait_for(what: str, check: Any, timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(control.Unreachable, AssertionError, OSError, ValueError):
            found = check()
            if found:
                return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def summary(root: Path) -> RunSummary:
    found: RunSummary | None = live(root, protocol.Status()).summary
    assert found is not None
    return found


def snapshot(root: Path) -> RunState:
    return decode_snapshot(live(root, protocol.Snapshot()).state)


# Steps until rank 0 finds the file named by its argument, then ends (both ranks
# together); it prints a line per step into its log.
STEPS_SCRIPT = textwrap.dedent('''\
    import sys, time
    from pathlib import Path
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if __name__ == "__main__":
        dist.init_process_group("gloo")
        model = DDP(torch.nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        done, step = torch.zeros(1), 0
        while not done.item():
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            step += 1
            print(f"step {step}", flush=True)
            done.fill_(float(dist.get_rank() == 0 and Path(sys.argv[1]).exists()))
            dist.all_reduce(done)
            time.sleep(0.01)
        dist.destroy_process_group()
''')


@pytest.mark.processes
def test_the_journal_filling_the_disk_costs_records_not_the_run(tmp_path: Path) -> None:
    """Built-in trainer; the disk is filled mid-epoch and freed a while later:
    the daemon keeps relaying, says so once, counts what it dropped, and the
    run succeeds; the ranks' logs and metrics.jsonl lose lines, not the run."""
    with small_disk(tmp_path / "disk", 16) as disk:
        root = disk / "runs" / "j"
        proc, tag = start([DDTRAIN, "start", "--foreground", "-n", "2", "--runs-dir",
                           str(disk / "runs"), "--run-id", "j", "--epochs", "1",
                           "--batch-size", "8", "--synthetic-train-samples", "4000",
                           "--synthetic-val-samples", "16", "--sync-every", "1",
                           "--progress-every", "0.1"], tmp_path)
        try:
            wait_for("the first steps", lambda: summary(root).global_step >= 5)
            filler = fill(disk, root / "logs" / "rank-0.log")
            filled_at = summary(root).global_step
            # Training goes on with the disk full: the daemon relays, warns, counts.
            # (metrics.jsonl fails once its last page is full: a sync record a step,
            # up to ~40 steps after the fill)
            seen = wait_for("the drop counted and the warnings relayed", lambda: (
                (s := snapshot(root)).journal_dropped > 0
                and min(v.global_step for v in s.ranks.values()) >= filled_at + 30
                and any("metrics.jsonl is not written" in e.message for e in s.events)
                and s))
            assert seen.status == "running"
            warnings = [e.message for e in seen.events if e.type == "warning"]
            assert any(m.startswith(f"journal: {NO_SPACE} on {root / 'telemetry.journal'}: ")
                       for m in warnings), warnings
            assert any("metrics.jsonl is not written" in m for m in warnings), warnings
            assert summary(root).journal_dropped >= seen.journal_dropped
            filler.unlink()  # room again before the epoch's checkpoint
        finally:
            run = finish(proc, tag)
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.leftovers == []
        assert f"ddtrain: warning: journal: {NO_SPACE} on " in run.stderr
        assert "ddtrain: journal: writing again to " in run.stderr
        record = decode_record((root / "run.json").read_bytes())
        assert record.status == "succeeded" and record.journal_dropped >= seen.journal_dropped
        status = subprocess.run([DDTRAIN, "status", "--runs-dir", str(disk / "runs"), "j",
                                 "--json"], capture_output=True, text=True, timeout=30)
        assert json.loads(status.stdout)["journal_dropped"] == record.journal_dropped
        replayed, _ = journal.replay(root / "telemetry.journal", "j")
        assert replayed.status == "succeeded" and replayed.journal_dropped > 0
        assert any(e.message.startswith("journal: writing again")
                   for e in replayed.events)
        syncs = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
        # whole lines only, and fewer than the run's 500 steps (a sync record each)
        assert 0 < len([r for r in syncs if r["kind"] == "sync"]) < 500
        assert f"of output not written here: {NO_SPACE}]" in (
            root / "logs" / "rank-0.log").read_text()


@pytest.mark.processes
def test_a_disk_full_to_the_end_still_records_how_the_run_ended(tmp_path: Path) -> None:
    """A detached run of a user's script on a disk that stays full until the run
    ends (the daemon's own log too): the daemon lives on, and the final status
    is in run.json (not `lost`) with the count of records not written."""
    (tmp_path / "steps.py").write_text(STEPS_SCRIPT)
    release = tmp_path / "release"
    with small_disk(tmp_path / "disk", 8) as disk:
        runs, root = str(disk / "runs"), disk / "runs" / "s"
        proc, tag = start([DDTRAIN, "start", "-n", "2", "--runs-dir", runs, "--run-id", "s",
                           "steps.py", "--", str(release)], tmp_path)
        try:
            started = proc.communicate(timeout=WAIT_S)
            assert proc.returncode == 0, started
            wait_for("the first steps", lambda: summary(root).global_step >= 5)
            fill(disk, root / "daemon.log", root / "logs" / "rank-0.log")
            wait_for("records dropped", lambda: summary(root).journal_dropped > 20)
            release.touch()
            wait_for("the end", lambda: decode_record(
                (root / "run.json").read_bytes()).status == "succeeded")
        finally:
            leftovers = wait_until_gone(tag)
        assert leftovers == []
        record = decode_record((root / "run.json").read_bytes())
        assert record.exit_code == 0 and record.journal_dropped > 20
        status = subprocess.run([DDTRAIN, "status", "--runs-dir", runs, "s"],
                                capture_output=True, text=True, timeout=30)
        assert status.stdout.startswith("run s: succeeded"), status.stdout + status.stderr


@pytest.mark.processes
def test_a_checkpoint_that_does_not_fit_fails_the_run_naming_the_disk(
        tmp_path: Path) -> None:
    """Checkpoints every 2 steps, all kept, until one does not fit: rank 0 fails
    with the file and 'No space left on device'; nothing half-written is left.
    Then, with room made: a stale temp file is gone after --resume."""
    with small_disk(tmp_path / "disk", 12) as disk:
        runs = str(disk / "runs")
        root = disk / "runs" / "c"
        proc, tag = start([DDTRAIN, "start", "--foreground", "-n", "2", "--runs-dir", runs,
                           "--run-id", "c", "--epochs", "1", "--batch-size", "8",
                           "--synthetic-train-samples", "800", "--synthetic-val-samples", "16",
                           "--checkpoint-every", "2", "--keep-checkpoints", "0"], tmp_path)
        run = finish(proc, tag)
        assert run.returncode == 1, run.stderr[-3000:]
        assert run.leftovers == []
        last = run.stderr.strip().splitlines()
        failed = next(line for line in last if line.startswith("ddtrain: run c failed: "))
        assert "rank 0" in failed and f"cannot write checkpoint {root / 'checkpoints'}" in failed
        assert failed.endswith(f".pt: {NO_SPACE}"), failed
        assert "unexpected pos" not in run.stderr
        record = decode_record((root / "run.json").read_bytes())
        assert record.status == "failed" and record.failure is not None
        assert record.failure.rank == 0 and NO_SPACE in (record.failure.message or "")
        kept = sorted(p.name for p in (root / "checkpoints").iterdir())
        assert kept and all(name.startswith("step-") and name.endswith(".pt") for name in kept)
        # Rank 0's own report, whole (room for it was held from its start), and in
        # the run's final headline; no reserve or temporary file left in logs/.
        report = msgspec.json.decode((root / "logs" / "rank-0.error.json").read_bytes())
        assert NO_SPACE in report["message"] and "CheckpointWriteError" in report["message"]
        assert sorted(p.name for p in (root / "logs").iterdir() if p.name.startswith(".")) == []
        replayed, _ = journal.replay(root / "telemetry.journal", "c")
        assert replayed.status == "failed" and replayed.status_message is not None
        assert replayed.status_message.startswith("run failed after "), replayed.status_message
        assert replayed.status_message.endswith(f".pt: {NO_SPACE}"), replayed.status_message

        for old in sorted((root / "checkpoints").iterdir())[:-1]:
            old.unlink()  # room for the epoch's checkpoint
        stale = root / "checkpoints" / ".step-00000099.pt.k1ll3d.tmp"
        stale.write_bytes(b"\0" * 4096)
        proc, tag = start([DDTRAIN, "start", "--foreground", "--resume", "--runs-dir", runs,
                           "--run-id", "c", "--checkpoint-every", "0", "--keep-checkpoints",
                           "1"], tmp_path)
        resumed = finish(proc, tag)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert resumed.leftovers == []
        assert [p.name for p in (root / "checkpoints").iterdir()] == ["step-00000100.pt"]
