"""Memory creeping (core/memcreep.py): the rule on synthetic readings, and the fold
on synthetic Step messages, where it is said (the headless line, the summary,
the rank's detail, /metrics)."""

from __future__ import annotations

import msgspec
import pytest
from test_state import RUN, hello

from ddtop.core import memcreep, wire
from ddtop.core.memcreep import Creep
from ddtop.core.printer import progress_text
from ddtop.core.state import RunState

MIB = 1 << 20
GIB = 1 << 30


def fed(readings: list[tuple[float, int]]) -> Creep:
    creep = Creep()
    for t, memory in readings:
        creep.add(t, memory)
    return creep


def test_memory_that_grows_steadily_for_five_minutes_is_creeping() -> None:
    start = int(1.2 * GIB)
    steady = [(10.0 * i, start + int(2 * MIB * i)) for i in range(37)]  # 12 MiB/min, 6 min
    creep = fed(steady)
    assert creep.rate() == pytest.approx(12 * MIB / 60)
    assert creep.words() == "memory creeping: +12.0 MiB/min for 6 min (1.20 GiB -> 1.27 GiB)"
    # Not before 5 minutes, nor by less than 64 MiB (and 5%).
    assert fed(steady[:30]).words() is None
    assert fed([(10.0 * i, start + int(0.1 * MIB * i)) for i in range(60)]).words() is None
    # Small dips (an allocator giving some back) do not break the run; a fall of
    # more than 16 MiB (or 2%) below its highest begins a new one.
    dipping = [(t, m - (8 * MIB if i % 5 == 4 else 0)) for i, (t, m) in enumerate(steady)]
    assert fed(dipping).words() is not None
    fallen = steady[:20] + [(200.0, start)] + [(t, m) for t, m in steady[21:]]
    assert fed(fallen).rate() is None  # its run began again at 200 s: not 5 minutes
    # Grown at start-up, then flat: not a leak (its run begins again once flat for 2 min).
    warm = [(10.0 * i, start + int(40 * MIB * min(i, 10))) for i in range(37)]
    assert fed(warm).words() is None
    # Readings closer than SAMPLE_S are not looked at; none at all is nothing.
    assert fed([(0.0, GIB), (1.0, 2 * GIB)]).last == GIB
    assert Creep().words() is None and Creep().rate() is None
    assert memcreep.SAMPLE_S == 10.0


def test_a_creeping_rank_is_said_where_a_run_is_read() -> None:
    from ddtop.daemon.metricreading import read

    state = RunState(run=RUN)
    for r in (0, 1):
        state.apply(msgspec.structs.replace(hello(r), world_size=2), 0.0)
    for i in range(1, 38):
        t = 10.0 * i
        for r in (0, 1):
            rss = GIB + (int(2 * MIB * i) if r == 1 else 0)
            state.apply(wire.Step(
                run=RUN, rank=r, seq=i, t=t, epoch=0, step=i, steps_per_epoch=10**6,
                global_step=i, steps=1, samples=32, loss_sum=64.0, lr=0.1, step_s=0.1,
                data_s=0.0, forward_s=0.1, backward_s=0.0, optimizer_s=0.0, comm_s=0.0,
                comm_bytes=0, comm_ops=0, algbw_gbps=0.0, busbw_gbps=0.0, sync_wait_s=0.0,
                rss=rss, rss_peak=rss + MIB), t)
    words = "memory creeping: +12.0 MiB/min for 6 min (1.00 GiB -> 1.07 GiB)"
    assert state.creeping() == {1: words}
    assert f"; rank 1 {words}" in progress_text(state, 370.0)
    summary = state.summary(370.0)
    assert summary.memory_creeping == {1: words}
    assert [(r.memory, r.memory_peak) for r in summary.ranks] == [
        (GIB, GIB + MIB), (GIB + 74 * MIB, GIB + 75 * MIB)]
    reading = {r.labels[1]: r for r in read(state, 370.0).ranks}
    assert reading["1"].creep == pytest.approx(12 * MIB / 60) and reading["0"].creep is None
    assert (reading["1"].rss, reading["1"].rss_peak) == (GIB + 74 * MIB, GIB + 75 * MIB)
    from ddtop.dashboard import panels

    shown = panels.detail(state, 1, 370.0).plain
    assert words in shown and "memory 1.2 GB (peak 1.2 GB)" in shown, shown  # (decimal)


def test_the_rank_detail_charts_each_ranks_memory() -> None:
    """Each step's reading keeps the rank's memory (CUDA allocated where it uses CUDA,
    else its RSS) for the rank detail's chart; thinning keeps the peaks; the chart's
    title says what it charts."""
    from ddtop.core.rankview import merge_points
    from ddtop.dashboard.panels import memory_title

    state = RunState(run=RUN)
    for r in (0, 1):
        state.apply(msgspec.structs.replace(hello(r), world_size=2), 0.0)
    for i in range(1, 4):
        for r in (0, 1):
            state.apply(wire.Step(
                run=RUN, rank=r, seq=i, t=float(i), epoch=0, step=i, steps_per_epoch=100,
                global_step=i, steps=1, samples=32, loss_sum=64.0, lr=0.1, step_s=0.1,
                data_s=0.0, forward_s=0.1, backward_s=0.0, optimizer_s=0.0, comm_s=0.0,
                comm_bytes=0, comm_ops=0, algbw_gbps=0.0, busbw_gbps=0.0, sync_wait_s=0.0,
                rss=GIB + i * MIB, cuda_allocated=(i * MIB if r == 1 else None)), float(i))
    cpu, cuda = state.ranks[0], state.ranks[1]
    assert [p.memory for p in cpu.history] == [GIB + MIB, GIB + 2 * MIB, GIB + 3 * MIB]
    assert [p.memory for p in cuda.history] == [MIB, 2 * MIB, 3 * MIB]
    assert memory_title(cpu, [p.memory for p in cpu.history]) == "memory: RSS 1.1 GB"
    assert memory_title(cuda, [3 * MIB]) == "memory: CUDA 3.1 MB"
    assert memory_title(cpu, []) == "memory: not reported"
    high, low = cuda.history[2], cuda.history[0]
    assert merge_points(high, 1, low, 1).memory == 3 * MIB  # the peak, not the later one
    assert merge_points(msgspec.structs.replace(low, memory=None), 1, low, 1).memory == MIB
