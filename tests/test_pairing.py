"""Step pairing (training/pairing.py): `ddtop.step()` and the optimizer hook
count each step once, in every order a script calls them."""

from __future__ import annotations

import pytest

from ddtop.training.pairing import Pairing, StepPairing


def play(events: str, pairing: StepPairing | None = None) -> list[str]:
    """Each event ('s' ddtop.step, 'o' the optimizer hook, 'f' a training
    forward) and what it did: counted a step, joined the step the other counted,
    or (a forward) nothing."""
    pairing = pairing or StepPairing()
    done = []
    for event in events:
        if event == "s":
            done.append("s:join" if pairing.step_called() else "s:count")
        elif event == "o":
            done.append("o:join" if pairing.optimizer_stepped() else "o:count")
        else:
            pairing.iteration_started()
    return done


@pytest.mark.parametrize(("events", "done"), [
    # No ddtop.step: the hook counts every step.
    ("fofofo", ["o:count", "o:count", "o:count"]),
    # ddtop.step after the optimizer step: the hook counts, the call adds its loss.
    ("fosfos", ["o:count", "s:join", "o:count", "s:join"]),
    # ddtop.step before it: the call counts, the hook goes with it.
    ("fsofso", ["s:count", "o:join", "s:count", "o:join"]),
    # No optimizer hook (plain torchrun): every call counts.
    ("fsfsfs", ["s:count", "s:count", "s:count"]),
    # GradScaler skips the first optimizer step: that iteration's call counted it,
    # and the next iteration's hook does not go with it.
    ("fsfos", ["s:count", "o:count", "s:join"]),
    # A GAN: the second model's forward between the hook and the call.
    ("fofsfofs", ["o:count", "s:join", "o:count", "s:join"]),
    # Accumulation with ddtop.step per micro-batch: steps the script says it took.
    ("fsfsofsfso", ["s:count", "s:count", "o:join", "s:count", "s:count", "o:join"]),
])
def test_every_step_is_counted_once(events: str, done: list[str]) -> None:
    assert play(events) == done


def test_the_state_after_each_event() -> None:
    p = StepPairing()
    assert (p.state, p.calls_step) == (Pairing.EVEN, False)
    play("fo", p)
    assert (p.state, p.calls_step) == (Pairing.HOOK_AHEAD, False)  # its loss may follow
    play("f", p)
    assert p.state is Pairing.HOOK_AHEAD  # a forward does not end it
    play("s", p)
    assert (p.state, p.calls_step) == (Pairing.EVEN, True)  # from now on a hook step waits
    play("fs", p)
    assert p.state is Pairing.CALL_AHEAD
    play("f", p)
    assert p.state is Pairing.EVEN
