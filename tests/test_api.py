"""`import ddtop` in a user's script, for real: a no-op without an endpoint; with
one, the right wire messages (real ZeroMQ PULL on loopback); strict mode; and
zero-code instrumentation of a real 2-rank gloo DDP script under `ddtrain start`
(its journal holds what the ranks sent); those eleven runs start together (a
module fixture)."""

from __future__ import annotations

import ast
import socket
import subprocess
import sys
import textwrap
import time
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import DDTRAIN, Collector, Together, collecting, finish, start, together

import ddtop
from ddtop.core import journal, wire
from ddtop.training.telemetry import LOSS_OVERWRITTEN

SCRIPTS = Path(__file__).resolve().parent / "scripts"
TIMEOUT_S = 60


def python(code: str, tmp_path: Path, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run `code` as a user's script would run (its own process, tagged, timed out)."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(code))
    proc, tag = start([sys.executable, str(script)], tmp_path, env)
    run = finish(proc, tag, TIMEOUT_S)
    assert run.leftovers == []
    return run.returncode, run.stdout, run.stderr


def test_every_phase_name_is_shown_as_a_wire_phase() -> None:
    """ddtop.phase's names map onto the wire's Phase; every phase a rank can be
    in has a name, but "done", which only the end of the rank enters."""
    wire_phases = set(typing.get_args(wire.Phase))
    assert set(ddtop.PHASES.values()) <= wire_phases
    assert wire_phases - set(ddtop.PHASES.values()) == {"done"}
    assert set(wire.STEP_PHASES) < wire_phases


@pytest.mark.processes
def test_without_an_endpoint_every_call_is_a_no_op(tmp_path: Path) -> None:
    code, out, err = python("""
        import sys, ddtop
        assert ddtop.init(total_steps=10) is False
        model = object()
        assert ddtop.watch(model) is model
        with ddtop.phase("eval"):
            ddtop.step(loss=1.0, samples=4)
        ddtop.log(acc=0.5, anything="is ignored")
        try:
            ddtop.phase("evaluating")
        except ValueError as e:
            print("ValueError:", e)
        print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'zmq', 'textual')))
        """, tmp_path)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("ValueError: ddtop.phase('evaluating'): not a phase")
    assert ast.literal_eval(lines[1]) == []


@pytest.mark.processes
def test_strict_without_an_endpoint_is_one_clear_error(tmp_path: Path) -> None:
    code, _, err = python("import ddtop\nddtop.init(strict=True)\n", tmp_path)
    assert code == 1
    assert ("ddtop.TelemetryUnavailable: ddtop.init(strict=True): DDTOP_TELEMETRY is not set"
            in err)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.mark.processes
def test_strict_with_nobody_listening_errors_and_with_a_receiver_passes(tmp_path: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    began = time.monotonic()
    code, _, err = python("import ddtop\nddtop.init(strict=True)\n", tmp_path,
                          {"DDTOP_TELEMETRY": endpoint})
    assert code == 1 and f"no ddtop receiver answered at {endpoint} within 5 s" in err, err
    assert time.monotonic() - began < 20
    with collecting() as collector:
        code, out, err = python("import ddtop\nprint(ddtop.init(strict=True))\n", tmp_path,
                                {"DDTOP_TELEMETRY": collector.endpoint})
    assert (code, out) == (0, "True\n"), err


@pytest.mark.processes
def test_ddtop_forwards_to_each_rank_the_live_side_starts(tmp_path: Path) -> None:
    """One live rank per process, owned by ddtop.training.api, which tells `ddtop`
    of each rank it starts: also after ddtop's first call found no endpoint (the
    live side loaded, as the built-in trainer loads it), and a second rank
    started after the first closed."""
    with collecting() as collector:
        code, _, err = python("""
            import os, ddtop
            from ddtop.training import api
            assert ddtop.init() is False  # no endpoint yet
            os.environ["DDTOP_TELEMETRY"] = os.environ["LATER"]
            for run in ("first", "second"):
                live = api.start(run=run)
                assert ddtop.init() is True
                ddtop.step(loss=1.0, samples=2)
                ddtop.step(loss=3.0, samples=2)
                live.close(0)
            """, tmp_path, {"LATER": collector.endpoint})
        assert code == 0, err
        wait_for(collector, wire.Bye, 2)
    for run in ("first", "second"):
        steps = [m for m in collector.of(wire.Step) if m.run == run]
        assert (sum(s.steps for s in steps), sum(s.loss_sum for s in steps)) == (2, 8.0), run


def wait_for(collector: Collector, kind: type, count: int = 1, timeout: float = 10.0) -> None:
    """Until `count` messages of `kind` arrived; fails after `timeout`."""
    deadline = time.monotonic() + timeout
    while len(collector.of(kind)) < count:
        assert time.monotonic() < deadline, f"{count} {kind.__name__} not received"
        time.sleep(0.05)


# The start of a one-rank gloo DDP script (`one_rank`).
ONE_RANK = """\
import os, time, torch, torch.distributed as dist, ddtop
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
"""


def one_rank(tmp_path: Path, body: str) -> tuple[Collector, str]:
    """`body` as a one-rank gloo DDP script with an endpoint: what it sent (all of
    it: until its bye) and what it printed."""
    with collecting() as collector:
        code, out, err = python(ONE_RANK + textwrap.dedent(body) +
                                "dist.destroy_process_group()\n", tmp_path,
                                {"DDTOP_TELEMETRY": collector.endpoint,
                                 "PORT": str(free_port())})
        assert code == 0, err
        wait_for(collector, wire.Bye)
    return collector, out


@pytest.mark.processes
def test_init_step_phase_log_send_the_right_messages(tmp_path: Path) -> None:
    with collecting() as collector:
        code, _, err = python("""
            import time, torch, ddtop
            ddtop.init(total_steps=10, epochs=2)
            for i in range(3):
                ddtop.step(loss=torch.tensor(2.0 + i), samples=4)
            ddtop.step(loss=torch.ones(3))  # weight 1, no samples
            with ddtop.phase("eval"):
                time.sleep(2.2)  # a heartbeat goes out meanwhile (one a second)
            ddtop.log(acc=0.5, n=3, flag=True, t=torch.tensor(0.25), bad="x",
                      **{"k" * 70: 1.0})
            """, tmp_path, {"DDTOP_TELEMETRY": collector.endpoint, "DDTOP_RUN_ID": "run-a",
                            "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
        assert code == 0, err
        wait_for(collector, wire.Bye)
    messages = collector.messages
    assert collector.errors == 0 and {m.run for m in messages} == {"run-a"}
    assert {m.rank for m in messages} == {1}
    hellos = collector.of(wire.Hello)
    assert hellos[0].program == "train.py" and hellos[0].world_size == 2
    assert (hellos[-1].total_steps, hellos[-1].epochs) == (10, 2)
    steps = collector.of(wire.Step)
    assert sum(s.steps for s in steps) == 4 and steps[-1].global_step == 4
    assert sum(s.samples for s in steps) == 12
    # (2 + 3 + 4) * 4 samples + 1.0 * 1, over weights 12 + 1
    assert sum(s.loss_sum for s in steps) == pytest.approx(37.0)
    assert sum(s.loss_weight for s in steps) == pytest.approx(13.0)
    assert (steps[-1].steps_per_epoch, steps[-1].epoch, steps[-1].step) == (5, 0, 4)
    assert "evaluation" in {b.phase for b in collector.of(wire.Heartbeat)}
    values = {k: v for s in collector.of(wire.Scalars) for k, v in s.values.items()}
    assert values == {"acc": 0.5, "n": 3.0, "flag": 1.0, "t": 0.25}
    warnings = [e.message for e in collector.of(wire.Event) if e.type == "warning"]
    assert any("bad=str is not a number" in w for w in warnings), warnings
    assert any("longer than 64 characters" in w for w in warnings), warnings
    assert collector.of(wire.Bye)[-1].exit_code == 0


@pytest.mark.processes
def test_a_samplers_set_epoch_is_the_epoch_and_a_bad_one_is_said_once(tmp_path: Path) -> None:
    """Zero-code (autowatch): each step goes with the epoch a DistributedSampler was
    last set to, and its steps in it; before any, the epoch is not known (null, not
    0). A value that is no epoch is left out with one warning; the script goes on."""
    with collecting() as collector:
        code, _, err = python("""
            import ddtop
            from torch.utils.data.distributed import DistributedSampler
            from ddtop.training import autowatch
            assert autowatch.install()
            sampler = DistributedSampler(range(8), num_replicas=1, rank=0)
            ddtop.step()
            sampler.set_epoch(0)
            ddtop.step(); ddtop.step()
            sampler.set_epoch("x"); sampler.set_epoch(-1)  # DistributedSampler takes them
            sampler.set_epoch(1); sampler.set_epoch(1)  # set twice: the same epoch goes on
            ddtop.step()
            assert sampler.epoch == 1
            """, tmp_path, {"DDTOP_TELEMETRY": collector.endpoint})
        assert code == 0, err
        wait_for(collector, wire.Bye)
    last = {s.epoch: (s.global_step, s.step) for s in collector.of(wire.Step)}
    assert last == {None: (1, 0), 0: (3, 2), 1: (4, 1)}, collector.of(wire.Step)
    warnings = [e.message for e in collector.of(wire.Event) if e.type == "warning"]
    assert len(warnings) == 1 and warnings[0].startswith("set_epoch(x): not an epoch"), warnings


@pytest.mark.processes
def test_a_loss_changed_in_place_before_it_is_read_is_left_out_and_said_once(
        tmp_path: Path) -> None:
    """ddtop's thread reads a loss tensor after `ddtop.step` returns (reading it
    there would cost the training thread a GIL hand-off per step). A script that
    writes the next value into the same tensor right after the call would have
    its losses read wrong: those are left out, never sent with the wrong value,
    and one warning says why and what to do."""
    with collecting() as collector:
        code, _, err = python("""
            import torch, ddtop
            ddtop.init()
            for i in range(10):
                ddtop.step(loss=torch.tensor(1.0 + i))  # a new tensor each step
            loss, losses = torch.zeros(()), torch.zeros(4)
            for i in range(10):
                loss.fill_(1.0 + i)
                ddtop.step(loss=loss)
                loss.fill_(1000.0)  # reused at once
            for i in range(5):
                losses.fill_(2.0)
                ddtop.step(loss=losses)
                losses.fill_(1000.0)
            """, tmp_path, {"DDTOP_TELEMETRY": collector.endpoint, "DDTOP_RUN_ID": "run-a",
                            "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
        assert code == 0, err
        wait_for(collector, wire.Bye)
    steps = collector.of(wire.Step)
    assert sum(s.steps for s in steps) == 25
    assert sum(s.loss_sum for s in steps) == pytest.approx(sum(range(1, 11)))
    assert sum(s.loss_weight for s in steps) == pytest.approx(10.0)
    warnings = [e.message for e in collector.of(wire.Event) if e.type == "warning"]
    assert warnings == [LOSS_OVERWRITTEN], warnings


class Sent:
    """What a run's ranks sent, from its telemetry journal, looked up as a
    Collector's messages are."""

    def __init__(self, run_root: Path) -> None:
        self.messages = [wire.decode([r.frame])
                         for r in journal.read(run_root / "telemetry.journal")]

    def of(self, kind: type, rank: int | None = None) -> list:  # type: ignore[type-arg]
        return [m for m in self.messages
                if isinstance(m, kind) and (rank is None or m.rank == rank)]


def run_script(runs: Together, name: str, run_id: str = "run-z",
               watched: bool = True) -> Sent | None:
    """A run `scripts` started, ended: what its ranks sent (unwatched: None)."""
    run = runs.result(name)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.leftovers == []
    return Sent(runs.cwd(name) / "runs" / run_id) if watched else None


ZERO_CODE = [
    (["--steps", "6", "--accum", "3"], 6),  # no_sync() micro-batches are not steps
    (["--steps", "6", "--accum", "2", "--by-hand", "--skip-step", "2"], 5),  # GradScaler skips
    (["--steps", "4", "--accum", "2", "--ddtop-step"], 4),  # ddtop.step too: not twice
    # ddtop.step every iteration, one skipped by GradScaler: counted, as the script says
    (["--steps", "5", "--accum", "2", "--skip-step", "1", "--ddtop-step"], 5),
]
# Each run of a trained pair (in a folder of its own), without ddtop and with it.
PAIRS = {"buckets": [], "own-hook": ["--own-hook"], "builtin-hook": ["--builtin-hook"]}
TOGETHER_TIMEOUT_S = 150  # eleven runs at once on shared cores


@pytest.fixture(scope="module")
def scripts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Together]:
    """The scripts under `ddtrain start --foreground`, 2 ranks, zero lines changed
    (as a user runs them; unwatched: with DDTOP_TELEMETRY=off, as without ddtop),
    started together (their start-ups overlap): `zero-K` (ZERO_CODE[K]), each
    pair's `NAME-plain` and `NAME-watched`, and `gan`."""
    with together(tmp_path_factory.mktemp("scripts")) as runs:
        def script(name: str, *args: str, file: str = "ddp_accum.py", run_id: str = "run-z",
                   watched: bool = True, folder: str | None = None) -> None:
            runs.start(name, [DDTRAIN, "start", "--foreground", "-n", "2", "--run-id", run_id,
                              str(SCRIPTS / file), "--", *args],
                       None if watched else {"DDTOP_TELEMETRY": "off"}, TOGETHER_TIMEOUT_S,
                       folder)

        for k, (args, _) in enumerate(ZERO_CODE):
            script(f"zero-{k}", *args)
        for pair, hook in PAIRS.items():
            out = runs.root / pair
            script(f"{pair}-plain", *hook, "--out", str(out / "plain.pt"), run_id="plain",
                   watched=False, folder=pair)
            script(f"{pair}-watched", *hook, "--out", str(out / "watched.pt"), folder=pair)
        script("gan", "5", file="ddp_gan.py", run_id="gan")
        yield runs


# Parameters of ddp_accum.py's model, in bytes: one all-reduce of each per step.
PARAM_BYTES = (32 * 64 + 64 + 64 * 4 + 4) * 4


@pytest.mark.parametrize("k", range(len(ZERO_CODE)), ids=[f"args{k}-{steps}" for k, (_, steps)
                                                           in enumerate(ZERO_CODE)])
@pytest.mark.processes
def test_zero_code_counts_optimizer_steps_and_times_ddp(scripts: Together, k: int) -> None:
    args, steps = ZERO_CODE[k]
    collector = run_script(scripts, f"zero-{k}")
    assert collector is not None
    for rank in (0, 1):
        sent = collector.of(wire.Step, rank)
        assert sum(s.steps for s in sent) == steps and sent[-1].global_step == steps
        updates = int(args[1])  # every optimizer step all-reduces once, skipped or not
        assert sum(s.comm_bytes for s in sent) == updates * PARAM_BYTES
        assert sum(s.comm_ops for s in sent) >= updates and sum(s.comm_s for s in sent) > 0
        assert collector.of(wire.Hello, rank)[-1].model == "Sequential"
        assert collector.of(wire.Bye, rank)[-1].exit_code == 0
        if "--ddtop-step" in args:  # every call's loss and samples went with a step
            assert sum(s.samples for s in sent) == steps * 16
            assert sum(s.loss_weight for s in sent) == steps * 16
            # ... in the same message: the hook's step waits for its loss
            assert all(s.loss_weight == s.steps * 16 for s in sent), sent
    assert not [e for e in collector.of(wire.Event) if e.type in ("warning", "error")]


@pytest.mark.processes
def test_ddtops_hook_trains_as_ddp_alone_over_several_buckets(scripts: Together) -> None:
    # ddp_accum.py's model has several buckets: the earlier ones all-reduced
    # asynchronously, the last one waited for inside ddtop's hook.
    tmp_path = scripts.cwd("buckets-watched")
    run_script(scripts, "buckets-plain", run_id="plain", watched=False)
    collector = run_script(scripts, "buckets-watched")
    assert collector is not None
    plain, watched = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "watched.pt")
    assert plain.keys() == watched.keys()
    assert all(torch.equal(plain[k], watched[k]) for k in plain)
    for rank in (0, 1):
        sent = collector.of(wire.Step, rank)
        assert sum(s.steps for s in sent) == 6
        assert sum(s.comm_bytes for s in sent) == 6 * PARAM_BYTES
        # One bucket at the first step (DDP's first bucket is large), several after
        # DDP rebuilds them.
        assert sum(s.comm_ops for s in sent) > 6 and all(s.comm_s > 0 for s in sent), \
            [(s.steps, s.comm_ops, s.comm_s) for s in sent]


@pytest.mark.processes
@pytest.mark.timing  # its 0.3 s bounds: run alone (make test), not beside other tests
def test_on_cpu_a_long_all_reduce_is_read_or_estimated_and_a_long_compute_is_read(
        tmp_path: Path) -> None:
    """DDP times at most one iteration in 10 ms (after the first 20): of 70 steps
    of a few ms many are not timed, and are estimated from the recent readings.
    A step whose all-reduce takes 0.3 s (the user's hook waits, as a rank does
    for another that evaluates) is given its 0.3 s whether it was timed or not
    (here: one that was not), and leaves the estimates alone; a step that
    computes 0.3 s longer, timed, is read exactly: its time is compute, not
    communication. (Which steps are due is set by hand, as the clock would:
    the same on any machine.)"""
    collector, out = one_rank(tmp_path, """
            import math
            from ddtop.training.api import WATCHED_ATTR
            slow = [False]
            def hook(state, bucket):
                if slow[0]:
                    time.sleep(0.3)
                return allreduce_hook(state, bucket)
            model = ddtop.watch(DDP(torch.nn.Linear(64, 64)))
            model.register_comm_hook(None, hook)
            stats = model.__dict__[WATCHED_ATTR].stats
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            long_compute, long_comm = 35, 50
            for step in range(1, 71):
                if step in (long_compute, long_comm):  # due, or not (as 10 ms would make it)
                    stats._next_read = -math.inf if step == long_compute else math.inf
                out = model(torch.ones(8, 64)).sum()
                timed = stats.timed == stats.iteration
                if step == long_compute:
                    time.sleep(0.3)
                slow[0] = step == long_comm
                if step in (long_compute, long_comm):
                    print(step, timed)
                    stats._next_read = 0.0  # as it comes
                out.backward()
                opt.step()
                opt.zero_grad()
                ddtop.step(samples=8)
        """)
    assert out.split() == ["35", "True", "50", "False"], out
    long_compute, long_comm = 35, 50
    sent = collector.of(wire.Step)
    assert sum(s.steps for s in sent) == 70
    assert sum(s.comm_bytes for s in sent) == 70 * (64 * 64 + 64) * 4
    assert sum(s.comm_ops for s in sent) == 70

    def window(step: int) -> wire.Step:
        (w,) = [s for s in sent if s.global_step >= step and s.global_step - s.steps < step]
        return w

    long, stalled = window(long_comm), window(long_compute)
    assert 0.29 <= long.comm_s <= 0.3 + 0.05 * long.steps, long
    assert long.step_s - long.comm_s < 0.2, long  # (the 0.3 s is not compute)
    assert stalled.step_s >= 0.3 and stalled.comm_s < 0.05 * stalled.steps, stalled
    others = [s for s in sent if s is not long and s is not stalled]
    assert all(0 < s.comm_s < 0.05 * s.steps for s in others), [
        (s.steps, s.comm_s) for s in others]


@pytest.mark.processes
def test_on_cpu_a_step_quicker_than_the_recent_compute_still_has_its_all_reduce(
        tmp_path: Path) -> None:
    """Steps 21-40 compute 20 ms and are timed; steps 41-60 take about a
    millisecond and are not (set by hand; 46-60 are sent apart from the rest,
    after a pause outside the steps): each is quicker than the recent
    compute, so its time less that compute is nothing, and it is given the
    all-reduce's usual share of its time instead, never 0 (the run's last step,
    whose reading never comes, is often such a step)."""
    collector, _ = one_rank(tmp_path, """
            import math
            from ddtop.training.api import WATCHED_ATTR
            model = ddtop.watch(DDP(torch.nn.Linear(64, 64)))
            stats = model.__dict__[WATCHED_ATTR].stats
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            for step in range(1, 61):
                if step > 20:
                    stats._next_read = -math.inf if step <= 40 else math.inf
                out = model(torch.ones(8, 64)).sum()
                if 20 < step <= 40:
                    time.sleep(0.02)
                out.backward()
                opt.step()
                opt.zero_grad()
                ddtop.step(samples=8)
                if step == 45:
                    with ddtop.phase("eval"):  # (not step time)
                        time.sleep(0.3)  # steps 46-60 in windows of their own
        """)
    sent = collector.of(wire.Step)
    assert sum(s.steps for s in sent) == 60 and sum(s.comm_ops for s in sent) == 60
    quick = [s for s in sent if s.global_step - s.steps >= 45]
    assert quick and sum(s.steps for s in quick) == 15, [(s.global_step, s.steps) for s in sent]
    assert all(0 < s.comm_s < s.step_s for s in quick), [(s.steps, s.comm_s, s.step_s)
                                                         for s in quick]


@pytest.mark.processes
def test_a_compiled_model_on_cpu_is_timed(tmp_path: Path) -> None:
    """torch.compile traces the model's forward: ddtop's marks there still run
    (as Python, the model compiled as it would be), so comm is timed."""
    collector, out = one_rank(tmp_path, """
            model = ddtop.watch(DDP(torch.nn.Linear(16, 4)))
            compiled = torch.compile(model, backend="eager")
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            for _ in range(30):
                compiled(torch.ones(8, 16)).sum().backward()
                opt.step()
                opt.zero_grad()
                ddtop.step(samples=8)
            print("trained")
        """)
    assert out == "trained\n"
    sent = collector.of(wire.Step)
    assert sum(s.steps for s in sent) == 30
    assert sum(s.comm_bytes for s in sent) == 30 * (16 * 4 + 4) * 4
    # (the first step's time, and so its comm, can be 0: set-up is not step time)
    assert sum(s.comm_s for s in sent) > 0
    assert all(s.comm_s <= s.step_s for s in sent), [(s.comm_s, s.step_s) for s in sent]
    assert not [e for e in collector.of(wire.Event) if e.type == "warning"]


@pytest.mark.processes
def test_on_cpu_a_forward_with_no_backward_is_not_an_all_reduce(tmp_path: Path) -> None:
    """An evaluation with gradients on (model.eval() without no_grad), or a step
    skipped before backward: DDP all-reduces nothing, and neither does ddtop
    count or name one."""
    collector, out = one_rank(tmp_path, """
            model = ddtop.watch(DDP(torch.nn.Linear(16, 4)))
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            def train(n):
                model.train()
                for _ in range(n):
                    model(torch.ones(8, 16)).sum().backward()
                    opt.step()
                    opt.zero_grad()
                    ddtop.step(samples=8)
            train(10)
            model.eval()
            for _ in range(20):
                model(torch.ones(8, 16)).sum()  # no backward
            train(10)
            print("trained")
        """)
    assert out == "trained\n"
    sent = collector.of(wire.Step)
    assert sum(s.steps for s in sent) == 20
    assert sum(s.comm_bytes for s in sent) == 20 * (16 * 4 + 4) * 4
    assert sum(s.comm_ops for s in sent) == 20


@pytest.mark.parametrize("hook", ["--own-hook", "--builtin-hook"])
@pytest.mark.processes
def test_a_users_own_comm_hook_is_kept_timed_and_trains_the_same(scripts: Together,
                                                                 hook: str) -> None:
    pair = hook.removeprefix("--")
    tmp_path = scripts.cwd(f"{pair}-watched")
    run_script(scripts, f"{pair}-plain", run_id="plain", watched=False)
    collector = run_script(scripts, f"{pair}-watched")
    assert collector is not None
    plain, watched = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "watched.pt")
    assert plain.keys() == watched.keys()
    assert all(torch.equal(plain[k], watched[k]) for k in plain)
    sent = collector.of(wire.Step, 0)
    assert sum(s.comm_bytes for s in sent) == 6 * PARAM_BYTES


@pytest.mark.processes
def test_watch_on_a_model_with_a_hook_already_times_it_and_says_what_is_not_ddp_once(
        tmp_path: Path) -> None:
    """On CPU a model's comm is timed from DDP's own statistics, whatever hook it
    has (on a GPU, ddtop's timing hook cannot join one registered before watch:
    it says so, see test_gpu.py); watching twice is watching once."""
    collector, _ = one_rank(tmp_path, """
            model = DDP(torch.nn.Linear(4, 2))
            model.register_comm_hook(None, allreduce_hook)
            ddtop.watch(model)
            ddtop.watch(model)
            ddtop.watch(torch.nn.Linear(2, 2))
            ddtop.watch(torch.nn.Linear(2, 2))
            for _ in range(3):
                model(torch.ones(1, 4)).sum().backward()
                ddtop.step()
        """)
    warnings = [e.message for e in collector.of(wire.Event) if e.type == "warning"]
    assert len(warnings) == 1, warnings
    assert "Linear is not DistributedDataParallel" in warnings[0]
    sent = collector.of(wire.Step)
    assert sum(s.steps for s in sent) == 3
    assert sum(s.comm_bytes for s in sent) == 3 * (4 * 2 + 2) * 4  # once per step, not twice
    assert sum(s.comm_ops for s in sent) == 3 and sum(s.comm_s for s in sent) > 0


@pytest.mark.processes
def test_import_ddtop_is_cheap() -> None:
    run = subprocess.run([sys.executable, "-X", "importtime", "-c", "import ddtop"],
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 0
    assert "torch" not in run.stderr and "zmq" not in run.stderr


@pytest.mark.processes
def test_a_watched_model_can_be_deep_copied_and_still_trains(tmp_path: Path) -> None:
    """An EMA copy (copy.deepcopy of the DDP model) shares the timer instead of
    failing to copy its lock and sender; the copy's own forwards (evaluated with
    gradients on, its own reducer counting them) leave the model's count of
    DDP's iterations, and so its readings, alone."""
    with collecting() as collector:
        code, out, err = python("""
            import copy, os, torch, torch.distributed as dist, ddtop
            from torch.nn.parallel import DistributedDataParallel as DDP
            from ddtop.training.api import WATCHED_ATTR
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
            dist.init_process_group("gloo", rank=0, world_size=1)
            model = ddtop.watch(DDP(torch.nn.Linear(4, 2)))
            ema = copy.deepcopy(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(30):
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
                ddtop.step()
                ema(torch.ones(2, 4))
            stats = model.__dict__[WATCHED_ATTR].stats
            print("copied", type(ema).__name__, stats.iteration, stats.timings >= 20)
            dist.destroy_process_group()
            """, tmp_path, {"DDTOP_TELEMETRY": collector.endpoint, "PORT": str(free_port())})
        assert code == 0, err
        assert out == "copied DistributedDataParallel 30 True\n"
        wait_for(collector, wire.Bye)
    assert sum(s.steps for s in collector.of(wire.Step)) == 30
    assert sum(s.comm_ops for s in collector.of(wire.Step)) == 30


@pytest.mark.processes
def test_a_gan_counts_one_step_per_iteration_with_ddtop_step(scripts: Together) -> None:
    """Two models, two optimizers, the second model's forward between the first
    optimizer's step and ddtop.step: one step per iteration, not two."""
    collector = run_script(scripts, "gan", run_id="gan")
    assert collector is not None
    for rank in (0, 1):
        sent = collector.of(wire.Step, rank)
        assert sum(s.steps for s in sent) == 5 and sent[-1].global_step == 5
        assert sum(s.samples for s in sent) == 5 * 16


@pytest.mark.processes
def test_watch_then_an_own_hook_outside_ddtrain_is_timed_not_an_error(tmp_path: Path) -> None:
    """The documented order (watch, then register_comm_hook) under plain torchrun:
    the user's hook communicates as it would alone, timed; so is a model with a
    built-in hook registered before watch (on CPU, from DDP's statistics; on a
    GPU watch says it cannot, never raising: test_gpu.py)."""
    collector, out = one_rank(tmp_path, """
            model = ddtop.watch(DDP(torch.nn.Linear(4, 2)))
            model.register_comm_hook(None, allreduce_hook)
            for _ in range(3):
                model(torch.ones(1, 4)).sum().backward()
                ddtop.step(loss=1.0)
            builtin = DDP(torch.nn.Linear(4, 2))
            builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
            ddtop.watch(builtin)
            builtin(torch.ones(1, 4)).sum().backward()
            ddtop.step(loss=1.0)
            print("trained")
        """)
    assert out == "trained\n"
    sent = collector.of(wire.Step)
    # the user's hook, timed, then the built-in one
    assert sum(s.comm_bytes for s in sent) == 4 * (4 * 2 + 2) * 4
    assert sum(s.comm_s for s in sent) > 0
    warnings = [e.message for e in collector.of(wire.Event) if e.type == "warning"]
    assert warnings == []


@pytest.mark.processes
def test_with_the_api_alone_a_rank_leaves_setup_and_steps_take_time(tmp_path: Path) -> None:
    """No ddtop.phase call at all: after the first step the rank is in a step phase
    (never shown in 'setup' for the whole run, then stalled), and every step's
    time counts."""
    with collecting() as collector:
        code, _, err = python("""
            import time, ddtop
            for i in range(30):
                time.sleep(0.05)
                ddtop.step(loss=1.0)
            time.sleep(1.2)  # heartbeats go out meanwhile
            """, tmp_path, {"DDTOP_TELEMETRY": collector.endpoint})
        assert code == 0, err
        wait_for(collector, wire.Bye)
    steps = collector.of(wire.Step)
    assert sum(s.steps for s in steps) == 30
    # The first step's time is set-up (not counted); the 29 after it, ~0.05 s each.
    assert sum(s.step_s for s in steps) >= 29 * 0.045, [s.step_s for s in steps]
    late = [b for b in collector.of(wire.Heartbeat) if b.global_step >= 1]
    # ("done": a heartbeat due just as the script ends goes out after its last phase)
    assert any(b.phase == "data" for b in late) and all(
        b.phase in ("data", "done") for b in late), [b.phase for b in late]
