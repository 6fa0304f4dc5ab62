"""examples/: two training scripts written the way people write them (the DDP
tutorial's Trainer with snapshots; a nanoGPT-style loop with gradient
accumulation, a learning-rate schedule and evaluation on rank 0 alone), each
with at most four lines marked `# ddtop`. Run for real, 2 gloo ranks: under
`ddtrain start --headless` (full telemetry), under plain torchrun with a
receiver, and under plain torchrun with no endpoint, where the script prints
exactly what its copy with the `# ddtop` lines stripped prints."""

from __future__ import annotations

import ast
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    DDTRAIN,
    TORCHRUN,
    Run,
    collecting,
    finish,
    start,
    torch_aborted_at_exit,
    torchrun,
    wait_until_gone,
)

from ddtop.core import journal, wire

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TUTORIAL = EXAMPLES / "ddp_tutorial.py"
GPT = EXAMPLES / "gpt_accum.py"
MARK = "# ddtop"
TIMEOUT_S = 60

# 512 samples over 2 ranks in batches of 32: 8 optimizer steps per epoch per rank.
TUTORIAL_ARGS = ["--epochs", "3", "--save-every", "2", "--dataset-size", "512",
                 "--batch-size", "32", "--snapshot-path", "snapshot.pt"]
TUTORIAL_STEPS = 3 * 8
# 4 micro-batches per optimizer step over 2 ranks: 2 per rank, one step counted.
# Rank 0 evaluates alone at iterations 0, 15 and 30 on 200 batches per split:
# a few hundred ms each here, while rank 1 waits in the next all-reduce.
GPT_ITERS = 30
GPT_ARGS = ["--max-iters", str(GPT_ITERS), "--grad-accum", "4", "--eval-interval", "15",
            "--eval-iters", "200", "--log-interval", "5"]
NOTICEABLE_S = 0.2


def strip_ddtop(source: str) -> str:
    """The script as it was before ddtop: every line marked `# ddtop` removed, and
    the body of a removed block header (`with ddtop.phase(...):`) dedented."""
    out: list[str] = []
    headers: list[tuple[int, int | None]] = []  # (header indent, body's extra indent)
    for line in source.splitlines(keepends=True):
        indent = len(line) - len(line.lstrip())
        if line.strip():
            while headers and indent <= headers[-1][0]:
                headers.pop()
            if headers and headers[-1][1] is None:
                headers[-1] = (headers[-1][0], indent - headers[-1][0])
        code = line.rstrip()
        if code.endswith(MARK):
            if code[: -len(MARK)].rstrip().endswith(":"):
                headers.append((indent, None))
            continue
        shift = sum(extra or 0 for _, extra in headers)
        out.append(line[shift:] if line.strip() else line)
    return "".join(out)


def names(source: str) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}


def jsonl(run: Run) -> list[dict[str, Any]]:
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def headless(script: Path, args: list[str], cwd: Path, run_id: str,
             *extra: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`ddtrain start --foreground --headless --format jsonl -n 2 SCRIPT -- ARGS`:
    (progress lines, the final summary)."""
    with headless_started(script, args, cwd, run_id, *extra) as started:
        return headless_end(started)


@contextlib.contextmanager
def headless_started(script: Path, args: list[str], cwd: Path, run_id: str, *extra: str
                     ) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """The same run, started (while the test does something else); `headless_end`
    waits for it. Killed, with all it started, if the test fails before."""
    proc, tag = start([DDTRAIN, "start", "--foreground", "--headless", "--format", "jsonl",
                       "-n", "2", "--run-id", run_id, *extra, str(script), "--", *args], cwd)
    try:
        yield proc, tag
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this test started
            proc.communicate()
        wait_until_gone(tag, 0)


def headless_end(started: tuple[subprocess.Popen[str], str]
                 ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A run `headless_started` started, ended: (progress lines, the final summary)."""
    run = finish(*started, TIMEOUT_S)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.leftovers == []
    lines = jsonl(run)
    summary = lines[-1]
    assert (summary["kind"], summary["status"], summary["exit_code"]) == (
        "summary", "succeeded", 0)
    return [line for line in lines if line["kind"] == "progress"], summary


def sent_steps(run_root: Path) -> list[wire.Step]:
    """Every Step message the ranks sent, from the run's telemetry journal."""
    return [m for r in journal.read(run_root / "telemetry.journal")
            if isinstance(m := wire.decode([r.frame]), wire.Step)]


def assert_every_rank_trained(summary: dict[str, Any], steps: int, run_root: Path,
                              loss: bool = True) -> None:
    ranks = summary["ranks"]
    assert [(r["rank"], r["state"], r["global_step"]) for r in ranks] == [
        (0, "finished", steps), (1, "finished", steps)]
    assert summary["global_step"] == steps
    assert all((r["loss"] is not None) == loss for r in ranks), ranks
    assert summary["hang"] is None and summary["stragglers"] == []
    assert summary["telemetry_loss"] == 0
    # DDP's all-reduce timed for every rank, in the summary (the last window) and
    # in every optimizer step over the run (a step's all-reduce goes out with it).
    assert all(r["comm_share"] and r["comm_share"] > 0 for r in ranks), ranks
    sent = sent_steps(run_root)
    for rank in (0, 1):
        mine = [s for s in sent if s.rank == rank]
        assert sum(s.steps for s in mine) == steps
        assert sum(s.comm_ops for s in mine) >= steps and sum(s.comm_s for s in mine) > 0


@pytest.mark.parametrize("script", [TUTORIAL, GPT], ids=lambda p: p.stem)
def test_each_example_has_at_most_four_ddtop_lines_and_none_unmarked(script: Path) -> None:
    source = script.read_text()
    marked = [line for line in source.splitlines() if line.rstrip().endswith(MARK)]
    assert 1 <= len(marked) <= 4, marked
    assert "ddtop" in names(source)
    assert "ddtop" not in names(strip_ddtop(source))  # every ddtop line is marked


@pytest.mark.processes
def test_ddp_tutorial_under_ddtrain_shows_steps_loss_progress_and_comm(tmp_path: Path) -> None:
    progress, summary = headless(TUTORIAL, TUTORIAL_ARGS, tmp_path, "tut", "--interval", "0.5")
    assert summary["program"] == "ddp_tutorial.py " + " ".join(TUTORIAL_ARGS)
    assert_every_rank_trained(summary, TUTORIAL_STEPS, tmp_path / "runs/tut")
    assert summary["total_steps"] == TUTORIAL_STEPS  # ddtop.init: progress and ETA
    # Its sampler set_epoch'd (and ddtop.init's epochs): epoch 3 of 3, 8 steps in it.
    assert [(r["epoch"], r["step"]) for r in summary["ranks"]] == [(3, 8), (3, 8)]
    assert all(line["hang"] is None for line in progress)
    assert (tmp_path / "snapshot.pt").is_file()  # rank 0 saved, as the tutorial does


@pytest.mark.processes
@pytest.mark.timing  # compute per step < 0.2 s: run alone (make test), not beside other tests
def test_gpt_accum_counts_optimizer_steps_and_shows_rank0_evaluation_as_such(
        tmp_path: Path) -> None:
    progress, summary = headless(GPT, GPT_ARGS, tmp_path, "gpt", "--interval", "0.2")
    # Micro-batches are not steps: one per optimizer step.
    assert_every_rank_trained(summary, GPT_ITERS, tmp_path / "runs/gpt")
    assert summary["total_steps"] == GPT_ITERS
    log = (tmp_path / "runs/gpt/logs/rank-0.log").read_text()
    assert "step 15: train loss" in log and "iter 25: loss" in log
    # The evaluation was noticeable: rank 1 waited for it in the all-reduce, and that
    # wait is communication time, not rank 1's compute ...
    steps = sent_steps(tmp_path / "runs/gpt")
    assert max(s.comm_s for s in steps if s.rank == 1) > NOTICEABLE_S, steps
    # ... and it is not rank 0's step time either: no step of either rank took as
    # long as the evaluation outside the all-reduce.
    for s in steps:
        assert s.steps == 0 or (s.step_s - s.comm_s) / s.steps < NOTICEABLE_S, s
    # So while it ran and after, no rank is stalled, no hang is named, and the ranks'
    # compute per step stays far apart from an evaluation's length: a straggler that
    # a progress line names is jitter of a few ms between ranks sharing 2 cores.
    assert progress
    for line in progress:
        assert line["hang"] is None, line
        assert {r["state"] for r in line["ranks"]} <= {"starting", "running", "finished"}, line
        assert line["skew_s"] < NOTICEABLE_S / 2, line


@pytest.mark.processes
def test_ddp_tutorial_under_plain_torchrun_sends_to_a_receiver(tmp_path: Path) -> None:
    for attempt in (1, 2):  # a second only after torch's abort at exit (see above)
        cwd = tmp_path / f"attempt-{attempt}"  # no snapshot to resume from
        cwd.mkdir()
        with collecting() as collector:
            run = torchrun("--standalone", "--nproc-per-node", "2", str(TUTORIAL),
                           *TUTORIAL_ARGS, cwd=cwd, env={"DDTOP_TELEMETRY": collector.endpoint},
                           timeout=TIMEOUT_S)
            if attempt == 1 and torch_aborted_at_exit(run, "the tutorial with ddtop"):
                continue
            assert run.returncode == 0, run.stderr[-3000:]
            assert run.leftovers == []
            deadline = time.monotonic() + 5
            while len(collector.of(wire.Bye)) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
        break
    assert collector.errors == 0
    for rank in (0, 1):
        hellos = collector.of(wire.Hello, rank)
        assert hellos and hellos[-1].program == "ddp_tutorial.py " + " ".join(TUTORIAL_ARGS)
        assert (hellos[-1].world_size, hellos[-1].total_steps) == (2, TUTORIAL_STEPS)
        sent = collector.of(wire.Step, rank)
        assert sum(s.steps for s in sent) == TUTORIAL_STEPS  # ddtop.step counts them here
        assert sum(s.samples for s in sent) == TUTORIAL_STEPS * 32
        assert all(s.loss_weight and s.loss_sum > 0 for s in sent), sent
        assert collector.of(wire.Bye, rank)[-1].exit_code == 0


@pytest.mark.processes
def test_ddp_tutorial_without_an_endpoint_prints_what_the_script_without_ddtop_prints(
        tmp_path: Path) -> None:
    stripped = tmp_path / "plain" / "ddp_tutorial.py"
    stripped.parent.mkdir()
    stripped.write_text(strip_ddtop(TUTORIAL.read_text()))
    (tmp_path / "with").mkdir()
    (tmp_path / "zero").mkdir()
    # One rank each, so that the output has one order; both at once, and with them
    # the stripped script under ddtrain (checked last; a folder of its own: no
    # snapshot to resume from).
    scripts = ((TUTORIAL, tmp_path / "with"), (stripped, tmp_path / "plain"))

    def one_rank(script: Path, cwd: Path) -> tuple[subprocess.Popen[str], str]:
        return start([TORCHRUN, "--standalone", "--nproc-per-node", "1", str(script),
                      *TUTORIAL_ARGS], cwd)

    with headless_started(stripped, TUTORIAL_ARGS, tmp_path / "zero", "zero") as zero:
        started = [one_rank(*s) for s in scripts]
        ended = [finish(proc, tag, TIMEOUT_S) for proc, tag in started]
        for k, (script, cwd) in enumerate(scripts):
            if torch_aborted_at_exit(ended[k], f"the tutorial {('with', 'without')[k]} ddtop"):
                (cwd / "snapshot.pt").unlink(missing_ok=True)
                ended[k] = finish(*one_rank(script, cwd), TIMEOUT_S)
        with_ddtop, without = ended
        for run in (with_ddtop, without):
            assert run.returncode == 0, run.stderr[-3000:]
            assert run.leftovers == []
        assert "Training snapshot saved at snapshot.pt" in without.stdout
        assert with_ddtop.stdout == without.stdout
        # Zero lines changed, 2 ranks under ddtrain: steps and comm timing for every
        # rank still (no loss: only the script knows which tensor it is).
        _, summary = headless_end(zero)
    assert_every_rank_trained(summary, TUTORIAL_STEPS, tmp_path / "zero/runs/zero", loss=False)
