"""What the dashboard shows for each state a rank can be in, from the fold:
the ranks table's rows (state, marks, filter, sort) and the banner, header and
comm panels, on hand-made message sequences. No UI, no sockets, no clock."""

from __future__ import annotations

import msgspec
from test_state import RUN, beat, fold, hello, step

from ddtop.core import wire
from ddtop.core.printer import new_events
from ddtop.core.scalars import SCALAR_WIDTH, compact
from ddtop.core.state import RunState
from ddtop.core.text import seconds
from ddtop.dashboard import format as fmt
from ddtop.dashboard import panels
from ddtop.dashboard.widgets import fit_columns


def rows_by_rank(state: RunState, now: float) -> dict[int, fmt.Row]:
    return {row.rank: row for row in fmt.rank_rows(state, now)}


def two_running() -> RunState:
    return fold(hello(0), hello(1), step(0, 1, 10), step(1, 1, 10),
                beat(0, 2, "forward", 10), beat(1, 2, "forward", 10))


def test_running_ranks_show_their_numbers() -> None:
    rows = rows_by_rank(two_running(), now=101.0)
    row = rows[0]
    assert row.state == "running" and not row.problem
    assert row.cells["state"] == "running" and row.cells["step"] == "10/100"
    assert row.cells["loss"] == "2.0000" and row.cells["comm_share"] == "20"
    assert row.cells["step_ms"] == "100" and row.cells["comm_ms"] == "20.0"
    assert row.cells["memory"] == "100.0 MB" and row.cells["host"] == "node"
    assert fmt.format_line(row).split()[0] == "0"


def test_stalled_rank_names_the_collective_the_others_wait_in() -> None:
    # Rank 0 sits in all-reduce #7 for 60 s; rank 1 is still in forward of step 11.
    s = fold(hello(0), hello(1), step(0, 1, 10), step(1, 1, 10),
             beat(0, 2, "backward", 10, phase_s=60.0, started=7, completed=6),
             beat(1, 2, "forward", 10, phase_s=60.0, started=6, completed=6))
    rows = rows_by_rank(s, now=100.5)
    assert rows[0].state == "stalled" and rows[1].state == "stalled"
    assert all(r.problem for r in rows.values())
    text = panels.banner(s, 100.5, "live", "")
    assert text is not None
    assert "rank 0 wait in allreduce #7" in text.plain
    assert "rank 1 is in forward of step 11" in text.plain
    comm = panels.comm(s, 100.5, 0, 20).plain
    assert "rank    1: allreduce #6 / #6" in comm.splitlines()[3]  # laggards first
    assert "(inside)" in comm


def test_stepping_ranks_collective_numbers_are_not_ranked_by_stale_readings() -> None:
    """Heartbeats a second apart: rank 1's reading is older, 500 collectives behind while
    its steps match; no one waits, so the ranks are listed in order, each reading's age
    said, and none is put first as a laggard."""
    s = RunState(run=RUN)
    for m, at in ((hello(0), 100.0), (hello(1), 100.0), (step(0, 1, 10), 100.0),
                  (step(1, 1, 10), 100.0), (beat(1, 2, "forward", 10, started=3, completed=3),
                                             100.1),
                  (beat(0, 2, "forward", 10, started=503, completed=503), 101.0)):
        s.apply(m, at)
    comm = panels.comm(s, 101.2, None, 20).plain.splitlines()
    header = next(i for i, line in enumerate(comm) if line.startswith("last collective"))
    assert "not compared" in comm[header] and "laggards first" not in comm[header]
    assert comm[header + 1] == "rank    0: allreduce #503 / #503  0.2 s ago"
    assert comm[header + 2] == "rank    1: allreduce #3 / #3  1.1 s ago"


def test_silent_rank_after_no_message_for_a_while() -> None:
    s = two_running()
    s.apply(beat(0, 3, "forward", 11), 110.0)
    rows = rows_by_rank(s, now=110.5)
    assert rows[0].state == "running" and rows[1].state == "silent"
    assert rows[1].cells["seen"] == "10s" and rows[1].problem
    assert [r.rank for r in fmt.filter_rows(list(rows.values()), "", True)] == [1]


def test_dead_rank_shows_its_signal_and_the_failure_banner() -> None:
    s = two_running()
    s.apply(wire.RankExit(run=RUN, rank=wire.DAEMON_RANK, seq=0, t=102.0, exited=1, pid=1001,
                          exit_code=None, signal="SIGKILL", traceback="Traceback...\nBoom"),
            102.0)
    rows = rows_by_rank(s, now=102.0)
    assert rows[1].state == "dead" and rows[1].cells["state"] == "SIGKILL"
    banner = panels.banner(s, 102.0, "live", "")
    assert banner is not None and banner.plain == "✖ rank 1 killed by SIGKILL"
    assert fmt.sort_rows(list(rows.values()), "state")[0].rank == 1  # problems first


def test_straggler_is_marked_and_the_slowest_named() -> None:
    # Rank 2 computes for 150 ms per step, the others 80 ms: it is the one they wait
    # for, over 40 steps (one message is no evidence: core/stragglers.py).
    msgs: list[wire.Message] = [hello(r) for r in range(3)]
    for seq in range(1, 5):
        for r in range(3):
            slow = r == 2
            msgs.append(step(r, seq, 10 * seq, step_s=0.2, comm_s=0.05 if slow else 0.12))
    s = fold(*msgs)
    rows = rows_by_rank(s, now=100.5)
    assert rows[2].slowest and rows[2].straggler and rows[2].problem
    assert not rows[0].straggler and not rows[1].straggler
    assert [r.rank for r in fmt.filter_rows(list(rows.values()), "straggler", False)] == [2]
    assert "slowest rank 2 (+70.0 ms/step, the others wait for it) · stragglers: 2" in (
        panels.header(s, 100.5).plain)
    # The mark's reason, in the rank detail: why its own row may read better.
    detail = panels.detail(s, 2, 100.5).plain
    assert "straggles (+70.0 ms/step)" in detail, detail
    assert "the others wait for it in their collectives" in detail
    assert "the others wait for it" not in panels.detail(s, 0, 100.5).plain


def test_a_rank_detail_lists_every_epoch_also_to_a_dashboard_attached_late() -> None:
    """An epoch's end is the run's (rank 0's metrics arrived first): rank 1's detail
    lists it too, and after 600 more events (more than the state keeps), so does a
    dashboard that attaches then (the daemon's snapshot)."""
    from ddtop.core import state as folds

    s = two_running()
    s.apply(wire.Aggregate(run=RUN, rank=0, seq=20, t=103.0, scope="epoch", epoch=0,
                           global_step=10, train_loss=1.5, train_accuracy=0.5,
                           train_samples=640), 103.0)
    assert "epoch 1 done: train loss 1.5000" in panels.events(s, 10, rank=1).plain
    for i in range(600):
        s.apply(wire.Event(run=RUN, rank=0, seq=21 + i, t=104.0 + i, type="info",
                           message=f"note {i}"), 104.0 + i)
    assert all("epoch" not in e.message for e in s.events)  # dropped from the newest kept
    attached = folds.decode_snapshot(folds.encode_snapshot(s))
    for state in (s, attached):
        lines = panels.events(state, 10, rank=1).plain.splitlines()
        assert any("epoch 1 done: train loss 1.5000 acc 50.00%" in line for line in lines)
        assert not any("note" in line for line in lines)  # rank 0's own: not rank 1's
    mine = panels.events(s, 1000, rank=0).plain.splitlines()
    assert "epoch 1 done" in mine[1] and "note 599" in mine[-1]  # oldest first


def test_finished_ranks_and_the_header_of_a_finished_run() -> None:
    s = two_running()
    for r in (0, 1):
        s.apply(wire.Bye(run=RUN, rank=r, seq=5, t=103.0, exit_code=0), 103.0)
    s.apply(wire.RunStatus(run=RUN, rank=wire.DAEMON_RANK, seq=1, t=103.0, status="succeeded",
                           world_size=2, message="run succeeded after 3.0 s"), 103.0)
    rows = rows_by_rank(s, now=103.0)
    assert {r.state for r in rows.values()} == {"finished"}
    header = panels.header(s, 103.0).plain
    assert "succeeded" in header and "2 ranks on 1 node" in header
    assert "elapsed 3.0 s" in header
    assert panels.banner(s, 103.0, "ended", "") is None


def test_ranks_not_heard_from_yet_are_listed() -> None:
    s = fold(hello(0))
    rows = rows_by_rank(s, now=100.0)
    assert sorted(rows) == [0, 1] and rows[1].state == "starting"
    assert rows[1].cells["loss"] == "-"


def test_sorting_and_filtering() -> None:
    msgs: list[wire.Message] = [hello(r) for r in range(4)]
    msgs += [step(r, 1, 10 + r, loss=4.0 - r) for r in range(4)]
    rows = fmt.rank_rows(fold(*msgs), 100.5)
    assert [r.rank for r in fmt.sort_rows(rows, "loss")] == [0, 1, 2, 3]  # worst loss first
    assert [r.rank for r in fmt.sort_rows(rows, "loss", reverse=True)] == [3, 2, 1, 0]
    assert [r.rank for r in fmt.sort_rows(rows, "step")] == [0, 1, 2, 3]
    assert [r.rank for r in fmt.filter_rows(rows, "2", False)] == [2]
    assert len(fmt.filter_rows(rows, "node", False)) == 4


def test_new_events_survive_the_bounded_event_list() -> None:
    s = fold(hello(0))
    events, seen = new_events(s, 0)
    assert [e.type for e in events] == ["join"] and seen == 1
    assert new_events(s, seen) == ([], 1)


def test_numbers_for_people() -> None:
    assert seconds(3.21) == "3.2 s" and seconds(185) == "3m05s"
    assert seconds(7300) == "2h01m"
    assert fmt.size(940_600) == "940.6 KB" and fmt.size(12) == "12 B"
    assert fmt.bar(0.5, 4) == "██  " and fmt.bar(1.5, 2) == "██"


def test_jitter_of_a_few_per_cent_of_the_step_is_not_a_straggler() -> None:
    # Compute 10, 10, 13 ms in 100 ms steps: 30% above the median, but 3% of the step,
    # over 40 steps. The others barely wait for rank 2: nobody is named, not even as
    # the slowest (a slowest without an effect size flickers through every rank).
    msgs: list[wire.Message] = [hello(r) for r in range(3)]
    msgs += [step(r, seq, 10 * seq, step_s=0.1, comm_s=0.087 if r == 2 else 0.09)
             for seq in range(1, 5) for r in range(3)]
    s = fold(*msgs)
    slowest, _, slow = s.stragglers()
    assert slowest is None and slow == []
    assert not any(r.straggler or r.slowest for r in fmt.rank_rows(s, 100.5))


def test_a_scripts_header_names_it_shows_its_scalars_and_no_made_up_eta() -> None:
    def script_hello(rank: int, total_steps: int) -> wire.Hello:
        return wire.Hello(run=RUN, rank=rank, seq=0, t=100.0, local_rank=rank, host="node",
                          pid=1000 + rank, device="cpu", backend="gloo", world_size=2,
                          config_digest="", model="", dataset="", epochs=0, global_batch=0,
                          program="train.py --lr 3e-4", total_steps=total_steps)

    def scalars(rank: int, seq: int, value: float) -> wire.Scalars:
        return wire.Scalars(run=RUN, rank=rank, seq=seq, values={"grad_norm": value})

    unknown = fold(script_hello(0, 0), script_hello(1, 0), step(0, 1, 10), step(1, 1, 10))
    text = panels.header(unknown, 101.0).plain
    assert "train.py --lr 3e-4 · gloo · 2 ranks" in text and "mlp on" not in text
    assert "step 10/?" in text and "ETA" not in text  # no total given: no ETA
    assert "scalars: none logged (ddtop.log)" in text and "metric sync" not in text

    known = fold(script_hello(0, 100), script_hello(1, 100), step(0, 1, 10), step(1, 1, 10),
                 scalars(0, 2, 1.0), scalars(1, 2, 3.0))
    text = panels.header(known, 101.0).plain
    assert "step 10/100 (10.0%)" in text
    assert "ETA 9.0 s" in text  # 90 steps left at 0.1 s per step
    assert "scalars: grad_norm 2 (1..3)" in text


def test_an_epoch_nobody_knows_is_a_dash_never_1() -> None:
    """A script's ranks whose sampler was never set_epoch'd: "-" in the table, the
    header and the detail; once one is, its epoch from 1, and a heartbeat that
    knows none (or an earlier one) leaves it."""
    def script_hello(rank: int) -> wire.Hello:
        return wire.Hello(run=RUN, rank=rank, seq=0, t=100.0, local_rank=rank, host="node",
                          pid=1000 + rank, device="cpu", backend="gloo", world_size=2,
                          config_digest="", model="", dataset="", epochs=0, global_batch=0,
                          program="train.py")

    def zero_code(message: wire.Step | wire.Heartbeat, epoch: int | None) -> wire.Message:
        if isinstance(message, wire.Step):
            return msgspec.structs.replace(message, epoch=epoch, step=0, steps_per_epoch=0)
        return msgspec.structs.replace(message, epoch=epoch)

    s = fold(script_hello(0), script_hello(1), *(zero_code(step(r, 1, 10), None) for r in (0, 1)),
             *(zero_code(beat(r, 2, "forward", 10), None) for r in (0, 1)))
    rows = rows_by_rank(s, 101.0)
    assert [rows[r].cells["epoch"] for r in (0, 1)] == ["-", "-"]
    assert " · epoch" not in panels.header(s, 101.0).plain  # nothing known: not said
    assert "epoch - step 0 (global 10)" in panels.detail(s, 0, 101.0).plain
    s.apply(zero_code(step(1, 3, 20), 2), 101.0)  # rank 1's sampler: set_epoch(2)
    s.apply(zero_code(beat(1, 4, "data", 20), None), 101.0)
    s.apply(zero_code(beat(1, 5, "data", 20), 1), 101.0)
    rows = rows_by_rank(s, 101.0)
    assert [rows[r].cells["epoch"] for r in (0, 1)] == ["-", "3"]
    # By epoch as by step: the furthest behind first, one not known before any
    assert [r.rank for r in fmt.sort_rows(list(rows.values()), "epoch")] == [0, 1]
    assert " · epoch 3 · " in panels.header(s, 101.0).plain
    assert "epoch 3 step 0 (global 20)" in panels.detail(s, 1, 101.0).plain
    # The built-in trainer (its epochs known): "-" of 2 until a rank says its own.
    s = fold(hello(0), hello(1))
    assert " · epoch -/2 · " in panels.header(s, 100.0).plain
    assert " · epoch 1/2 · " in panels.header(two_running(), 101.0).plain
    assert rows_by_rank(two_running(), 101.0)[0].cells["epoch"] == "1"


def test_scalar_cells_hold_each_ranks_newest_value_and_sort_largest_first() -> None:
    def logged(rank: int, seq: int, **values: float) -> wire.Scalars:
        return wire.Scalars(run=RUN, rank=rank, seq=seq, values=values)

    # A scalar named "loss" is a column of its own, not the LOSS column.
    s = fold(hello(0), hello(1), step(0, 1, 10), step(1, 1, 10),
             logged(0, 2, loss=0.5, tps=12345.0), logged(1, 2, loss=float("nan")),
             logged(0, 3, loss=0.25))
    rows = rows_by_rank(s, 101.0)
    assert "scalar:loss" not in rows[0].cells  # only the scalars asked for get cells
    rows = {r.rank: r for r in fmt.rank_rows(s, 101.0, ["loss", "tps"])}
    assert rows[0].cells["loss"] == "2.0000" and rows[0].cells["scalar:loss"] == "0.25"
    assert (rows[0].cells["scalar:tps"], rows[1].cells["scalar:tps"]) == ("12.35k", "-")
    assert rows[1].cells["scalar:loss"] == "nan"
    by_tps = fmt.sort_rows(list(rows.values()), "scalar:tps")
    assert [r.rank for r in by_tps] == [0, 1]  # largest first, not logged last
    assert [r.rank for r in fmt.sort_rows(list(rows.values()), "scalar:loss")] == [1, 0]


def test_numbers_in_a_scalar_column_fit_it() -> None:
    cases = {0.123456: "0.1235", 2.5: "2.5", 1234.0: "1234", 12345.0: "12.35k",
             3.2e6: "3.2M", 1e-5: "1e-05", -0.00012345: "-0.000123", -1.2345e-7: "-1.23e-07",
             -1.5e15: "-1.5e+15", float("inf"): "inf", float("nan"): "nan", 512.0: "512"}
    assert {v: compact(v) for v in cases} == cases
    assert all(len(shown) <= SCALAR_WIDTH for shown in cases.values())


def test_scalar_columns_follow_the_fixed_ones_by_name_and_count_those_left_out() -> None:
    names = ["grad_norm", "lr", "tokens_per_s"]
    wide = fit_columns(200, names)
    assert wide.scalars == tuple(names) and wide.hidden == 0 and wide.more == ""
    assert [c.key for c in wide.columns][-4:] == ["seen", *(f"scalar:{n}" for n in names)]
    assert [c.key for c in wide.columns][:-3] == [c.key for c in fit_columns(200).columns]
    # 120 cells: every scalar before the columns a script can do without.
    at_120 = fit_columns(120, names)
    assert at_120.scalars == tuple(names) and "host" not in [c.key for c in at_120.columns]
    narrow = fit_columns(100, names)
    assert narrow.scalars == ("grad_norm", "lr") and narrow.more == "+1 more"
    assert "progress" not in [c.key for c in narrow.columns]  # a scalar outranks it
    assert fit_columns(80, names).more == "+3 more"
    assert fit_columns(60, names).more == ""  # no room even for the count
    # The layout depends on the names and the width only: values never move a column.
    assert fit_columns(120, names) == at_120
    long = fmt.scalar_column("a_rather_long_metric_name")
    assert (long.title, long.width) == ("a_rather_long…", fmt.SCALAR_MAX_WIDTH)
