"""The step folder (training/stepfold.py) fed marks made by hand, as the
training thread would leave them: step times and phases, the DDP estimate for
all-reduces not read, the open step, the epoch split, the loss held or
overwritten, dropped steps. Every number is worked out by hand in the test."""

from __future__ import annotations

import pytest
import torch

from ddtop.training.marks import (
    CommMark,
    CudaLoss,
    DdpReadingMark,
    DdpSyncMark,
    ExposedMark,
    FoldRounds,
    LossMark,
    Mark,
    PhaseMark,
    ResumeMark,
    StepMark,
    TensorLoss,
)
from ddtop.training.stepfold import (
    LOSS_OVERWRITTEN,
    OPEN_WAIT_S,
    StepFolder,
    StepWindow,
    step_message,
)

HOLD_S = 0.1
NOW = 100.0  # the rounds' clock (monotonic); the marks' clock starts at 0


class Model:
    """A DDP model as the folder sees it (commtimer.DDPStats)."""

    def __init__(self, grad_bytes: int, buckets: int) -> None:
        self.grad_bytes, self.buckets = grad_bytes, buckets


def folder(world_size: int = 2) -> StepFolder:
    return StepFolder(world_size, FoldRounds(rank=0), start=0.0, hold_s=HOLD_S)


def step(at: float, n: int, epoch: int = 0, steps_per_epoch: int = 0, loss: object = None,
         samples: int | None = None, hold: bool = False) -> StepMark:
    """Step number `n` (counted from 1) counted at `at`."""
    in_epoch = n - epoch * steps_per_epoch if steps_per_epoch else 0
    return StepMark(at, epoch, in_epoch, steps_per_epoch, n, 0.5, loss, samples, hold, None)


def fold(f: StepFolder, *marks: Mark, now: float = NOW) -> None:
    f.fold(iter(marks), now)


def only(windows: list[StepWindow]) -> StepWindow:
    assert len(windows) == 1, windows
    return windows[0]


def message(w: StepWindow) -> dict[str, object]:
    m = step_message(w, "r", 0, 2, (None, None, 1 << 30, None, None))
    return {f: getattr(m, f) for f in m.__struct_fields__}


def test_a_step_is_its_time_less_the_phases_that_are_not_step_phases() -> None:
    f = folder()
    fold(f, PhaseMark("data", 1.0),  # setup, 0 to 1: not step time
         PhaseMark("forward", 1.5), PhaseMark("backward", 2.0),
         PhaseMark("evaluation", 3.0),  # 3.0 to 3.5: not step time
         PhaseMark("optimizer", 3.5), step(4.0, 1, samples=8))
    w = only(f.ready(NOW))
    assert (w.steps, w.samples, w.global_step) == (1, 8, 1)
    assert w.step_s == pytest.approx(4.0 - 1.0 - 0.5)
    assert dict(w.phase_s) == pytest.approx({"data": 0.5, "forward": 0.5, "backward": 1.0,
                                             "optimizer": 0.5})
    sent = message(w)
    assert (sent["data_s"], sent["forward_s"], sent["backward_s"], sent["optimizer_s"]) == (
        pytest.approx(0.5), pytest.approx(0.5), pytest.approx(1.0), pytest.approx(0.5))
    assert sent["compute_trim_s"] is None  # (fewer than 3 steps)
    # The next step starts in the phase the last one ended in (no phase spans two).
    fold(f, PhaseMark("backward", 4.25), step(5.0, 2))
    w = only(f.ready(NOW))
    assert w.step_s == pytest.approx(1.0)
    assert dict(w.phase_s) == pytest.approx({"optimizer": 0.25, "backward": 0.75})


def test_an_all_reduce_not_read_takes_the_recent_compute_or_its_usual_share() -> None:
    """Three steps read (readings 0.4, 0.1, 0.1: median 0.1; computes 0.6, 0.9,
    0.5: median 0.6), then two not read: a long one (2.0 s) is the usual compute
    plus an all-reduce of 1.4; a quick one (0.35 s) is no less than the
    all-reduce's usual share of a step, 0.1 / (0.1 + 0.6)."""
    m = Model(grad_bytes=4000, buckets=2)
    f = folder(world_size=4)  # an all-reduce's bus factor: 2 * 3 / 4
    fold(f, PhaseMark("data", 0.0),
         DdpSyncMark(m, True), step(1.0, 1), DdpReadingMark(m, 0.4),
         DdpSyncMark(m, True), step(2.0, 2), DdpReadingMark(m, 0.1),
         DdpSyncMark(m, True), step(2.6, 3), DdpReadingMark(m, 0.1),
         DdpSyncMark(m, False), step(4.6, 4),
         DdpSyncMark(m, False), step(4.95, 5))
    w = only(f.ready(NOW))  # the last step is open, but no reading will come: it goes too
    estimate_long = 2.0 - 0.6  # more than the share, 2.0 * 0.1 / 0.7
    estimate_quick = 0.35 * 0.1 / (0.1 + 0.6)  # more than 0.35 - 0.6
    assert w.steps == 5 and w.step_s == pytest.approx(4.95)
    assert w.comm_s == pytest.approx(0.4 + 0.1 + 0.1 + estimate_long + estimate_quick)
    assert (w.comm_bytes, w.comm_ops) == (5 * 4000, 5 * 2)
    assert w.comm_bus_bytes == pytest.approx(5 * 4000 * 1.5)
    computes = [1.0 - 0.4, 1.0 - 0.1, 0.6 - 0.1, 2.0 - estimate_long, 0.35 - estimate_quick]
    assert w.compute_sum_s == pytest.approx(sum(computes))
    assert w.compute_max_s == pytest.approx(0.9) and w.compute_steps == 5
    sent = message(w)
    # The mean compute per step without the longest: (sum - 0.9) / 4.
    assert sent["compute_trim_s"] == pytest.approx((sum(computes) - 0.9) / 4)
    assert sent["busbw_gbps"] == pytest.approx(5 * 4000 * 1.5 / w.comm_s / 1e9)


def test_several_all_reduces_not_read_take_their_models_median_reading() -> None:
    """Two models in a step: each all-reduce not read takes its own model's
    median reading; never more communication than the step's time."""
    a, b = Model(100, 1), Model(200, 1)
    f = folder()
    fold(f, PhaseMark("data", 0.0),
         DdpSyncMark(a, True), DdpSyncMark(b, True), step(1.0, 1),
         DdpReadingMark(a, 0.2), DdpReadingMark(b, 0.3),
         DdpSyncMark(a, False), DdpSyncMark(b, False), step(2.0, 2),
         DdpSyncMark(a, False), DdpSyncMark(b, False), step(2.4, 3))
    w = only(f.ready(NOW))
    # 0.5 read, 0.2 + 0.3 estimated, then 0.5 estimated but only 0.4 long.
    assert w.comm_s == pytest.approx(0.5 + 0.5 + 0.4)
    assert (w.comm_bytes, w.comm_ops) == (3 * 300, 3 * 2)
    assert w.compute_sum_s == pytest.approx(0.5 + 0.5 + 0.0)


def test_the_open_step_waits_for_its_reading_a_while_and_goes_at_a_flush() -> None:
    m = Model(1000, 1)
    f = folder()
    fold(f, PhaseMark("data", 0.0), DdpSyncMark(m, True), step(1.0, 1))
    assert f.ready(NOW) == [] and f.ready(NOW + OPEN_WAIT_S / 2) == []  # it waits
    fold(f, DdpReadingMark(m, 0.25), now=NOW + 0.6)
    assert only(f.ready(NOW + 0.6)).comm_s == pytest.approx(0.25)  # read: it goes
    # The next one's reading never comes: it waits OPEN_WAIT_S, then is estimated
    # (compute 0.75 known; 1.5 s long: 1.5 - 0.75, above 1.5 * 0.25 / 1.0).
    fold(f, DdpSyncMark(m, True), step(2.5, 2), now=NOW + 1.0)
    assert f.ready(NOW + 1.0 + OPEN_WAIT_S * 0.9) == []
    assert only(f.ready(NOW + 1.0 + OPEN_WAIT_S)).comm_s == pytest.approx(0.75)
    # At a flush (the last round) it goes at once.
    fold(f, DdpSyncMark(m, True), step(3.0, 3), now=NOW + 3.0)
    assert f.ready(NOW + 3.0) == []
    w = only(f.ready(NOW + 3.0, final=True))
    assert w.steps == 1 and w.comm_s == pytest.approx(0.5 * 0.25 / (0.25 + 0.75))


def test_communication_goes_with_the_step_it_was_marked_in() -> None:
    f = folder()
    fold(f, PhaseMark("data", 0.0), CommMark(0.3, 1000, 1.0), ExposedMark(0.1))
    assert f.ready(NOW, final=True) == []  # no step yet: nothing goes, nothing is lost
    fold(f, CommMark(0.2, 500, 0.5), step(1.0, 1))
    w = only(f.ready(NOW))
    assert (w.comm_s, w.comm_bytes, w.comm_ops) == (pytest.approx(0.5), 1500, 2)
    assert w.comm_bus_bytes == pytest.approx(1000 + 250)
    assert message(w)["comm_overlap_s"] == pytest.approx(0.5 - 0.1)
    fold(f, step(2.0, 2))
    assert only(f.ready(NOW)).comm_s == 0.0  # (the next step has none)


def test_a_window_never_spans_two_epochs() -> None:
    f = folder()
    fold(f, PhaseMark("data", 0.0),
         step(1.0, 1, 0, 2, loss=1.0, samples=4), step(2.0, 2, 0, 2, loss=2.0, samples=4),
         step(3.5, 3, 1, 2, loss=4.0, samples=4))
    first, second = f.ready(NOW)
    assert (first.epoch, first.step, first.global_step, first.steps) == (0, 2, 2, 2)
    assert (first.loss_sum, first.loss_weight, first.samples) == (12.0, 8, 8)
    assert first.step_s == pytest.approx(2.0)
    assert (second.epoch, second.step, second.global_step, second.steps) == (1, 1, 3, 1)
    assert (second.loss_sum, second.loss_weight, second.samples) == (16.0, 4, 4)
    assert second.step_s == pytest.approx(1.5)


def test_a_held_step_waits_for_its_loss_at_most_the_hold() -> None:
    f = folder()
    fold(f, PhaseMark("data", 0.0), step(1.0, 1, hold=True))
    assert f.ready(NOW + HOLD_S / 2) == []  # held for its loss
    fold(f, LossMark(2.0, 4, release=True), now=NOW + HOLD_S / 2)
    w = only(f.ready(NOW + HOLD_S / 2))  # released by it
    assert (w.loss_sum, w.loss_weight, w.samples) == (8.0, 4, 4)
    # Held from the first step that waits, however many wait after it.
    fold(f, step(2.0, 2, hold=True), now=NOW + 1.0)
    fold(f, step(3.0, 3, hold=True), now=NOW + 1.0 + HOLD_S * 0.9)
    assert f.ready(NOW + 1.0 + HOLD_S * 0.95) == []
    w = only(f.ready(NOW + 1.0 + HOLD_S))  # no loss came: they go without
    assert (w.steps, w.loss_weight, w.loss_sum) == (2, 0.0, 0.0)


def test_a_loss_changed_in_place_before_it_was_read_is_left_out_and_said_once() -> None:
    f = folder()
    kept, reused = torch.tensor(3.0), torch.tensor(5.0)
    marks = [PhaseMark("data", 0.0),
             step(1.0, 1, loss=TensorLoss(kept, kept._version), samples=2),
             step(2.0, 2, loss=TensorLoss(reused, reused._version), samples=2),
             step(3.0, 3, loss=TensorLoss(reused, reused._version), samples=2)]
    reused.add_(1.0)  # the script reuses its tensor before the sender reads it
    fold(f, *marks)
    w = only(f.ready(NOW))
    assert (w.loss_sum, w.loss_weight, w.samples, w.steps) == (6.0, 2, 6, 3)
    assert f.said == [LOSS_OVERWRITTEN]


def test_a_gpu_loss_goes_as_its_devices_running_sum_weighted_for_the_sender_to_read() -> None:
    """(The sender reads the latest running sum once its event has passed; here
    the sum is a CPU tensor and nothing is read.)"""
    f = folder()
    first = CudaLoss(torch.tensor(8.0, dtype=torch.float64), ready=None)
    latest = CudaLoss(torch.tensor(11.0, dtype=torch.float64), ready=None)
    fold(f, PhaseMark("data", 0.0), step(1.0, 1, loss=first, samples=4),
         step(2.0, 2, loss=latest))
    w = only(f.ready(NOW))
    assert w.loss_cuda is latest
    assert (w.loss_weight, w.loss_sum, w.samples) == (4 + 1, 0.0, 4)


def test_dropped_steps_are_counted_from_the_step_numbers() -> None:
    rounds = FoldRounds(rank=0)
    f = StepFolder(2, rounds, start=0.0, hold_s=HOLD_S)
    fold(f, PhaseMark("data", 0.0), step(1.0, 1), step(2.0, 2), step(3.0, 5))
    w = only(f.ready(NOW))
    assert (w.steps, w.global_step, rounds.dropped_steps) == (5, 5, 2)
    assert w.compute_steps == 3 and w.step_s == pytest.approx(3.0)
    fold(f, ResumeMark(100), step(4.0, 101))  # a resumed run goes on from step 100
    assert (only(f.ready(NOW)).steps, rounds.dropped_steps) == (1, 2)
