"""Stragglers: the rank the others persistently wait for, and nothing without evidence.

In DDP every rank waits in the gradient all-reduce for the slowest one, so a
rank's *compute* per step (its step time minus its all-reduce time, which for a
fast rank includes the wait) is its own work: a rank whose compute stands above
the others' is the one they wait for, and by how much is what the run loses each
step. One Step message says little on a busy machine: clean ranks sharing two
cores vary 2-10x from one message to the next, every rank in turn (a rule that
named the newest reading's slowest flickered through every rank). So:

- window: a rank's steps since its previous window, closed by the first Step
  message that brings it to WINDOW_STEPS steps (steps, not messages: a message
  carries every step since the sender's previous one);
- round: once every rank of the world has closed a window (or one rank closes
  a second before the others caught up), each new window is judged against the
  median of the other ranks' newest windows (closed in this round or the one
  before). It is *over* when its compute per step is at least FACTOR times that
  median and above it by at least STEP_SHARE of the median step time (and
  MIN_EXCESS_S): the others lose a noticeable share of every step waiting for
  it. A rank computing 30% longer in a step that is mostly communication costs
  the others little, and on a shared machine clean ranks differ that much all
  the time;
- hysteresis: a rank is named after NAME_AFTER windows over in a row and
  un-named after CLEAR_AFTER windows in a row that are not; or sooner, after
  NAME_AFTER_ROBUST windows holding NAME_AFTER_STEPS steps together, when each
  of them is over by FACTOR_STRONG and robust: every message in it carried its
  compute per step without its longest step (Step.compute_trim_s, from 3 steps
  a message), so one step the rank was descheduled in does not count. A sender
  packs ~0.1 s of steps in a message: at 8 steps a message that is 2 windows,
  16 steps, where 4 windows would take 32.

A rank that sends no steps is neither judged nor a reference for the others: a
stopped rank names nobody (the others block in the all-reduce and send no steps
either), and `named` leaves out a rank that exited, said bye, or has not
stepped for a while. A one-off long step (a rank stopped and resumed, a pause)
falls in one window: not enough to name anyone.

Pure: the fold (core/state.py) keeps an `Evidence` per rank and `Rounds` per
run and calls `add_steps` for each Step message; tested on synthetic sequences
in tests/test_stragglers.py.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Callable, Iterable, Mapping

import msgspec

from ddtop.core import causes

WINDOW_STEPS = 5  # steps per window, at least (whole Step messages)
FACTOR = 1.25  # compute per step at least this many times the others' median ...
STEP_SHARE = 0.15  # ... and above it by this share of the median step time ...
MIN_EXCESS_S = 0.001  # ... and by at least this much: over
NAME_AFTER = 4  # windows over in a row to name a rank: 20 steps at least
# ... or, when every window's messages left out their longest step (a spike),
# this many windows holding NAME_AFTER_STEPS steps together.
# Each of them over by FACTOR_STRONG: fewer steps of evidence, a larger effect.
NAME_AFTER_ROBUST = 2
NAME_AFTER_STEPS = 16
FACTOR_STRONG = 1.3
CLEAR_AFTER = 4  # windows not over in a row to un-name it
TRIM_MIN_STEPS = 3  # a message's steps without the longest one: only from this many
# A named rank that has not stepped for this long (or QUIET_STEPS of its steps, if
# longer), as of the newest message the run received, is not shown: no fresh evidence.
QUIET_AFTER_S = 5.0
QUIET_STEPS = 3


class Window(msgspec.Struct, array_like=True):
    """Sums over a run of one rank's steps."""

    steps: int = 0
    step_s: float = 0.0
    compute_s: float = 0.0  # step time outside the gradient all-reduce
    # Every message of it carried its steps' compute without the longest step
    # (Step.compute_trim_s): one descheduled step does not move it.
    robust: bool = True
    # Where the compute went, for its cause (core/causes.py): the data phase; the
    # rest of it (forward, backward and the optimizer, less the gradient all-reduce,
    # in which a fast rank waits); and, over `host_steps` of its steps
    # (those whose messages carried them), the wait for a CPU and major faults.
    data_s: float = 0.0
    work_s: float = 0.0
    runq_s: float = 0.0
    faults: int = 0
    host_steps: int = 0

    def parts(self) -> causes.Parts:
        """Per step (the host's readings over the steps that carried them)."""
        n, h = max(1, self.steps), self.host_steps
        return causes.Parts(self.data_s / n, self.work_s / n,
                            self.runq_s / h if h else None, self.faults / h if h else None)


class Verdict(msgspec.Struct, array_like=True):
    """A yes/no that changes only after enough windows in a row disagree with it."""

    named: bool = False
    streak: int = 0  # windows in a row that said the opposite of `named`
    streak_steps: int = 0  # the steps in those windows
    streak_robust: bool = True  # every one of them robust (Window.robust)

    def judge(self, over: bool, window: Window | None = None, strong: bool = False) -> None:
        """`strong`: over by FACTOR_STRONG (what the short robust streak counts)."""
        if over == self.named:
            self.streak, self.streak_steps, self.streak_robust = 0, 0, True
            return
        self.streak += 1
        if window is not None:
            self.streak_steps += window.steps
            self.streak_robust = self.streak_robust and window.robust and strong
        if over:
            due = self.streak >= NAME_AFTER or (
                window is not None and self.streak_robust
                and self.streak >= NAME_AFTER_ROBUST and self.streak_steps >= NAME_AFTER_STEPS)
        else:
            due = self.streak >= CLEAR_AFTER
        if due:
            self.named, self.streak, self.streak_steps, self.streak_robust = over, 0, 0, True


class Evidence(msgspec.Struct, kw_only=True):
    """What one rank's steps say about it."""

    open: Window = msgspec.field(default_factory=Window)
    newest: Window | None = None  # the newest closed window
    newest_round: int = -1  # the round it closed in
    unjudged: bool = False  # `newest` waits for its round
    verdict: Verdict = msgspec.field(default_factory=Verdict)  # named: a straggler
    excess_s: float = 0.0  # newest judged window: compute per step above the others' median
    # While named: why, from its newest judged window (core/causes.py): (cause, words).
    cause: tuple[str, str] | None = None
    stepped_at: float | None = None  # receiver time of its newest steps
    step_s: float = 0.0  # per step, in its newest closed window


class Rounds(msgspec.Struct, kw_only=True):
    """The run's rounds of judging."""

    number: int = 0
    unjudged: int = 0  # ranks with a window waiting for this round


def add_steps(rounds: Rounds, evidence: Evidence, steps: int, step_s: float, comm_s: float,
              received: float, world_size: int,
              stepping: Callable[[], Mapping[int, Evidence]],
              compute_trim_s: float | None = None, split: Window | None = None) -> None:
    """Fold one Step message's sums (`steps` steps of `step_s` seconds in all,
    `comm_s` of it in the all-reduce, received at `received`) into a rank's
    evidence, judging a round when one is due. `stepping()`: the evidence of
    every rank still running (called only for a round). `split`: where the
    message's compute went (Window's data_s, work_s, runq_s, faults, host_steps)."""
    evidence.stepped_at = received
    if steps <= 0:
        return
    w = evidence.open
    w.steps += steps
    w.step_s += step_s
    if split is not None:
        w.data_s += split.data_s
        w.work_s += split.work_s
        w.runq_s += split.runq_s
        w.faults += split.faults
        w.host_steps += split.host_steps
    if (compute_trim_s is not None and steps >= TRIM_MIN_STEPS and math.isfinite(compute_trim_s)
            and compute_trim_s >= 0):
        w.compute_s += compute_trim_s * steps
    else:
        w.robust = False
        if step_s > comm_s:
            w.compute_s += step_s - comm_s
    if w.steps < WINDOW_STEPS:
        return
    evidence.open = Window()
    if evidence.unjudged:  # a window ahead of some rank: judge what there is
        judge(rounds, stepping())
    evidence.newest, evidence.newest_round, evidence.unjudged = w, rounds.number, True
    evidence.step_s = w.step_s / w.steps
    rounds.unjudged += 1
    if world_size and rounds.unjudged >= world_size:  # every rank has a new window
        judge(rounds, stepping())


def judge(rounds: Rounds, ranks: Mapping[int, Evidence]) -> None:
    """One round: every unjudged window of `ranks` against the others' fresh ones."""
    fresh = [e.newest for e in ranks.values()
             if e.newest is not None and e.newest_round >= rounds.number - 1]
    values = sorted(w.compute_s / w.steps for w in fresh)
    step = statistics.median(w.step_s / w.steps for w in fresh) if fresh else 0.0
    for e in ranks.values():
        if not e.unjudged or e.newest is None:
            continue
        e.unjudged = False
        if len(values) < 2:
            continue  # nobody to compare with: no evidence either way
        mine = e.newest.compute_s / e.newest.steps
        others = _median_without(values, mine)
        e.excess_s = mine - others
        big = e.excess_s >= max(MIN_EXCESS_S, STEP_SHARE * step)
        e.verdict.judge(mine >= FACTOR * others and big, e.newest,
                        strong=mine >= FACTOR_STRONG * others and big)
        e.cause = (causes.choose(e.newest.parts(), _medians([w for w in fresh
                                                            if w is not e.newest]),
                                 e.excess_s) if e.verdict.named else None)
    rounds.number += 1
    rounds.unjudged = 0


def _medians(windows: list[Window]) -> causes.Parts:
    """The part-wise median of `windows`, per step (of those that read the host's)."""
    parts = [w.parts() for w in windows]
    runq = [p.runq_s for p in parts if p.runq_s is not None]
    faults = [p.faults for p in parts if p.faults is not None]
    return causes.Parts(statistics.median(p.data_s for p in parts) if parts else 0.0,
                        statistics.median(p.work_s for p in parts) if parts else 0.0,
                        statistics.median(runq) if runq else None,
                        statistics.median(faults) if faults else None)


def _median_without(ordered: list[float], value: float) -> float:
    """The median of sorted `ordered` with one occurrence of `value` left out."""
    skip = bisect.bisect_left(ordered, value)
    n = len(ordered) - 1

    def at(i: int) -> float:
        return ordered[i if i < skip else i + 1]

    return (at((n - 1) // 2) + at(n // 2)) / 2


def quiet(evidence: Evidence, newest: float | None) -> bool:
    """No steps from the rank for a while, as of the run's newest message `newest`."""
    if evidence.stepped_at is None or newest is None:
        return True
    return newest - evidence.stepped_at > max(QUIET_AFTER_S, QUIET_STEPS * evidence.step_s)


def named(ranks: Iterable[tuple[int, Evidence]]) -> tuple[int | None, float, list[int]]:
    """(slowest rank, its excess compute per step in s, stragglers) among `ranks`
    (those that may be shown: running, stepping): the stragglers are the ranks
    named, the slowest the one of them with the largest excess; (None, 0.0, [])
    without evidence."""
    excess = {rank: e.excess_s for rank, e in ranks if e.verdict.named}
    if not excess:
        return None, 0.0, []
    slowest = max(excess, key=lambda r: (excess[r], -r))
    return slowest, max(0.0, excess[slowest]), sorted(excess)
