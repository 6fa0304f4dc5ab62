"""`ddtrain watch`: ranks that any launcher starts, watched with no line changed.

Real processes throughout: ddtrain watch runs torchrun (or a plain command), the
ranks are an unchanged gloo DDP script (tests/scripts/plain_ddp.py) made ranks
by the package's start-up hook; a watch without a command is fed by a torchrun
started separately with the variables it printed.

The runs that tests only look at once they end (a clean run, a killed rank, a
rank that raises, a Lightning script spawning its rank 1) start together (a
module fixture); each test waits for its own and checks that nothing it
started is left."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddtop.core import blame, journal, wire
from ddtop.daemon import cli
from tests.helpers import DDTRAIN, TORCHRUN, Run, ddtrain, finish, start, tagged_env

SCRIPT = Path(__file__).parent / "scripts" / "plain_ddp.py"
LIGHTNING = Path(__file__).parent / "scripts" / "fw_lightning.py"  # spawns its rank 1
ELASTIC = Path(__file__).parent / "scripts" / "elastic_ddp.py"  # for torchrun's restarts
SBATCH = Path(__file__).parent.parent / "examples" / "slurm" / "watch-srun.sbatch"
TWO_RANKS = [TORCHRUN, "--standalone", "--nproc-per-node", "2"]


# The runs the module fixture starts together: their `ddtrain watch` arguments,
# environment and timeout.
WATCHED: dict[str, tuple[list[str], dict[str, str], float]] = {
    # 3 epochs of 4 steps, each begun with its DistributedSampler's set_epoch
    "ok": ([*TWO_RANKS, str(SCRIPT)], {"STEPS": "12", "EPOCHS": "3"}, 120),
    "crash": ([*TWO_RANKS, str(SCRIPT)],
              {"STEPS": "400", "SLEEP": "0.02", "DIE_RANK": "1", "DIE_STEP": "5"}, 120),
    "raise": ([*TWO_RANKS, str(SCRIPT)],
              {"STEPS": "400", "SLEEP": "0.02", "RAISE_RANK": "1", "RAISE_STEP": "4"}, 120),
    "pl": ([sys.executable, str(LIGHTNING)], {"STEPS": "5"}, 150),
    # torchrun fails by itself, before any rank: a flag it does not know
    "launcher": ([TORCHRUN, "--nproc-per-node", "2", "--no-such-flag", str(SCRIPT)], {}, 60),
    # Open MPI's mpirun, each process a rank by OMPI_COMM_WORLD_RANK; rank 1 killed
    "mpi": (["mpirun", "-np", "2", "--oversubscribe", "bash", "-c",
             'RANK=$OMPI_COMM_WORLD_RANK LOCAL_RANK=$OMPI_COMM_WORLD_LOCAL_RANK '
             'WORLD_SIZE=$OMPI_COMM_WORLD_SIZE exec "$0" "$@"', sys.executable, str(SCRIPT)],
            {"STEPS": "400", "SLEEP": "0.02", "DIE_RANK": "1", "DIE_STEP": "5",
             "MASTER_ADDR": "127.0.0.1", "OMPI_ALLOW_RUN_AS_ROOT": "1",
             "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}, 120),
    # torchrun restarts both ranks once after rank 1's SIGKILL at step 3; they finish
    "restart": ([*TWO_RANKS, "--max-restarts", "1", str(ELASTIC)],
                {"STEPS": "12", "SLEEP": "0.02", "DIE_RANK": "1", "DIE_STEP": "3"}, 150),
}


class Watches:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, tuple[subprocess.Popen[str], str]] = {}
        self.done: dict[str, Run] = {}

    def result(self, name: str) -> Run:
        if name not in self.done:
            proc, tag = self.procs[name]
            self.done[name] = finish(proc, tag, timeout=WATCHED[name][2])
        return self.done[name]


@pytest.fixture(scope="module")
def watches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Watches]:
    started = Watches(tmp_path_factory.mktemp("watches"))
    try:
        for name, (command, env, _) in WATCHED.items():
            if name == "pl" and importlib.util.find_spec("lightning") is None:
                continue  # its test skips, saying so
            if name == "mpi":
                if shutil.which("mpirun") is None:
                    continue  # its test skips, saying so
                env = {**env, "MASTER_PORT": str(free_port())}
            cwd = started.root / name
            cwd.mkdir()
            started.procs[name] = start([DDTRAIN, "watch", "--run-id", name, "--", *command],
                                        cwd, env)
        yield started
    finally:
        for name in started.procs:  # every run waited for (and killed on a timeout)
            if name not in started.done:
                with contextlib.suppress(AssertionError):
                    started.result(name)


def status(cwd: Path, run: str) -> dict:  # type: ignore[type-arg]
    done = subprocess.run([DDTRAIN, "status", run, "--json"], cwd=cwd, capture_output=True,
                          text=True, timeout=30, env=tagged_env("status"))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


# -- bad input: one line, exit 2, nothing started ----------------------------------------
@pytest.mark.parametrize(("argv", "said"), [
    (["watch", "torchrun", "train.py"], "put the command after --: ddtrain watch -- torchrun"),
    (["watch", "--", "no-such-launcher-here"], "cannot run 'no-such-launcher-here': not found"),
    (["watch", "--", "./missing.sh"], "cannot run './missing.sh': no such file"),
    (["watch", "--idle", "5", "--", "true"], "--idle is for a watch without a command"),
    (["watch", "--idle", "-1"], "--idle must be a number of seconds >= 0"),
    (["watch", "--allow-no-ranks"], "--allow-no-ranks is for a watch with a command"),
    (["watch", "--run-id", "a/b", "--", "true"], "--run-id 'a/b' may hold only"),
])
def test_bad_watch_lines_are_one_line_and_exit_2(argv: list[str], said: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err, err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_watch_help_leads_with_the_command() -> None:
    text = cli.build_parser()._subparsers._group_actions[0].choices["watch"].format_help()  # type: ignore[union-attr]
    assert "ddtrain watch [options] -- COMMAND" in text
    for flag in ("--run-id", "--runs-dir", "--bind", "--idle", "--headless"):
        assert flag in text


# -- the command's exit code, and who is blamed --------------------------------------------
@pytest.mark.processes
@pytest.mark.timeout(60)
def test_the_command_exit_code_is_returned_and_the_command_named(tmp_path: Path) -> None:
    run = ddtrain("watch", "--run-id", "code3", "--", sys.executable, "-c",
                  "import sys; print('hello from the command'); sys.exit(3)", cwd=tmp_path)
    assert run.returncode == 3, run.stderr
    assert "hello from the command" in run.stdout  # its output, echoed
    # Named with its exit code and its last words (a launcher failing by itself says why).
    assert re.search(r"run code3 failed: the command \(pid \d+\) exited with code 3, saying: "
                     r"hello from the command\n", run.stderr), run.stderr
    assert "hello from the command" in (tmp_path / "runs/code3/logs/command.log").read_text()
    assert status(tmp_path, "code3")["status"] == "failed"
    assert not run.leftovers


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_a_watch_that_saw_no_rank_fails_unless_allowed(tmp_path: Path) -> None:
    """A command that ran one plain process (accelerate without its multi-process
    flags) exits 0 with nothing watched: a failure naming the command, not a
    success a CI gate would pass; --allow-no-ranks keeps it a success, said."""
    plain = [sys.executable, "-c", "print('one plain process')"]
    run = ddtrain("watch", "--run-id", "none", "--", *plain, cwd=tmp_path)
    assert run.returncode == 1, run.stderr
    assert re.search(r"run none failed: the command \(pid \d+\) ended \(exit 0\) with no rank "
                     r"seen: none of its processes initialised a torch.distributed process "
                     r"group .*; --allow-no-ranks accepts that\n  log: .*command.log; each "
                     r"launcher's spelling that starts ranks: docs/own-scripts.md#every-launcher\n",
                     run.stderr), run.stderr
    got = status(tmp_path, "none")
    assert got["status"] == "failed" and got["exit_code"] == 1
    assert got["failure"]["rank"] == -2 and "no rank seen" in got["failure"]["reason"]
    allowed = ddtrain("watch", "--run-id", "allowed", "--allow-no-ranks", "--", *plain,
                      cwd=tmp_path)
    assert allowed.returncode == 0, allowed.stderr
    assert "ddtrain: no rank seen: the command ended (exit 0)" in allowed.stderr
    assert status(tmp_path, "allowed")["status"] == "succeeded"
    assert not run.leftovers and not allowed.leftovers


# -- torchrun of an unchanged script -------------------------------------------------------
@pytest.mark.processes
@pytest.mark.timeout(120)
def test_watch_torchrun_of_an_unchanged_script_counts_every_rank(watches: Watches) -> None:
    run, tmp_path = watches.result("ok"), watches.root / "ok"
    assert run.returncode == 0, run.stderr
    got = status(tmp_path, "ok")
    assert got["status"] == "succeeded"
    assert [(r["rank"], r["state"], r["global_step"]) for r in got["ranks"]] == [
        (0, "finished", 12), (1, "finished", 12)]
    assert all(r["comm_share"] is not None for r in got["ranks"]), got["ranks"]
    assert not run.leftovers


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_the_epoch_a_scripts_sampler_was_set_to_is_shown(watches: Watches) -> None:
    """Zero-code: the epoch is the one DistributedSampler.set_epoch was given,
    counted from 1 where a user reads it (status, run.json), with the steps in it."""
    run, tmp_path = watches.result("ok"), watches.root / "ok"
    assert run.returncode == 0, run.stderr
    assert [r["epoch"] for r in status(tmp_path, "ok")["ranks"]] == [3, 3]
    record = json.loads((tmp_path / "runs" / "ok" / "run.json").read_text())
    assert [(r["epoch"], r["step"]) for r in record["ranks"]] == [(3, 4), (3, 4)]
    lines = ddtrain("status", "ok", cwd=tmp_path).stdout.splitlines()
    header = next(k for k, line in enumerate(lines) if line.split()[:1] == ["RANK"])
    column = lines[header].split().index("EPOCH")
    assert [line.split()[column] for line in lines[header + 1:header + 3]] == ["3", "3"]
    # On the wire, from 0: each step in the epoch its sampler was last set to.
    sent = [wire.decode([r.frame]) for r in journal.read(tmp_path / "runs" / "ok" /
                                                         "telemetry.journal")]
    for rank in (0, 1):
        steps = [m for m in sent if isinstance(m, wire.Step) and m.rank == rank]
        assert {(m.global_step, m.epoch, m.step) for m in steps} >= {(4, 0, 4), (8, 1, 4)}
        assert steps[-1].epoch == 2 and steps[-1].global_step == 12
        assert all(m.epoch == (m.global_step - 1) // 4 for m in steps), steps


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_killed_rank_is_named_and_the_exit_code_is_torchruns(watches: Watches) -> None:
    run, tmp_path = watches.result("crash"), watches.root / "crash"
    assert run.returncode == 1, run.stderr  # torchrun's own exit code
    assert re.search(r"run crash failed: rank 1 \(pid \d+\) was killed by SIGKILL", run.stderr)
    got = status(tmp_path, "crash")
    assert got["failure"]["rank"] == 1 and got["failure"]["signal"] == "SIGKILL"
    # No sampler was set_epoch'd: the epoch is not known, never "1".
    assert [r["epoch"] for r in got["ranks"]] == [None, None], got["ranks"]
    # torchrun ended rank 0 (its log says so); the daemon stopped nothing: said so (or,
    # a race, rank 0 died of the lost peer first): a victim either way, not blamed.
    exits = {m.exited: m for m in (wire.decode([r.frame]) for r in journal.read(
        tmp_path / "runs" / "crash" / "telemetry.journal")) if isinstance(m, wire.RankExit)}
    assert not exits[0].culprit and exits[1].culprit and exits[1].reason is None, exits
    if exits[0].signal == "SIGTERM":
        assert exits[0].stopped_by_daemon, exits
        assert exits[0].reason == "was stopped by torchrun (SIGTERM) after rank 1 failed", exits
    else:
        assert blame.PEER_LOSS.search(exits[0].message or ""), exits
    assert not run.leftovers


@pytest.mark.processes
@pytest.mark.timeout(150)
def test_a_rank_torchrun_restarted_is_named_and_the_restart_counted(watches: Watches
                                                                     ) -> None:
    """torchrun --max-restarts 1: rank 1 killed once. The killed life is named from
    torchrun's own words (its pid), the restart counted, the new lives followed as
    the same ranks to the end; the run succeeds."""
    run, tmp_path = watches.result("restart"), watches.root / "restart"
    assert run.returncode == 0, run.stderr
    said = re.search(r"restart 1: rank 1 \(pid (\d+)\) was killed by SIGKILL at step \d+; its "
                     r"launcher started the ranks again \(attempt 1\)", run.stderr)
    assert said, run.stderr
    got = status(tmp_path, "restart")
    assert got["status"] == "succeeded" and got["failure"] is None, got
    assert got["restarts"] == 1, got
    [restart] = got["timeline"]
    assert (restart["restart"], restart["rank"], restart["signal"], restart["pid"]) == (
        1, 1, "SIGKILL", int(said[1])), restart
    assert [(r["rank"], r["state"], r["global_step"]) for r in got["ranks"]] == [
        (0, "finished", 12), (1, "finished", 12)]
    assert int(said[1]) not in [r["pid"] for r in got["ranks"]]  # the new lives are shown
    assert not run.leftovers


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_process_killed_under_mpirun_is_named_with_its_signal(watches: Watches) -> None:
    """mpirun's own words of it (`mpirun noticed that process rank 1 ... exited on
    signal 9`), its rank the one whose process carried OMPI_COMM_WORLD_RANK=1."""
    if shutil.which("mpirun") is None:
        pytest.skip("Open MPI's mpirun is not installed: apt-get install openmpi-bin "
                    "(.ci/run does)")
    run, tmp_path = watches.result("mpi"), watches.root / "mpi"
    assert run.returncode != 0, run.stderr
    assert re.search(r"run mpi failed: rank 1 \(pid \d+\) was killed by SIGKILL", run.stderr), \
        run.stderr
    failure = status(tmp_path, "mpi")["failure"]
    assert (failure["rank"], failure["signal"], failure["reason"]) == (1, "SIGKILL", None)
    assert not run.leftovers


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_a_launcher_that_fails_by_itself_is_named_with_its_last_words(watches: Watches
                                                                       ) -> None:
    run, tmp_path = watches.result("launcher"), watches.root / "launcher"
    assert run.returncode == 2, run.stderr  # torchrun's own
    said = ("the command (pid {}) exited with code 2, saying: torchrun: error: "
            "unrecognized arguments: --no-such-flag")
    got = status(tmp_path, "launcher")
    failure = got["failure"]
    assert failure["rank"] == wire.COMMAND_RANK and failure["exit_code"] == 2, failure
    assert f"run launcher failed: {said.format(failure['pid'])}" in run.stderr, run.stderr
    assert failure["reason"] == said.split(") ", 1)[1], failure
    assert not run.leftovers


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_rank_that_raises_is_named_with_its_error(watches: Watches) -> None:
    run, tmp_path = watches.result("raise"), watches.root / "raise"
    assert run.returncode == 1, run.stderr
    assert re.search(r"run raise failed: rank 1 \(pid \d+\) exited with code 1: "
                     r"RuntimeError: bad batch at step 4", run.stderr), run.stderr
    got = status(tmp_path, "raise")
    assert got["failure"]["rank"] == 1 and "bad batch at step 4" in got["failure"]["message"]
    assert not run.leftovers


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_ddtrain_stacks_profile_and_stop_of_a_watched_command(tmp_path: Path) -> None:
    proc, tag = start([DDTRAIN, "watch", "--run-id", "long", "--", *TWO_RANKS, str(SCRIPT)],
                      tmp_path, {"STEPS": "100000", "SLEEP": "0.01"})
    stop = None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if (tmp_path / "runs/long/run.json").exists():
                got = status(tmp_path, "long")
                if len(got["ranks"]) == 2 and all(r["global_step"] > 3 for r in got["ranks"]):
                    break
            time.sleep(0.3)
        else:
            raise AssertionError("the ranks never stepped")
        stacks = subprocess.run([DDTRAIN, "stacks", "long"], cwd=tmp_path,
                                capture_output=True, text=True, timeout=60, env=tagged_env(tag))
        assert stacks.returncode == 0, stacks.stderr  # written by the hook's faulthandler
        assert "== rank 0" in stacks.stdout and "== rank 1" in stacks.stdout
        assert stacks.stdout.count("plain_ddp.py") >= 2, stacks.stdout
        # ddtrain profile of the watched ranks: the start-up hook's, zero-code.
        profile = subprocess.run([DDTRAIN, "profile", "long", "--ranks", "all", "--steps", "3"],
                                 cwd=tmp_path, capture_output=True, text=True, timeout=90,
                                 env=tagged_env(tag))
        assert profile.returncode == 0, profile.stdout + profile.stderr
        assert len(list((tmp_path / "runs/long/profiles").glob("*/rank-*.trace.json.gz"))) == 2
        stop = subprocess.run([DDTRAIN, "stop", "long"], cwd=tmp_path, capture_output=True,
                              text=True, timeout=60, env=tagged_env(tag))
        assert stop.returncode == 0, stop.stderr
    finally:
        if proc.poll() is None and stop is None:  # failed before the stop: end it now
            proc.terminate()
        run = finish(proc, tag)
    assert run.returncode != 0  # torchrun's, after its workers were terminated
    got = status(tmp_path, "long")
    assert got["status"] == "stopped", got
    assert {r["signal"] for r in got["ranks"]} == {"SIGTERM"}
    assert not run.leftovers


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_a_lightning_script_that_spawns_its_own_ranks_is_watched(watches: Watches) -> None:
    pytest.importorskip("lightning")  # in the test extra: installed by make test
    run, tmp_path = watches.result("pl"), watches.root / "pl"
    assert run.returncode == 0, run.stderr
    got = status(tmp_path, "pl")
    # Rank 0 is the command itself (no RANK at its start), rank 1 its child.
    assert [(r["rank"], r["state"], r["global_step"]) for r in got["ranks"]] == [
        (0, "finished", 5), (1, "finished", 5)]
    assert all(r["comm_share"] is not None for r in got["ranks"]), got["ranks"]
    assert not run.leftovers


FAKE_SRUN = """#!/bin/bash
# srun's part here: SLURM_NTASKS tasks of "$@", each with its SLURM_PROCID.
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do SLURM_PROCID=$i SLURM_LOCALID=$i "$@" & pids+=($!); done
code=0
for pid in "${pids[@]}"; do wait "$pid" || code=$?; done
exit $code
"""


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_the_slurm_watch_example_runs_with_a_stand_in_srun(tmp_path: Path) -> None:
    """examples/slurm/watch-srun.sbatch as sbatch would run it, with `srun` and
    `scontrol` standing in for SLURM's: the tasks report over TCP with the keys."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    for tool in ("srun", "scontrol", "python"):
        (bin_dir / tool).chmod(0o755)
    env = {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin",
           "SLURM_NTASKS": "2", "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "vm",
           "RUNS": str(tmp_path / "runs"), "STEPS": "5"}
    proc, tag = start(["bash", str(SBATCH), str(SCRIPT)], tmp_path, env)
    run = finish(proc, tag)
    assert run.returncode == 0, run.stderr
    got = status(tmp_path, str(tmp_path / "runs" / "slurm-42"))
    assert [(r["rank"], r["state"], r["global_step"]) for r in got["ranks"]] == [
        (0, "finished", 5), (1, "finished", 5)]
    assert not run.leftovers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.processes
@pytest.mark.timeout(150)
def test_one_watch_per_node_node_0_the_hub_names_a_rank_killed_on_node_1(tmp_path: Path
                                                                          ) -> None:
    """Two nodes on one machine, as `ddtrain start` tests them: each node's watch runs
    its torchrun (static rendezvous at node 0), node 1's forwards to node 0's hub."""
    port = str(free_port())
    procs = []
    for node in (0, 1):
        torchrun = [TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node",
                    "1", "--master-addr", "127.0.0.1", "--master-port", port, str(SCRIPT)]
        procs.append(start([DDTRAIN, "watch", "--nnodes", "2", "--node-rank", str(node),
                            "--run-id", "mn", "--", *torchrun], tmp_path,
                           {"STEPS": "400", "SLEEP": "0.02", "DIE_RANK": "1",
                            "DIE_STEP": "6"}))
    runs = [finish(proc, tag) for proc, tag in procs]
    assert [r.returncode for r in runs] == [1, 1], [r.stderr for r in runs]
    assert "node 0 is the hub of 2 nodes" in runs[0].stderr
    assert "node 1 forwards to the hub" in runs[1].stderr
    assert re.search(r"rank 1 \(pid \d+\) was killed by SIGKILL", runs[1].stderr)
    hub = status(tmp_path, "mn")
    assert hub["failure"]["rank"] == 1 and hub["failure"]["signal"] == "SIGKILL", hub
    assert hub["failure"]["node"] == 1
    assert [(r["rank"], r["node"]) for r in hub["ranks"]] == [(0, 0), (1, 1)]
    assert not any(r.leftovers for r in runs)


@pytest.mark.processes
def test_the_slurm_watch_example_of_one_watch_per_node_is_valid_bash() -> None:
    done = subprocess.run(["bash", "-n", str(SBATCH.parent / "watch.sbatch")],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


# -- without a command ---------------------------------------------------------------------
@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_watch_without_a_command_is_fed_by_a_separate_torchrun(tmp_path: Path) -> None:
    proc, tag = start([DDTRAIN, "watch", "--run-id", "apart", "--idle", "60", "--headless",
                       "--format", "jsonl"], tmp_path)
    assert proc.stderr is not None
    try:
        exports: dict[str, str] = {}
        while "DDTOP_RUN_ID" not in exports:
            line = proc.stderr.readline()
            assert line, "ddtrain watch printed no exports"
            if m := re.match(r"\s+export (\w+)=(\S+)", line):
                exports[m[1]] = m[2]
        ranks = subprocess.run([*TWO_RANKS, str(SCRIPT)], cwd=tmp_path, timeout=90,
                               env=tagged_env(tag, {**exports, "STEPS": "7"}),
                               capture_output=True, text=True)
        assert ranks.returncode == 0, ranks.stderr
    finally:
        run = finish(proc, tag)
    assert run.returncode == 0, run.stderr
    last = json.loads(run.stdout.splitlines()[-1])  # --headless: the summary, as JSON
    assert last["status"] == "succeeded" and last["global_step"] == 7, last
    got = status(tmp_path, "apart")
    assert [(r["rank"], r["state"], r["global_step"]) for r in got["ranks"]] == [
        (0, "finished", 7), (1, "finished", 7)]


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_a_watch_without_a_command_ends_after_idle_seconds_without_ranks(tmp_path: Path) -> None:
    run = ddtrain("watch", "--run-id", "nobody", "--idle", "1", cwd=tmp_path)
    assert run.returncode == 1
    assert "the watch heard from no rank within 1 s (--idle)" in run.stderr
    assert "export DDTOP_TELEMETRY=ipc://" in run.stderr

