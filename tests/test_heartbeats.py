"""A rank's heartbeats go out only when they tell the daemon something
(training/beats.py): none while Step messages go out, one a second from a rank
blocked in a collective or idle, one at once when it enters or leaves work
outside the steps. The rule fed by hand, then a real sender thread
(LiveTelemetry) and a real PULL socket counting what arrives."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from helpers import Collector, collecting

from ddtop.core import wire
from ddtop.training.beats import COLLECTIVE_NEWS_S, HEARTBEAT_INTERVAL_S, Beats, phase_news
from ddtop.training.telemetry import LiveTelemetry

HELLO = wire.Hello(run="beats", rank=0, local_rank=0, host="h", pid=1, device="cpu",
                   backend="gloo", world_size=2, config_digest="", model="", dataset="",
                   epochs=0, global_batch=0)
STEP_S = 0.1  # ~10 steps a second, as a fast rank
# A heartbeat a second, give or take a send round and a loaded machine's delays.
BEAT_SLACK_S = 0.6


def test_a_stepping_rank_needs_no_heartbeat_after_the_first() -> None:
    beats = Beats()
    assert beats.due(0.0, "setup")  # the daemon knows nothing yet
    beats.beat(0.0, "setup", sent=True)
    assert not beats.due(0.5, "setup")
    for i in range(1, 50):  # a Step message every 0.1 s for 5 s
        now = i * 0.1
        beats.stepped(now)
        assert not beats.due(now + 0.05, "forward")
    assert beats.told == "data"  # a step ends set-up, as the daemon's fold reads it
    assert beats.next_at() == 4.9 + HEARTBEAT_INTERVAL_S
    assert not beats.due(5.85, "backward")
    assert beats.due(5.9, "backward")  # a second without a step: a heartbeat


def test_an_idle_rank_heartbeats_every_second() -> None:
    beats = Beats()
    sent = []
    for i in range(100):  # a send round every 0.1 s for 10 s, in the same phase
        now = i * 0.1
        if beats.due(now, "backward"):
            beats.beat(now, "backward", sent=True)
            sent.append(now)
    assert len(sent) == 10
    assert all(abs(b - a - 1.0) < 0.11 for a, b in itertools.pairwise(sent)), sent


def test_work_outside_the_steps_is_said_at_once_step_phases_are_not() -> None:
    assert phase_news("evaluation", "forward") and phase_news("checkpoint", "data")
    assert phase_news("forward", "evaluation") and phase_news("evaluation", "checkpoint")
    assert phase_news("data", "setup")
    assert not phase_news("backward", "forward") and not phase_news("optimizer", "data")
    assert not phase_news("done", "forward") and not phase_news("done", "evaluation")
    assert not phase_news("evaluation", "evaluation")
    beats = Beats()
    beats.beat(0.0, "forward", sent=True)
    for now in (0.5, 1.0, 1.5):
        beats.stepped(now)
    assert not beats.due(1.55, "backward")
    assert beats.due(1.55, "evaluation")
    beats.beat(1.55, "evaluation", sent=True)
    assert not beats.due(1.65, "evaluation")
    # Back to the steps (the daemon's stall rule changes), but a heartbeat went
    # out less than a second ago: at that second.
    beats.stepped(2.0)
    assert not beats.due(2.5, "data")
    beats.stepped(2.5)
    assert beats.due(2.6, "data")


def test_an_evaluation_begun_again_is_said_though_its_end_could_not_be() -> None:
    """Evaluation every few steps: its end came less than a second after the heartbeat
    before it (not said then), and the next evaluation, by name the phase the daemon
    holds, is said as soon as the second is up, not a second after the last step."""
    beats = Beats()
    beats.beat(0.0, "evaluation", sent=True, since=0.0)
    beats.beat(1.0, "evaluation", sent=True, since=0.0)  # a second in: still evaluating
    assert not beats.due(1.3, "data", since=1.3)  # its end: within the second
    for now in (1.4, 1.5, 1.6):
        beats.stepped(now)
    assert not beats.due(1.9, "evaluation", since=1.7)  # the next: not before 2.0
    assert beats.due(2.0, "evaluation", since=1.7)  # then said, at once
    assert not beats.due(2.0, "evaluation", since=0.0)  # the one told, still going: no news
    beats.beat(2.0, "evaluation", sent=True, since=1.7)
    assert beats.told_since == 1.7 and not beats.due(2.1, "evaluation", since=1.7)


def test_a_phase_that_flips_every_step_costs_a_heartbeat_a_second_at_most() -> None:
    """A script that runs an evaluation forward in each training step."""
    beats = Beats()
    beats.beat(0.0, "setup", sent=True)
    sent = []
    for i in range(1, 101):  # 10 s of send rounds; a Step message in each
        now = i * 0.1
        beats.stepped(now)
        phase: wire.Phase = "evaluation" if i % 2 else "forward"
        if beats.due(now + 0.05, phase):
            beats.beat(now + 0.05, phase, sent=True)
            sent.append(now)
    assert 4 <= len(sent) <= 10, sent
    assert all(b - a >= HEARTBEAT_INTERVAL_S - 1e-9 for a, b in itertools.pairwise(sent)), sent


def test_a_heartbeat_that_could_not_go_out_is_tried_again_a_second_later() -> None:
    beats = Beats()
    beats.beat(0.0, "forward", sent=True)
    for now in (0.5, 1.0):
        beats.stepped(now)
    assert beats.due(1.1, "evaluation")
    beats.beat(1.1, "evaluation", sent=False)  # nobody listening
    assert beats.told == "forward"
    beats.stepped(1.5)
    assert not beats.due(1.6, "evaluation") and not beats.due(2.05, "evaluation")
    beats.stepped(2.0)
    assert beats.due(2.1, "evaluation")
    beats.beat(2.1, "evaluation", sent=True)
    assert beats.told == "evaluation"


@contextmanager
def live_rank() -> Iterator[tuple[LiveTelemetry, Collector]]:
    with collecting() as got:
        tel = LiveTelemetry(got.endpoint, HELLO)
        try:
            yield tel, got
        finally:
            tel.close(0)
            deadline = time.monotonic() + 10
            while not got.of(wire.Bye) and time.monotonic() < deadline:
                time.sleep(0.05)


def steps(tel: LiveTelemetry, first: int, count: int) -> int:
    """`count` steps at ~10 a second, each with an all-reduce; the last step's number."""
    n = first
    for n in range(first, first + count):
        tel.phase("data")
        tel.phase("forward")
        tel.phase("backward")
        with tel.collective("allreduce", 4096):
            time.sleep(STEP_S / 2)
        tel.phase("optimizer")
        time.sleep(STEP_S / 2)
        tel.count_step(0, n, 0, n, 0.1, loss=1.0, samples=4)
    return n


def beats_between(got: Collector, since: float, until: float) -> list[wire.Heartbeat]:
    return [b for b in got.of(wire.Heartbeat) if since <= b.t <= until]


@pytest.mark.slow  # seconds of heartbeats on the clock (7 s): make test runs it
def test_a_stepping_rank_sends_no_heartbeats_a_blocked_or_sleeping_one_one_a_second() -> None:
    with live_rank() as (tel, got):
        n = steps(tel, 1, 15)  # 1.5 s
        stepped = time.time()
        tel.phase("data")
        time.sleep(2.5)  # a slow data loader
        slept = time.time()
        tel.phase("backward")
        with tel.collective("allreduce", 8192):  # blocked: the others do not come
            time.sleep(2.5)
        blocked = time.time()
        steps(tel, n + 1, 5)
    first_step = got.of(wire.Step)[0].t
    assert not beats_between(got, first_step, stepped), "heartbeats while stepping"
    for since, until in ((stepped, slept), (slept, blocked)):
        quiet = beats_between(got, since, until)
        assert 2 <= len(quiet) <= 3, [b.t - since for b in quiet]
        times = [since, *[b.t for b in quiet]]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert all(0.9 <= g < HEARTBEAT_INTERVAL_S + BEAT_SLACK_S for g in gaps[1:]), gaps
        assert gaps[0] < HEARTBEAT_INTERVAL_S + BEAT_SLACK_S, gaps  # after the last message
    waiting = beats_between(got, slept + BEAT_SLACK_S, blocked)
    assert waiting and all(b.phase == "backward" and b.coll_started is not None
                           and b.coll_started.bytes == 8192 and b.coll_completed is not None
                           and b.coll_completed.seq < b.coll_started.seq for b in waiting)
    liveness = [m.t for m in got.messages if isinstance(m, wire.Step | wire.Heartbeat)]
    assert max(b - a for a, b in itertools.pairwise(liveness)) < (
        HEARTBEAT_INTERVAL_S + BEAT_SLACK_S)
    assert sum(s.steps for s in got.of(wire.Step)) == 20


@pytest.mark.slow  # seconds on the clock (5 s): make test runs it
def test_evaluation_is_said_at_once_and_so_is_its_end() -> None:
    with live_rank() as (tel, got):
        n = steps(tel, 1, 15)  # more than a second since the first heartbeat
        entered = time.time()
        tel.phase("evaluation")
        time.sleep(1.3)
        left = time.time()
        steps(tel, n + 1, 15)
        ended = time.time()
    evaluating = [b for b in got.of(wire.Heartbeat) if b.phase == "evaluation"]
    assert evaluating and entered <= evaluating[0].t < entered + 0.4, (
        evaluating, entered)
    # Its end: a second after its newest heartbeat at the latest (at once when
    # that one is older), then steps again and no heartbeat.
    back = beats_between(got, left, ended)
    assert len(back) == 1 and back[0].phase in wire.STEP_PHASES, back
    newest = max(b.t for b in evaluating)
    assert back[0].t < max(left, newest + HEARTBEAT_INTERVAL_S) + 0.4, (back, left, newest)
    first_step = got.of(wire.Step)[0].t
    assert not beats_between(got, first_step, entered)



def test_a_signed_collective_is_said_once_after_a_short_while_inside_it() -> None:
    """A script's own collective (signed: its group is compared across ranks) is
    said COLLECTIVE_NEWS_S after the rank was first seen inside it, once, and
    never sooner than a second after the last heartbeat."""
    beats = Beats()
    beats.beat(0.0, "setup", sent=True)
    for i in range(1, 20):
        beats.stepped(i * 0.1)
    first, second = object(), object()
    assert not beats.inside(2.0, None)
    assert not beats.inside(2.0, first)  # first seen inside it
    assert not beats.inside(2.0 + COLLECTIVE_NEWS_S - 0.01, first)
    assert beats.inside(2.01 + COLLECTIVE_NEWS_S, first)
    beats.beat(2.3, "forward", sent=True)
    assert not beats.inside(3.5, first)  # said once
    # The next one, entered soon after: not before a second since that heartbeat.
    assert not beats.inside(2.4, second)
    assert not beats.inside(2.41 + COLLECTIVE_NEWS_S, second)
    assert beats.inside(3.3, second)
    # Out of it (the rank stepped on): nothing.
    assert not beats.inside(5.0, None)
    # A heartbeat that could not go out does not tell it: asked again a second later.
    third = object()
    assert not beats.inside(6.0, third)
    assert beats.inside(6.01 + COLLECTIVE_NEWS_S, third)
    beats.beat(6.31, "forward", sent=False)
    assert not beats.inside(6.9, third) and beats.inside(7.32, third)
