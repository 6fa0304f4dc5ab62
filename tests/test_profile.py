"""`ddtrain profile` (daemon/profilecmd.py, training/profiling.py), for real: a
live 2-rank run profiled on both ranks for the same 5 optimizer steps, each a
gzipped Chrome trace and its top operators, printed side by side; a user's
script that runs its own profiler is refused in one line; bad input is one
line. The request file (core/profilereq.py) is read only as its types allow.
The dashboard's `P` is in tests/test_app.py."""

from __future__ import annotations

import gzip
import json
import subprocess
import textwrap
from pathlib import Path

import pytest
from helpers import DDTRAIN, detached

from ddtop.core import profilereq
from ddtop.core.contract import UsageError
from ddtop.daemon.profilecmd import parse_ranks


def test_ranks_are_a_list_a_range_or_all() -> None:
    assert parse_ranks("0,3", 4) == [0, 3]
    assert parse_ranks("1-3,0", 4) == [0, 1, 2, 3]
    assert parse_ranks("all", 4) == "all"
    for bad, says in (("x", "give ranks as 0,3 or 2-5, or all"),
                      ("4", "the run has ranks 0-3, not rank 4"), ("1-", "give ranks as"),
                      ("3-1", "3-1 runs backwards: write 1-3"),
                      ("0-10000000000", "the run has ranks 0-3, not rank 10000000000")):
        with pytest.raises(UsageError, match=says):
            parse_ranks(bad, 4)


def test_a_request_is_written_whole_and_read_only_as_its_types_allow(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    request = profilereq.write(logs, [0, 3], 120, 5, now=0.0)
    assert profilereq.read(profilereq.request_path(logs)) == request
    assert request.covers(3) and not request.covers(1)
    again = profilereq.write(logs, "all", 121, 5, now=0.0)  # the same second: its own id
    assert again.id == request.id + "-1" and again.covers(7)
    assert (tmp_path / "profiles" / again.id).is_dir()
    path = profilereq.request_path(logs)
    for bad in (b"{", b'{"id": "../x", "ranks": "all", "start": 1, "steps": 5}',
                b'{"id": "1", "ranks": [-1], "start": 1, "steps": 5}',
                b'{"id": "1", "ranks": "all", "start": 1, "steps": 5000}',
                b'{"id": "1", "ranks": "all", "start": 1, "steps": 5, "more": 1}',
                b" " * (profilereq.MAX_REQUEST_BYTES + 1)):
        path.write_bytes(bad)
        assert profilereq.read(path) is None, bad
    # A second of steps ahead, at least 3: every rank asked is still before it.
    assert profilereq.start_after([100, 104], 0.01) == 204
    assert profilereq.start_after([100], 2.0) == 103
    assert profilereq.start_after([], 0.0) == 3


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_two_ranks_are_profiled_for_the_same_steps_and_shown_side_by_side(
        tmp_path: Path) -> None:
    with detached("-n", "2", "--epochs", "50", "--step-delay", "0.02", "--run-id", "prof",
                  cwd=tmp_path) as run:
        assert run.started.returncode == 0, run.started.stderr
        run.wait_for("prof", lambda s: all(r["global_step"] > 5 for r in s["ranks"]))
        done = run.cli("profile", "prof", "--ranks", "all", "--steps", "5")
        shown = run.cli("profile", "prof", "--show")
        bad = run.cli("profile", "prof", "--ranks", "2")
        none = run.cli("profile", "prof")
        stopped = run.cli("stop", "prof", "--timeout", "10")
        assert stopped.returncode in (0, 130), stopped.stdout + stopped.stderr
        assert run.leftovers() == []
    assert done.returncode == 0, done.stdout + done.stderr
    (folder,) = (tmp_path / "runs" / "prof" / "profiles").iterdir()
    assert done.stderr.startswith("ddtrain: profiling every rank for steps "), done.stderr
    tops = {r: json.loads((folder / f"rank-{r}.top.json").read_text()) for r in (0, 1)}
    # The same global steps on both ranks, 5 of them.
    assert {(t["from_step"], t["to_step"], t["steps"]) for t in tops.values()} == {
        (tops[0]["from_step"], tops[0]["from_step"] + 4, 5)}, tops
    assert f"steps {tops[0]['from_step']}-{tops[0]['to_step']}" in done.stderr
    for r in (0, 1):
        trace = json.loads(gzip.decompress((folder / f"rank-{r}.trace.json.gz").read_bytes()))
        assert trace["traceEvents"], r
        names = [op["name"] for op in tops[r]["top"]]
        assert any(name.startswith("aten::") for name in names), names
    # Side by side, per step, and the slowest against the other.
    assert "self ms/step" in done.stdout and "rank 0" in done.stdout and "rank 1" in done.stdout
    assert "against the median of rank " in done.stdout, done.stdout
    assert shown.returncode == 0 and shown.stdout.startswith(f"runs/prof/profiles/{folder.name}:")
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "ddtrain: error: --ranks 2: the run has ranks 0-1, not rank 2")
    assert none.returncode == 2 and "say which ranks: --ranks 0,3" in none.stderr


OWN_PROFILER = textwrap.dedent("""\
    import time
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with torch.profiler.profile():  # the program's own, for its whole loop
        for step in range(600):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.02)
    dist.destroy_process_group()
""")


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_a_program_that_runs_its_own_profiler_is_refused_in_one_line(tmp_path: Path) -> None:
    script = tmp_path / "own.py"
    script.write_text(OWN_PROFILER)
    with detached("-n", "2", "--run-id", "own", str(script), cwd=tmp_path) as run:
        assert run.started.returncode == 0, run.started.stderr
        run.wait_for("own", lambda s: all(r["global_step"] > 5 for r in s["ranks"]))
        done = run.cli("profile", "own", "--ranks", "0", "--steps", "2")
        stopped = run.cli("stop", "own", "--timeout", "10")
        assert stopped.returncode in (0, 130), stopped.stdout + stopped.stderr
        assert run.leftovers() == []
    assert done.returncode == 1, done.stdout + done.stderr
    assert ("  rank 0: not profiled: its own program runs a profiler already: not profiled "
            "(stop it, or profile with it)") in done.stdout, done.stdout


@pytest.mark.processes
def test_the_command_is_in_ddtrains_help() -> None:
    shown = subprocess.run([DDTRAIN, "profile", "--help"], capture_output=True, text=True,
                           timeout=60, check=False)
    assert shown.returncode == 0 and "--ranks LIST" in shown.stdout


def test_a_request_that_comes_while_one_runs_waits_its_turn(tmp_path: Path) -> None:
    import time

    from ddtop.training import profiling

    logs = tmp_path / "logs"
    logs.mkdir()
    stacks = logs / "rank-0.stacks"
    stacks.touch()
    try:
        profiling.watch(stacks)
        first = profilereq.write(logs, [0], 2, 2, now=0.0)
        profiling.poll()
        for step in (1, 2, 3):  # it begins after step 2
            profiling.at_step(step)
        second = profilereq.write(logs, "all", 3, 1, now=0.0)  # (while the first runs)
        profiling.poll()
        for step in (4, 5, 6):  # the first ends after step 4; the second runs step 6
            profiling.at_step(step)
        folders = {r.id: tmp_path / "profiles" / r.id for r in (first, second)}
        deadline = time.monotonic() + 30
        while not all((f / "rank-0.top.json").exists() for f in folders.values()):
            assert time.monotonic() < deadline, list(tmp_path.rglob("*"))
            time.sleep(0.05)
        tops = {name: json.loads((f / "rank-0.top.json").read_text())
                for name, f in folders.items()}
        assert (tops[first.id]["from_step"], tops[first.id]["to_step"]) == (3, 4), tops
        assert (tops[second.id]["from_step"], tops[second.id]["to_step"]) == (6, 6), tops
    finally:
        profiling._request, profiling._running = None, None
        profiling._plans.clear()
