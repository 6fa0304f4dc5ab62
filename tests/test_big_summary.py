"""A 16,384-rank job's summary, whole and short: run.json written by the daemon's
report and read back by `ddtrain status` and `list` (every rank kept, the text a
few lines), and the pieces that make RunState.summary fast at that size built as
the slow way built them (the rank states: tests/test_state.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import get_args

import msgspec
import pytest
from test_manyranks import DEAD, HUNG, NOW, SILENT, SLOW, WORLD, big_job, named
from test_state import RUN

from ddtop.core import printer, wire
from ddtop.core.config import TrainConfig
from ddtop.core.rankview import RankView
from ddtop.core.rundir import RunPaths
from ddtop.core.runinfo import RunInfo
from ddtop.core.state import RunState
from ddtop.core.summary import RankSummary, RunRecord, encode_record, rank_summaries
from ddtop.daemon import cli
from ddtop.daemon.hangtimeout import HangTimer


@pytest.fixture(scope="module")
def ended() -> RunState:
    s = big_job()
    s.apply(wire.RunStatus(run=RUN, rank=wire.DAEMON_RANK, seq=10_000, t=NOW,
                           status="failed", world_size=WORLD, restarts=0,
                           message=f"rank {DEAD} failed", exit_code=1), NOW)
    return s


@pytest.fixture
def run_dir(ended: RunState, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """runs/<RUN>/ of a 2,048 x 8 job that failed, as node 0's daemon leaves it:
    its config.json, and run.json as daemon/report.py encodes it."""
    monkeypatch.delenv("DDTOP_RUNS_DIR", raising=False)
    config = TrainConfig(run_id=RUN, runs_dir=str(tmp_path / "runs"), nnodes=2048,
                         nproc_per_node=8, world_size=WORLD, rdzv_endpoint="node0:29400",
                         program="train.py", launcher="torchrun").validate()
    paths = RunPaths(tmp_path / "runs" / RUN)
    paths.root.mkdir(parents=True)
    paths.config.write_text(json.dumps(config.to_dict()))
    # as RunReport.write encodes it, at the job's own clock (the report's is the wall's)
    record = RunRecord(run_id=RUN, ended=NOW).with_summary(ended.summary(NOW))
    paths.status.write_bytes(encode_record(record))
    return paths.root


def test_run_json_of_16384_ranks_is_read_back_whole(run_dir: Path, ended: RunState) -> None:
    info = RunInfo.load(RunPaths(run_dir))
    assert info.problem is None and info.status == "failed" and not info.live
    assert info.world_size == WORLD and len(info.record.ranks) == WORLD
    assert [r.rank for r in info.record.ranks] == list(range(WORLD))
    states = ended.rank_states(NOW)
    assert {r.rank: r.state for r in info.record.ranks} == states
    assert info.record.ranks[SLOW].node == 37
    assert info.record.ranks[SLOW].step_time_s == pytest.approx(0.25)
    assert info.record.failure is not None and info.record.failure.rank == DEAD


def test_status_and_list_of_a_16384_rank_run_stay_short(
        run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", str(run_dir)]) == 0
    out, err = capsys.readouterr()
    assert err == "" and len(out.splitlines()) <= 14, out
    named(out)
    assert cli.main(["status", str(run_dir), "--ranks"]) == 0
    every = capsys.readouterr().out.splitlines()
    assert len(every) > WORLD and any(line.lstrip().startswith(f"{HUNG} ") for line in every)
    assert cli.main(["status", str(run_dir), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["world_size"] == WORLD and len(record["ranks"]) == WORLD
    assert cli.main(["list", "--runs-dir", str(run_dir.parent)]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == 2 and RUN in rows[1] and " failed " in rows[1] and "16384" in rows[1]


def test_the_github_summary_of_16384_ranks_is_short(ended: RunState) -> None:
    final = printer.final_summary(ended, NOW)
    markdown = printer.summary_markdown(final)
    assert len(markdown.splitlines()) < 30 and len(markdown) < 5000, markdown
    for rank in (DEAD, HUNG, SILENT, SLOW):
        assert f"| {rank} |" in markdown, rank


def test_a_rank_summary_is_its_views_fields_by_name() -> None:
    """RankSummary.of builds from positions: each field is the view's of its name."""
    v = RankView(rank=3, host="h", pid=42, epoch=4, step=5, global_step=6, loss=0.5,
                 samples_per_s=7.0, comm_s=0.02, step_time_s=0.08, exit_code=9,
                 signal="SIGKILL", phase="backward", stopped_by_daemon=True, last_seen=90.0)
    v.lost = 11
    got = RankSummary.of(v, "dead", 2, 100.0)
    assert got == RankSummary(rank=3, state="dead", host="h", node=2, pid=42, epoch=5, step=5,
                              global_step=6, loss=0.5, samples_per_s=7.0,
                              comm_share=v.comm_share, step_time_s=0.08, exit_code=9,
                              signal="SIGKILL", phase="backward", stopped_by_daemon=True,
                              last_seen_s=10.0, lost=11)
    assert got.comm_share == pytest.approx(0.25)
    # comm_share and last_seen_s at their edges, as RankView.comm_share and max() say
    for comm, step in ((None, 0.1), (0.1, None), (0.1, 0.0), (0.3, 0.1), (0.1, 0.1),
                       (math.nan, 0.1), (0.1, math.nan), (-0.1, 0.1)):
        v.comm_s, v.step_time_s = comm, step
        share = RankSummary.of(v, "running", None, 100.0).comm_share
        want = v.comm_share
        assert share == want or (share is not None and want is not None
                                 and math.isnan(share) and math.isnan(want)), (comm, step)
    for seen, ago in ((None, None), (100.0, 0.0), (120.0, 0.0), (99.5, 0.5)):
        v.last_seen = seen
        assert RankSummary.of(v, "running", None, 100.0).last_seen_s == ago


def test_rank_summaries_keep_the_states_order_and_ranks_never_heard() -> None:
    views = {1: RankView(rank=1, host="a"), 0: RankView(rank=0, host="b")}
    got = rank_summaries(views, {0: "running", 1: "silent", 2: "unreached"}, {1: 7}, 5.0)
    assert [(r.rank, r.state, r.host, r.node) for r in got] == [
        (0, "running", "b", None), (1, "silent", "a", 7), (2, "unreached", "", None)]
    assert got[2] == RankSummary.of(RankView(rank=2), "unreached", None, 5.0)


def test_the_summary_of_a_big_job_is_its_parts(ended: RunState) -> None:
    """summary() derives the states once and hands them on: the same rate and hang
    as asked one by one."""
    s = msgspec.structs.replace(ended, status="running")
    summary = s.summary(NOW)
    assert summary.samples_per_s == s.throughput(NOW) and summary.hang == s.hang(NOW)
    assert [r.state for r in summary.ranks] == list(s.rank_states(NOW).values())


def test_the_hang_timer_looks_at_most_twice_a_second_above_1024_ranks(ended: RunState) -> None:
    """--hang-timeout's look at a big job costs milliseconds: the daemon's loop (ten
    passes a second and more) looks every LOOK_EVERY_S there; a small job, every pass."""
    small = msgspec.structs.replace(ended, world_size=0, rank_nodes={}, node_states={},
                                    ranks={r: ended.ranks[r] for r in (0, 1, HUNG)})
    for state, seen_at in ((ended, NOW + 0.6), (small, NOW + 0.2)):
        assert state.hung(NOW) is not None  # HUNG stalled in its backward
        timer = HangTimer(1.0)
        assert timer.judge(state, NOW) is None and timer.since == NOW
        timer.reset()
        assert timer.judge(state, NOW + 0.2) is None
        assert timer.judge(state, NOW + 0.6) is None
        assert timer.since == seen_at, len(state.ranks)
        judged = timer.judge(state, seen_at + 1.0)
        assert judged is not None and judged[0] == HUNG


def test_a_ranks_state_is_its_phase_against_its_stall_limit() -> None:
    """RankView.state writes phase_elapsed(now) > stall_after() out: the same answer
    in every phase, with and without a phase clock and a step time."""
    cases = 0
    assert len(get_args(wire.Phase)) == 9
    for phase in get_args(wire.Phase):
        for at in (None, 50.0, 99.0, 101.0):
            for phase_s in (0.0, 2.0, 400.0):
                for step in (None, 0.0, 0.5, 3.0, math.nan):
                    v = RankView(rank=0, last_seen=99.0, phase=phase, phase_at=at,
                                 phase_s=phase_s, step_time_s=step)
                    slow = v.phase_elapsed(100.0) > v.stall_after()
                    assert v.state(100.0) == ("stalled" if slow else "running"), (
                        phase, at, phase_s, step)
                    cases += slow
    assert cases > 20  # both answers seen


def test_a_rank_summary_carries_the_memory_its_table_shows_and_its_peak() -> None:
    v = RankView(rank=1, rss=100, rss_peak=150)
    got = RankSummary.of(v, "running", None, 1.0)
    assert (got.memory, got.memory_peak) == (100, 150)
    v.cuda_allocated, v.cuda_peak = 70, 90  # a GPU rank: CUDA's, not the process's
    got = RankSummary.of(v, "running", None, 1.0)
    assert (got.memory, got.memory_peak) == (70, 90)
