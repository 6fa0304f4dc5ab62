"""Zero-code phases of an optimizer step given a closure (Lightning's
`optimizer.step(closure)`: forward and backward run inside the step), split as
they happen: forward and backward inside the closure as forward and backward,
the optimizer's own update as optimizer; and a plain DDP loop split as before.
Real 2-rank gloo runs of tests/scripts/closure_lightning.py, whose model takes
FORWARD_S forward, BACKWARD_S backward and whose optimizer takes UPDATE_S for
its update (sleeps: lower bounds whatever the machine's load)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import ddtrain
from test_api import Sent

from ddtop.core import wire

SCRIPT = Path(__file__).resolve().parent / "scripts" / "closure_lightning.py"
sys.path.insert(0, str(SCRIPT.parent))
from closure_lightning import BACKWARD_S, FORWARD_S, UPDATE_S  # noqa: E402

STEPS = 8
TIMEOUT_S = 120


def phase_split(run_root: Path, rank: int) -> dict[str, float]:
    """The rank's seconds per step in each step phase, over the whole run (the
    daemon's phase_split is each Step message's, divided by its steps)."""
    steps: list[wire.Step] = Sent(run_root).of(wire.Step, rank)
    n = sum(s.steps for s in steps)
    assert n == STEPS and steps[-1].global_step == STEPS
    return {"data": sum(s.data_s for s in steps) / n,
            "forward": sum(s.forward_s for s in steps) / n,
            "backward": sum(s.backward_s for s in steps) / n,
            "optimizer": sum(s.optimizer_s for s in steps) / n}


def assert_split_as_it_happens(split: dict[str, float]) -> None:
    what = {k: f"{v * 1e3:.1f} ms" for k, v in split.items()}
    assert split["forward"] >= 0.9 * FORWARD_S, what
    assert split["backward"] >= 0.9 * BACKWARD_S, what
    assert split["optimizer"] >= 0.9 * UPDATE_S, what  # the update, not ~0
    # ... and nothing of forward or backward in it: the update is the small part.
    assert split["optimizer"] < 0.5 * min(split["forward"], split["backward"]), what
    model = split["forward"] + split["backward"]
    assert model / (model + split["optimizer"]) > 0.75, what


def run(tmp_path: Path, run_id: str, *args: str) -> Path:
    done = ddtrain("start", "--foreground", "-n", "2", "--run-id", run_id, str(SCRIPT), "--",
                   "--steps", str(STEPS), *args, cwd=tmp_path, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.leftovers == []
    return tmp_path / "runs" / run_id


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_lightnings_closure_step_is_split_as_it_happens(tmp_path: Path) -> None:
    pytest.importorskip("lightning")  # in the test extra: installed by make test
    root = run(tmp_path, "pl")
    for rank in (0, 1):
        assert_split_as_it_happens(phase_split(root, rank))
    assert not [e for e in Sent(root).of(wire.Event) if e.type in ("warning", "error")]


@pytest.mark.parametrize("closure", [[], ["--closure"]], ids=["plain", "closure"])
@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_a_plain_ddp_loop_is_split_the_same_with_or_without_a_closure(
        tmp_path: Path, closure: list[str]) -> None:
    """The same model and optimizer without Lightning: `optimizer.step()` after
    backward, or `optimizer.step(closure)` with the closure passed positionally."""
    root = run(tmp_path, "plain", "--plain", *closure)
    for rank in (0, 1):
        assert_split_as_it_happens(phase_split(root, rank))
