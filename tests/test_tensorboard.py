"""A run's telemetry as TensorBoard files, read back with TensorBoard's own reader.

`ddtop export` on the recorded runs (tests/fixtures/runs): a folder per rank with the
same tags, one point per Step message of the journal at its global step, its values
per step, its wall time; the run's folder with the global metrics once each and the
events as text. Bad input is one line: no such run, a DIR that is a file, files
already there; a damaged journal is exported as far as it reads, and what was
skipped is said. The daemon's live writer (`ddtrain start --tensorboard`) on a real
2-rank run gives the same points; a DIR it cannot write is one warning, and the run
succeeds; a disk that fills up mid-run (/dev/full) is one warning, said once.
"""

from __future__ import annotations

import contextlib
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from helpers import ddtrain

from ddtop.core import journal, tbpoints, wire
from ddtop.core.state import RunState
from ddtop.core.tbwriter import EventFiles, TensorBoardTap
from ddtop.daemon import cli
from ddtop.daemon.startline import parse_command_line
from ddtop.daemon.watchcmd import watch_config
from ddtop.dashboard import export
from ddtop.dashboard.cli import main as ddtop_main

accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="tensorboard is not installed (the test extra has it)")

FIXTURES = Path(__file__).parent / "fixtures" / "runs"
STEP_TAGS = ["step/seconds", "step/compute_seconds", "step/comm_seconds", "step/comm_share",
             "train/loss", "train/samples_per_second"]
# ... and each memory reading the Step messages carry (a rank reads RSS or CUDA's).
MEMORY_TAGS = {"memory/rss_bytes": "rss", "memory/rss_peak_bytes": "rss_peak",
               "memory/cuda_allocated_bytes": "cuda_allocated",
               "memory/cuda_reserved_bytes": "cuda_reserved", "memory/cuda_peak_bytes": "cuda_peak"}


def read_back(folder: Path) -> accumulator.EventAccumulator:
    """Everything in the folder (0: keep every point, not TensorBoard's sample)."""
    found = accumulator.EventAccumulator(str(folder), size_guidance={"scalars": 0,
                                                                       "tensors": 0})
    found.Reload()
    return found


def journal_messages(run: Path) -> list[wire.Message]:
    return [wire.decode([r.frame]) for r in journal.read(run / "telemetry.journal")]


def events_text(folder: Path) -> list[str]:
    """The run's lines as TensorBoard shows them: each step's last text (a live
    writer's flush can write a step's lines so far, then all of them again at that
    step; TensorBoard keeps the last), split into its lines."""
    last = {e.step: e for e in read_back(folder).Tensors(tbpoints.EVENTS_TAG)}
    return [line for _, e in sorted(last.items())
            for line in e.tensor_proto.string_val[0].decode().split(tbpoints.LINE_BREAK)]


def assert_points_are_the_step_messages(run: Path, written: Path) -> None:
    """Per rank: one point per Step message of the journal, at its global step, with
    its wall time and its values per step, in every step tag."""
    steps = [m for m in journal_messages(run) if isinstance(m, wire.Step)]
    ranks = sorted({m.rank for m in steps})
    assert ranks == [0, 1]
    # A folder per rank, the run's, and the ranks' spread (ranks/max, median, min); the
    # run's own folder holds its HParams.
    assert sorted(p.name for p in written.iterdir() if p.is_dir()) == [
        "rank0", "rank1", "ranks", "run"]
    assert sorted(p.name for p in (written / "ranks").iterdir()) == ["max", "median", "min"]
    for rank in ranks:
        mine = [m for m in steps if m.rank == rank]
        found = read_back(written / f"rank{rank}")
        memory = [tag for tag, field in MEMORY_TAGS.items()
                  if all(getattr(m, field) is not None for m in mine)]
        assert found.Tags()["scalars"] == STEP_TAGS + memory
        for tag in STEP_TAGS + memory:
            points = found.Scalars(tag)
            assert len(points) == len(mine), tag
            assert [p.step for p in points] == [m.global_step for m in mine], tag
            assert [p.wall_time for p in points] == pytest.approx([m.t for m in mine]), tag
        seconds = [p.value for p in found.Scalars("step/seconds")]
        assert seconds == pytest.approx([m.step_s / m.steps for m in mine], rel=1e-6)
        comm = [p.value for p in found.Scalars("step/comm_seconds")]
        assert comm == pytest.approx([m.comm_s / m.steps for m in mine], rel=1e-6)
        compute = [p.value for p in found.Scalars("step/compute_seconds")]
        assert compute == pytest.approx([max(0.0, m.step_s - m.comm_s) / m.steps
                                         for m in mine], rel=1e-6, abs=1e-9)
        share = [p.value for p in found.Scalars("step/comm_share")]
        assert share == pytest.approx([min(1.0, m.comm_s / m.step_s) for m in mine], rel=1e-6)
        loss = [p.value for p in found.Scalars("train/loss")]
        assert loss == pytest.approx([m.loss_sum / m.samples for m in mine], rel=1e-6)
        for tag in memory:
            assert [p.value for p in found.Scalars(tag)] == [
                float(getattr(m, MEMORY_TAGS[tag])) for m in mine], tag
    assert "memory/rss_bytes" in memory, memory  # (CPU ranks: their RSS, every message)


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    shutil.copytree(FIXTURES, tmp_path / "runs")
    return tmp_path / "runs"


def test_a_recorded_run_exported_reads_back_point_for_point(
        runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = ddtop_main(["export", "recorded-ok", "--runs-dir", str(runs), "--tensorboard",
                       str(tmp_path / "tb")])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert out == (f"ddtop: exported run recorded-ok to {tmp_path / 'tb' / 'recorded-ok'}: "
                   f"84 step messages of 2 ranks (tensorboard --logdir {tmp_path / 'tb'})\n")
    written = tmp_path / "tb" / "recorded-ok"
    assert_points_are_the_step_messages(runs / "recorded-ok", written)
    run = read_back(written / "run")
    # The global metrics once per sync (every rank sends them), at their global step.
    aggregates = [m for m in journal_messages(runs / "recorded-ok")
                  if isinstance(m, wire.Aggregate) and m.rank == 0]
    losses = run.Scalars("global/train_loss")
    assert [p.step for p in losses] == [m.global_step for m in aggregates] == [512, 1024]
    assert [p.value for p in losses] == pytest.approx([m.train_loss for m in aggregates])
    assert len(run.Scalars("global/val_accuracy")) == 2
    text = events_text(written / "run")
    assert text[0] == "**status** · daemon: run recorded-ok starting 2 ranks"
    assert "**join** · rank 1: rank 1 joined: vm pid 4493, cpu, gloo" in text
    assert text[-1] == "**status** · daemon: run succeeded after 7.2 s"


def test_a_failed_run_exports_its_failure_as_an_event(runs: Path, tmp_path: Path) -> None:
    assert export.main(["recorded-failed", "--runs-dir", str(runs), "--tensorboard",
                        str(tmp_path / "tb")]) == 0
    text = events_text(tmp_path / "tb" / "recorded-failed" / "run")
    assert any(t.startswith("**error** · rank 1: rank 1 (pid") and "SIGKILL" in t
               for t in text), text


def test_a_run_is_found_as_ddtop_finds_it_by_prefix_or_folder(
        runs: Path, tmp_path: Path) -> None:
    assert export.main([str(runs / "recorded-ok"), "--tensorboard", str(tmp_path / "a")]) == 0
    assert export.main(["recorded-f", "--runs-dir", str(runs), "--tensorboard",
                        str(tmp_path / "b")]) == 0
    assert (tmp_path / "a" / "recorded-ok" / "rank0").is_dir()
    assert (tmp_path / "b" / "recorded-failed" / "rank1").is_dir()


@pytest.mark.parametrize(("args", "error"), [
    (["nope"], "ddtop: error: no run 'nope' under {runs}/: see the folders there for run ids"),
    (["recorded"], "ddtop: error: run id 'recorded' is ambiguous (recorded-failed, recorded-ok):"
     " give more of it"),
    (["recorded-ok", "--tensorboard", "{file}"],
     "ddtop: error: cannot write TensorBoard files in {file}/recorded-ok: Not a directory"),
])
def test_bad_input_is_one_line(runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               args: list[str], error: str) -> None:
    (tmp_path / "file").write_text("not a folder\n")
    names = {"runs": str(runs), "file": str(tmp_path / "file")}
    args = [a.format(**names) for a in args]
    if "--tensorboard" not in args:
        args += ["--tensorboard", str(tmp_path / "tb")]
    assert export.main([*args, "--runs-dir", str(runs)]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", error.format(**names) + "\n")


def test_files_already_there_are_not_added_to(runs: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    args = ["recorded-ok", "--runs-dir", str(runs), "--tensorboard", str(tmp_path / "tb")]
    assert export.main(args) == 0
    capsys.readouterr()
    assert export.main(args) == 2
    assert capsys.readouterr().err == (
        f"ddtop: error: {tmp_path / 'tb' / 'recorded-ok'} already holds TensorBoard files of "
        "run recorded-ok (written live, or exported before): remove it, or give another "
        "--tensorboard DIR\n")


@pytest.mark.processes
def test_a_failed_export_leaves_nothing_that_blocks_it_run_again(
        runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: an export that failed half way (the audit made DIR/<run>/rank1 a file)
    left rank0/ and run/ written, and once the cause was gone, the same export was
    refused: "already holds TensorBoard files ... remove it". Now it writes in a
    folder of its own beside DIR/<run> and renames it at the end; one that fails
    removes what it wrote. Acted out for real: a file-size limit (RLIMIT_FSIZE, as
    root too) makes the export's own writes fail, EFBIG, part of a file written."""
    tb = tmp_path / "tb"
    args = ["recorded-ok", "--runs-dir", str(runs), "--tensorboard", str(tb)]

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4_000, 4_000))  # a rank's file: ~7.7 KB

    failed = subprocess.run(
        [sys.executable, "-c", "import sys; from ddtop.dashboard import export; "
         "sys.exit(export.main(sys.argv[1:]))", *args],
        preexec_fn=limit, capture_output=True, text=True, timeout=120, check=False)
    assert (failed.returncode, failed.stdout) == (2, ""), failed.stderr
    assert failed.stderr == (f"ddtop: error: cannot write TensorBoard files in "
                             f"{tb / 'recorded-ok'}: File too large\n")
    assert list(tb.iterdir()) == []  # nothing left: neither DIR/<run> nor the export's own
    assert export.main(args) == 0  # run again: written whole
    assert_points_are_the_step_messages(runs / "recorded-ok", tb / "recorded-ok")
    assert sorted(p.name for p in tb.iterdir()) == ["recorded-ok"]
    # Something in the way of DIR/<run> (the audit's file at rank1) is refused before
    # anything is written; gone (an empty folder stays), the export goes through.
    capsys.readouterr()
    shutil.rmtree(tb / "recorded-ok")
    (tb / "recorded-ok").mkdir()
    (tb / "recorded-ok" / "rank1").write_text("in the way\n")
    assert export.main(args) == 2
    assert capsys.readouterr().err == (
        f"ddtop: error: {tb / 'recorded-ok'} is there already, not an empty folder (the "
        "export writes the folder of run recorded-ok whole): remove it, or give another "
        "--tensorboard DIR\n")
    assert [p.name for p in (tb / "recorded-ok").iterdir()] == ["rank1"]
    assert sorted(p.name for p in tb.iterdir()) == ["recorded-ok"]
    (tb / "recorded-ok" / "rank1").unlink()
    assert export.main(args) == 0
    assert_points_are_the_step_messages(runs / "recorded-ok", tb / "recorded-ok")


def test_without_a_subcommand_ddtop_still_takes_a_run(runs: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """`export` is a word before RUN; a run is still named as before."""
    assert ddtop_main(["--headless", "--replay", "--runs-dir", str(runs), "recorded-ok"]) == 0
    assert "succeeded" in capsys.readouterr().out


def test_a_damaged_journal_is_exported_as_far_as_it_reads(
        runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A record whose frame is not a message (skipped), a gap in the relay sequence (a
    record the daemon could not write) and a torn tail: the rest is written, and one
    line says what was skipped."""
    path = runs / "recorded-ok" / "telemetry.journal"
    records = list(journal.read(path))
    steps = [i for i, r in enumerate(records) if isinstance(wire.decode([r.frame]), wire.Step)]
    garbled, dropped = steps[3], steps[10]
    encoder = msgspec.msgpack.Encoder()
    with path.open("wb") as f:
        for i, r in enumerate(records):
            if i == dropped:
                continue
            frame = b"\xc1not msgpack" if i == garbled else r.frame
            data = encoder.encode(journal.Record(r.seq, r.received, frame))
            f.write(journal.LENGTH.pack(len(data)) + data)
        f.write(journal.LENGTH.pack(500) + b"torn")
    assert export.main(["recorded-ok", "--runs-dir", str(runs), "--tensorboard",
                        str(tmp_path / "tb")]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.splitlines() == [
        f"ddtop: exported run recorded-ok to {tmp_path / 'tb' / 'recorded-ok'}: 82 step "
        "messages of 2 ranks; skipped 1 record not readable; 1 record the daemon could not "
        "write (missing from the journal); the last 8 bytes (a damaged or torn record) "
        f"(tensorboard --logdir {tmp_path / 'tb'})"]
    found = [len(read_back(tmp_path / "tb" / "recorded-ok" / f"rank{r}").Scalars("step/seconds"))
             for r in (0, 1)]
    assert sum(found) == 82


def test_the_translation_of_hand_made_messages() -> None:
    state, translator = RunState(run="r"), tbpoints.Translator()

    def fold(message: wire.Message, received: float) -> list[tbpoints.Item]:
        state.apply(message, received)
        return translator.items(message, state, received)

    base = {"run": "r", "epoch": 0, "step": 1, "steps_per_epoch": 10, "lr": 0.1,
            "data_s": 0.0, "forward_s": 0.0, "backward_s": 0.0, "optimizer_s": 0.0,
            "comm_bytes": 0, "comm_ops": 0, "algbw_gbps": 0.0, "busbw_gbps": 0.0,
            "sync_wait_s": 0.0}
    step = wire.Step(rank=0, seq=0, t=100.0, global_step=4, steps=4, samples=8, loss_sum=4.0,
                     step_s=2.0, comm_s=0.5, loss_weight=2.0, **base)
    config, point = fold(step, 100.5)  # the first step: the run's HParams, once
    assert config == tbpoints.HParams("", "r", 100.0, (
        ("model", ""), ("dataset", ""), ("program", ""), ("strategy", ""), ("backend", ""),
        ("world_size", 0), ("global_batch", 0), ("epochs", 0), ("lr", 0.1)))
    assert point == tbpoints.Scalars("rank0", 4, 100.0, (
        ("step/seconds", 0.5), ("step/compute_seconds", 0.375), ("step/comm_seconds", 0.125),
        ("step/comm_share", 0.25), ("train/loss", 2.0), ("train/samples_per_second", 4.0)))
    empty = wire.Step(rank=0, seq=1, t=101.0, global_step=4, steps=0, samples=0, loss_sum=0.0,
                      step_s=0.0, comm_s=0.0, **base)
    assert fold(empty, 100.6) == []  # covers no step: nothing to read per step
    aggregate = {"run": "r", "scope": "sync", "epoch": 0, "global_step": 4, "train_loss": 1.5,
                 "train_accuracy": 0.5, "train_samples": 8}
    first = fold(wire.Aggregate(rank=0, seq=2, t=102.0, **aggregate), 102.0)
    again = fold(wire.Aggregate(rank=1, seq=0, t=102.1, **aggregate), 102.1)
    assert first == [tbpoints.Scalars("run", 4, 102.0, (("global/train_loss", 1.5),
                                                         ("global/train_accuracy", 0.5)))]
    assert again == []  # the same sync from another rank: once
    logged = fold(wire.Scalars(run="r", rank=1, seq=1, t=103.0, values={"grad_norm": 3.0},
                               global_step=5), 103.0)
    assert logged == [tbpoints.Scalars("rank1", 5, 103.0, (("log/grad_norm", 3.0),))]
    said = fold(wire.Event(run="r", rank=0, seq=3, t=104.0, type="warning", message="hot"),
                104.0)
    assert said == []  # held with the other lines of its step, given when asked for
    said = translator.pending()
    assert said == [tbpoints.Text("run", 5, 104.0, "events", "**warning** · rank 0: hot")]
    assert translator.steps_written == 1
    # a node's summary (a multi-node hub's journal): a point for each rank's step in it
    summed = [wire.Step(rank=r, seq=5, t=105.0, global_step=6, steps=2, samples=8,
                        loss_sum=4.0, step_s=1.0, comm_s=0.5, **base) for r in (2, 3)]
    summary = wire.NodeSummary(run="r", rank=wire.DAEMON_RANK, t=105.5, node=1,
                               messages=[*summed, wire.Scalars(
                                   run="r", rank=3, seq=6, t=105.2, values={"gn": 1.0},
                                   global_step=6)])
    points = fold(summary, 105.6)
    assert [(p.folder, p.step, p.wall) for p in points if isinstance(p, tbpoints.Scalars)
            and not p.folder.startswith("ranks/")] == [
        ("rank2", 6, 105.0), ("rank3", 6, 105.0), ("rank3", 6, 105.2)]
    # ... and the ranks' spread, at most once a second: ranks 0, 2 and 3 have step times.
    spread = {p.folder: dict(p.values) for p in points if isinstance(p, tbpoints.Scalars)
              and p.folder.startswith("ranks/")}
    assert spread == {"ranks/max": {"step/seconds": 0.5, "step/comm_share": 0.5},
                      "ranks/median": {"step/seconds": 0.5, "step/comm_share": 0.5},
                      "ranks/min": {"step/seconds": 0.5, "step/comm_share": 0.25}}
    assert translator.steps_written == 3


def test_the_live_writer_says_a_folder_it_cannot_make_once(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    tap = TensorBoardTap(tmp_path / "file" / "run-1")
    state = RunState(run="r")
    hello = wire.Event(run="r", rank=-1, seq=0, t=1.0, type="info", message="hi")
    state.apply(hello, 1.0)
    said = tap.take(hello, state, 1.0)
    assert said == (f"tensorboard: Not a directory on {tmp_path / 'file' / 'run-1'}: "
                    "TensorBoard records are dropped until it can be written again, tried "
                    "every 1 s (the run goes on)")
    assert tap.take(hello, state, 2.0) is None and tap.close() is None


def test_a_disk_that_fills_up_is_one_warning_and_a_retry_with_new_files(tmp_path: Path) -> None:
    """The rank's event file is /dev/full: the write buffered is refused at the flush.
    What was held is dropped and counted; RETRY_S later the tap writes again, to a
    file of its own (the torn one is never appended to), and says what it lost."""
    clock = [0.0]
    tap = TensorBoardTap(tmp_path / "run-1", clock=lambda: clock[0])
    assert tap.files is not None
    (tmp_path / "run-1" / "rank0").mkdir()
    (tmp_path / "run-1" / "rank0" / tap.files.name).symlink_to("/dev/full")
    state = RunState(run="r")
    said = []
    for seq in range(30):
        clock[0] = seq
        step = wire.Step(run="r", rank=0, seq=seq, t=float(seq), epoch=0, step=seq,
                         steps_per_epoch=99, global_step=seq + 1, steps=1, samples=1,
                         loss_sum=1.0, lr=0.1, step_s=0.1, data_s=0.0, forward_s=0.0,
                         backward_s=0.0, optimizer_s=0.0, comm_s=0.0, comm_bytes=0, comm_ops=0,
                         algbw_gbps=0.0, busbw_gbps=0.0, sync_wait_s=0.0)
        state.apply(step, float(seq))
        said.append(tap.take(step, state, float(seq)))
    warnings = [s for s in said if s is not None]
    root = tmp_path / "run-1"
    assert warnings == [f"tensorboard: No space left on device on {root}: TensorBoard "
                        "records are dropped until it can be written again, tried every 1 s "
                        "(the run goes on)",
                        f"tensorboard: writing to {root} again; dropped meanwhile: 6 records"]
    assert said.index(warnings[0]) == 5  # the first flush, FLUSH_S after the start
    assert said.index(warnings[1]) == 10  # reopened at 6, written at the next flush (5 + 5)
    assert tap.close() is None
    assert tap.dropped == 6  # the 6 steps held when the flush was refused
    files = sorted(p.name for p in (root / "rank0").iterdir())
    assert len(files) == 2 and files[1] == files[0] + ".1", files  # /dev/full, then its own
    # What the retry wrote reads back: global steps 7 to 30 (1 to 6 were dropped).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(root / "rank0"))
    acc.Reload()
    tag = acc.Tags()["scalars"][0]
    assert [e.step for e in acc.Scalars(tag)] == list(range(7, 31)), tag


def test_a_thousand_ranks_hold_no_file_open(tmp_path: Path) -> None:
    """Records wait in memory and each file is opened only to append them: a
    1,100-rank run's writer stays under a process's usual 1,024 open files."""
    def held() -> list[str]:  # this process's open files under the writer's folder
        paths = []
        for fd in Path("/proc/self/fd").iterdir():
            with contextlib.suppress(OSError):  # an fd another thread closed meanwhile
                paths.append(str(fd.readlink()))
        return [p for p in paths if p.startswith(str(tmp_path / "big"))]

    files = EventFiles(tmp_path / "big")
    for step in (1, 2):
        files.write([tbpoints.Scalars(f"rank{r}", step, 1.0, (("step/seconds", 0.1),))
                     for r in range(1100)])
        assert held() == []
        files.flush()
    files.close()
    assert held() == []
    assert len(list((tmp_path / "big").glob("rank*/events.out.tfevents.*"))) == 1100
    assert [p.step for p in read_back(tmp_path / "big" / "rank1099").Scalars("step/seconds")
            ] == [1, 2]


@pytest.mark.parametrize("command", [["start", "--foreground", "-n", "1"],
                                     ["watch", "--", "true"]], ids=["start", "watch"])
@pytest.mark.parametrize(("where", "said"), [
    ("file", "--tensorboard {file} is a file: give a folder (it is made if missing)"),
    ("file/tb", "--tensorboard {file}/tb: {file} is a file, not a folder; pick another path"),
], ids=["a-file", "under-a-file"])
def test_a_tensorboard_folder_that_cannot_be_written_is_refused_before_the_start(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str], where: str,
        said: str) -> None:
    """As --summary-json is: one line, exit 2, no run folder (before, the run
    started and only warned)."""
    (tmp_path / "file").write_text("not a folder\n")
    flag = ["--tensorboard", str(tmp_path / where), "--runs-dir", str(tmp_path / "runs")]
    at = command.index("--") if "--" in command else len(command)
    assert cli.main([*command[:at], *flag, *command[at:]]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"ddtrain: error: {said.format(file=tmp_path / 'file')}\n", err
    assert not (tmp_path / "runs").exists()


def test_a_tensorboard_folder_no_one_may_write_in_is_refused_before_the_start(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The folder_problem probe makes a folder there for real: the tests run as root,
    for whom a chmod 555 folder is writable, so the folder here is /proc's, where
    no one, root included, may make one."""
    probe = Path("/proc/ddtop-write-test")
    try:
        probe.mkdir()
    except OSError:
        pass
    else:  # pragma: no cover - not Linux's /proc
        probe.rmdir()
        pytest.skip("/proc takes new folders here: no folder that root cannot write")
    flag = ["--tensorboard", "/proc/ddtop-tb", "--runs-dir", str(tmp_path / "runs")]
    assert cli.main(["start", "--foreground", "-n", "1", *flag]) == 2
    out, err = capsys.readouterr()
    assert out == "" and re.fullmatch(r"ddtrain: error: --tensorboard /proc/ddtop-tb: /proc "
                                      r"cannot be written \([^)]+\); pick another path\n",
                                      err), err
    assert not (tmp_path / "runs").exists()


def test_ddtrain_watch_takes_the_flag_too() -> None:
    args = parse_command_line(cli.build_parser(), ["watch", "--tensorboard", "tb", "--", "true"],
                              {})
    assert watch_config(args).tensorboard == "tb"


@pytest.mark.processes
def test_a_live_run_writes_what_its_journal_exports(tmp_path: Path) -> None:
    run = ddtrain("start", "--foreground", "-n", "2", "--epochs", "1", "--run-id", "live",
                  "--tensorboard", "tb", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.leftovers == []
    assert "tensorboard" not in run.stderr
    live = tmp_path / "tb" / "live"
    assert_points_are_the_step_messages(tmp_path / "runs" / "live", live)
    # The export of its journal writes the same points and events.
    assert export.main(["live", "--runs-dir", str(tmp_path / "runs"), "--tensorboard",
                        str(tmp_path / "exported")]) == 0
    exported = tmp_path / "exported" / "live"
    for folder in ("rank0", "rank1", "run"):
        a, b = read_back(live / folder), read_back(exported / folder)
        assert a.Tags()["scalars"] == b.Tags()["scalars"]
        for tag in a.Tags()["scalars"]:
            assert a.Scalars(tag) == b.Scalars(tag), (folder, tag)
    assert events_text(live / "run") == events_text(exported / "run")
    assert events_text(live / "run")[-1].startswith("**status** · daemon: run succeeded")


@pytest.mark.processes
def test_a_live_run_that_cannot_write_its_files_succeeds_with_one_warning(
        tmp_path: Path) -> None:
    """The run's own folder under DIR is a file (DIR itself is fine, so the run
    starts): every retry is refused, and said once."""
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "nowrite").write_text("a file, not a folder\n")
    run = ddtrain("start", "--foreground", "-n", "2", "--epochs", "1", "--run-id", "nowrite",
                  "--synthetic-train-samples", "2048", "--tensorboard", "tb", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.leftovers == []
    line = ("tensorboard: File exists on tb/nowrite: TensorBoard records are dropped "
            "until it can be written again, tried every 1 s (the run goes on)")
    assert run.stderr.count(line) == 1, run.stderr
    warnings = [m for m in journal_messages(tmp_path / "runs" / "nowrite")
                if isinstance(m, wire.Event) and m.type == "warning"]
    assert [w.message for w in warnings] == [line]


def test_a_rank_that_steps_back_goes_on_in_a_life_of_its_own(tmp_path: Path) -> None:
    """TensorBoard's server drops a series' points past a step given again: points
    that step back (a restart from a checkpoint) go to `<folder>/restart<n>`, the tags
    that do not (the run's lines) stay; a resumed run's writer begins after the lives
    already written (core/tbwriter.first_life)."""
    from ddtop.core.tbwriter import first_life

    translator = tbpoints.Translator()
    s = tbpoints.Scalars
    tag = (("step/seconds", 0.1),)
    placed = [translator._placed(item) for item in (
        s("rank0", 10, 1.0, tag), s("rank0", 20, 2.0, tag),
        s("rank0", 15, 3.0, (("log/x", 1.0),)),  # another tag, lower: no step back for it
        s("rank0", 12, 4.0, tag),  # the restart: back to 12
        s("rank0", 14, 5.0, tag), s("rank1", 3, 6.0, tag),
        s("rank0", 1, 7.0, tag))]  # and a second one
    assert [(p.folder, p.step) for p in placed] == [
        ("rank0", 10), ("rank0", 20), ("rank0", 15), ("rank0/restart1", 12),
        ("rank0/restart1", 14), ("rank1", 3), ("rank0/restart2", 1)]
    assert first_life(tmp_path / "none") == 0
    (tmp_path / "r" / "rank0" / "restart1").mkdir(parents=True)
    assert first_life(tmp_path / "r") == 0  # folders, but nothing written in them
    (tmp_path / "r" / "rank0" / "events.out.tfevents.1.h.1").write_bytes(b"")
    assert first_life(tmp_path / "r") == 2
    resumed = tbpoints.Translator(first_life=2)
    assert resumed._placed(s("rank0", 40, 1.0, (("step/seconds", 0.1),))).folder == \
        "rank0/restart2"
    state = RunState(run="r")
    message = wire.Event(run="r", rank=0, seq=0, t=1.0, type="warning", message="a")
    state.apply(message, 1.0)
    assert resumed.items(message, state, 1.0) == []
    state.apply(msgspec.structs.replace(message, seq=1, message="b"), 1.1)
    assert resumed.items(message, state, 1.1) == []
    [text] = resumed.pending()  # both lines of the step, one text, in the resumed life
    assert (text.folder, text.text) == ("run/restart2", f"**warning** · rank 0: a"
                                        f"{tbpoints.LINE_BREAK}**warning** · rank 0: b")
    assert resumed.pending() == []  # nothing new since


def test_the_lines_of_a_step_that_stands_still_are_bounded() -> None:
    """A hang or a long set-up: lines keep coming at one step; its one text keeps the
    first MAX_STEP_LINES - 1 and counts the rest."""
    translator, state = tbpoints.Translator(), RunState(run="r")
    for seq in range(tbpoints.MAX_STEP_LINES + 50):
        message = wire.Event(run="r", rank=0, seq=seq, t=1.0 + seq, type="warning",
                             message=f"w{seq}")
        state.apply(message, 1.0 + seq)
        translator.items(message, state, 1.0 + seq)
    [text] = translator.pending()
    lines = text.text.split(tbpoints.LINE_BREAK)
    assert len(lines) == tbpoints.MAX_STEP_LINES
    assert lines[0].endswith(": w0") and lines[-1] == "... and 51 more lines at this step"
