"""A straggler's cause (core/causes.py): the rule on synthetic parts, the fold on
synthetic Step messages of ranks in DDP's lockstep, and real runs of the
built-in trainer with a drill that makes rank 1 slow for one reason each:
`slowdata=40ms` (input) and `cpuhog` (host: a busy process on its core). The
compute cause of a real run is tests/test_drills.py's slow drill."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
from helpers import DDTRAIN, finish, start
from test_state import RUN, hello

from ddtop.core import causes, wire
from ddtop.core.causes import Parts
from ddtop.core.state import RunState

MS = 0.001


# -- the rule ------------------------------------------------------------------------------
def test_the_first_part_that_explains_half_the_gap_is_the_cause() -> None:
    others = Parts(data_s=2 * MS, work_s=40 * MS, runq_s=0.5 * MS, faults=0.0)
    gap = 40 * MS
    assert causes.choose(Parts(44 * MS, 40 * MS, 0.5 * MS, 0.0), others, gap) == (
        "input", "input: 44 ms/step waiting for data vs 2.0 ms median")
    assert causes.choose(Parts(2 * MS, 80 * MS, 0.5 * MS, 0.0), others, gap) == (
        "compute", "compute: 80 ms/step in forward, backward and the optimizer vs 40 ms median")
    # A rank starved of CPU is slower in every phase: the host is asked first.
    assert causes.choose(Parts(20 * MS, 62 * MS, 41 * MS, 0.0), others, gap) == (
        "host", "host: 41 ms/step waiting for a CPU vs 0.5 ms median")
    assert causes.choose(Parts(2 * MS, 70 * MS, 0.5 * MS, 120.0), others, gap) == (
        "memory", "memory: 120 major page faults/step vs 0 median")
    # A little of each explains none: unknown, with the figures.
    kind, words = causes.choose(Parts(12 * MS, 50 * MS, 10 * MS, 1.0), others, gap)
    assert kind == "unknown" and words.startswith("unknown: no reading explains half of the "
                                                  "+40 ms/step (data 12 ms vs 2.0 ms"), words
    # Host readings not read (an older sender): never the host's nor memory's.
    unread = Parts(2 * MS, 40 * MS, None, None)
    assert causes.choose(Parts(44 * MS, 40 * MS, None, None), unread, gap)[0] == "input"
    assert causes.choose(Parts(2 * MS, 40 * MS, 41 * MS, 500.0), unread, gap)[0] == "unknown"
    assert causes.choose(others, others, 0.0)[0] == "unknown"


# -- the fold ------------------------------------------------------------------------------
def lockstep(where: str, world: int = 4, steps: int = 60) -> RunState:
    """`world` ranks in lockstep, each step a Step message; rank `world - 1` computes
    30 ms more a step, spent `where` (data, work, host: waiting for a CPU)."""
    state = RunState(run=RUN)
    t = 100.0
    for r in range(world):
        state.apply(msgspec.structs.replace(hello(r), world_size=world), t)
    slow = world - 1
    for step in range(1, steps + 1):
        parts = {r: {"data": 2 * MS, "work": 38 * MS, "runq": 0.5 * MS} for r in range(world)}
        extra = {"data": "data", "work": "work", "host": "work"}[where]
        parts[slow][extra] += 30 * MS
        if where == "host":
            parts[slow]["runq"] += 30 * MS
        compute = {r: p["data"] + p["work"] for r, p in parts.items()}
        step_s = max(compute.values()) + 10 * MS
        t += step_s
        for r in range(world):
            state.apply(wire.Step(
                run=RUN, rank=r, seq=step, t=t, epoch=0, step=step, steps_per_epoch=10**6,
                global_step=step, steps=1, samples=32, loss_sum=64.0, lr=0.1, step_s=step_s,
                data_s=parts[r]["data"], forward_s=parts[r]["work"], backward_s=0.0,
                optimizer_s=0.0, comm_s=step_s - compute[r], comm_bytes=10**6, comm_ops=1,
                algbw_gbps=1.0, busbw_gbps=1.0, sync_wait_s=0.0,
                runq_s=parts[r]["runq"], major_faults=0), t)
    return state


@pytest.mark.parametrize(("where", "cause", "words"), [
    ("data", "input", "input: 32 ms/step waiting for data vs 2.0 ms median"),
    ("work", "compute", "compute: 68 ms/step in forward, backward and the optimizer vs 38 ms "
                        "median"),
    ("host", "host", "host: 30 ms/step waiting for a CPU vs 0.5 ms median"),
])
def test_a_named_straggler_carries_its_cause_everywhere_it_is_named(
        where: str, cause: str, words: str) -> None:
    state = lockstep(where)
    assert state.stragglers()[2] == [3]
    assert state.straggler_causes() == {3: (cause, words)}
    summary = state.summary(200.0)
    assert summary.straggler_causes == {3: words}
    # (a summary goes as JSON to ddtrain status and run.json: its keys as strings)
    assert msgspec.json.decode(msgspec.json.encode(summary))["straggler_causes"] == {"3": words}


# -- real runs -----------------------------------------------------------------------------
RUN_TIMEOUT_S = 180
SMALL = ("--foreground", "--headless", "--format", "jsonl", "--interval", "0.5", "-n", "2",
         "--epochs", "1")


def run_lines(tmp_path: Path, *args: str) -> list[dict[str, Any]]:
    proc, tag = start([DDTRAIN, "start", "--run-id", "cause", *SMALL, *args], tmp_path,
                      {"OMP_NUM_THREADS": "1"})
    run = finish(proc, tag, timeout=RUN_TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.leftovers == []  # (cpuhog's busy process ended with its rank)
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def progress(tmp_path: Path, *args: str) -> list[dict[str, Any]]:
    return [line for line in run_lines(tmp_path, *args) if line["kind"] == "progress"]


def said(lines: list[dict[str, Any]]) -> Counter[str]:
    """The causes rank 1 was named with, line by line; no other rank ever named."""
    named = [line for line in lines if line["stragglers"]]
    assert named and all(line["stragglers"] == [1] for line in named), [
        (line["global_step"], line["stragglers"]) for line in lines]
    return Counter(line["straggler_causes"].get("1", {}).get("cause") for line in named)


@pytest.mark.processes
@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_a_slow_data_loader_is_named_input_and_profiled_beside_the_median(
        tmp_path: Path) -> None:
    every = run_lines(tmp_path, "--synthetic-train-samples", "9600", "--profile-stragglers",
                      "--inject", "1:slowdata=40ms@step=10")
    lines = [line for line in every if line["kind"] == "progress"]
    causes_said = said(lines)
    assert causes_said.most_common(1)[0][0] == "input", causes_said
    words = next(line["straggler_causes"]["1"]["words"] for line in lines
                 if line["straggler_causes"].get("1", {}).get("cause") == "input")
    assert words.startswith("input: 4") and "ms/step waiting for data vs" in words, words
    # --profile-stragglers: the straggler and the median rank (rank 0) profiled by
    # themselves, once, and what differs told.
    told = [line["message"] for line in every if line["kind"] == "event"
            and line.get("type") == "info" and "profil" in line["message"]]
    asked = [m for m in told if m.startswith("profiling rank 1 (a straggler) and rank 0 (the "
                                             "median) for steps ")]
    assert len(asked) == 1, told
    name = asked[0].rsplit(" ", 1)[1]
    folder = tmp_path / "runs" / "cause" / "profiles" / name
    assert sorted(p.name for p in folder.glob("rank-*.trace.json.gz")) == [
        "rank-0.trace.json.gz", "rank-1.trace.json.gz"]
    assert any(m.startswith(f"profile {name}: rank 1 (the straggler) against the median of "
                            "rank 0: ") for m in told), told


@pytest.mark.processes
@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_a_busy_process_on_its_core_is_named_host(tmp_path: Path) -> None:
    lines = progress(tmp_path, "--model", "cnn", "--synthetic-train-samples", "4800",
                     "--inject", "1:cpuhog@step=10")
    causes_said = said(lines)
    assert causes_said.most_common(1)[0][0] == "host", causes_said
    words = next(line["straggler_causes"]["1"]["words"] for line in lines
                 if line["straggler_causes"].get("1", {}).get("cause") == "host")
    assert "ms/step waiting for a CPU vs" in words, words


def test_metrics_give_a_stragglers_cause_as_a_label() -> None:
    from promserver import served

    from ddtop.daemon.metricreading import read

    samples = served(read(lockstep("data"), 200.0))["ddtop_rank_straggler_cause"]
    assert {(s.labels["rank"], s.labels["cause"]): s.value for s in samples} == {
        ("3", each): float(each == "input") for each in causes.CAUSES}


def test_the_rank_detail_says_why_it_straggles() -> None:
    from ddtop.dashboard import panels

    state = lockstep("data")
    shown = panels.detail(state, 3, 200.0).plain
    assert ("straggles (+30.0 ms/step): input: 32 ms/step waiting for data vs 2.0 ms median"
            in shown), shown
    assert "straggles" not in panels.detail(state, 0, 200.0).plain
    header = panels.header(state, 200.0).plain
    assert header.endswith(" · stragglers: 3 · input: 32 ms/step waiting for data vs 2.0 ms "
                           "median"), header
