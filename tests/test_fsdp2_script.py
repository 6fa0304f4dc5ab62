"""A user's FSDP2 (`fully_shard`) script with no ddtop line, watched: every
all-gather and reduce-scatter FSDP2 does timed, its bytes exactly what FSDP2
moves (padding included), under `ddtrain start` and under `ddtrain watch --
torchrun` (the start-up hook, after the script imported `fully_shard`), the
same per step as the built-in trainer's `--strategy fsdp` on the same model;
with the API alone, `ddtop.watch(model)`; and an FSDP1 model said once not to
be timed. Real 2-rank gloo runs (the FSDP1
one: one rank)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from helpers import TORCHRUN, collecting, ddtrain, torch_aborted_at_exit, torchrun
from test_api import Sent, one_rank, wait_for
from torch import nn

from ddtop.core import wire

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fsdp2_plain.py"
sys.path.insert(0, str(SCRIPT.parent))
from fsdp2_plain import BUILTIN, MLP, TINY  # noqa: E402

WORLD = 2
STEPS = 5
TIMEOUT_S = 90


def padded_bytes(module: nn.Module, recurse: bool) -> int:
    """What FSDP2 all-gathers (or reduce-scatters) of `module`'s parameters on
    WORLD ranks: each padded to a multiple of WORLD rows."""
    return sum(math.ceil(p.shape[0] / WORLD) * WORLD * math.prod(p.shape[1:]) * p.element_size()
               for p in module.parameters(recurse=recurse))


def expected_per_step(model: nn.Module) -> tuple[int, int]:
    """(bytes, ops) of one training step: every Linear all-gathered for its
    forward and again for its backward (resharded after forward), its gradients
    reduce-scattered; the root's own parameters all-gathered once (the root keeps
    them after forward) and reduce-scattered."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    nbytes = sum(3 * padded_bytes(m, recurse=True) for m in linears)
    ops = 3 * len(linears)
    root = padded_bytes(model, recurse=False)
    if root:
        nbytes, ops = nbytes + 2 * root, ops + 2
    return nbytes, ops


def steps_of(sent: Sent, rank: int) -> list[wire.Step]:
    steps: list[wire.Step] = sent.of(wire.Step, rank)
    return steps


@pytest.mark.processes
@pytest.mark.timeout(2 * TIMEOUT_S + 30)
def test_an_fsdp2_script_with_no_ddtop_line_shows_comm_like_a_ddp_one(tmp_path: Path) -> None:
    bare = ddtrain("start", "--foreground", "-n", str(WORLD), "--run-id", "bare", str(SCRIPT),
                   "--", "--steps", str(STEPS), "--out", str(tmp_path / "bare"), cwd=tmp_path,
                   env={"DDTOP_TELEMETRY": "off"}, timeout=TIMEOUT_S)
    assert bare.returncode == 0, bare.stdout[-3000:] + bare.stderr[-3000:]
    run = ddtrain("start", "--foreground", "--headless", "--format", "jsonl", "-n", str(WORLD),
                  "--run-id", "fsdp2", str(SCRIPT), "--", "--steps", str(STEPS),
                  "--out", str(tmp_path / "watched"), cwd=tmp_path, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.leftovers == [] and bare.leftovers == []
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert [(r["rank"], r["state"], r["global_step"]) for r in summary["ranks"]] == [
        (0, "finished", STEPS), (1, "finished", STEPS)]
    assert all(r["comm_share"] and r["comm_share"] > 0 for r in summary["ranks"]), summary
    per_step, ops = expected_per_step(MLP(TINY, root_parameter=True))
    assert (per_step, ops) == (40928, 11)  # (the rows of 33 padded to 34)
    sent = Sent(tmp_path / "runs" / "fsdp2")
    counted = []
    for rank in range(WORLD):
        steps = steps_of(sent, rank)
        # FSDP2's all-gathers and reduce-scatters are signed: counted in the world
        # group's sequence, as the ranks say every 4 steps (core/desync.py compares).
        counted.append({c.global_step: dict(c.counts) for s in steps
                        if isinstance(s.group_counts, list) for c in s.group_counts})
        assert sum(s.steps for s in steps) == STEPS and steps[-1].global_step == STEPS
        assert sum(s.comm_bytes for s in steps) == STEPS * per_step
        assert sum(s.comm_ops for s in steps) == STEPS * ops
        assert sum(s.comm_s for s in steps) > 0
        for s in steps:  # all-gather and reduce-scatter: (n-1)/n; on CPU all of it waited for
            assert s.busbw_gbps == pytest.approx(s.algbw_gbps * (WORLD - 1) / WORLD, rel=1e-6)
            assert s.comm_overlap_s == 0.0
        # Phases: forward at the root's forward, backward after it (most of a step).
        assert sum(s.forward_s for s in steps) > 0 and sum(s.backward_s for s in steps) > 0
        assert sent.of(wire.Hello, rank)[-1].model == "MLP"
        assert sent.of(wire.Bye, rank)[-1].exit_code == 0
    assert counted[0] == counted[1] == {4: {"world": 4 * ops}}, counted
    assert not [e for e in sent.of(wire.Event) if e.type in ("warning", "error")]
    for rank in range(WORLD):  # watched, it trains exactly as without ddtop
        plain = torch.load(tmp_path / f"bare.rank-{rank}.pt")
        watched = torch.load(tmp_path / f"watched.rank-{rank}.pt")
        assert plain.keys() == watched.keys()
        assert all(torch.equal(plain[k], watched[k]) for k in plain)


@pytest.mark.processes
@pytest.mark.timeout(2 * TIMEOUT_S + 30)
def test_under_the_start_up_hook_it_moves_what_the_builtin_fsdp_strategy_does(
        tmp_path: Path) -> None:
    """The same model as the built-in trainer's mlp, sharded the same way (each
    Linear, then the root): under `ddtrain watch -- torchrun` (the script imports
    fully_shard before its process group exists, so before the rank is
    instrumented) the same bytes and ops per step as `--strategy fsdp`. Both
    evaluate (the built-in each epoch, the script after every step): those
    all-gathers are not a training step's. But an evaluation's forward joins the
    order FSDP2 prefetches by in the next backward, which then all-gathers the
    last layer once more: that all-gather is the step's (the built-in gathers
    every layer once for its evaluation and so has none)."""
    builtin = ddtrain("start", "--foreground", "-n", str(WORLD), "--run-id", "builtin",
                      "--strategy", "fsdp", "--model", "mlp", "--epochs", "1",
                      "--batch-size", "32", "--synthetic-train-samples", "128",
                      "--synthetic-val-samples", "16", cwd=tmp_path, timeout=TIMEOUT_S)
    assert builtin.returncode == 0, builtin.stdout[-3000:] + builtin.stderr[-3000:]
    for attempt in (1, 2):  # a second only after torch's abort at exit (helpers.py)
        watch = ddtrain("watch", "--run-id", f"script{attempt}", "--", TORCHRUN,
                        "--standalone", "--nproc-per-node", str(WORLD), str(SCRIPT),
                        "--model", "builtin", "--eval", "--steps", "4", cwd=tmp_path,
                        timeout=TIMEOUT_S)
        if attempt == 1 and torch_aborted_at_exit(watch, "the watched torchrun's ranks"):
            continue
        break
    assert watch.returncode == 0, watch.stdout[-3000:] + watch.stderr[-3000:]
    assert builtin.leftovers == [] and watch.leftovers == []
    model = MLP(BUILTIN, root_parameter=False)
    per_step, ops = expected_per_step(model)
    assert (per_step, ops) == (3 * sum(p.nbytes for p in model.parameters()), 9)
    last = padded_bytes([m for m in model.modules() if isinstance(m, nn.Linear)][-1], True)
    ours, theirs = Sent(tmp_path / "runs" / f"script{attempt}"), Sent(tmp_path / "runs" / "builtin")
    for rank in range(WORLD):
        mine, built = steps_of(ours, rank), steps_of(theirs, rank)
        assert sum(s.steps for s in mine) == sum(s.steps for s in built) == 4
        assert sum(s.comm_bytes for s in built) == 4 * per_step
        assert sum(s.comm_ops for s in built) == 4 * ops
        # Three steps follow an evaluation (not counted: 3 all-gathers each).
        assert sum(s.comm_bytes for s in mine) == 4 * per_step + 3 * last
        assert sum(s.comm_ops for s in mine) == 4 * ops + 3
        assert sum(s.comm_s for s in mine) > 0 and sum(s.comm_s for s in built) > 0
        assert ours.of(wire.Hello, rank)[-1].model == "MLP"
    assert not [e for e in ours.of(wire.Event) if e.type in ("warning", "error")]


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_an_fsdp1_model_trains_counted_and_timed_as_every_collective(tmp_path: Path) -> None:
    collector, out = one_rank(tmp_path, """
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        # Each Linear wrapped as well as the whole: the constructor runs three times.
        model = FSDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)),
                     auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
                     device_id=torch.device("cpu"))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
            optimizer.step()
        print("trained")
        """)
    assert "trained" in out
    steps = collector.of(wire.Step)
    # Its all-gathers and reduce-scatters go through the public collective functions
    # (training/collectives.py): timed, with their bytes, and nothing to warn of.
    assert sum(s.steps for s in steps) == 3 and sum(s.comm_bytes for s in steps) > 0
    warnings = [e.message for e in collector.of(wire.Event) if e.type == "warning"]
    assert warnings == []


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_with_the_api_alone_ddtop_watch_times_an_fsdp2_model(tmp_path: Path) -> None:
    """DDTOP_ZERO_CODE=off (no optimizer hook, nothing installed by the start-up
    hook): `ddtop.watch(model)` of a fully_shard model times its collectives,
    and the steps `ddtop.step()` counts carry them."""
    with collecting() as collector:
        run = torchrun("--standalone", "--nproc-per-node", str(WORLD), str(SCRIPT), "--api",
                       "--steps", str(STEPS), cwd=tmp_path,
                       env={"DDTOP_TELEMETRY": collector.endpoint, "DDTOP_ZERO_CODE": "off"},
                       timeout=TIMEOUT_S)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        wait_for(collector, wire.Bye, WORLD)
    assert run.leftovers == []
    per_step, ops = expected_per_step(MLP(TINY, root_parameter=True))
    for rank in range(WORLD):
        steps = collector.of(wire.Step, rank)
        assert sum(s.steps for s in steps) == STEPS
        assert sum(s.comm_bytes for s in steps) == STEPS * per_step
        assert sum(s.comm_ops for s in steps) == STEPS * ops
        assert sum(s.comm_s for s in steps) > 0
    assert not [e for e in collector.of(wire.Event) if e.type in ("warning", "error")]
