"""Stragglers, honestly: on synthetic Step messages of ranks in DDP's lockstep
(each step lasts as long as the slowest rank's compute plus the all-reduce; a
faster rank spends the difference waiting in it), clean ranks with realistic
noise are never named, a rank that computes 1.5x as long is named within 20
steps and stays named while it lasts, is un-named when it recovers, and a
stopped rank names nobody. One real 2-rank run with a rank slowed by
`--inject RANK:slow=FACTORx@step=N` names that rank and no other."""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
from helpers import ddtrain
from test_state import RUN, beat, hello

from ddtop.core import stragglers, wire
from ddtop.core.state import RunState
from ddtop.dashboard import format as fmt

COMPUTE_S = 0.040  # a rank's own work per step (data, forward, backward, optimizer)
ALLREDUCE_S = 0.010  # the all-reduce itself, once the last rank arrives

# compute(rank, step) -> seconds, before noise
Work = Callable[[int, int], float]


def clean(rank: int, step: int) -> float:
    return COMPUTE_S


def slowed(who: int, start: int, end: int | None = None, factor: float = 1.5) -> Work:
    """Rank `who` computes `factor` times as long in steps start..end-1."""
    def work(rank: int, step: int) -> float:
        slow = rank == who and step >= start and (end is None or step < end)
        return COMPUTE_S * (factor if slow else 1.0)
    return work


class Ranks:
    """`world` ranks in lockstep, each sending every `per_message` steps a Step
    message of the steps since its previous one, as a rank's sender does."""

    def __init__(self, world: int, work: Work = clean, jitter: float = 0.2,
                 per_message: int = 1, seed: int = 0, spikes: bool = True,
                 trim: bool = True) -> None:
        self.world, self.work, self.jitter, self.per_message = world, work, jitter, per_message
        self.spikes = spikes
        self.trim = trim  # send compute_trim_s, as a rank's sender does
        self.computes: list[list[float]] = [[] for _ in range(world)]
        self.random = random.Random(seed)
        self.state = RunState(run=RUN)
        self.t = 100.0
        self.step = 0
        self.seq = [1] * world
        self.sums = [[0.0, 0.0] for _ in range(world)]  # step_s, comm_s since the last message
        for r in range(world):
            self.state.apply(msgspec.structs.replace(hello(r), world_size=world), self.t)
        self.stopped: set[int] = set()

    def noisy(self, seconds: float) -> float:
        """Realistic noise on a shared machine: `jitter` relative (normal, at
        least -80%) and, with `spikes`, one step in a hundred 2-5x as long (the
        rank descheduled for a while)."""
        x = seconds * max(0.2, 1.0 + self.random.gauss(0.0, self.jitter))
        if self.spikes and self.random.random() < 0.01:
            x += seconds * self.random.uniform(1.0, 4.0)
        return x

    def advance(self, steps: int = 1) -> Iterator[int]:
        """Run `steps` steps, folding each message when it is sent; yields the step."""
        for _ in range(steps):
            self.step += 1
            running = [r for r in range(self.world) if r not in self.stopped]
            compute = {r: self.noisy(self.work(r, self.step)) for r in running}
            step_s = max(compute.values()) + ALLREDUCE_S
            self.t += step_s
            for r in running:
                self.sums[r][0] += step_s
                self.sums[r][1] += step_s - compute[r]  # waits for the slowest, then reduces
                self.computes[r].append(compute[r])
                if self.step % self.per_message == 0:
                    self.send(r)
            yield self.step

    def send(self, rank: int) -> None:
        step_s, comm_s = self.sums[rank]
        n = self.per_message
        mine = self.computes[rank]
        trimmed = ((sum(mine) - max(mine)) / (len(mine) - 1)
                   if self.trim and len(mine) >= stragglers.TRIM_MIN_STEPS else None)
        self.computes[rank] = []
        self.state.apply(wire.Step(
            run=RUN, rank=rank, seq=self.seq[rank], t=self.t, epoch=0, step=self.step,
            steps_per_epoch=10**6, global_step=self.step, steps=n, samples=32 * n,
            loss_sum=64.0 * n, lr=0.1, step_s=step_s, data_s=0.0, forward_s=0.0, backward_s=0.0,
            optimizer_s=0.0, comm_s=comm_s, comm_bytes=10**6 * n, comm_ops=n, algbw_gbps=1.0,
            busbw_gbps=1.0, sync_wait_s=0.0, compute_trim_s=trimmed), self.t)
        self.seq[rank] += 1
        self.sums[rank] = [0.0, 0.0]

    def heartbeats(self) -> None:
        for r in range(self.world):
            if r not in self.stopped:
                self.state.apply(msgspec.structs.replace(
                    beat(r, self.seq[r], "backward", self.step), t=self.t), self.t)
                self.seq[r] += 1

    def named(self) -> list[int]:
        return self.state.stragglers()[2]


@pytest.mark.parametrize("world", [2, 8])
@pytest.mark.parametrize("per_message", [1, 3, 8])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_clean_noisy_ranks_are_never_named(world: int, per_message: int, seed: int) -> None:
    ranks = Ranks(world, per_message=per_message, seed=seed)
    named = [(step, ranks.state.stragglers()) for step in ranks.advance(3000)
             if ranks.state.stragglers() != (None, 0.0, [])]
    assert named == []


@pytest.mark.parametrize("world", [2, 8])
@pytest.mark.parametrize("per_message", [1, 3, 8])
def test_a_rank_one_and_a_half_times_slower_is_named_in_about_20_steps_and_kept(
        world: int, per_message: int) -> None:
    slow = world - 1
    latencies = []
    for seed in range(5):
        onset = 200 + seed  # anywhere in a window
        ranks = Ranks(world, slowed(slow, onset), per_message=per_message, seed=seed,
                      spikes=False)
        first = None
        for step in ranks.advance(onset + 300):
            named = ranks.named()
            if first is None and named:
                first = step
            # Nobody else, ever; and once named, named while it lasts.
            assert named == ([] if first is None else [slow]), (seed, step, named)
        assert first is not None
        latencies.append(first - onset)
    # Four windows of five steps (or of whole messages) over in a row: 20 steps,
    # give or take the window the slowdown began in and a noisy window or two.
    assert statistics.median(latencies) <= 25 and max(latencies) <= 50, latencies
    slowest, skew, slow_ranks = ranks.state.stragglers()
    # ... and shown as such: the slowest, by how long the others wait for it each step.
    assert (slowest, slow_ranks) == (slow, [slow])
    assert skew == pytest.approx(0.5 * COMPUTE_S, rel=0.5)
    rows = {row.rank: row for row in fmt.rank_rows(ranks.state, ranks.t)}
    assert rows[slow].slowest and rows[slow].straggler and rows[slow].problem
    assert not any(rows[r].straggler or rows[r].slowest for r in rows if r != slow)


def test_a_rank_that_recovers_is_un_named() -> None:
    ranks = Ranks(4, slowed(1, 100, end=300), seed=5)
    names = {step: ranks.named() for step in ranks.advance(600)}
    assert names[299] == [1]
    cleared = min(step for step in range(300, 601) if names[step] == [])
    assert cleared <= 300 + 5 * stragglers.WINDOW_STEPS
    assert all(names[step] == [] for step in range(cleared, 601))


def test_a_small_slowdown_is_no_straggler() -> None:
    # 10% slower than the others: they lose a few ms per 50 ms step, under the effect size.
    ranks = Ranks(8, slowed(3, 0, factor=1.1), seed=4)
    assert all(ranks.named() == [] for _ in ranks.advance(2000))


def test_a_stopped_rank_is_no_straggler_and_makes_none() -> None:
    ranks = Ranks(8, slowed(5, 100), seed=6)
    for _ in ranks.advance(200):
        pass
    assert ranks.named() == [5]
    # Rank 2 stops (SIGSTOP): the others block in the all-reduce, no rank sends a step,
    # heartbeats go on. Nobody new is named; rank 2's last window is no evidence.
    ranks.stopped.add(2)
    for _ in range(30):
        ranks.t += 1.0
        ranks.heartbeats()
        assert ranks.named() in ([5], [])
        assert 2 not in ranks.named()
    # After a while with no step from anyone, nobody is named: no fresh evidence.
    assert ranks.named() == []
    # Rank 2 resumes: the step it was stopped in took 30 s of its compute, once.
    # One window: it is not named, and rank 5 is again.
    ranks.stopped.clear()
    ranks.work = slowed(5, 0, factor=1.5)
    first = ranks.work
    ranks.work = lambda rank, step: 30.0 if rank == 2 and step == 201 else first(rank, step)
    seen: set[int] = set()
    for _ in ranks.advance(100):
        seen.update(ranks.named())
    assert seen == {5} and ranks.named() == [5]


def test_a_rank_that_stops_sending_names_no_other() -> None:
    # Without lockstep (a rank's telemetry lost, or ranks not in one all-reduce):
    # the others go on; rank 0 is never a reference again and nobody is named.
    ranks = Ranks(2, seed=7)
    for _ in ranks.advance(100):
        pass
    ranks.stopped.add(0)
    assert all(ranks.named() == [] for _ in ranks.advance(500))


def test_an_exited_rank_is_not_named() -> None:
    ranks = Ranks(2, slowed(1, 0), seed=8)
    for _ in ranks.advance(100):
        pass
    assert ranks.named() == [1]
    ranks.state.apply(wire.Bye(run=RUN, rank=1, seq=ranks.seq[1], t=ranks.t, exit_code=0),
                      ranks.t)
    assert ranks.state.stragglers() == (None, 0.0, [])


def test_a_restarted_rank_starts_without_a_verdict() -> None:
    ranks = Ranks(2, slowed(1, 0), seed=9)
    for _ in ranks.advance(100):
        pass
    assert ranks.named() == [1]
    ranks.state.apply(msgspec.structs.replace(hello(1, seq=0, pid=4242), world_size=2), ranks.t)
    assert ranks.named() == []


def test_the_verdict_survives_a_snapshot() -> None:
    from ddtop.core.state import decode_snapshot, encode_snapshot

    ranks = Ranks(4, slowed(2, 0), seed=10)
    for _ in ranks.advance(60):
        pass
    copy = decode_snapshot(encode_snapshot(ranks.state))
    assert copy == ranks.state and copy.stragglers() == ranks.state.stragglers() != (None, 0, [])


def test_median_of_the_others() -> None:
    values = [1.0, 2.0, 3.0, 10.0]
    assert stragglers._median_without(values, 10.0) == 2.0
    assert stragglers._median_without(values, 1.0) == 3.0
    assert stragglers._median_without([1.0, 4.0], 4.0) == 1.0
    assert stragglers._median_without([2.0, 2.0, 2.0], 2.0) == 2.0


# -- a real run ---------------------------------------------------------------------------
SLOW_RANK, SLOW_FROM = 1, 100


@pytest.mark.processes
def test_a_slowed_rank_of_a_real_run_is_named_and_no_other(tmp_path: Path) -> None:
    # Rank 1 takes 8x its step time from step 100 on (it sleeps 7x its own step
    # time after each step): the few-ms steps of this run become ~25 ms, nearly all
    # of them rank 0 waiting in the all-reduce for it. 300 steps: named within a
    # few windows of step 100, then 100 and more steps still named.
    run = ddtrain("start", "--foreground", "--headless", "--format", "jsonl", "--interval",
                  "0.2", "-n", "2", "--epochs", "1", "--synthetic-train-samples", "9600",
                  "--batch-size", "32", "--run-id", "slow",
                  "--inject", f"{SLOW_RANK}:slow=8x@step={SLOW_FROM}", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    progress = [line for line in lines if line["kind"] == "progress"]
    named = [(line["global_step"], line["stragglers"]) for line in progress if line["stragglers"]]
    assert named, progress[-1]
    assert all(slow == [SLOW_RANK] for _, slow in named), named
    first = min(step for step, _ in named)
    assert first >= SLOW_FROM, named
    late = [line for line in progress if line["global_step"] >= first + 50
            and all(r["state"] == "running" for r in line["ranks"])]
    assert late and all(line["stragglers"] == [SLOW_RANK] for line in late), late
