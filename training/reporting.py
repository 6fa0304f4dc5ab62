"""Each fact of a run, reported once, told to everyone who listens.

The training loop says what happened (a step, a metric sync, a checkpoint, an
epoch's end, a stop, a resume) to its `Reporter`, once. The reporter passes it
on to both sinks, in a fixed order:

- `Progress` (progress.py): the console lines in each rank's log and
  metrics.jsonl; only rank 0 tells the run's story.
- The wire, to the daemon or whoever listens, on every rank: a step through
  `ddtop.step` (counted as a user's script's steps are), everything else
  through `Telemetry` (telemetry.py; a no-op base class when telemetry is off).

What is telemetry alone, not a fact for the console (which phase a rank is in,
which collective it waits in, what the comm hook timed), the loop tells
`ddtop` or `Telemetry` directly. Nothing here reads a device tensor on its own:
`loss` goes on as a tensor, `Progress.step` turns it into a number when it
prints, and `LossWatch` tests it on the device, read where the loop waits for
the device anyway (`Reporter.check_loss`).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ddtop
from ddtop.core.config import TrainConfig
from ddtop.core.rundir import RunPaths
from ddtop.training.checkpoint import Position
from ddtop.training.distributed import RankEnv
from ddtop.training.metrics import GlobalMetrics
from ddtop.training.progress import Progress
from ddtop.training.telemetry import Telemetry


class NonFiniteLoss(RuntimeError):
    """--fail-on-nan: this rank's loss was NaN or infinite."""


class LossWatch:
    """Finds the first step whose loss is NaN or infinite, and says so once per
    rank: a warning in the rank's log and on the wire (the dashboard's events,
    the headless lines), training going on; with --fail-on-nan, NonFiniteLoss
    naming the step instead, which fails the run.

    Never a device sync of its own: a CPU loss is a number already and is tested
    at every step; a GPU loss is tested on the device (the first non-finite
    step and its value kept there) and read by `check()`, which the loop calls
    only where it waits for the device anyway."""

    def __init__(self, fail: bool, telemetry: Telemetry) -> None:
        self.fail, self.telemetry = fail, telemetry
        self.reported = False
        self.first_step: torch.Tensor | None = None  # on the device; -1: none yet
        self.first_value: torch.Tensor | None = None

    def step(self, loss: torch.Tensor, global_step: int) -> None:
        if self.reported:
            return
        value = loss.detach()
        if value.device.type == "cpu":
            number = float(value)
            if not math.isfinite(number):
                self._found(global_step, number)
        else:
            self._keep_first(value, global_step)

    def _keep_first(self, value: torch.Tensor, global_step: int) -> None:
        """On the device: remember the first non-finite step and its loss."""
        if self.first_step is None or self.first_value is None:
            self.first_step = torch.full((), -1, dtype=torch.int64, device=value.device)
            self.first_value = torch.zeros((), dtype=value.dtype, device=value.device)
        first = ~torch.isfinite(value) & (self.first_step < 0)  # queued, not waited for
        self.first_step = torch.where(first, global_step, self.first_step)
        self.first_value = torch.where(first, value, self.first_value)

    def check(self) -> None:
        """A GPU loss's verdict. Reads the device: call only at a sync point."""
        if self.reported or self.first_step is None or self.first_value is None:
            return
        step = int(self.first_step.item())
        if step >= 0:
            self._found(step, float(self.first_value.item()))

    def _found(self, global_step: int, value: float) -> None:
        self.reported = True
        if self.fail:
            raise NonFiniteLoss(f"the loss is {value} at step {global_step} (--fail-on-nan)")
        message = (f"the loss is {value} at step {global_step}; training goes on "
                   "(--fail-on-nan fails the run instead)")
        print(f"warning: {message}", file=sys.stderr, flush=True)
        self.telemetry.event("warning", message, global_step=global_step, loss=str(value))


class Reporter:
    def __init__(self, progress: Progress, telemetry: Telemetry,
                 fail_on_nan: bool = False) -> None:
        self.progress, self.telemetry = progress, telemetry
        self.losses = LossWatch(fail_on_nan, telemetry)

    @classmethod
    def for_rank(cls, config: TrainConfig, env: RankEnv, paths: RunPaths,
                 launch_time: float | None, telemetry: Telemetry) -> Reporter:
        return cls(Progress.for_rank(config, env, paths, launch_time), telemetry,
                   config.fail_on_nan)

    def resumed(self, checkpoint: Path, position: Position, global_step: int) -> None:
        """This rank loaded `checkpoint` and goes on from `position`."""
        self.progress.resumed(checkpoint.name, position)
        self.telemetry.event("resumed", f"resumed from {checkpoint.name}",
                             checkpoint=checkpoint.name, epoch=position.epoch,
                             step=position.step, global_step=global_step)

    def started(self, backend: str, device: torch.device, model: nn.Module, train_set: Any,
                val_set: Any, steps_per_epoch: int) -> None:
        """Set up, about to train (the telemetry said hello when it opened)."""
        self.progress.started(backend, device, model, train_set, val_set, steps_per_epoch)

    def epoch_started(self, epoch: int) -> None:
        self.progress.epoch_started(epoch)

    def step(self, epoch: int, step: int, steps_per_epoch: int, global_step: int,
             loss: torch.Tensor, samples: int) -> None:
        """One optimizer step done; `loss` is this rank's, still on its device."""
        ddtop.step(loss=loss, samples=samples)
        self.losses.step(loss, global_step)
        if self.progress.step(epoch, step, steps_per_epoch, loss, global_step):
            self.losses.check()  # the line read the device: so may the watch

    def check_loss(self) -> None:
        """The loop is at a sync point (it read the device): a GPU loss that went
        NaN or infinite since the last one is told now."""
        self.losses.check()

    def synced(self, epoch: int, step: int, global_step: int, metrics: GlobalMetrics) -> None:
        """Global training metrics of the epoch so far (--sync-every)."""
        self.progress.synced(epoch, step, global_step, metrics)
        self.telemetry.aggregate("sync", epoch, global_step, train_loss=metrics.loss,
                                 train_accuracy=metrics.accuracy, train_samples=metrics.samples)

    def checkpointed(self, path: Path, position: Position, global_step: int) -> None:
        """Rank 0 wrote `path`: telemetry only (the console has never listed them)."""
        self.telemetry.event("checkpoint", f"saved {path.name}", path=str(path),
                             epoch=position.epoch, step=position.step, global_step=global_step)

    def epoch_done(self, epoch: int, global_step: int, train: GlobalMetrics,
                   val: GlobalMetrics) -> None:
        """The epoch's global training and validation metrics."""
        self.progress.epoch_done(epoch, global_step, train, val)
        self.telemetry.aggregate("epoch", epoch, global_step, train_loss=train.loss,
                                 train_accuracy=train.accuracy, train_samples=train.samples,
                                 val_loss=val.loss, val_accuracy=val.accuracy,
                                 val_samples=val.samples)
        self.telemetry.event("epoch_end", f"epoch {epoch + 1} done", epoch=epoch,
                             global_step=global_step)

    def stopped(self, position: Position, global_step: int) -> None:
        """A graceful stop after `position`, checkpoint written; training ends."""
        message = (f"stopped as asked after step {global_step} (epoch {position.epoch + 1}, "
                   f"step {position.step}); checkpoint written")
        self.progress.stopped(message)
        self.telemetry.event("stopped", message, epoch=position.epoch, step=position.step,
                             global_step=global_step)

    def finished(self, global_step: int) -> None:
        """Every epoch done (the telemetry says bye when it closes)."""
        self.progress.finished(global_step)
