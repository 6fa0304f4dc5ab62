"""Marks that come faster than telemetry's sender can fold them (a thread that
calls `ddtop.step` in a loop): the sender folds a bounded share per round, so its
heartbeats and Step messages keep going out, the marks beyond the bound are
dropped (their steps still counted, from their numbers), and one warning says
so (training/marks.py). In-process with a real sender and socket, and a real
2-rank run of tests/scripts/step_flood.py."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import threading
import time
from pathlib import Path

import pytest
from helpers import collecting, ddtrain

from ddtop.core import journal, wire
from ddtop.core.rankview import SILENT_AFTER_S
from ddtop.training.marks import FoldRounds
from ddtop.training.telemetry import LiveTelemetry

SCRIPTS = Path(__file__).resolve().parent / "scripts"
FLOOD_S = 2.5  # long enough for the warning (a second after the queue is first full)
FLOODED = re.compile(r"^rank (\d): ddtop\.step called [\d,]+ times/s, faster than telemetry "
                     r"can fold \([\d,]+ marks/s\): marks beyond 65,536 waiting are dropped "
                     r"\(at least [\d,]+ so far\)")
HELLO = wire.Hello(run="flood", rank=1, local_rank=1, host="h", pid=1, device="cpu",
                   backend="gloo", world_size=2, config_digest="", model="", dataset="",
                   epochs=0, global_batch=0)


def max_gap(messages: list[wire.Message], since: float, until: float) -> float:
    """The longest time without a message, from `since` to `until`."""
    times = [since, *sorted(m.t for m in messages), until]
    return max(b - a for a, b in itertools.pairwise(times))


def test_dropped_steps_are_counted_from_their_numbers() -> None:
    rounds = FoldRounds(rank=0)
    assert [rounds.step(n, 0.0) for n in (1, 2, 5, 6, 4)] == [1, 1, 3, 1, 1]
    assert rounds.dropped_steps == 2 and rounds.last_step == 6
    rounds.resumed(100)  # a resumed run goes on from step 100: nothing dropped
    assert rounds.step(101, 0.0) == 1 and rounds.dropped_steps == 2
    assert rounds.warning() is None  # the queue was never found full
    first = FoldRounds(rank=0)  # the marks of steps 1-4 dropped before the first fold
    assert first.step(5, 0.0) == 5 and first.dropped_steps == 4


def test_a_thread_stepping_in_a_loop_leaves_the_sender_its_rounds() -> None:
    """A thread marks steps as fast as it can for FLOOD_S: heartbeats and Step
    messages still go out every round, one warning names the rank and the rate,
    every step is counted (the dropped ones from their numbers), and the bye
    comes at once."""
    with collecting() as got:
        tel = LiveTelemetry(got.endpoint, HELLO)
        stop = threading.Event()
        produced = 0

        def flood() -> None:
            nonlocal produced
            n = 0
            while not stop.is_set():
                n += 1
                tel.count_step(0, n, 0, n, 0.1)
            produced = n

        thread = threading.Thread(target=flood)
        started = time.time()
        thread.start()
        time.sleep(FLOOD_S)  # the flood's length, not a wait for a condition
        stop.set()
        thread.join()
        ended = time.time()
        closing = time.monotonic()
        tel.close(0)
        closed_s = time.monotonic() - closing
        deadline = time.monotonic() + 10
        while not got.of(wire.Bye) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert got.of(wire.Bye), "no bye"
    assert closed_s < 1.5, f"close took {closed_s:.2f} s"
    during = [m for m in got.messages if started <= m.t <= ended]
    assert max_gap([m for m in during if isinstance(m, wire.Heartbeat | wire.Step)],
                   started, ended) < SILENT_AFTER_S
    # (a Step message every 0.1 s, but on two shared cores a thread can wait its turn)
    assert len([m for m in during if isinstance(m, wire.Step)]) >= 3
    warnings = [e.message for e in got.of(wire.Event) if e.type == "warning"]
    assert len(warnings) == 1 and FLOODED.match(warnings[0]), warnings
    assert FLOODED.match(warnings[0]).group(1) == "1"  # type: ignore[union-attr]
    steps = got.of(wire.Step)
    assert steps[-1].global_step == produced > 65_536  # (more than the queue holds)
    assert sum(s.steps for s in steps) == produced


@pytest.mark.processes
def test_a_run_whose_ranks_step_in_a_loop_is_reported_and_ends_in_time(tmp_path: Path) -> None:
    shutil.copy(SCRIPTS / "step_flood.py", tmp_path)
    begun = time.monotonic()
    run = ddtrain("start", "--foreground", "-n", "2", "--run-id", "flood", "step_flood.py",
                  "--", "40", cwd=tmp_path)
    took = time.monotonic() - begun
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.leftovers == []
    root = tmp_path / "runs" / "flood"
    assert json.loads((root / "run.json").read_text())["status"] == "succeeded"
    sent = [wire.decode([r.frame]) for r in journal.read(root / "telemetry.journal")]
    for rank in (0, 1):
        mine = [m for m in sent if getattr(m, "rank", None) == rank]
        steps = [m for m in mine if isinstance(m, wire.Step)]
        assert steps, f"rank {rank} reported no step"
        # (within 1%: the two threads' counts can race, as a script's own counter would)
        assert steps[-1].global_step > 40
        assert sum(s.steps for s in steps) == pytest.approx(steps[-1].global_step, rel=0.01)
        bye = [m for m in mine if isinstance(m, wire.Bye)]
        assert bye and bye[0].exit_code == 0, f"rank {rank} said no bye"
        assert max_gap(mine, mine[0].t, bye[0].t) < SILENT_AFTER_S, (
            f"rank {rank} went silent")
        warnings = [m.message for m in mine if isinstance(m, wire.Event)
                    and m.type == "warning" and FLOODED.match(m.message)]
        assert len(warnings) == 1 and warnings[0].startswith(f"rank {rank}: "), warnings
    trained = [float(t) for t in re.findall(r"TRAINED 40 steps in ([\d.]+) s", run.stdout)]
    assert len(trained) == 2, run.stdout
    assert took < 90, f"the run took {took:.0f} s ({trained} s training)"
