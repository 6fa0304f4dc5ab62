"""Every --strategy on 2 real gloo ranks: the same weights as one process with
the whole batch, the communication each must do (ops, bytes, bus bandwidth,
overlap) in its telemetry, checkpoints that resume, and the dashboard; the
same weights again on 3 ranks, where the ring takes two hops per phase and
every tensor splits into uneven pieces; and `fsdp` on a torch without FSDP2's
collectives is a one-line error while the other strategies still work.

One torchrun of tests/scripts/strategy_ranks.py runs all six strategies one
after another in the same ranks (start-up paid once), once with two ranks and
once with three; one pair of `ddtrain start` runs covers the built-in trainer
(fsdp, then resumed as ring).
"""

from __future__ import annotations

import argparse
import collections
import functools
import subprocess
import sys
import textwrap
import time
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import collecting, ddtrain, torchrun
from rich.console import Console
from test_ddp_correctness import SingleProcess, load_weights
from torch import nn

from ddtop.core import wire
from ddtop.core.config import TrainConfig
from ddtop.core.flags import add_train_arguments
from ddtop.core.state import RunState
from ddtop.core.strategy_names import STRATEGIES, SyncStrategy, comm_ops
from ddtop.dashboard import panels
from ddtop.training.data import SYNTHETIC_SPEC
from ddtop.training.models import build_model
from ddtop.training.strategies import BUILDERS

SCRIPT = Path(__file__).parent / "scripts" / "strategy_ranks.py"
sys.path.insert(0, str(SCRIPT.parent))
from strategy_ranks import BATCH, LR, SEED, STEPS, batches  # noqa: E402

WORLD = 2
# Three ranks: the ring's 2 hops per phase, and uneven pieces of every tensor
# (the MLP's 200704, 256, 32768, 128, 1280 and 10 elements, none divisible by 3;
# for fsdp, dims 0 of 256, 128 and 10 rows need padding).
WORLD_3 = 3
RUN_TIMEOUT_S = 90  # six strategies in one torchrun, ~10 s on 2 cores
DRAIN_S = 0.5  # the collector's last messages after torchrun returns


@dataclass
class Comm:
    """One strategy's telemetry on one rank, summed over its Step messages."""

    steps: int = 0
    ops: int = 0
    nbytes: int = 0
    comm_s: float = 0.0
    overlap_s: float | None = None
    algbw: float = 0.0
    busbw: float = 0.0


@dataclass
class StrategyRun:
    out: Path
    comm: dict[tuple[str, int], Comm]  # (strategy, rank)
    hellos: dict[str, str]  # run -> the strategy its hello named


@pytest.fixture(scope="module")
def strategy_run(tmp_path_factory: pytest.TempPathFactory) -> StrategyRun:
    out = tmp_path_factory.mktemp("strategies")
    with collecting() as collector:
        run = torchrun("--standalone", "--nproc-per-node", str(WORLD), str(SCRIPT), str(out),
                       cwd=out, env={"DDTOP_TELEMETRY": collector.endpoint},
                       timeout=RUN_TIMEOUT_S)
        time.sleep(DRAIN_S)
    assert run.returncode == 0, run.stdout + run.stderr
    assert not run.leftovers
    comm: dict[tuple[str, int], Comm] = collections.defaultdict(Comm)
    for m in collector.of(wire.Step):
        c = comm[(m.run.removeprefix("strategy-"), m.rank)]
        c.steps += m.steps
        c.ops += m.comm_ops
        c.nbytes += m.comm_bytes
        c.comm_s += m.comm_s
        c.algbw, c.busbw = m.algbw_gbps, m.busbw_gbps
        if not isinstance(m.comm_overlap_s, type(wire.UNSET)):
            c.overlap_s = (c.overlap_s or 0.0) + m.comm_overlap_s
    hellos = {m.run: m.strategy for m in collector.of(wire.Hello)}
    return StrategyRun(out, dict(comm), hellos)


@pytest.fixture(scope="module")
def strategy_run_3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """All six strategies on three ranks (weights only: no telemetry collected)."""
    out = tmp_path_factory.mktemp("strategies3")
    run = torchrun("--standalone", "--nproc-per-node", str(WORLD_3), str(SCRIPT), str(out),
                   cwd=out, env={"DDTOP_TELEMETRY": "off"}, timeout=RUN_TIMEOUT_S)
    assert run.returncode == 0, run.stdout + run.stderr
    assert not run.leftovers
    return out


@functools.cache
def one_process_weights(world: int = WORLD) -> dict[str, torch.Tensor]:
    """The same model, seed and batches in one process with the whole batch: the
    samples the ranks train on (BATCH // world each, the rest of a batch unused).
    Computed once a world size (every strategy is compared with it; only read)."""
    used = BATCH // world * world
    torch.manual_seed(SEED)
    model = build_model("mlp", SYNTHETIC_SPEC)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for x, y in batches()[:STEPS]:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x[:used]), y[:used]).backward()
        optimizer.step()
    return model.state_dict()


def assert_same_weights(out: Path, strategy: str, world: int) -> None:
    expected = one_process_weights(world)
    got = torch.load(out / f"{strategy}.pt", weights_only=True)
    assert sorted(got) == sorted(expected)  # fsdp's gathered state: the plain module's keys
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{strategy}, {n}: {m}")


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.processes
def test_same_weights_as_one_process(strategy_run: StrategyRun, strategy: str) -> None:
    assert_same_weights(strategy_run.out, strategy, WORLD)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.processes
def test_same_weights_as_one_process_on_3_ranks(strategy_run_3: Path, strategy: str) -> None:
    """Where 2 ranks cannot tell: the ring's chunk indices over two hops, and
    chunks of unequal size (tensor_split's first pieces are one longer)."""
    assert_same_weights(strategy_run_3, strategy, WORLD_3)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.processes
def test_checkpoint_state_resumes_the_same_training(strategy_run: StrategyRun,
                                                    strategy: str) -> None:
    """Model and optimizer state saved and loaded into a fresh model under the same
    strategy: one more step gives what the original's next step gives."""
    both = torch.load(strategy_run.out / f"{strategy}-resumed.pt", weights_only=True)
    for name, tensor in both["original"].items():
        torch.testing.assert_close(both["resumed"][name], tensor, rtol=0, atol=0)


@pytest.mark.processes
def test_telemetry_counts_what_each_strategy_must_do(strategy_run: StrategyRun) -> None:
    model = build_model("mlp", SYNTHETIC_SPEC)
    params = list(model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    layers = sum(isinstance(m, nn.Linear) for m in model.modules())
    expected_ops = {
        "ddp": 1,  # 0.94 MB of gradients: one bucket (DDP's first holds up to 1 MiB)
        "allreduce": len(params), "hooks": len(params), "hooks-async": len(params),
        "ring": len(params),
        # Per layer: all-gathered for forward, again for backward, reduce-scattered.
        "fsdp": 3 * layers,
    }
    expected_bytes = {s: param_bytes for s in STRATEGIES}
    expected_bytes["fsdp"] = 3 * param_bytes  # no padding: every dim 0 is even
    ring_factor = 2 * (WORLD - 1) / WORLD  # busbw / algbw of an all-reduce
    for strategy in STRATEGIES:
        assert strategy_run.hellos[f"strategy-{strategy}"] == strategy
        for rank in range(WORLD):
            c = strategy_run.comm[(strategy, rank)]
            what = f"{strategy} rank {rank}"
            assert c.steps == STEPS, what
            assert c.ops == STEPS * expected_ops[strategy], what
            assert c.nbytes == STEPS * expected_bytes[strategy], what
            assert c.comm_s > 0, what
            factor = (WORLD - 1) / WORLD if strategy == "fsdp" else ring_factor
            assert c.busbw == pytest.approx(c.algbw * factor, rel=1e-6), what
            # Overlap is measured for every strategy; blocking ones have none.
            assert c.overlap_s is not None, what
            if strategy in ("allreduce", "hooks", "ring", "fsdp"):
                assert c.overlap_s == 0.0, what
            assert 0.0 <= c.overlap_s <= c.comm_s, what


# As test_ddp_correctness's run (its SingleProcess is the reference), but with 33
# validation samples: rank 0 evaluates 2 batches of up to 16, rank 1 one batch.
TRAIN_ARGS = ("--world-size", "2", "--batch-size", "32", "--lr", "0.05", "--seed", "3",
              "--synthetic-train-samples", "256", "--synthetic-val-samples", "33",
              "--sync-every", "4")


@pytest.mark.processes
def test_trainer_checkpoints_fsdp_and_resumes_it_as_ring(tmp_path: Path) -> None:
    """The built-in trainer: epoch 1 under fsdp (gathered checkpoint, evaluation
    with a different number of batches per rank), epoch 2 resumed from it under ring; both
    checkpoints hold what one process with the whole batch computes."""
    env = {"DDTOP_TELEMETRY": "off"}
    first = ddtrain("start", "--foreground", *TRAIN_ARGS, "--epochs", "1", "--run-id", "s",
                    "--strategy", "fsdp", cwd=tmp_path, env=env, timeout=60)
    assert first.returncode == 0, first.stdout + first.stderr
    second = ddtrain("start", "--foreground", "--resume", "--run-id", "s", "--epochs", "2",
                     "--strategy", "ring", cwd=tmp_path, env=env, timeout=60)
    assert second.returncode == 0, second.stdout + second.stderr
    assert not first.leftovers and not second.leftovers
    root = tmp_path / "runs" / "s"
    checked = []

    def check(step: int, expected: dict[str, torch.Tensor]) -> None:
        if step % 8:
            return  # checkpoints at epoch ends only
        got = load_weights(root, step)
        for name, tensor in expected.items():
            torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name: f"step {step}, {n}: {m}")
        checked.append(step)

    SingleProcess().run(check)
    assert checked == [8, 16]


def test_the_flag_the_dashboard_and_the_trainer_name_the_same_strategies() -> None:
    """--strategy is declared once (core/strategy_names.py): the config field's
    type, the flag's choices, the comm panel's table and the trainer's
    implementations all list its names, in its order."""
    names = typing.get_args(SyncStrategy)
    assert len(names) == 6
    assert typing.get_type_hints(TrainConfig)["strategy"] == SyncStrategy
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    flag = next(a for a in parser._actions if a.dest == "strategy")
    assert tuple(flag.choices or ()) == names
    assert tuple(STRATEGIES) == names
    assert tuple(BUILDERS) == names
    assert [comm_ops(name) for name in names] == list(STRATEGIES.values())
    assert comm_ops("") == comm_ops("a-script's-own") == "all-reduce/step"


def test_dashboard_shows_the_strategy_and_its_overlap() -> None:
    state = RunState(run="r")
    hello = dict(run="r", local_rank=0, host="h", pid=1, device="cpu", backend="gloo",
                 world_size=1, config_digest="", model="mlp", dataset="synthetic", epochs=1,
                 global_batch=8)
    state.apply(wire.Hello(rank=0, strategy="hooks-async", **hello), 1.0)  # type: ignore[arg-type]
    state.apply(wire.Step(
        run="r", rank=0, seq=1, t=2.0, epoch=0, step=1, steps_per_epoch=10, global_step=1,
        steps=1, samples=8, loss_sum=8.0, lr=0.1, step_s=0.010, data_s=0.0, forward_s=0.002,
        backward_s=0.006, optimizer_s=0.002, comm_s=0.004, comm_bytes=6_000, comm_ops=6,
        algbw_gbps=0.0015, busbw_gbps=0.0015, sync_wait_s=0.0, comm_overlap_s=0.001), 2.0)
    console = Console(width=200)

    def shown(text: object) -> str:
        with console.capture() as capture:
            console.print(text)
        return capture.get()

    assert "strategy hooks-async" in shown(panels.header(state, 2.0))
    comm = shown(panels.comm(state, 2.0, 0, 10))
    assert "one per parameter from its hook, async" in comm
    assert "6 ops of" in comm
    assert "overlapped 25% (1.0 ms)" in comm


# What an older torch lacks: the private module FSDP2's collectives live in (and
# that `fsdp` times through). None in sys.modules makes importing it fail, as it
# does where it does not exist.
FSDP_COLLECTIVES = "torch.distributed.fsdp._fully_shard._fsdp_collectives"
BLOCK = f"import sys\nsys.modules[{FSDP_COLLECTIVES!r}] = None\n"


@pytest.mark.processes
def test_without_fsdp2_every_other_strategy_trains_and_fsdp_says_why() -> None:
    """The strategies module (which the trainer always imports) imports nothing of
    FSDP until `fsdp` is built."""
    code = BLOCK + textwrap.dedent("""
        import torch
        import torch.distributed as dist
        from ddtop.core.contract import UsageError
        from ddtop.training import strategies, trainer
        from ddtop.training.data import SYNTHETIC_SPEC
        from ddtop.training.models import build_model
        from ddtop.training.telemetry import Telemetry

        print("fsdp imported:", sorted(m for m in sys.modules if ".fsdp" in m and sys.modules[m]))
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        for name in strategies.BUILDERS:
            if name == "fsdp":
                continue
            model = build_model("mlp", SYNTHETIC_SPEC)
            strategy = strategies.build(name, model, torch.device("cpu"), Telemetry())
            strategy.backward(strategy.model(torch.randn(4, 1, 28, 28)).sum())
            assert all(p.grad is not None for p in model.parameters()), name
            print("trained", name)
        try:
            strategies.build("fsdp", build_model("mlp", SYNTHETIC_SPEC),
                             torch.device("cpu"), Telemetry())
        except UsageError as e:
            print("fsdp:", e)
        dist.destroy_process_group()
        """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "fsdp imported: []"
    assert lines[1:6] == [f"trained {s}" for s in STRATEGIES if s != "fsdp"]
    assert lines[6].startswith("fsdp: --strategy fsdp needs torch 2.9 or newer, this is "
                               f"torch {torch.__version__}"), lines[6]


@pytest.mark.processes
def test_ddtrain_start_fsdp_without_fsdp2_is_a_one_line_usage_error(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(BLOCK)  # in every process ddtrain starts
    run = ddtrain("start", "--foreground", "-n", "1", "--epochs", "1", "--strategy", "fsdp",
                  "--synthetic-train-samples", "64", "--synthetic-val-samples", "16",
                  cwd=tmp_path, env={"DDTOP_TELEMETRY": "off", "PYTHONPATH": str(tmp_path)},
                  timeout=60)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "Traceback" not in run.stdout + run.stderr
    assert run.stderr.splitlines()[-1].startswith(
        "ddtrain: error: --strategy fsdp needs torch 2.9 or newer"), run.stderr
    assert not run.leftovers
