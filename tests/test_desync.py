"""A desync named, for real: tests/scripts/desync.py under `ddtrain start -n 4`
(zero-code: its collectives' signatures from training/collectives.py), one rank
entering another collective than its group's at one step:

- on the world group, rank 3 all-gathers where ranks 0-2 all-reduce;
- on a pair's sub-group ([2, 3]), rank 3 all-gathers where rank 2 all-reduces,
  while ranks 0-1 go on to wait in DDP's all-reduce; again with the pairs a
  DeviceMesh's tp dimension (named so);
- on the world group, rank 3 all-gathers before a step's forward where ranks
  0-2 enter DDP's gradient all-reduce (one collective of the group a step).

A point-to-point pair that cannot meet: ranks 0 and 1 each send to the other.

And hangs that are not a desync: in a sub-group, rank 2 sleeps before its
pair's all-reduce (rank 3 waits in group [2,3] for rank 2, ranks 0-1 in the
world's DDP all-reduce, and rank 2 is blamed); in a point-to-point pair, rank 0
sleeps before its send (rank 1 waits in recv from rank 0, ranks 2-3 in the
world's all_reduce, and rank 0 is blamed); and in two ranks that exchange with
isend and irecv each step, rank 1 waits on an irecv's work from rank 0, which
sleeps (the exchange, batched and not, is never a desync: the world run has it
too).

(A mismatch of sizes that gloo sees, an all_reduce of 4 float64s against 4
float32s, aborts the ranks at once, "Received data size doesn't match expected
size": over before a heartbeat could tell it. The words for it are tested in
tests/test_desync_words.py.)

Each is named as a desync (not "ranks 0-3 wait in all_reduce"), the odd rank is
blamed, and --hang-timeout stops the run with the desync as its cause. The eight
runs start together (a module fixture), so that their hang timeouts overlap.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import DDTRAIN, Run, finish, start

from ddtop.daemon.nativestacks import NATIVE_MARK

pytestmark = pytest.mark.processes

SCRIPT = str(Path(__file__).parent / "scripts" / "desync.py")
RUN_TIMEOUT_S = 120
JSONL = ("--foreground", "--headless", "--format", "jsonl", "--interval", "0.2")
RUNS = {
    # (with a ring exchange of isend and irecv a step, batched and not: never a desync)
    "world": ("--at", "3", "--odd-rank", "3", "--odd", "all_gather", "--exchange"),
    "pair": ("--at", "3", "--odd-rank", "3", "--odd", "all_gather", "--pairs"),
    # The same, the pairs a DeviceMesh's tp dimension.
    "mesh": ("--at", "3", "--odd-rank", "3", "--odd", "all_gather", "--pairs", "--mesh"),
    # Rank 3 all-gathers where ranks 0-2 enter DDP's gradient all-reduce.
    "ddp": ("--at", "3", "--odd-rank", "3", "--odd", "ddp"),
    # Ranks 0 and 1 each send to the other: neither receives.
    "p2p-send": ("--at", "3", "--odd-rank", "0", "--odd", "p2p-send"),
    # Not a desync: rank 2 sleeps before its pair's all_reduce.
    "sleep": ("--at", "3", "--odd-rank", "2", "--odd", "sleep", "--pairs"),
    # Nor this: rank 0 sleeps before it sends to rank 1, which waits in recv.
    "p2p": ("--at", "3", "--odd-rank", "0", "--odd", "p2p"),
    # Nor this, of 2 ranks exchanging with isend and irecv each step: rank 1 waits on
    # its irecv's work.
    "p2p-irecv": ("--at", "3", "--odd-rank", "0", "--odd", "p2p-irecv", "--exchange"),
}
WORLD = {"p2p-irecv": "2"}  # ranks, where not 4
RUN_ROOT: dict[str, Path] = {}  # each run's folder (the module fixture's)
WORDS = {
    # The world group's 8th collective: DDP's all-reduce, then an all_reduce, in each
    # of steps 0-3.
    "world": "desync in group world #8: rank 3 entered all_gather (float32 x 4 per rank) "
             "while ranks 0-2 entered all_reduce (float32 x 4)",
    # ... and its 7th: DDP's all-reduce of step 3 (Linear(8, 1): 9 gradient elements).
    "ddp": "desync in group world #7: rank 3 entered all_gather (float32 x 4 per rank) "
           "while ranks 0-2 entered DDP's gradient all-reduce (float32 x 9)",
    "pair": "desync in group [2,3] #4: rank 3 entered all_gather (float32 x 4 per rank) "
            "while rank 2 entered all_reduce (float32 x 4)",
    "mesh": "desync in group [2,3] (tp) #4: rank 3 entered all_gather (float32 x 4 per rank) "
            "while rank 2 entered all_reduce (float32 x 4)",
    "p2p-send": "desync in group world, send/recv of ranks 0 and 1: rank 1 entered send "
                "(float32 x 4) to rank 0 while rank 0 entered send (float32 x 4) to rank 1 "
                "(neither receives)",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    root = tmp_path_factory.mktemp("desync")
    RUN_ROOT.update({name: root / name for name in RUNS})
    procs = {}
    done: dict[str, Run] = {}
    try:
        for name, args in RUNS.items():
            (root / name).mkdir()
            procs[name] = start([DDTRAIN, "start", "--run-id", name, *JSONL,
                                 "-n", WORLD.get(name, "4"),
                                 "--hang-timeout", "4", SCRIPT, "--steps", "12", *args],
                                root / name, {"OMP_NUM_THREADS": "1"})
        for name, (proc, tag) in procs.items():
            done[name] = finish(proc, tag, timeout=RUN_TIMEOUT_S)
        yield done
    finally:
        for name, (proc, tag) in procs.items():
            if name not in done:
                with contextlib.suppress(AssertionError):
                    finish(proc, tag, timeout=RUN_TIMEOUT_S)


def evidence_of(name: str) -> list[Path]:
    """The run's evidence bundles, oldest first."""
    return sorted((RUN_ROOT[name] / "runs" / name / "evidence").iterdir())


def lines(run: Run) -> list[dict[str, Any]]:
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("name", ["world", "pair", "mesh", "ddp"])
def test_a_rank_entering_another_collective_is_named_as_a_desync_and_blamed(
        runs: dict[str, Run], name: str) -> None:
    run = runs[name]
    assert run.returncode == 1, run.stderr[-3000:]
    assert run.leftovers == []
    words = WORDS[name]
    hangs = [line["hang"] for line in lines(run) if line["kind"] == "progress" and line["hang"]]
    # Named as soon as both sides are in (before any rank stalls), and only as that;
    # the side of the group whole once every rank's heartbeat has come.
    odd_side = words.partition(" while ")[0]
    assert hangs and hangs[-1] == words, hangs
    assert all(h.startswith(odd_side) for h in hangs), hangs
    assert f"rank 3 entered another collective than its group's (--hang-timeout 4): {words}" \
        in run.stderr, run.stderr[-3000:]
    # Said once, as it was first seen: a warning event (the journal keeps it).
    told = [line["message"] for line in lines(run)
            if line["kind"] == "event" and line.get("type") == "warning"]
    assert told.count(words) == 1, told
    assert f"ddtrain: {words}\n" in run.stderr
    summary = next(line for line in lines(run) if line["kind"] == "summary")
    assert summary["failure"]["rank"] == 3, summary["failure"]
    # Its stacks at that moment: Python's, then native (py-spy's, or why not).
    stacks = (RUN_ROOT[name] / "runs" / name / "logs" / "rank-3.stacks").read_text()
    assert "all_gather" in stacks and NATIVE_MARK in stacks, stacks
    assert words in summary["failure"]["message"], summary["failure"]
    # The evidence, gathered when the desync was told and again when --hang-timeout
    # failed it (daemon/evidence.py): the words, each rank as the state held it, and
    # every rank's stacks, each bundle complete (its index written last).
    bundles = evidence_of(name)
    indexes = [json.loads((b / "index.json").read_text()) for b in bundles]
    assert [i["why"] for i in indexes] == ["desync", "hang"], indexes
    assert indexes[0]["verdict"] == words and words in indexes[1]["verdict"], indexes
    assert all(set(i["files"]) == {"verdict.txt", "ranks.json", "rank-0.stacks",
                                   "rank-1.stacks", "rank-2.stacks", "rank-3.stacks",
                                   "rank-0.fr.json", "rank-1.fr.json", "rank-2.fr.json",
                                   "rank-3.fr.json"}
               for i in indexes), indexes
    # Each rank's Flight Recorder (on by default), dumped by its sender thread as its
    # stacks were asked for, and its verdict: the odd rank's last entry is its own op,
    # not completed, in the group of the desync (torch's #N: every collective of the
    # group, DDP's and the object collectives' inner ones included).
    group = {"pair": "[2,3]", "mesh": "[2,3] (tp)"}.get(name, "world")
    odd_op = re.escape(words.split("rank 3 entered ")[1].split(" (")[0])
    for index in indexes:
        assert re.search(rf"Flight Recorder: (.*; )?group {re.escape(group)}: .*rank 3's (last )?"
                         rf"is {odd_op} #\d+ \(float32 x 4, not completed\)",
                         index["flight_recorder"]), index["flight_recorder"]
    assert f"ddtrain: {indexes[0]['flight_recorder']}\n" in run.stderr
    # The run went on meanwhile: py-spy's dumps were each given their time (the hang's
    # bundle waits HANG_NATIVE_S, and may say a rank's came too late).
    assert indexes[0]["missing"] == [], indexes[0]
    assert not any("Python" in line for line in indexes[1]["missing"]), indexes[1]
    ranks = json.loads((bundles[0] / "ranks.json").read_text())
    number = int(words.split(" #")[1].split(":")[0])
    odd = ranks["3"]["coll_started"]
    assert odd["op"] == "all_gather" and odd["group_seq"] == number, ranks
    assert (bundles[0] / "verdict.txt").read_text() == words + "\n"
    in_bundle = (bundles[0] / "rank-3.stacks").read_text()
    assert "all_gather" in in_bundle and NATIVE_MARK in in_bundle, in_bundle
    folders = [str(Path("runs", name, "evidence", bundle.name)) for bundle in bundles]
    for why, folder in zip(("desync", "hang"), folders, strict=True):
        assert f"ddtrain: evidence of the {why} in {folder}\n" in run.stderr, run.stderr[-3000:]
    # Named by the summary and run.json.
    assert summary["evidence"] == folders, summary
    record = json.loads((RUN_ROOT[name] / "runs" / name / "run.json").read_text())
    assert record["evidence"] == folders, record


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 30)
def test_a_pair_that_both_send_is_named_as_a_desync_and_fails_the_run_as_one(
        runs: dict[str, Run]) -> None:
    run = runs["p2p-send"]
    assert run.returncode == 1, run.stderr[-3000:]
    assert run.leftovers == []
    words = WORDS["p2p-send"]
    hangs = [line["hang"] for line in lines(run) if line["kind"] == "progress" and line["hang"]]
    assert hangs and hangs[-1] == words, hangs
    assert f"ddtrain: {words}\n" in run.stderr
    assert (f"rank 1 entered a send or recv its peer's cannot meet (--hang-timeout 4): {words}"
            in run.stderr), run.stderr[-3000:]
    summary = next(line for line in lines(run) if line["kind"] == "summary")
    assert summary["failure"]["rank"] == 1 and words in summary["failure"]["message"], summary
    assert [json.loads((b / "index.json").read_text())["why"]
            for b in evidence_of("p2p-send")] == ["desync", "hang"]


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 30)
def test_a_hang_in_a_sub_group_says_who_waits_for_whom_in_which_group(
        runs: dict[str, Run]) -> None:
    run = runs["sleep"]
    assert run.returncode == 1, run.stderr[-3000:]
    assert run.leftovers == []
    hangs = [line["hang"] for line in lines(run) if line["kind"] == "progress" and line["hang"]]
    # Ranks 0-1 wait in DDP's all-reduce of the next step (the world's); rank 3 waits
    # in its pair's 4th all_reduce for rank 2, which sleeps after its 4th step.
    assert hangs, run.stdout[-3000:]
    last = hangs[-1]
    assert last.startswith("ranks 0-1 wait in allreduce #"), hangs
    assert "; rank 3 wait in group [2,3] all_reduce #4 for rank 2; rank 2 is in " in last, hangs
    assert not any("desync in group" in h for h in hangs), hangs  # (the script: desync.py)
    summary = next(line for line in lines(run) if line["kind"] == "summary")
    assert summary["failure"]["rank"] == 2, summary["failure"]
    assert "rank 2 hung for 4 s (--hang-timeout 4): ranks 0-1 wait in allreduce #" \
        in run.stderr, run.stderr[-3000:]
    # No desync: one bundle, the hang's, with the sleeping rank's stacks.
    (bundle,) = evidence_of("sleep")
    index = json.loads((bundle / "index.json").read_text())
    assert index["why"] == "hang" and index["verdict"].startswith("rank 2 hung for 4 s"), index
    # Rank 2's Python stacks at the line it sleeps on (the "sleep" odd one's).
    script = Path(SCRIPT).read_text().splitlines()
    line = next(n for n, text in enumerate(script, 1)
                if text.strip() == "time.sleep(600)" and "sleep" in script[n - 2])
    assert f'desync.py", line {line} in main' in (bundle / "rank-2.stacks").read_text()
    # ... and in the hang's words, from its heartbeats: between steps, outside any
    # collective and its data loader, at that line of the script.
    assert last.endswith("; rank 2 is in Python between steps 4 and 5, outside any collective "
                         f"and its data loader (desync.py:{line} in main)"), hangs


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 30)
def test_a_rank_waiting_in_recv_waits_for_its_peer(runs: dict[str, Run]) -> None:
    run = runs["p2p"]
    assert run.returncode == 1, run.stderr[-3000:]
    assert run.leftovers == []
    hangs = [line["hang"] for line in lines(run) if line["kind"] == "progress" and line["hang"]]
    # Ranks 2-3 wait in the world's 4th all_reduce; rank 1 in recv from rank 0,
    # which sleeps before its send.
    assert hangs, run.stdout[-3000:]
    assert hangs[-1].startswith("ranks 2-3 wait in all_reduce #"), hangs
    assert "; rank 1 wait in recv #" in hangs[-1] and " from rank 0; rank 0 is in " in hangs[-1]
    summary = next(line for line in lines(run) if line["kind"] == "summary")
    assert summary["failure"]["rank"] == 0, summary["failure"]


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 30)
def test_a_rank_waiting_on_an_irecvs_work_waits_for_its_peer(runs: dict[str, Run]) -> None:
    run = runs["p2p-irecv"]
    assert run.returncode == 1, run.stderr[-3000:]
    assert run.leftovers == []
    hangs = [line["hang"] for line in lines(run) if line["kind"] == "progress" and line["hang"]]
    # Each step's exchange (a batch of isend and irecv, then one of each) was never a
    # desync; then rank 1 waits on an irecv's work (gloo's: no future, seen completed by
    # its sender thread) from rank 0, which sleeps before its send.
    assert hangs and not any("desync in group" in h for h in hangs), hangs
    assert re.fullmatch(r"rank 1 wait in irecv #\d+ from rank 0; rank 0 is in Python between "
                        r"steps 4 and 5, .*", hangs[-1]), hangs
    summary = next(line for line in lines(run) if line["kind"] == "summary")
    assert summary["failure"]["rank"] == 0, summary["failure"]
