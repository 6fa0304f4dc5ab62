"""Fault drills (`ddtrain start --inject SPEC`) and `--hang-timeout`, on real runs.

Each drill kind is acted out by a real 2-rank run and named by the daemon:
segfault and exit=CODE@epoch=E (dead ranks, by signal and exit code),
slow=FACTORx (named as the straggler, no other rank) with stall-data on the
other rank, desync (named as a desync, then failed by --hang-timeout with it as
the cause), skip (named by the ranks' counts of collectives, though gloo pairs
the rest silently), p2p-hang (rank 1 waits in recv for rank 0, which waits for
it in its next all-reduce), hang (the hung rank and the collective named; --hang-timeout fails
it, --max-restarts restarts it) and stop (silent, then failed by
--hang-timeout). In a user's own script, through the optimizer step hook: raise
(the script's line in the traceback), kill (named by its signal), stop (silent,
failed by --hang-timeout) and slow=2x (named as the straggler). kill and raise
of the built-in trainer are in test_failures_and_resume.py, test_daemon.py and
test_headless.py. A DDTOP_FAULT set by hand without --inject does nothing (it
is only --inject's transport), with the local and the torchrun launcher.

The runs start together (a module fixture), so that the hang runs' seconds
of waiting to be declared overlap the others; each test waits for its own run
(with a timeout) and checks that nothing it started is left.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import re
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import DDTRAIN, Run, finish, metric_records, start

from ddtop.core import inject, journal, wire
from ddtop.core.config import TrainConfig
from ddtop.core.contract import UsageError
from ddtop.training.drills import Drills

SCRIPTS = Path(__file__).parent / "scripts"
# 20 steps an epoch of 8 samples per rank: start-up dominates.
SHORT = ("-n", "2", "--synthetic-train-samples", "320", "--synthetic-val-samples", "32",
         "--batch-size", "16")
JSONL = ("--foreground", "--headless", "--format", "jsonl", "--interval", "0.2")
RUN_TIMEOUT_S = 100
ACCUM = (str(SCRIPTS / "ddp_accum.py"), "--")  # then the script's own arguments

RUNS: dict[str, tuple[str, ...]] = {
    # The hang runs first: they wait longest.
    # --hang-timeout 2 and 3: a rank descheduled for a few seconds on these shared
    # cores is not failed for it, and a stopped rank is silent (5 s without a
    # message) well before its hang fails the run (4.5 s + 3 s).
    "hang": (*JSONL, *SHORT, "--epochs", "1", "--inject", "1:hang@step=5",
             "--hang-timeout", "2", "--max-restarts", "1"),
    # (without the Flight Recorder: its evidence says so)
    "stop": (*JSONL, *SHORT, "--epochs", "1", "--inject", "1:stop@step=5",
             "--hang-timeout", "3", "--flight-recorder", "0"),
    # Rank 1 all-gathers after step 5 where rank 0 enters step 6's DDP all-reduce.
    "desync": (*JSONL, *SHORT, "--epochs", "1", "--inject", "1:desync@step=5",
               "--hang-timeout", "3"),
    # Rank 1 waits in a recv from rank 0 after step 5; rank 0 in step 6's all-reduce.
    "p2p-hang": (*JSONL, *SHORT, "--epochs", "1", "--inject", "1:p2p-hang@step=5",
                 "--hang-timeout", "3"),
    # Rank 1's step 6 goes without DDP's all-reduce: gloo pairs the rest one apart.
    "skip": (*JSONL, *SHORT, "--epochs", "1", "--inject", "1:skip@step=5",
             "--hang-timeout", "3"),
    # A user's script (ACCUM: no ddtop line in it), the drills acting from the
    # optimizer step hook: stop, kill, raise and slow.
    "script-stop": (*JSONL, "-n", "2", "--inject", "1:stop@step=3", "--hang-timeout", "3",
                    *ACCUM, "--steps", "20"),
    "segv": ("--foreground", *SHORT, "--epochs", "1", "--inject", "1:segfault@step=5"),
    "exit": ("--foreground", *SHORT, "--epochs", "2", "--sync-every", "10",
             "--inject", "1:exit=3@epoch=1"),
    "script": ("--foreground", "-n", "2", "--inject", "1:raise@step=3", *ACCUM, "--steps", "6"),
    "script-kill": ("--foreground", "-n", "2", "--inject", "1:kill@step=3",
                    *ACCUM, "--steps", "6"),
    # 500 steps of a few ms (one micro-batch each), rank 1 at twice its step time.
    "script-slow": (*JSONL, "-n", "2", "--inject", "1:slow=2x",
                    *ACCUM, "--steps", "500", "--accum", "1"),
    # Another process binds the port the daemon picked before rank 0 does.
    "take-port": ("--foreground", *SHORT, "--epochs", "1", "--inject", "0:take-port"),
    # ... and before a user's script's rank 0 hosts its rendezvous.
    "script-take-port": ("--foreground", "-n", "2", "--inject", "0:take-port",
                         *ACCUM, "--steps", "6"),
    # DDTOP_FAULT set by hand (ENV below) without --inject: no drill, with either launcher.
    "ignored": ("--foreground", "-n", "2", *ACCUM, "--steps", "6"),
    "ignored-torchrun": ("--foreground", "--launcher", "torchrun", *SHORT, "--epochs", "1"),
    # 200 steps of 32 samples; rank 1 at twice its step time from the start.
    "slow": (*JSONL, "-n", "2", "--epochs", "1", "--synthetic-train-samples", "6400",
             "--synthetic-val-samples", "64", "--batch-size", "32",
             "--inject", "1:slow=2x", "--inject", "0:stall-data=2s@step=60"),
}
# Environment variables a run's `ddtrain start` gets besides the test's own.
ENV: dict[str, dict[str, str]] = {
    "ignored": {"DDTOP_FAULT": "1:kill@step=3"},
    "ignored-torchrun": {"DDTOP_FAULT": "1:kill@step=3"},
}


class Started:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, tuple[subprocess.Popen[str], str]] = {}
        self.done: dict[str, Run] = {}

    def result(self, name: str) -> Run:
        if name not in self.done:
            proc, tag = self.procs[name]
            self.done[name] = finish(proc, tag, timeout=RUN_TIMEOUT_S)
        return self.done[name]

    def run_dir(self, name: str) -> Path:
        return self.root / name / "runs" / name


@pytest.fixture(scope="module")
def drills(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Started]:
    started = Started(tmp_path_factory.mktemp("drills"))
    try:
        for name, args in RUNS.items():
            cwd = started.root / name
            cwd.mkdir()
            started.procs[name] = start([DDTRAIN, "start", "--run-id", name, *args], cwd,
                                        ENV.get(name))
        yield started
    finally:
        for name in started.procs:  # every run waited for (and killed on a timeout)
            if name not in started.done:
                with contextlib.suppress(AssertionError):
                    started.result(name)


def jsonl(run: Run) -> list[dict[str, Any]]:
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def record(root: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((root / "run.json").read_text())
    return data


# -- the grammar ------------------------------------------------------------------------------
def test_the_grammar_round_trips() -> None:
    specs = ["1:kill@step=50", "2:hang@step=80", "3:stop@step=30", "0:raise@step=10",
             "1:exit=3@epoch=1", "2:segfault@step=20", "1:slow=1.5x", "0:stall-data=2s@step=30",
             "1:slow=2x@step=10", "0:slow=1.0000001x",  # every digit a value needs
             "1:desync@step=5", "1:skip@epoch=1", "0:p2p-hang@step=2", "1:oom@step=3"]
    drills = inject.parse_all(specs)
    assert [d.spec() for d in drills] == specs
    assert inject.parse_environ(inject.encode(drills)) == drills
    assert inject.parse("1:slow=3").value == 3.0
    assert inject.parse("0:stall-data=0.5@step=2").value == 0.5
    assert drills[4].first_step(20) == 20 and drills[4].first_step(0) is None  # epoch 1 ends
    assert drills[6].first_step(0) == 1 and drills[6].repeats  # slow: from the first step


@pytest.mark.parametrize(("spec", "fragment"), [
    ("1:kil@step=5", "unknown action 'kil': use kill, stop, hang"),
    ("1:kill", "say when: add @step=N"),
    ("1:desync", "say when: add @step=N"),
    ("1:desync=2@step=3", "desync takes no value"),
    ("1:oom", "say when: add @step=N"),
    ("5:kill@step=3", "there is no rank 5: --world-size 2 has ranks 0-1"),
    ("1:slow=0.5x", "the factor must be a number above 1"),
    ("1:slow=infx", "the factor must be a number above 1"),
    ("1:raise=3@step=2", "raise takes no value"),
    ("1:exit@step=2", "exit needs a value, e.g. exit=3"),
    ("1:exit=256@step=2", "from 0 to 255"),
    ("1:kill@step=0", "@step=N or @epoch=E"),
    ("1:kill@steps=4", "@step=N or @epoch=E"),
    ("0:stall-data=nans@step=3", "give seconds above 0"),
    ("1:20:SIGKILL", "write it as RANK:ACTION@step=N, e.g. 1:kill@step=20"),
    ("one:kill@step=1", "the rank 'one' must be a whole number"),
    ("", "write it as RANK:ACTION[@step=N|@epoch=E]"),
    ("1:take-port", "take-port acts on rank 0 at the start: write it as 0:take-port"),
    ("0:take-port@step=3", "take-port acts on rank 0 at the start: write it as 0:take-port"),
])
def test_a_bad_spec_names_the_problem_and_the_fix(spec: str, fragment: str) -> None:
    with pytest.raises(UsageError) as bad:
        inject.check_ranks(inject.parse_all(["0:kill@step=9", spec]), 2)
    assert str(bad.value).startswith(f"--inject {spec!r}: ") and fragment in str(bad.value)


@pytest.mark.parametrize(("strategy", "fragment"), [
    (None, "in a user's script ddtrain cannot reach its model"),
    ("allreduce", "--strategy allreduce has none: use --strategy ddp (the default)"),
])
def test_skip_drills_ddp_alone(strategy: str | None, fragment: str) -> None:
    drills = inject.parse_all(["0:desync@step=2", "1:skip@step=3"])
    inject.check_ddp(drills, "ddp")  # the built-in trainer's DDP model: fine
    inject.check_ddp(drills[:1], strategy)  # desync: any run
    with pytest.raises(UsageError) as bad:
        inject.check_ddp(drills, strategy)
    assert str(bad.value).startswith("--inject '1:skip@step=3': skip drills the built-in "
                                     "trainer's DDP gradient all-reduce; ")
    assert fragment in str(bad.value)


@pytest.mark.parametrize(("args", "env", "fragment"), [
    (("--inject", "0:kill@step=9", "--inject", "1:kil@step=5"), {},
     "ddtrain: error: --inject '1:kil@step=5': unknown action 'kil'"),
    (("--inject", "2:hang@step=3"), {},
     "ddtrain: error: --inject '2:hang@step=3': there is no rank 2: --world-size 2 has"),
    (("--inject", "1:kill@step=3", "--inject", "0:bad"), {"DDTOP_FAULT": "1:kill@step=3"},
     "ddtrain: error: --inject '0:bad': unknown action"),
    (("--hang-timeout", "nan"), {}, "ddtrain: error: --hang-timeout must be a positive, finite"),
    ((), {"TORCH_FR_BUFFER_SIZE": "lots"}, "ddtrain: error: TORCH_FR_BUFFER_SIZE='lots' in the "
     "environment is not 0 to 1,000,000 entries: unset it, or give --flight-recorder N"),
    (("--flight-recorder", "-1"), {}, "ddtrain: error: --flight-recorder must be at least 0"),
    (("--epochs", "2", "--inject", "1:exit=3@epoch=3"), {},
     "ddtrain: error: --inject '1:exit=3@epoch=3': the run trains --epochs 2, so epoch 3 "
     "never ends"),
    (("--launcher", "torchrun", "--inject", "0:take-port",
      str(Path(__file__).parent / "scripts" / "plain_ddp.py")), {},
     "ddtrain: error: --inject 0:take-port drills the rendezvous port the daemon picks; "
     "under --launcher torchrun, torchrun picks it"),
    (("--inject", "1:skip@step=3", str(Path(__file__).parent / "scripts" / "plain_ddp.py")),
     {}, "ddtrain: error: --inject '1:skip@step=3': skip drills the built-in trainer's DDP "
         "gradient all-reduce; in a user's script"),
])
@pytest.mark.processes
def test_bad_drills_are_one_line_and_exit_2(tmp_path: Path, args: tuple[str, ...],
                                           env: dict[str, str], fragment: str) -> None:
    proc, tag = start([DDTRAIN, "start", "-n", "2", *args], tmp_path, env)
    run = finish(proc, tag, timeout=30)
    assert run.returncode == 2, run.stdout + run.stderr
    (line,) = run.stderr.splitlines()
    assert line.startswith(fragment), line
    assert run.leftovers == [] and not any((tmp_path / "runs").glob("*"))  # nothing started


@pytest.mark.parametrize("seconds", [0.0, -5.0, math.inf, math.nan])
def test_hang_timeout_is_positive_and_finite(seconds: float) -> None:
    with pytest.raises(UsageError, match="--hang-timeout must be a positive, finite number"):
        TrainConfig(hang_timeout=seconds).validate()
    assert TrainConfig(hang_timeout=0.5).validate().hang_timeout == 0.5


def test_the_old_form_is_refused_with_the_new_one() -> None:
    with pytest.raises(UsageError, match=r"DDTOP_FAULT '1:3:sleep4'.*1:stall-data=4s@step=3"):
        inject.parse_environ("1:3:sleep4")  # as a rank would read it


def test_slow_takes_its_factor_of_the_step_time() -> None:
    """Steps 1-10 as they are, 11-20 slowed 3x: the slowed steps take about three
    times the unslowed ones, measured in the same loop (so that sleeps overshooting
    on busy cores move both alike)."""
    slow = Drills([inject.parse("0:slow=3x@step=11")])
    marks = [time.monotonic()]
    for step in range(1, 21):
        time.sleep(0.02)  # the step's own work
        slow.after_step(step, 0)
        marks.append(time.monotonic())
    took = [b - a for a, b in itertools.pairwise(marks)]  # took[k]: step k + 1
    plain, slowed = statistics.median(took[1:10]), statistics.median(took[11:20])  # 2-10, 12-20
    assert 2.0 < slowed / plain < 4.5, (plain, slowed)


@pytest.mark.parametrize("name", ["ignored", "ignored-torchrun"])
@pytest.mark.processes
def test_a_fault_set_by_hand_without_inject_does_nothing(drills: Started, name: str) -> None:
    """DDTOP_FAULT is --inject's transport only: one in the environment of
    `ddtrain start` reaches neither the daemon nor a rank (local forkserver, and
    torchrun's workers), and is said to be ignored."""
    run = drills.result(name)
    assert run.returncode == 0, run.stderr[-2000:]
    assert ("ddtrain: note: DDTOP_FAULT in the environment is ignored: drills are given "
            "with --inject SPEC") in run.stderr, run.stderr
    assert "fault drills armed" not in run.stderr
    logs = (drills.run_dir(name) / "logs").glob("*.log")  # the ranks', torchrun's
    for text in (run.stdout, run.stderr, *(log.read_text() for log in logs)):
        assert "ddtop drill" not in text and "injected failure" not in text
    assert record(drills.run_dir(name))["status"] == "succeeded"
    assert run.leftovers == []


# -- dead ranks ----------------------------------------------------------------------------------
@pytest.mark.processes
def test_a_port_the_daemon_picked_and_another_took_is_picked_again(drills: Started) -> None:
    """Before, rank 0 failed with "pick another --master-port, or leave it out",
    though the user had left it out. Now the daemon picks another port and starts
    the ranks again (not a restart), and the run succeeds."""
    run, _ = picked_again(drills, "take-port")
    assert run.stderr.count("fault drills armed") == 1


def picked_again(drills: Started, name: str) -> tuple[Run, dict[str, Any]]:
    """The drill's run: rank 0 found the port taken, the daemon picked another and
    started the ranks again (not a restart), and the run succeeded; its run.json."""
    run = drills.result(name)
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"ddtrain: port (\d+) \(MASTER_PORT\), which the daemon picked, was "
                     r"bound by another process before rank 0 could bind it: starting the "
                     r"ranks again on port (\d+) \(not a restart; 1 of at most 3\)",
                     run.stderr), run.stderr
    assert "--master-port" not in run.stdout + run.stderr
    got = record(drills.run_dir(name))
    assert (got["status"], got["restarts"], got["failure"]) == ("succeeded", 0, None)
    assert run.leftovers == []
    return run, got


@pytest.mark.processes
def test_a_port_the_daemon_picked_for_a_script_and_another_took_is_picked_again(
        drills: Started) -> None:
    """The same for a user's script: its rank 0 finds the port taken as it hosts the
    rendezvous (inside the script's own init_process_group); the daemon picks
    another and starts the ranks again, and the script trains to the end."""
    _, got = picked_again(drills, "script-take-port")
    assert [(r["rank"], r["global_step"]) for r in got["ranks"]] == [(0, 6), (1, 6)]


@pytest.mark.processes
def test_segfault_is_named_by_its_signal(drills: Started) -> None:
    run = drills.result("segv")
    assert run.returncode == 1, run.stderr[-2000:]
    assert "fault drills armed: 1:segfault@step=5" in run.stderr
    assert "rank 1 (pid" in run.stderr and "was killed by SIGSEGV" in run.stderr
    failure = record(drills.run_dir("segv"))["failure"]
    assert (failure["rank"], failure["signal"]) == (1, "SIGSEGV")
    assert run.leftovers == []


@pytest.mark.processes
def test_exit_at_an_epoch_end_is_named_by_its_code(drills: Started) -> None:
    run = drills.result("exit")
    assert run.returncode == 1, run.stderr[-2000:]
    assert "rank 1 (pid" in run.stderr and "exited with code 3" in run.stderr
    status = record(drills.run_dir("exit"))
    assert (status["failure"]["rank"], status["failure"]["exit_code"]) == (1, 3)
    # After the last step of epoch 1 (its metric sync at step 20 done), before the
    # epoch's end was agreed.
    assert [r["global_step"] for r in metric_records(drills.run_dir("exit"), "sync")] == [10, 20]
    assert metric_records(drills.run_dir("exit"), "epoch") == []
    assert run.leftovers == []


@pytest.mark.processes
def test_raise_in_a_users_script_goes_through_its_optimizer_step(drills: Started) -> None:
    run = drills.result("script")
    assert run.returncode == 1, run.stderr[-2000:]
    assert ("RuntimeError: injected failure at step 3 (--inject 1:raise@step=3)"
            in run.stderr), run.stderr
    report = json.loads((drills.run_dir("script") / "logs" / "rank-1.error.json").read_text())
    assert "ddp_accum.py" in report["traceback"]  # from the script's own optimizer step
    assert record(drills.run_dir("script"))["failure"]["rank"] == 1
    assert run.leftovers == []


@pytest.mark.processes
def test_kill_in_a_users_script_is_named_by_its_signal(drills: Started) -> None:
    run = drills.result("script-kill")
    assert run.returncode == 1, run.stderr[-2000:]
    assert "fault drills armed: 1:kill@step=3" in run.stderr
    assert "rank 1 (pid" in run.stderr and "was killed by SIGKILL" in run.stderr, run.stderr
    failure = record(drills.run_dir("script-kill"))["failure"]
    assert (failure["rank"], failure["signal"]) == (1, "SIGKILL")
    log = (drills.run_dir("script-kill") / "logs" / "rank-1.log").read_text()
    assert "ddtop drill 1:kill@step=3: acting after step 3" in log  # from the step hook
    assert run.leftovers == []


@pytest.mark.processes
def test_a_stopped_rank_in_a_users_script_is_silent_and_fails_the_run(drills: Started) -> None:
    run = drills.result("script-stop")
    assert run.returncode == 1, run.stderr[-3000:]
    summary = jsonl(run)[-1]
    assert summary["kind"] == "summary" and summary["status"] == "failed"
    failure = summary["failure"]
    assert failure["rank"] == 1, failure
    assert failure["message"].startswith("hung for 3 s (--hang-timeout 3): rank 0 wait in "
                                         "allreduce #"), failure
    assert "rank 1 is silent, last in " in failure["message"]
    assert "failed: rank 1 (pid" in run.stderr and "hung for 3 s" in run.stderr
    assert run.leftovers == []


# -- slow and stalled ranks ---------------------------------------------------------------------
@pytest.mark.processes
def test_a_slow_rank_is_named_and_a_data_stall_is_data_time(drills: Started) -> None:
    run = drills.result("slow")
    assert run.returncode == 0, run.stderr[-2000:]
    progress = [line for line in jsonl(run) if line["kind"] == "progress"]
    named = [line["stragglers"] for line in progress if line["stragglers"]]
    assert named and all(slow == [1] for slow in named), [p["stragglers"] for p in progress]
    # Its cause (core/causes.py): its own work (the drill sleeps in forward), never its
    # input or memory; on these shared cores, with the module's other runs, its wait for
    # a CPU after each sleep may explain more of it (host).
    said = Counter(line["straggler_causes"].get("1", {}).get("cause") for line in progress
                   if line["stragglers"])
    assert said and not {"input", "memory"} & set(said), said
    # Rank 0's data loading after step 60 took 2 s more: its data time, not a hang.
    state_steps = [wire.decode([r.frame]) for r in
                   journal.read(drills.run_dir("slow") / "telemetry.journal")]
    stalled = [m for m in state_steps if isinstance(m, wire.Step) and m.rank == 0
               and m.data_s >= 2.0]
    assert len(stalled) == 1 and stalled[0].global_step > 60, stalled
    assert all(line["hang"] is None for line in progress)
    assert run.leftovers == []


@pytest.mark.processes
def test_a_slow_rank_in_a_users_script_is_named(drills: Started) -> None:
    run = drills.result("script-slow")
    assert run.returncode == 0, run.stderr[-2000:]
    progress = [line for line in jsonl(run) if line["kind"] == "progress"]
    named = [line for line in progress if line["stragglers"]]
    # Named while it ran, and no other rank ever.
    assert named and all(line["stragglers"] == [1] for line in named), [
        (p["global_step"], p["stragglers"]) for p in progress]
    # The others wait for it: by how much, as of its newest window, which while
    # it stays named (hysteresis: un-named only after 4 windows not over) may be
    # one where it was not over, on cores shared with the other drills' runs.
    skews = [line["skew_s"] for line in named]
    assert statistics.median(skews) > 0, skews
    log = (drills.run_dir("script-slow") / "logs" / "rank-1.log").read_text()
    assert "ddtop drill 1:slow=2x: acting after step 1" in log
    assert run.leftovers == []


# -- hangs ----------------------------------------------------------------------------------------
@pytest.mark.processes
def test_a_hang_is_named_then_failed_by_hang_timeout_and_restarted(drills: Started) -> None:
    run = drills.result("hang")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = jsonl(run)
    hangs = [line["hang"] for line in lines if line["kind"] == "progress" and line["hang"]]
    # Rank 0 waits inside the all-reduce of step 6; rank 1 never reached it.
    assert hangs and "rank 0 wait in allreduce #" in hangs[0], hangs
    # (between steps, outside its data loader: not "in data")
    assert "rank 1 is in Python between steps 5 and 6, outside any collective and its data loader" \
        in hangs[0], hangs
    assert "rank 1 hung for 2 s (--hang-timeout 2): rank 0 wait in allreduce" in run.stderr
    assert "restart 1/1: rank 1 hung for 2 s (--hang-timeout 2) and was stopped" in run.stderr
    status = record(drills.run_dir("hang"))
    assert (status["status"], status["restarts"]) == ("succeeded", 1)
    (entry,) = status["timeline"]
    assert entry["rank"] == 1 and "hung" in entry["reason"]
    # Its stacks were taken before it was stopped: where it hung.
    stacks = (drills.run_dir("hang") / "logs" / "rank-1.stacks").read_text()
    assert "drills.py" in stacks and "trainer.py" in stacks
    assert run.leftovers == []


@pytest.mark.processes
def test_a_stopped_rank_is_silent_and_hang_timeout_fails_the_run(drills: Started) -> None:
    run = drills.result("stop")
    assert run.returncode == 1, run.stderr[-3000:]
    summary = jsonl(run)[-1]
    assert summary["kind"] == "summary" and summary["status"] == "failed"
    failure = summary["failure"]
    assert failure["rank"] == 1, failure
    assert failure["message"].startswith("hung for 3 s (--hang-timeout 3): rank 0 wait in "
                                         "allreduce #"), failure
    assert "rank 1 is silent, last in " in failure["message"]
    assert "failed: rank 1 (pid" in run.stderr and "hung for 3 s" in run.stderr
    # Continued once its SIGTERM was pending, the frozen rank died of it at once.
    assert summary["failure"]["signal"] == "SIGTERM"
    # --flight-recorder 0: no rank dumped one, and the evidence says so.
    (bundle,) = (drills.run_dir("stop") / "evidence").iterdir()
    index = json.loads((bundle / "index.json").read_text())
    assert index["flight_recorder"] == "" and not any(".fr.json" in f for f in index["files"])
    assert [m for m in index["missing"] if "Flight Recorder" in m] == [
        f"rank {k}: no Flight Recorder dump (off, or its sender thread could not run)"
        for k in (0, 1)], index["missing"]
    assert run.leftovers == []


@pytest.mark.processes
def test_a_desync_drill_is_named_as_a_desync_and_fails_the_run_as_one(drills: Started) -> None:
    run = drills.result("desync")
    assert run.returncode == 1, run.stderr[-3000:]
    # Rank 1's all_gather after step 5 is the world group's #6 (DDP's all-reduce of
    # steps 1-5 before it), where rank 0 enters step 6's DDP all-reduce; the metrics'
    # and checkpoints' all_gather_object of the built-in trainer are signed too.
    words = re.compile(r"desync in group world #6: rank 1 entered all_gather \(float32 x 1 "
                       r"per rank\) while rank 0 entered DDP's gradient all-reduce "
                       r"\(float32 x [\d,]+\)")
    hangs = [line["hang"] for line in jsonl(run) if line["kind"] == "progress" and line["hang"]]
    assert hangs and all(words.fullmatch(h) for h in hangs), hangs
    summary = jsonl(run)[-1]
    assert summary["kind"] == "summary" and summary["status"] == "failed"
    assert summary["failure"]["rank"] == 1, summary["failure"]
    assert summary["failure"]["message"].startswith(
        "entered another collective than its group's (--hang-timeout 3): desync in group "
        "world #6: "), summary["failure"]
    assert "ddtop drill 1:desync@step=5: acting after step 5" in \
        (drills.run_dir("desync") / "logs" / "rank-1.log").read_text()
    # The evidence holds each rank's Flight Recorder (on by default), and its verdict:
    # torch's own record of the two sides, each in the collective it entered.
    bundles = sorted((drills.run_dir("desync") / "evidence").iterdir())
    assert len(bundles) == 2, bundles  # the desync told, then failed by --hang-timeout
    for bundle in bundles:
        index = json.loads((bundle / "index.json").read_text())
        assert {"rank-0.fr.json", "rank-1.fr.json"} <= set(index["files"]), index
        assert re.fullmatch(r"Flight Recorder: group world: rank 0's last is all_reduce #(\d+) "
                            r"\(float32 x [\d,]+, not completed\); rank 1's is all_gather "
                            r"#\1 \(float32 x 1, not completed\)",
                            index["flight_recorder"]), index["flight_recorder"]
        assert not any("Flight Recorder" in m for m in index["missing"]), index["missing"]
    assert f"ddtrain: {index['flight_recorder']}\n" in run.stderr
    assert run.leftovers == []


@pytest.mark.processes
def test_a_skip_drill_is_named_by_the_ranks_counts_of_collectives(drills: Started) -> None:
    run = drills.result("skip")
    assert run.returncode == 1, run.stderr[-3000:]
    # Rank 1 skipped step 6's all-reduce; gloo paired its step 7's with rank 0's step
    # 6's, and so on, silently: by step 8 (counts are taken every 4 steps) it had
    # entered one collective fewer of the world group (DDP's all-reduce of each step).
    words = ("desync in group world by step 8: rank 1 had entered 7 collectives of the "
             "group where rank 0 had entered 8 (1 fewer)")
    hangs = [line["hang"] for line in jsonl(run) if line["kind"] == "progress" and line["hang"]]
    assert hangs and all(h == words for h in hangs), hangs
    assert f"ddtrain: {words}\n" in run.stderr
    summary = jsonl(run)[-1]
    assert summary["kind"] == "summary" and summary["status"] == "failed"
    assert summary["failure"]["rank"] == 1, summary["failure"]
    assert summary["failure"]["message"] == (
        f"entered another number of its group's collectives (--hang-timeout 3): {words}")
    assert run.leftovers == []


@pytest.mark.processes
def test_a_p2p_hang_drill_waits_in_recv_for_its_peer_and_is_blamed(drills: Started) -> None:
    run = drills.result("p2p-hang")
    assert run.returncode == 1, run.stderr[-3000:]
    hangs = [line["hang"] for line in jsonl(run) if line["kind"] == "progress" and line["hang"]]
    # Rank 0 waits in step 6's DDP all-reduce for rank 1, which waits in its recv from
    # rank 0 (the drill's, signed as the trainer's: not the world's collective).
    assert hangs and re.fullmatch(r"rank 0 wait in allreduce #\d+; rank 1 wait in recv #\d+ "
                                  r"from rank 0", hangs[-1]), hangs
    summary = jsonl(run)[-1]
    assert summary["kind"] == "summary" and summary["status"] == "failed"
    assert summary["failure"]["rank"] == 1, summary["failure"]
    assert summary["failure"]["message"].startswith("hung for 3 s (--hang-timeout 3): "), summary
    assert run.leftovers == []


def test_the_take_port_drill_finds_its_port_already_taken_and_leaves_it_so(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Another process took the port the daemon picked before the drill could (a busy
    machine; seen in CI): the drill's end, without the drill. It says so and holds
    nothing; rank 0's own bind then fails as the drill would have made it fail."""
    import socket

    from ddtop.core.contract import ATTEMPT_ENV, FAULT_ENV
    from ddtop.training import rendezvous

    other = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        port = other.getsockname()[1]
        monkeypatch.setattr(rendezvous, "_drilled", False)
        for name, value in ((FAULT_ENV, inject.encode([inject.parse("0:take-port")])),
                            (ATTEMPT_ENV, "0"), ("MASTER_ADDR", "127.0.0.1"),
                            ("MASTER_PORT", str(port))):
            monkeypatch.setenv(name, value)
        assert rendezvous.port_drill(0) is None
        assert f"port {port} was already taken by another process" in capsys.readouterr().err
        assert rendezvous.port_drill(0) is None  # once a process
    finally:
        other.close()
