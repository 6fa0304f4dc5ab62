"""Every collective a rank enters, seen with no line of the script changed
(training/collectives.py), for real:

- an unchanged 2-rank gloo script under torchrun (the start-up hook) that
  enters each collective once, asynchronous ones, one taken by name before its
  process group existed, and a barrier one rank comes to late: counted,
  sized, the waiting rank named in it and its wait counted as communication;
- Lightning (`Trainer(accelerator="cpu", devices=2, strategy="ddp")`),
  Hugging Face's Trainer (`use_cpu=True`), Accelerate (`Accelerator(cpu=True,
  gradient_accumulation_steps=2)`) and an FSDP2 script (`fully_shard` on gloo)
  under `ddtrain start -n 2`, rank 1 hung just after an optimizer step
  (`--inject 1:hang@step=3`): rank 0 waits in the collective it comes to next
  (Lightning's SIGTERM-flag broadcast, the Trainer's all-gather of the items in
  the batch, DDP's all-reduce of the second batch, FSDP2's all-gather of the
  forward) and rank 1 is blamed;
- rank 1 slowed after each optimizer step (`--inject 1:slow=3x`: the drill
  sleeps in a global optimizer step hook, after the step, so before the next
  batch's collective) in a plain DDP loop that all-reduces a flag before every
  batch as Lightning does, under Lightning and under the Trainer: rank 1 is
  the straggler, and no other rank ever;
- two ranks that never initialise a process group: one warning, in the events,
  `ddtrain status` and the headless summary.

The runs start together (a module fixture), so that the seconds the hangs take
to be declared overlap; each test waits for its own. The Trainer's output folder
is made in its run's folder, so a rank stopped by a drill leaves it there, not in
/tmp.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import DDTRAIN, Collector, Run, collecting, finish, start, tagged_env
from test_api import wait_for

from ddtop.core import alone, wire
from ddtop.training import collectives

SCRIPTS = Path(__file__).parent / "scripts"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
RUN_TIMEOUT_S = 150
WAIT_S = 3.0  # every_collective.py: how late rank 1 comes to its barrier
JSONL = ("--foreground", "--headless", "--format", "jsonl", "--interval", "0.2")
# --hang-timeout 3: a rank descheduled for a second on these shared cores is not failed.
HANG = ("--inject", "1:hang@step=3", "--hang-timeout", "3")
SLOW = ("--inject", "1:slow=3x")


# -- in process -------------------------------------------------------------------------------
def test_the_wrapped_collectives_are_torchs_own_to_a_program_until_a_rank_is_watched() -> None:
    originals = {name: getattr(dist, name) for name in collectives.OPS}
    collectives.wrap()
    try:
        for name, original in originals.items():
            wrapped = getattr(dist, name)
            assert wrapped is not original and wrapped.__wrapped__ is original
            assert getattr(dist.distributed_c10d, name) is wrapped
            assert inspect.signature(wrapped) == inspect.signature(original)
            assert wrapped.__doc__ == original.__doc__
        # Where async_op is, under torch's own decorators; none for the object collectives.
        assert collectives._param_at(originals["all_reduce"], "async_op") == 3
        assert collectives._param_at(originals["barrier"], "async_op") == 1
        assert collectives._param_at(originals["all_to_all_single"], "async_op") == 5
        assert collectives._param_at(originals["all_gather_object"], "async_op") == -1
        collectives.wrap()  # idempotent: wrapped once
        assert dist.all_reduce.__wrapped__ is originals["all_reduce"]
        # No rank watched: straight through (torch's own error for no process group).
        with pytest.raises(ValueError, match="Default process group has not been initialized"):
            dist.all_reduce(torch.zeros(1))
    finally:
        collectives.unwrap()
    assert all(getattr(dist, name) is original for name, original in originals.items())


# -- ddtrain start: the frameworks, a straggler, ranks alone -----------------------------------
RUNS: dict[str, tuple[str, ...]] = {
    "lightning": (*JSONL, "-n", "2", *HANG, str(SCRIPTS / "fw_lightning.py")),
    "hf": (*JSONL, "-n", "2", *HANG, str(SCRIPTS / "fw_hf_trainer.py")),
    "accelerate": (*JSONL, "-n", "2", *HANG, str(SCRIPTS / "fw_accelerate.py")),
    "fsdp2": (*JSONL, "-n", "2", *HANG, str(SCRIPTS / "fsdp2_plain.py"), "--steps", "6"),
    # 300 steps of a few ms; rank 1 at three times its step time from the start.
    "slow": (*JSONL, "-n", "2", *SLOW, str(SCRIPTS / "flag_loop.py"), "--steps", "300"),
    # 40 steps each (STEPS): rank 1 is named after 16 to 20 steps of evidence.
    "lightning_slow": (*JSONL, "-n", "2", *SLOW, str(SCRIPTS / "fw_lightning.py")),
    "hf_slow": (*JSONL, "-n", "2", *SLOW, str(SCRIPTS / "fw_hf_trainer.py")),
    "alone": ("--foreground", "--headless", "-n", "2", str(SCRIPTS / "train_alone.py")),
}
# In the test extra (make test).
NEEDS = {"lightning": "lightning", "hf": "transformers", "accelerate": "accelerate",
         "lightning_slow": "lightning", "hf_slow": "transformers"}
# The hangs: 8 optimizer steps at most (6: 12 batches of Accelerate's); train_alone.py: 30.
ENV = {"lightning": {"STEPS": "8"}, "hf": {"STEPS": "8"}, "accelerate": {"STEPS": "6"},
       "lightning_slow": {"STEPS": "40"}, "hf_slow": {"STEPS": "40"}}


class Started:
    def __init__(self, root: Path, collector: Collector) -> None:
        self.root, self.collector = root, collector
        self.procs: dict[str, tuple[subprocess.Popen[str], str]] = {}
        self.done: dict[str, Run] = {}

    def result(self, name: str) -> Run:
        if name in NEEDS and not installed(NEEDS[name]):
            pytest.skip(f"{NEEDS[name]} is not installed (the test extra: make test installs it)")
        if name not in self.done:
            proc, tag = self.procs[name]
            self.done[name] = finish(proc, tag, timeout=RUN_TIMEOUT_S)
        return self.done[name]

    def status(self, name: str) -> dict[str, Any]:
        done = subprocess.run([DDTRAIN, "status", name, "--json"], cwd=self.root / name,
                              capture_output=True, text=True, timeout=30,
                              env=tagged_env("status"))
        assert done.returncode == 0, done.stderr
        status: dict[str, Any] = json.loads(done.stdout)
        return status


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Started]:
    """Every run of the module, started together: torchrun's, reporting to a
    collector of the fixture's, and ddtrain's."""
    root = tmp_path_factory.mktemp("collectives")
    with collecting() as collector:
        started = Started(root, collector)
        try:
            (root / "every").mkdir()
            started.procs["every"] = start(
                [*TORCHRUN, str(SCRIPTS / "every_collective.py")], root / "every",
                {"DDTOP_TELEMETRY": collector.endpoint, "DDTOP_RUN_ID": "every",
                 "OMP_NUM_THREADS": "1", "WAIT_S": str(WAIT_S)})
            for name, args in RUNS.items():
                if name in NEEDS and not installed(NEEDS[name]):
                    continue  # its test says so
                cwd = root / name
                cwd.mkdir()
                started.procs[name] = start([DDTRAIN, "start", "--run-id", name, *args], cwd,
                                            {"OMP_NUM_THREADS": "1", **ENV.get(name, {})})
            yield started
        finally:
            for name in started.procs:  # every run waited for (and killed on a timeout)
                if name not in started.done:
                    with contextlib.suppress(AssertionError):
                        started.result(name)


def jsonl(run: Run) -> list[dict[str, Any]]:
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def test_a_ddp_comm_hook_runs_as_itself_and_what_it_calls_is_not_another_collective() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    given = collectives.ddp_hook(allreduce_hook)
    assert given.__wrapped__ is allreduce_hook and given.__qualname__ == "allreduce_hook"
    assert inspect.signature(given) == inspect.signature(allreduce_hook)
    inside: list[bool] = []
    collectives.ddp_hook(lambda state, bucket: inside.append(collectives._thread.inside))(1, 2)
    assert inside == [True] and collectives._thread.inside is False
    assert collectives.ddp_hook("not a hook") == "not a hook"  # (DDP refuses it, as without ddtop)


# -- torchrun, the start-up hook -------------------------------------------------------------
@pytest.mark.processes
@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_every_collective_a_rank_enters_is_named_counted_and_its_wait_is_communication(
        runs: Started) -> None:
    run, collector = runs.result("every"), runs.collector
    assert run.returncode == 0, run.stderr[-3000:]
    wait_for(collector, wire.Bye, 2)
    assert collector.errors == 0 and run.leftovers == []
    assert [e.message for e in collector.of(wire.Event)] == []  # nothing failed
    assert {m.run for m in collector.messages} == {"every"}
    for rank in (0, 1):
        assert collector.of(wire.Hello, rank)[-1].collectives is True
        steps = collector.of(wire.Step, rank)
        assert sum(s.steps for s in steps) == 3
        # 17 collectives (the object collectives' own all-gathers and broadcasts are
        # part of them), 3 asynchronous ones, all_reduce taken by name before the
        # process group, the late barrier: 22, with their payloads.
        assert sum(s.comm_ops for s in steps) == 22
        assert sum(s.comm_bytes for s in steps) == 272 + 32 + 16
    # While rank 1 sleeps, rank 0 is in the barrier, number 22; rank 1 in none.
    # Its signature: the world group's 22nd collective (every one is the world's).
    late = wire.Collective(seq=22, op="barrier", bytes=0, group="world", group_size=2,
                           group_ranks="0,1", group_seq=22, dtype="", count=-1)
    waiting = [b for b in collector.of(wire.Heartbeat, 0) if b.coll_started == late]
    assert waiting and all(b.coll_completed is not None and b.coll_completed.seq == 21
                           for b in waiting), collector.of(wire.Heartbeat, 0)
    sleeping = [b for b in collector.of(wire.Heartbeat, 1)
                if b.global_step == 2 and b.coll_started is not None]
    assert sum(b.coll_started == b.coll_completed for b in sleeping) >= 2, sleeping
    # Rank 0's wait is communication (not its compute); rank 1's sleep is its compute.
    comm = {r: sum(s.comm_s for s in collector.of(wire.Step, r)) for r in (0, 1)}
    assert comm[0] > 0.8 * WAIT_S and comm[1] < 0.5 * WAIT_S, comm


@pytest.mark.parametrize(("name", "collective"), [("lightning", "broadcast"),
                                                  ("hf", "all_gather"),
                                                  ("accelerate", "allreduce"),
                                                  ("fsdp2", "all_gather")])
@pytest.mark.processes
@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_a_rank_hung_after_its_optimizer_step_is_blamed_under_a_framework(
        runs: Started, name: str, collective: str) -> None:
    run = runs.result(name)
    assert run.returncode == 1, run.stderr[-3000:]
    hangs = [line["hang"] for line in jsonl(run) if line["kind"] == "progress" and line["hang"]]
    # Rank 0 waits in the collective it comes to next (the framework's own before
    # its 4th batch; DDP's, FSDP2's in its 4th step); rank 1, hung after step 3,
    # never came to it.
    assert hangs and f"rank 0 wait in {collective} #" in hangs[-1], hangs
    # (between steps, outside its data loader: not "in data")
    assert "rank 1 is in Python between steps 3 and 4, outside any collective and its data loader" \
        in hangs[-1], hangs
    assert f"rank 1 hung for 3 s (--hang-timeout 3): rank 0 wait in {collective} #" in run.stderr
    got = runs.status(name)
    assert got["failure"]["rank"] == 1, got["failure"]
    # The framework saw torchrun's environment and started no rank of its own
    # (Accelerate: 3 optimizer steps of 2 batches each).
    assert [(r["rank"], r["global_step"]) for r in got["ranks"]] == [(0, 3), (1, 3)]
    assert got["rejected"] == {}
    assert run.leftovers == []


@pytest.mark.parametrize("name", ["slow", "lightning_slow", "hf_slow"])
@pytest.mark.processes
@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_a_rank_slow_before_the_next_batchs_collective_is_the_straggler(runs: Started,
                                                                        name: str) -> None:
    run = runs.result(name)
    assert run.returncode == 0, run.stderr[-2000:]
    progress = [line for line in jsonl(run) if line["kind"] == "progress"]
    named = [line for line in progress if line["stragglers"]]
    # Named while it ran, and no other rank ever: rank 0's wait for it in the flag's
    # all-reduce (Lightning's broadcast, the Trainer's all-gather) is communication,
    # not compute.
    assert named and all(line["stragglers"] == [1] for line in named), [
        (p["global_step"], p["stragglers"]) for p in progress]
    assert all(line["hang"] is None for line in progress)
    assert run.leftovers == []


@pytest.mark.processes
@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_ranks_that_never_communicate_are_told_once(runs: Started) -> None:
    run = runs.result("alone")
    assert run.returncode == 0, run.stderr[-2000:]
    said = (f"ranks 0-1 never communicated in {alone.ALONE_AFTER_STEPS} steps each: are they "
            "training independently?")
    events = [line for line in run.stdout.splitlines() if said in line]
    assert len(events) == 2, run.stdout  # the event, and the summary's line
    assert "[daemon] warning: " + said in events[0] and events[1].startswith("  warning: ")
    got = runs.status("alone")
    assert got["status"] == "succeeded" and said in got["alone"]
    shown = subprocess.run([DDTRAIN, "status", "alone"], cwd=runs.root / "alone",
                           capture_output=True, text=True, timeout=30, env=tagged_env("status"))
    assert f"  warning: {said}" in shown.stdout, shown.stdout
    assert [(r["rank"], r["global_step"]) for r in got["ranks"]] == [(0, 30), (1, 30)]
    assert run.leftovers == []


@pytest.mark.processes
@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_a_rank_stalled_in_its_data_loader_is_in_data_not_between_steps(tmp_path: Path) -> None:
    """The zero-code rank's DataLoader `__next__` (autowatch): rank 1's dataset sleeps
    8 s fetching its 5th batch while rank 0 waits in DDP's all-reduce of step 5."""
    proc, tag = start([DDTRAIN, "start", "--foreground", "--headless", "--format", "jsonl",
                       "--interval", "0.2", "-n", "2", "--run-id", "loader",
                       str(SCRIPTS / "plain_ddp.py")], tmp_path,
                      {"EPOCHS": "1", "STEPS": "8", "LOADER_SLEEP_RANK": "1",
                       "LOADER_SLEEP_BATCH": "5", "LOADER_SLEEP_S": "8"})
    run = finish(proc, tag, timeout=RUN_TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.leftovers == []
    hangs = [line["hang"] for line in jsonl(run) if line["kind"] == "progress" and line["hang"]]
    assert hangs and all("rank 1 is in data of step 5" in h for h in hangs), hangs
    assert all(h.startswith("rank 0 wait in allreduce #") for h in hangs), hangs
