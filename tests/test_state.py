"""The RunState fold on recorded message sequences: order, loss, duplicates,
restarts, and every state a rank can be shown in. No sockets, no clock."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from ddtop.core import journal, state, wire
from ddtop.core.state import RunState
from ddtop.core.summary import Restart

RUN = "r1"


def hello(rank: int, seq: int = 0, pid: int | None = None) -> wire.Hello:
    return wire.Hello(run=RUN, rank=rank, seq=seq, t=100.0, local_rank=rank, host="node",
                      pid=pid or 1000 + rank, device="cpu", backend="gloo", world_size=2,
                      config_digest="d", model="mlp", dataset="synthetic", epochs=2,
                      global_batch=64)


def step(rank: int, seq: int, global_step: int, steps: int = 10, *, t: float | None = None,
         step_s: float = 0.1, comm_s: float = 0.02, loss: float = 2.0) -> wire.Step:
    return wire.Step(run=RUN, rank=rank, seq=seq, t=t if t is not None else 100.0 + seq,
                     epoch=0, step=global_step, steps_per_epoch=100, global_step=global_step,
                     steps=steps, samples=32 * steps, loss_sum=loss * 32 * steps, lr=0.1,
                     step_s=step_s * steps, data_s=0.01 * steps, forward_s=0.03 * steps,
                     backward_s=0.05 * steps, optimizer_s=0.01 * steps, comm_s=comm_s * steps,
                     comm_bytes=1_000_000 * steps, comm_ops=steps, algbw_gbps=1.0,
                     busbw_gbps=1.0, sync_wait_s=0.0, rss=10**8)


def beat(rank: int, seq: int, phase: str, global_step: int, phase_s: float = 0.0,
         started: int | None = None, completed: int | None = None) -> wire.Heartbeat:
    def coll(n: int | None) -> wire.Collective | None:
        return None if n is None else wire.Collective(seq=n, op="allreduce", bytes=4_000_000)

    return wire.Heartbeat(run=RUN, rank=rank, seq=seq, t=100.0 + seq, phase=phase,  # type: ignore[arg-type]
                          epoch=0, global_step=global_step, phase_s=phase_s,
                          coll_started=coll(started), coll_completed=coll(completed))


def fold(*messages: wire.Message, at: float = 100.0) -> RunState:
    s = RunState(run=RUN)
    for m in messages:
        s.apply(m, at)
    return s


def test_in_order_steps_sum_and_show_the_newest() -> None:
    s = fold(hello(0), step(0, 1, 10), step(0, 2, 20, loss=1.5))
    v = s.ranks[0]
    assert (v.global_step, v.samples, v.received, v.lost) == (20, 640, 3, 0)
    assert v.loss == pytest.approx(1.5)
    assert v.step_time_s == pytest.approx(0.1) and v.comm_share == pytest.approx(0.2)
    assert v.samples_per_s == pytest.approx(320 / 1.0)  # 320 samples, 1 s apart (sender clock)
    assert [p.global_step for p in v.history] == [10, 20]
    assert s.world_size == 2 and s.model == "mlp" and s.status == "running"


def test_gaps_count_as_lost_until_they_arrive_late() -> None:
    s = fold(hello(0), step(0, 1, 10), step(0, 4, 40))
    assert s.ranks[0].lost == 2
    assert s.telemetry_loss() == pytest.approx(2 / 5)
    s.apply(step(0, 2, 20, loss=9.0), 101.0)  # late: counted, but does not overwrite
    v = s.ranks[0]
    assert (v.lost, v.samples, v.global_step) == (1, 320 * 3, 40)
    assert v.loss == pytest.approx(2.0)


def test_duplicates_are_ignored() -> None:
    s = fold(hello(0), step(0, 1, 10))
    assert s.apply(step(0, 1, 10), 101.0) is False
    assert s.apply(hello(0), 101.0) is False  # the same pid and seq: the same message
    v = s.ranks[0]
    assert (v.duplicates, v.samples, v.received) == (2, 320, 2)


def test_a_forged_huge_sequence_number_is_refused_so_the_ranks_own_are_not_old() -> None:
    """A key holder sends rank 0's Step numbered 2**62: were it folded, every real
    message of rank 0 after it would be dropped as a duplicate."""
    s = fold(hello(0), step(0, 1, 10))
    assert s.apply(step(0, 2**62, 999_999), 101.0) is False
    assert s.rejected == {"seq_jump": 1}
    assert s.apply(step(0, 2, 20), 102.0) is True
    assert (s.ranks[0].global_step, s.ranks[0].lost) == (20, 0)
    assert s.apply(step(0, 2 + state.MAX_SEQ_JUMP, 30), 103.0) is True  # a real gap: lost


def test_a_forged_jump_of_any_size_is_held_and_dropped_when_the_rank_goes_on() -> None:
    """Under the old bound (a jump of 990,000 < 1,000,000 was folded) one forged
    Step froze rank 0 at its step and loss for hours of its own messages. Now a
    jump is held until the rank's next message: the rank's own sequence going on
    drops it; a message that follows the held one (a real gap) takes both."""
    for jump in (990_000, state.MAX_SEQ_JUMP + 1, 2**40):
        s = fold(hello(0), step(0, 1, 10))
        assert s.apply(step(0, 1 + jump, 99_999), 101.0) is False
        assert s.rejected == {"seq_jump": 1} and s.ranks[0].global_step == 10
        for seq in range(2, 6):
            assert s.apply(step(0, seq, 10 * seq), 101.0 + seq) is True
        assert (s.ranks[0].global_step, s.ranks[0].lost, s.held) == (50, 0, {})
        assert s.rejected == {"seq_jump": 1}
    # A real gap (the sender lost 5,000 messages): held, then taken with the next.
    s = fold(hello(0), step(0, 1, 10))
    assert s.apply(step(0, 5_002, 20), 101.0) is False
    assert s.apply(step(0, 5_003, 30), 102.0) is True
    v = s.ranks[0]
    assert (v.global_step, v.lost, s.rejected, s.held) == (30, 5_000, {}, {})
    # A forger's flood of jumps holds at most MAX_HELD messages.
    s = fold(*[hello(r) for r in range(state.MAX_HELD + 10)],
             *[step(r, 1, 10) for r in range(state.MAX_HELD + 10)])
    for r in range(state.MAX_HELD + 10):
        s.apply(step(r, 10**9, 1), 101.0)
    assert len(s.held) == state.MAX_HELD
    assert s.rejected == {"seq_jump": state.MAX_HELD + 10}


@pytest.mark.parametrize("forged", [2, 100])
@pytest.mark.parametrize("jump", [2**40, 990_000, state.MAX_SEQ_JUMP + 1])
def test_forged_frames_in_a_row_far_ahead_are_undone_by_the_ranks_next_own(
        forged: int, jump: int) -> None:
    """Before: two forged Steps in a row (seq = last + 2**40, then that + 1) were
    taken as a real gap, the second following the first; the rank then stayed at
    step 99999 and loss 54321 while none of its ~5,000 own messages changed it, and
    `seq_jump` read nothing. Now the rank's next own message, going on from its own
    sequence below the forged ones, sets the sequence back: shown at once."""
    s = fold(hello(0), step(0, 1, 10))
    for k in range(forged):
        s.apply(step(0, 1 + jump + k, 99_999, loss=54321.0), 101.0)
    assert s.ranks[0].global_step == 99_999  # taken: as a real gap would be
    assert s.apply(step(0, 2, 20), 102.0) is True
    v = s.ranks[0]
    assert (v.global_step, v.loss, v.lost, v.max_seq) == (20, pytest.approx(2.0), 0, 2)
    assert s.rejected == {"seq_jump": 1}
    assert all([s.apply(step(0, seq, 10 * seq), 103.0) for seq in range(3, 5_000)])
    assert (v.global_step, v.lost, v.duplicates) == (49_990, 0, 0)
    # The forger goes on: each pair is undone by the next own message again.
    for seq in range(5_000, 5_010):
        s.apply(step(0, 2**50 + 2 * seq, 99_999), 104.0)
        s.apply(step(0, 2**50 + 2 * seq + 1, 99_999), 104.0)
        assert s.apply(step(0, seq, 10 * seq), 104.0) is True
        assert v.global_step == 10 * seq
    assert (v.lost, s.rejected) == (0, {"seq_jump": 11})


def test_forged_numbers_under_the_bound_cannot_silence_the_rank_either() -> None:
    """A jump under the bound is folded as a gap (a real one is not held), so the
    rank's own messages come late: a chain of them (each 1,000 past the one before)
    once put its sequence a million ahead. Now its own messages going on from
    below undo them: at once when they lie more than MAX_SEQ_JUMP below the newest
    number, else after MAX_LATE_RUN of them (a gap filled late is fewer)."""
    s = fold(hello(0), step(0, 1, 10))
    for k in range(1, 1_001):
        assert s.apply(step(0, 1 + state.MAX_SEQ_JUMP * k, 99_999), 101.0) is True
    assert s.apply(step(0, 2, 20), 102.0) is True
    v = s.ranks[0]
    assert (v.global_step, v.lost, v.missing, s.rejected) == (20, 0, set(), {"seq_jump": 1})
    # One forged number 1,000 ahead: its own messages fill the gap late, then go on.
    s = fold(hello(0), step(0, 1, 10))
    s.apply(step(0, 1 + state.MAX_SEQ_JUMP, 99_999, loss=54321.0), 101.0)
    for seq in range(2, 2 + state.MAX_LATE_RUN):
        assert s.apply(step(0, seq, 10 * seq), 102.0) is True
    v = s.ranks[0]
    assert (v.global_step, v.loss, v.lost) == (10 * (1 + state.MAX_LATE_RUN),
                                              pytest.approx(2.0), 0)
    assert v.samples == 320 * (1 + 1 + state.MAX_LATE_RUN)  # its own all counted (the forged too)
    assert s.rejected == {"seq_jump": 1}


def test_out_of_order_delivery_ends_in_the_same_state() -> None:
    messages = [hello(0), step(0, 1, 10), step(0, 2, 20), step(0, 3, 30), hello(1),
                step(1, 1, 10), step(1, 2, 20)]
    ordered = fold(*messages)
    shuffled = fold(*[messages[i] for i in (0, 4, 3, 1, 6, 2, 5)])
    for rank in (0, 1):
        a, b = ordered.ranks[rank], shuffled.ranks[rank]
        assert (a.samples, a.global_step, a.lost, a.received) == (
            b.samples, b.global_step, b.lost, b.received)


def test_a_restarted_rank_starts_a_new_sequence() -> None:
    s = fold(hello(0), step(0, 1, 10), step(0, 2, 20))
    s.apply(wire.RankExit(run=RUN, rank=wire.DAEMON_RANK, seq=0, exited=0, pid=1000,
                          exit_code=None, signal="SIGKILL"), 101.0)
    assert s.rank_states(101.0)[0] == state.DEAD
    s.apply(hello(0, pid=2000), 102.0)
    s.apply(step(0, 1, 15), 102.0)
    v = s.ranks[0]
    assert (v.pid, v.lost, v.duplicates, v.exited) == (2000, 0, 0, False)
    assert s.rank_states(102.0)[0] == state.RUNNING


def test_states_running_silent_finished() -> None:
    s = fold(hello(0), hello(1), beat(0, 1, "forward", 5), beat(1, 1, "forward", 5))
    assert s.rank_states(101.0) == {0: state.RUNNING, 1: state.RUNNING}
    s.apply(beat(0, 2, "forward", 6), 110.0)
    assert s.rank_states(110.0) == {0: state.RUNNING, 1: state.SILENT}
    s.apply(wire.Bye(run=RUN, rank=0, seq=3, exit_code=0), 111.0)
    assert s.rank_states(111.0)[0] == state.FINISHED
    assert s.rank_states(1000.0)[0] == state.FINISHED  # finished ranks never go silent


def test_a_rank_not_heard_from_is_starting_then_unreached_not_silent() -> None:
    """Never heard from (a failed CURVE handshake looks like this) is told apart from
    a rank that went quiet (silent, as a hung one does): was SILENT before."""
    s = fold(hello(0))
    assert s.rank_states(100.0) == {0: state.RUNNING, 1: state.STARTING}
    assert s.rank_states(200.0)[1] == state.UNREACHED
    s.apply(hello(1), 201.0)
    assert s.rank_states(300.0)[1] == state.SILENT  # heard once, then quiet


def test_stalled_in_a_collective_names_who_everyone_waits_for() -> None:
    # Rank 0 entered all-reduce #41 and has waited 30 s; rank 1 sits in forward.
    s = fold(hello(0), hello(1), step(0, 1, 40), step(1, 1, 40),
             beat(0, 2, "backward", 40, phase_s=30.0, started=41, completed=40),
             beat(1, 2, "forward", 40, phase_s=30.0, started=40, completed=40))
    states = s.rank_states(100.5)
    assert states == {0: state.STALLED, 1: state.STALLED}
    assert s.hang(100.5) == "rank 0 wait in allreduce #41; rank 1 is in forward of step 41"
    assert s.ranks[0].where() == "in allreduce #41 (4.0 MB)"
    assert s.summary(100.5).hang == s.hang(100.5)


def test_a_slow_phase_is_not_a_stall() -> None:
    s = fold(hello(0), beat(0, 1, "evaluation", 10, phase_s=60.0))
    assert s.rank_states(100.0)[0] == state.RUNNING
    assert s.hang(100.0) is None


def test_dead_with_signal_becomes_the_failure() -> None:
    s = fold(hello(0), hello(1), step(1, 1, 11),
             wire.Event(run=RUN, rank=1, seq=2, type="error", message="RuntimeError: boom",
                        traceback="Traceback...\nRuntimeError: boom"))
    s.apply(wire.RankExit(run=RUN, rank=wire.DAEMON_RANK, seq=0, exited=1, pid=1001,
                          exit_code=None, signal="SIGKILL"), 101.0)
    s.apply(wire.RankExit(run=RUN, rank=wire.DAEMON_RANK, seq=1, exited=0, pid=1000,
                          exit_code=None, signal="SIGTERM", stopped_by_daemon=True), 101.0)
    assert s.rank_states(101.0) == {0: state.DEAD, 1: state.DEAD}
    assert s.failure is not None
    assert (s.failure.rank, s.failure.signal, s.failure.global_step) == (1, "SIGKILL", 11)
    assert s.failure.message == "RuntimeError: boom"
    assert [e.message for e in s.events if e.type == "error"][-1] == (
        "rank 1 (pid 1001) was killed by SIGKILL")


def test_straggler_is_the_rank_that_computes_longest() -> None:
    # Every rank takes 0.1 s per step (DDP keeps them in lockstep), but rank 2
    # computes for 0.09 s of it while the others wait for it in the all-reduce,
    # over 40 steps (one message of 10 steps is no evidence: core/stragglers.py).
    s = fold(*(hello(r) for r in range(4)),
             *(step(r, seq, 10 * seq, comm_s=0.01 if r == 2 else 0.06)
               for seq in range(1, 5) for r in range(4)))
    slowest, skew, slow = s.stragglers()
    assert (slowest, slow) == (2, [2])
    assert skew == pytest.approx(0.05)


def test_aggregates_from_every_rank_count_once() -> None:
    def agg(rank: int) -> wire.Aggregate:
        return wire.Aggregate(run=RUN, rank=rank, seq=1, scope="epoch", epoch=0, global_step=100,
                              train_loss=1.0, train_accuracy=0.5, train_samples=3200,
                              val_loss=0.9, val_accuracy=0.6, val_samples=100)

    s = fold(hello(0), hello(1), agg(0), agg(1))
    assert len(s.epochs_done) == 1 and s.aggregate == agg(0)
    assert sum(e.type == "epoch_end" for e in s.events) == 1


def test_restart_timeline_and_status_from_the_daemon() -> None:
    entry = {"restart": 1, "rank": 1, "reason": "was killed by SIGKILL", "global_step": 11,
             "checkpoint": "step-00000009.pt"}
    s = fold(hello(0), wire.Restarting(run=RUN, rank=-1, seq=0, message="restart 1",
                                       restart=Restart(**entry)),
             wire.RunStatus(run=RUN, rank=-1, seq=1, status="restarting", world_size=2,
                            restarts=1))
    assert s.timeline == [Restart(**entry)] and (s.status, s.restarts) == ("restarting", 1)
    # Shown as an event too, the entry as its data (the headless printer's JSON lines).
    (event,) = [e for e in s.events if e.type == "restart"]
    assert (event.message, event.data["checkpoint"]) == ("restart 1", "step-00000009.pt")


def test_snapshot_round_trip_keeps_folding_identically() -> None:
    s = fold(hello(0), step(0, 1, 10), step(0, 3, 30))
    copy = state.decode_snapshot(state.encode_snapshot(s))
    assert copy == s
    for target in (s, copy):
        target.apply(step(0, 2, 20), 101.0)
        target.apply(step(0, 4, 40), 101.0)
    assert copy == s


def test_bounded_history_and_events() -> None:
    s = fold(hello(0), *(step(0, i, i) for i in range(1, 400)))
    assert len(s.ranks[0].history) == state.HISTORY_POINTS
    for i in range(state.MAX_EVENTS + 10):
        s.apply(wire.Event(run=RUN, rank=0, seq=400 + i, type="info", message=str(i)), 100.0)
    assert len(s.events) == state.MAX_EVENTS and s.events[-1].message == str(
        state.MAX_EVENTS + 9)


def test_journal_replay_stops_quietly_at_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "telemetry.journal"
    writer = journal.JournalWriter(path)
    messages = [hello(0), step(0, 1, 10), step(0, 2, 20)]
    for i, m in enumerate(messages, 1):
        writer.append(i, 100.0 + i, wire.encode(m)[0])
    writer.close()
    whole, last = journal.replay(path, RUN)
    assert last == 3 and whole.ranks[0].global_step == 20
    with path.open("ab") as f:
        f.write(journal.LENGTH.pack(500) + b"\x93partial")  # killed mid-write
    replayed, last = journal.replay(path, RUN)
    assert last == 3 and replayed.ranks[0].samples == whole.ranks[0].samples
    upto, last = journal.replay(path, RUN, upto=2)
    assert last == 2 and upto.ranks[0].global_step == 10


def test_summary_is_plain_data() -> None:
    s = fold(hello(0), hello(1), step(0, 1, 10), step(1, 1, 10))
    summary = msgspec.to_builtins(s.summary(100.5))
    assert msgspec.json.decode(msgspec.json.encode(summary)) == summary
    assert [r["state"] for r in summary["ranks"]] == ["running", "running"]
    assert summary["global_step"] == 10 and summary["total_steps"] == 200


def test_ranks_waiting_while_one_evaluates_are_not_stalled() -> None:
    # Rank 0 evaluates alone for 30 s (ddtop.phase("eval")); rank 1 waits in the
    # next step's all-reduce for as long: waiting for rank 0, not a hang.
    s = fold(hello(0), hello(1), step(0, 1, 40), step(1, 1, 40),
             beat(0, 2, "evaluation", 40, phase_s=30.0),
             beat(1, 2, "backward", 40, phase_s=30.0, started=41, completed=40))
    assert s.rank_states(100.5) == {0: state.RUNNING, 1: state.RUNNING}
    assert s.hang(100.5) is None
    # An evaluation stuck past its own limit is a hang again, for both.
    s.apply(beat(0, 3, "evaluation", 40, phase_s=400.0), 100.0)
    s.apply(beat(1, 3, "backward", 40, phase_s=400.0, started=41, completed=40), 100.0)
    assert s.rank_states(100.5) == {0: state.STALLED, 1: state.STALLED}
    assert s.hang(100.5) is not None


def test_a_rank_stuck_in_its_own_step_stays_stalled_while_another_evaluates() -> None:
    # Rank 1 is not waiting in a collective rank 0 has yet to reach: stuck in its forward.
    s = fold(hello(0), hello(1), step(0, 1, 40), step(1, 1, 40),
             beat(0, 2, "evaluation", 40, phase_s=30.0, started=40, completed=40),
             beat(1, 2, "forward", 40, phase_s=30.0, started=40, completed=40))
    assert s.rank_states(100.5) == {0: state.RUNNING, 1: state.STALLED}


@pytest.mark.parametrize("rank0_ticks", [0.05, 0.13])
@pytest.mark.parametrize("stopped_in", ["forward", "allreduce"])
def test_a_stopped_rank_that_resumes_is_not_misnamed_while_heartbeats_catch_up(
        stopped_in: str, rank0_ticks: float) -> None:
    """Ranks 0 and 1 in lockstep (a step every 0.05 s, all-reduce #g in step g;
    Step messages every 0.1 s, heartbeats every 1 s, as a rank's sender sends
    them). Rank 1 is stopped (SIGSTOP) at 100.04 in step 41, in its forward or
    inside all-reduce #41, and continued at 110.0: its sender's first heartbeat
    still says where it was stopped, 10 s ago; its steps come 0.1 s later, rank
    0's within 0.1 s of them, while their next heartbeats come up to a second
    later. From rank 1's first new Step message on, the hang is gone or names
    rank 1; once both ranks' steps have come, it is gone. Was: 'ranks 0-1 wait
    in allreduce #41' (no one waited for) and then 'rank 1 wait in allreduce #41;
    rank 0 is in forward' (rank 0 waited for) until rank 1's next heartbeat, or
    rank 1 still named after both ranks' steps came."""
    inside = stopped_in == "allreduce"
    seqs = [1, 1]
    timeline: list[tuple[float, wire.Message]] = []

    def send(at: float, m: wire.Message) -> None:
        m.seq, m.t = seqs[m.rank], at
        seqs[m.rank] += 1
        timeline.append((at, m))

    def counted(at: float) -> int:  # global steps done by time `at`
        if at < 110.0:
            return min(40, int((at - 98.0) / 0.05 + 1e-9))
        return 40 + max(0, int((at - 110.03) / 0.05 + 1e-9) + 1)

    # Before the stop: Step messages of the steps since the previous one.
    for rank, first in ((0, 99.03), (1, 99.0)):
        done = counted(first - 0.1)
        for k in range(12):
            at = round(first + 0.1 * k, 3)
            if counted(at) > done:
                send(at, step(rank, 0, counted(at), counted(at) - done))
                done = counted(at)
    send(99.8, beat(0, 0, "forward", counted(99.8), 0.01, counted(99.8), counted(99.8)))
    send(100.03, beat(1, 0, "backward" if inside else "forward", 40, 0.01,
                      41 if inside else 40, 40))
    # Rank 0 waits in all-reduce #41 from 100.02 on; its heartbeats say so.
    for k in range(11):
        at = 100.8 + k
        send(at, beat(0, 0, "backward", 40, at - 100.02, 41, 40))
    # Continued at 110.0: rank 1's sender wakes with the reading of 10 s ago.
    send(110.001, beat(1, 0, "backward" if inside else "forward", 40, 9.98,
                       41 if inside else 40, 40))
    firsts = []
    for rank, first in ((0, 110.0 + rank0_ticks), (1, 110.1)):
        done = 40
        for k in range(25):
            at = round(first + 0.1 * k, 3)
            if counted(at) > done:
                send(at, step(rank, 0, counted(at), counted(at) - done, t=at))
                done = counted(at)
        firsts.append(min(at for at, m in timeline
                          if m.rank == rank and isinstance(m, wire.Step) and at > 110.0))
    # Their next heartbeats: rank 0 in a forward, rank 1 inside an all-reduce.
    for at in (110.8, 111.8):
        g = counted(at)
        send(at, beat(0, 0, "forward", g, 0.01, g, g))
    for at in (111.0, 112.0):
        g = counted(at)
        send(at, beat(1, 0, "backward", g, 0.02, g + 1, g))

    timeline.sort(key=lambda item: item[0])
    s = RunState(run=RUN)
    for r in (0, 1):
        s.apply(hello(r), 98.0)
    pending = iter(timeline)
    upcoming = next(pending, None)

    def fold_until(now: float) -> None:
        nonlocal upcoming
        while upcoming is not None and upcoming[0] <= now:
            s.apply(upcoming[1], upcoming[0])
            upcoming = next(pending, None)

    fold_until(106.0)  # rank 1 silent, rank 0 stalled in its all-reduce
    found = s.hung(106.0)
    assert found is not None and found[1].startswith(
        "ranks 0-1 wait in allreduce #41" if inside else "rank 0 wait in allreduce #41"), found
    if not inside:
        assert found == ([1], "rank 0 wait in allreduce #41; rank 1 is silent, last in forward"
                              " of step 41")
    resumed, flowing = firsts[1], max(firsts)
    for i in range(int((112.5 - resumed) / 0.01) + 1):
        now = round(resumed + 0.01 * i, 3)
        fold_until(now)
        found = s.hung(now)
        if now >= flowing:
            assert found is None, (now, found)
        else:
            assert found is None or (found[0] == [1] and found[1].startswith(
                "rank 0 wait in allreduce #41; rank 1 ")), (now, found)


def test_a_rank_ahead_and_stuck_is_still_named_as_the_one_waited_for() -> None:
    """Rank 1 counts 5 global steps ahead of rank 0 (it stepped past the step rank 0
    waits in long ago) and then stops in its forward, while rank 0 waits in
    all-reduce #41. A rank past the others' step is excused only when its step came
    after their newest reading (test above); here rank 0 keeps reporting, so the hang
    names rank 1 (was: no hang named at all, so --hang-timeout never fired)."""
    s = RunState(run=RUN)
    for r in (0, 1):
        s.apply(hello(r), 90.0)
    s.apply(beat(0, 1, "forward", 39, 0.01, 40, 40), 99.0)
    s.apply(beat(1, 1, "forward", 44, 0.01, 45, 45), 99.0)
    s.apply(step(0, 2, 40, t=99.9), 99.9)  # both step after their heartbeats
    s.apply(step(1, 2, 45, t=99.9), 99.9)
    for k in range(11):
        at = 100.5 + k
        s.apply(beat(0, 3 + k, "backward", 40, at - 100.0, 41, 40), at)
        s.apply(beat(1, 3 + k, "forward", 45, at - 100.0, 45, 45), at + 0.3)
    assert s.rank_states(111.0) == {0: state.STALLED, 1: state.STALLED}
    assert s.hung(111.0) == ([1], "rank 0 wait in allreduce #41; rank 1 is in forward of step 46")


def node_event(seq: int, news: wire.NodeNews | None,
               data: dict[str, object] | None = None) -> wire.Event:
    return wire.Event(run=RUN, rank=wire.DAEMON_RANK, seq=seq, t=100.0, type="info",
                      message="node news", node=news, data=data or {})  # type: ignore[arg-type]


def test_node_news_is_believed_only_whole_and_a_lost_nodes_ranks_are_unknown() -> None:
    s = fold(*(hello(r) for r in range(4)),
             node_event(0, wire.node_news(0, "up", [0, 1], "a")),
             node_event(1, wire.node_news(1, "up", [2, 3], "b")))
    assert s.rank_nodes == {0: 0, 1: 0, 2: 1, 3: 1}
    assert s.node_states == {0: "up", 1: "up"}
    # Node news is typed from the daemon that writes it to the fold: what only an
    # event's data says of a node is shown as the event it is, and changes nothing.
    s.apply(node_event(2, None, {"node": 1, "node_state": "lost", "ranks": "2,3"}), 100.0)
    # News that is not whole is refused with its frame, as any malformed message: a
    # state no hub says, a node number too big, a field of the wrong kind, a field no
    # hub writes, a rank beyond any job.
    bad: list[dict[str, object]] = [
        {"node": 1, "node_state": "gone", "ranks": [0, 1]},
        {"node": 1 << 40, "node_state": "lost", "ranks": [0]},
        {"node": "1", "node_state": "lost"},
        {"node": True, "node_state": "lost"},
        {"node": 1, "node_state": "lost", "ranks": 3},
        {"node": 1, "node_state": "lost", "ranks": "0,1"},
        {"node": 1, "node_state": "lost", "extra": 1},
        {"node": 1, "node_state": "lost", "ranks": [1 << 20]},
    ]
    for seq, news in enumerate(bad, start=3):
        frame = msgspec.msgpack.encode({**msgspec.to_builtins(node_event(seq, None)),
                                        "node": news})
        with pytest.raises(wire.WireError):
            wire.decode([frame], RUN)
    assert s.rank_nodes == {0: 0, 1: 0, 2: 1, 3: 1}
    assert s.node_states == {0: "up", 1: "up"}
    assert len([e for e in s.events if e.message == "node news"]) == 3
    # The hub says node 1 lost: its ranks are no longer known to run.
    s.apply(node_event(99, wire.node_news(1, "lost", [2, 3], "b")), 100.0)
    assert s.node_states[1] == "lost"
    states = s.rank_states(101.0)
    assert states[0] != "lost" and states[2] in ("unreachable", "lost"), states
    # A node's own news of its ranks (local) makes them the ones it shows.
    s.apply(node_event(100, wire.node_news(0, "up", [0, 1], "a", local=True)), 100.0)
    assert s.local_ranks == [0, 1]


def test_a_finished_runs_journal_read_at_once_never_shows_an_infinite_clock(
        tmp_path: Path) -> None:
    """A finished run is read at once (speed 0, no step), BATCH records a pump:
    between two pumps its clock stood at infinity, and a dashboard drawing then
    crashed on an elapsed time of inf (seen once in CI). Now it stands at the
    last record folded."""
    from ddtop.core.rundir import RunPaths
    from ddtop.dashboard.feed import BATCH
    from ddtop.dashboard.live import open_feed

    root = tmp_path / "runs" / RUN
    root.mkdir(parents=True)
    writer = journal.JournalWriter(RunPaths(root).journal)
    messages = [hello(0), *(step(0, i, i) for i in range(1, BATCH + 10))]
    for i, m in enumerate(messages, 1):
        writer.append(i, 100.0 + i / 1000, wire.encode(m)[0])
    writer.close()
    feed = open_feed(RunPaths(root))
    assert feed.pump(0.0) == BATCH and not feed.finished
    assert feed.now() == 100.0 + BATCH / 1000
    assert feed.state.elapsed(feed.now()) == pytest.approx((BATCH - 1) / 1000)
    while not feed.finished:
        feed.pump(0.0)
    assert feed.state.ranks[0].global_step == BATCH + 9
