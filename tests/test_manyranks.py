"""Many ranks in a few lines: a 16,384-rank job (2,048 nodes of 8) folded from wire
messages, with one dead rank, one stalled, one silent and one slow rank on node 37,
said by the headless printer and `ddtrain status` in a few lines that name each."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import msgspec
import pytest
from test_state import RUN, beat, step

from ddtop.core import manyranks, printer, wire
from ddtop.core.rundir import RunPaths
from ddtop.core.runinfo import RunInfo
from ddtop.core.state import RunState
from ddtop.core.summary import RunRecord, encode_record
from ddtop.daemon import cli, statuscmds

NODES, PER_NODE = 2048, 8
WORLD = NODES * PER_NODE
DEAD, HUNG, SILENT, SLOW = 5, 9_000, 12_345, 37 * PER_NODE + 3  # SLOW: on node 37
NOW = 110.0


def hello(rank: int) -> wire.Hello:
    return wire.Hello(run=RUN, rank=rank, seq=0, t=100.0, local_rank=rank % PER_NODE,
                      host=f"host-{rank // PER_NODE}", pid=1000 + rank, device="cpu",
                      backend="gloo", world_size=WORLD, config_digest="d", model="mlp",
                      dataset="synthetic", epochs=2, global_batch=64)


def node_up(node: int) -> wire.Event:
    ranks = list(range(node * PER_NODE, (node + 1) * PER_NODE))
    return wire.Event(run=RUN, rank=wire.DAEMON_RANK, seq=node, t=100.0, type="info",
                      message="node up", node=wire.node_news(node, "up", ranks,
                                                              f"host-{node}"))


def big_job() -> RunState:
    s = RunState(run=RUN)
    for r in range(WORLD):
        s.apply(hello(r), 100.0)
    for k in range(NODES):
        s.apply(node_up(k), 100.0)
    for r in range(WORLD):
        if r != SILENT:  # heard from last at 100 s: silent at NOW
            s.apply(step(r, 1, 120 + r % 3, step_s=0.25 if r == SLOW else 0.1), 108.0)
    s.apply(beat(HUNG, 2, "backward", 120, phase_s=30.0), 108.0)  # 30 s in its backward
    s.apply(wire.RankExit(run=RUN, rank=wire.DAEMON_RANK, seq=NODES, t=109.0, exited=DEAD,
                          pid=1000 + DEAD, exit_code=1, signal=None, culprit=True), 109.0)
    return s


@pytest.fixture(scope="module")
def job() -> RunState:
    return big_job()


def named(text: str) -> None:
    """Each planted outlier is named, with its node, in `text`."""
    assert f"dead: rank {DEAD} (node 0, exit 1)" in text
    assert f"stalled: rank {HUNG} (node {HUNG // PER_NODE}" in text
    assert f"silent: rank {SILENT} (node {SILENT // PER_NODE}" in text
    assert f"rank {SLOW} (node 37, 250 ms/step)" in text.split("slowest: ")[1]


def test_the_digest_counts_states_and_names_the_outliers(job: RunState) -> None:
    summary = job.summary(NOW)
    assert manyranks.many(summary.ranks) and not manyranks.many(summary.ranks[:64])
    d = manyranks.digest(summary.ranks, summary.stragglers)
    assert d.counts == {"running": WORLD - 3, "dead": 1, "silent": 1, "stalled": 1}
    assert (d.step_min, d.step_p50, d.step_max) == (0, 121, 122)  # the silent rank: 0
    assert d.step_time_p50_s == pytest.approx(0.1) and d.step_time_p90_s == pytest.approx(0.1)
    assert [r.rank for r in d.outliers["slowest"]] == [SLOW]  # the others step alike
    text = "\n".join(manyranks.lines(d))
    assert len(manyranks.lines(d)) == 6
    assert text.startswith(f"  16384 ranks: {WORLD - 3} running, 1 dead, 1 silent, 1 stalled")
    named(text)


def test_many_of_a_kind_are_counted_past_the_first_few(job: RunState) -> None:
    ranks = job.summary(NOW).ranks
    gone = [msgspec.structs.replace(r, state="dead") if r.rank < 100 else r for r in ranks]
    d = manyranks.digest(gone)
    assert len(d.outliers["dead"]) == manyranks.NAMED_PER_KIND
    assert d.more["dead"] == 100 - manyranks.NAMED_PER_KIND
    assert f"and {100 - manyranks.NAMED_PER_KIND} more" in "\n".join(manyranks.lines(d))


def test_headless_text_progress_and_summary_stay_short(job: RunState) -> None:
    out = io.StringIO()
    p = printer.Printer(format="text", interval=1.0, out=out, tty=False)
    p.events_seen = job.event_count  # the node and exit events are not progress
    p.tick(job, NOW)
    p.tick(job, NOW + 1.5)  # one progress line and its digest
    progress = out.getvalue().splitlines()
    assert len(progress) <= 7, progress
    named("\n".join(progress))
    final = printer.summary_text(printer.final_summary(job, NOW + 1.5), NOW + 1.5)
    assert len(final) <= 10, final
    named("\n".join(final))
    markdown = printer.summary_markdown(printer.final_summary(job, NOW + 1.5))
    assert len(markdown.splitlines()) < 30 and f"| {SLOW} | running |" in markdown


def test_jsonl_progress_is_compact_and_the_summary_keeps_every_rank(job: RunState) -> None:
    progress = printer.progress_record(job, NOW)
    assert progress["ranks_complete"] is False
    assert {r["rank"] for r in progress["ranks"]} >= {DEAD, HUNG, SILENT, SLOW}
    assert progress["rank_digest"]["outliers"]["dead"] == [DEAD]
    assert len(json.dumps(progress)) < 10_000
    record = printer.summary_record(printer.final_summary(job, NOW))
    assert len(record["ranks"]) == WORLD


def test_status_says_a_digest_and_every_rank_when_asked(job: RunState) -> None:
    record = RunRecord(run_id=RUN).with_summary(job.summary(NOW))
    info = RunInfo(paths=RunPaths(Path("/nonexistent/runs/r1")), record=record, config=None)
    lines = statuscmds.status_lines(info, record)
    assert len(lines) <= 12, lines
    named("\n".join(lines))
    assert f"  (every rank: ddtrain status {RUN} --ranks)" in lines
    every = statuscmds.status_lines(info, record, every_rank=True)
    assert len(every) > WORLD and any(line.lstrip().startswith(f"{SLOW} ") for line in every)


def test_ddtrain_status_of_a_big_finished_run_and_its_ranks_flag(
        job: RunState, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # run.json holds the whole job (summary.WorldSize: up to 65,536 ranks)
    record = RunRecord(run_id="big").with_summary(job.summary(NOW))
    record.status = "failed"
    (tmp_path / "run.json").write_bytes(encode_record(record))
    shutil.copy(Path(__file__).parent / "fixtures" / "runs" / "recorded-failed" / "config.json",
                tmp_path)  # what makes a folder a run's
    assert cli.main(["status", str(tmp_path)]) == 0
    short = capsys.readouterr().out.splitlines()
    assert len(short) <= 12, short
    text = "\n".join(short)
    assert f"dead: rank {DEAD} (node 0, exit 1)" in text and f"rank {SLOW} (node 37" in text
    assert cli.main(["status", str(tmp_path), "--ranks"]) == 0
    assert len(capsys.readouterr().out.splitlines()) > 1024
