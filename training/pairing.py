"""Step pairing: a step counted once, when two hands may count it.

Under `ddtrain start` a script's optimizer steps are counted by a global
optimizer hook (autowatch.py), and a script may also call `ddtop.step()`
once per step, before or after the optimizer steps. The two are paired so a
step is never counted twice: a `ddtop.step()` right after the hook counted a
step goes with that step (adds its loss and samples), and the hook right after
a `ddtop.step()` that counted one goes with that one.

The pairing is one of three states, moved by three events (the methods):

    state        ddtop.step()              optimizer hook            training forward
    EVEN         counts: CALL_AHEAD        counts: HOOK_AHEAD        -
    HOOK_AHEAD   joins its step: EVEN      counts: HOOK_AHEAD        -
    CALL_AHEAD   counts: CALL_AHEAD        joins its step: EVEN      EVEN

A training forward ends a CALL_AHEAD: the step `ddtop.step()` counted was one
the hook never saw (GradScaler skipped the optimizer step), and must not be
paired with the next iteration's optimizer step. A HOOK_AHEAD stays: in a GAN
the second model's forward comes between the hook and its `ddtop.step()`.
Apart from the state, whether the script calls `ddtop.step()` at all
(`calls_step`): from its first call, a step the hook counts waits for its loss.
"""

from __future__ import annotations

import enum


class Pairing(enum.Enum):
    EVEN = "even"  # every step counted so far went with both hands, or nothing waits
    HOOK_AHEAD = "hook ahead"  # the hook counted a step no ddtop.step() went with yet
    CALL_AHEAD = "call ahead"  # ddtop.step() counted a step the hook has not seen


class StepPairing:
    """The pairing state of a rank (training/api.py's LiveRank), and its transitions."""

    __slots__ = ("calls_step", "state")

    def __init__(self) -> None:
        self.state = Pairing.EVEN
        self.calls_step = False  # the script calls ddtop.step (its loss follows the hook)

    def step_called(self) -> bool:
        """`ddtop.step()`: True when it goes with the step the hook just counted
        (its loss and samples join that step); False when it counts a step."""
        self.calls_step = True
        if self.state is Pairing.HOOK_AHEAD:
            self.state = Pairing.EVEN
            return True
        self.state = Pairing.CALL_AHEAD
        return False

    def optimizer_stepped(self) -> bool:
        """The optimizer hook: True when it goes with the step `ddtop.step()` just
        counted; False when it counts a step."""
        if self.state is Pairing.CALL_AHEAD:
            self.state = Pairing.EVEN
            return True
        self.state = Pairing.HOOK_AHEAD
        return False

    def iteration_started(self) -> None:
        """A training forward of a DDP model (zero-code)."""
        if self.state is Pairing.CALL_AHEAD:
            self.state = Pairing.EVEN
