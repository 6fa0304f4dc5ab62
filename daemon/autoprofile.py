"""`--profile-stragglers`: a newly named straggler, and the median rank beside it,
profiled by themselves, and what differs told.

When the fold names a rank a straggler it had not named (core/stragglers.py),
and the last such profile is EVERY_S old or more, the daemon asks for a
profile of that rank and of the median rank (of the others stepping, the one
whose compute per step is the median), STEPS steps a second of steps ahead,
exactly as `ddtrain profile` does (core/profilereq.py; each rank's own threads
act on it: training/profiling.py). It says so, and once both ranks' profiles
are written (or WAIT_S has passed) it tells the operators where the straggler
spends most above the other, per step:

    profiling rank 1 (a straggler) and rank 0 (the median) for steps 45-49:
        ddtrain profile --show 20261207-104512
    profile 20261207-104512: rank 1 (the straggler) against the median of rank 0:
        aten::addmm +12.00 ms; ...

(each one line).
"""

from __future__ import annotations

import statistics
import time

from ddtop.core import profilereq
from ddtop.core.rundir import RunPaths
from ddtop.core.state import RunState
from ddtop.daemon import profilecmd

EVERY_S = 600.0  # at most one profile this often
STEPS = 5
WAIT_S = 60.0  # for both profiles to be written: this beyond the steps' own time


class AutoProfile:
    def __init__(self, paths: RunPaths, enabled: bool) -> None:
        self.paths, self.enabled = paths, enabled
        self.acted: set[int] = set()  # stragglers profiled while they stay named
        self.last = -EVERY_S  # monotonic time of the last profile asked
        # The profile asked for: its id, ranks, straggler, and until when it is waited for.
        self.pending: tuple[str, list[int], int, float] | None = None

    def tick(self, state: RunState, now: float | None = None) -> list[str]:
        """The lines to tell (info events), after a look at `state`."""
        if not self.enabled:
            return []
        now = time.monotonic() if now is None else now
        said = self._done(now)
        _, _, slow = state.stragglers()
        self.acted &= set(slow)  # (one no longer named is new again when it is)
        new = [r for r in slow if r not in self.acted]
        if new and self.pending is None and now - self.last >= EVERY_S:
            said += self._ask(state, new[0], set(slow), now)
        return said

    def _ask(self, state: RunState, straggler: int, slow: set[int], now: float) -> list[str]:
        views = {r: v for r, v in state.ranks.items()
                 if r not in slow and not v.exited and v.evidence.newest is not None}
        if not views:
            return []
        compute = {r: v.evidence.newest.compute_s / max(1, v.evidence.newest.steps)
                   for r, v in views.items() if v.evidence.newest is not None}
        middle = statistics.median_low(compute.values())
        median = min(r for r, c in compute.items() if c == middle)
        ranks = sorted({straggler, median})
        chosen = [state.ranks[r] for r in ranks]
        start = profilereq.start_after([v.global_step for v in chosen],
                                       max(v.step_time_s or 0.0 for v in chosen))
        try:
            request = profilereq.write(self.paths.logs, ranks, start, STEPS)
        except OSError as e:
            self.last = now
            return [f"--profile-stragglers: the request could not be written: {e}"]
        step_s = max(v.step_time_s or 0.0 for v in chosen)
        lead = start - min(v.global_step for v in chosen)
        self.acted.add(straggler)
        self.last = now
        self.pending = (request.id, ranks, straggler, now + WAIT_S + step_s * (lead + STEPS))
        return [f"profiling rank {straggler} (a straggler) and rank {median} (the median) for "
                f"steps {start + 1}-{start + STEPS}: ddtrain profile --show {request.id}"]

    def _done(self, now: float) -> list[str]:
        if self.pending is None:
            return []
        name, ranks, straggler, until = self.pending
        folder = profilereq.profiles_path(self.paths.root) / name
        tops = profilecmd.read_tops(folder)  # (what ranks wrote: bounded, never raises)
        if not set(ranks) <= set(tops) and now < until:
            return []
        self.pending = None
        per_step = profilecmd.per_step_ms(tops)
        if len(per_step) < 2:
            return [f"profile {name}: {len(per_step)} of the 2 ranks profiled (ddtrain "
                    f"profile --show {name})"]
        return [f"profile {name}: {profilecmd.against(per_step, [straggler])}"]
