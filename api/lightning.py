"""ddtop's Lightning callback: the loss, the learning rate, what `self.log`
logs, validation as evaluation and progress, per optimizer step.

    import lightning as L
    from ddtop.lightning import DdtopCallback

    trainer = L.Trainer(accelerator="gpu", devices=8, strategy="ddp",
                        accumulate_grad_batches=4, callbacks=[DdtopCallback()])
    trainer.fit(model, train_loader, val_loader)

    ddtrain start -n 8 train.py          # or: ddtrain watch -- python train.py

What it adds to zero-code watching (docs/frameworks.md):

- one `ddtop.step(loss=..., samples=...)` per optimizer step, not per batch:
  at `on_train_batch_end` only when `trainer.global_step` moved, so that
  `accumulate_grad_batches=4` is one step in four batches. Its loss is the
  mean of the training step's losses over those batches (Lightning hands each
  on divided by `accumulate_grad_batches`), its samples the batches' first
  dimension. Under zero-code the optimizer hook has counted the step already
  and this call only adds the loss and samples (docs/own-scripts.md, "Steps
  counted once"); without it (DDTOP_ZERO_CODE=off) this call counts it;
- the learning rate (the first optimizer's, `ddtop.watch(optimizer)`) and the
  DDP model's comm timing (`ddtop.watch`, which zero-code has done already);
- what the module logs with `self.log`, as `ddtop.log` scalars: the training
  metrics after an optimizer step (at most once a second, and after the last
  step), the validation ones at the end of each validation
  (`trainer.callback_metrics`, read where Lightning has computed them
  already: never a collective of its own);
- validation, the sanity check, test and predict as the `eval` phase, from
  their start hook to their end hook: time there is not step time, and a rank
  evaluating is not a straggler;
- the totals for progress and ETA: `trainer.estimated_stepping_batches` and
  `max_epochs` (`ddtop.init`), and the steps done before a resume.

Without DDTOP_TELEMETRY (plain `python train.py`) every hook returns at once.
"""

from __future__ import annotations

import importlib.util
import math
import time
from typing import Any

import ddtop
from ddtop.callbacks import (
    LOG_EVERY_S,
    EvalPhase,
    batch_size,
    loss_of,
    numbers,
    torch_optimizer,
)

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
except ImportError:
    if importlib.util.find_spec("lightning") is not None:
        raise  # Lightning is there but broken: its own error says why
    raise ImportError("ddtop.lightning needs Lightning 2: pip install lightning") from None

__all__ = ["DdtopCallback"]


class DdtopCallback(pl.Callback):
    """Report a Lightning run to ddtop: loss, learning rate and `self.log` metrics
    per optimizer step, validation as evaluation, progress totals."""

    def __init__(self) -> None:
        super().__init__()
        self._live: bool | None = None  # telemetry on in this process (None: not asked yet)
        self._eval = EvalPhase()
        self._stepped = 0  # trainer.global_step at the last step reported
        self._loss: Any = None  # the training step's losses since then, summed
        self._batches = 0  # batches since then
        self._samples = 0  # their samples (0: not known)
        self._logged_at = -math.inf  # when the training metrics last went to ddtop.log

    def _on(self) -> bool:
        """Whether telemetry is on, asked once: in the first hook of fit, validate,
        test or predict, after the strategy's set-up (the process group is up, so
        a rank that the start-up hook watches has started reporting already)."""
        if self._live is None:
            self._live = ddtop.init()
        return self._live

    # -- the run's start --------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._on():
            return
        if trainer.optimizers:
            ddtop.watch(torch_optimizer(trainer.optimizers[0]))
        if isinstance(trainer.strategy, DDPStrategy):
            ddtop.watch(trainer.strategy.model)  # comm timing; zero-code has done it already

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._live:
            return
        self._stepped = trainer.global_step  # more than 0 after a resume
        total, epochs = _totals(trainer)
        ddtop.init(total_steps=total, epochs=epochs, start_step=self._stepped or None)

    # -- each batch, each optimizer step -------------------------------------------------
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._live:
            return
        loss = loss_of(outputs)
        if loss is not None:
            if pl_module.automatic_optimization and trainer.accumulate_grad_batches != 1:
                loss = loss * trainer.accumulate_grad_batches  # Lightning divided it
            self._loss = loss if self._loss is None else self._loss + loss
        self._batches += 1
        size = batch_size(batch)
        if size is not None:
            self._samples += size
        if trainer.global_step == self._stepped:
            return  # a batch whose gradients accumulate: no optimizer step yet
        self._stepped = trainer.global_step
        loss, batches, samples = self._loss, self._batches, self._samples
        self._loss, self._batches, self._samples = None, 0, 0
        if loss is not None and batches > 1:
            loss = loss / batches
        ddtop.step(loss=loss, samples=samples or None)
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            # Read during a batch, Lightning's metrics are the step's own values (no compute).
            _log_metrics(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._live:
            _log_metrics(trainer)  # the last step's (the epoch's results are reset: no compute)

    # -- evaluation ------------------------------------------------------------------
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._on():
            self._eval.begin()  # the sanity check too: it runs the validation loop

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._live:
            return
        if not trainer.sanity_checking:
            # Computed by Lightning at the validation epoch's end, before this hook.
            _log_metrics(trainer)
        self._eval.end()

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._on():
            self._eval.begin()

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval.end()

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._on():
            self._eval.begin()

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval.end()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self._eval.end()


def _log_metrics(trainer: pl.Trainer) -> None:
    """What the module logged with `self.log`, as ddtop.log scalars."""
    try:
        metrics = numbers(trainer.callback_metrics)
    except Exception:  # noqa: BLE001 - Lightning's own logging says what is wrong with a metric
        return
    if metrics:
        ddtop.log(**metrics)


def _totals(trainer: pl.Trainer) -> tuple[int | None, int | None]:
    """(optimizer steps in the run, epochs) as far as Lightning knows them; epochs
    only when the run is as many whole epochs (not cut short by max_steps)."""
    try:
        total = trainer.estimated_stepping_batches
    except Exception:  # noqa: BLE001 - e.g. accumulation that changes by epoch: no total
        return None, None
    if not isinstance(total, int) or total <= 0:
        return None, None  # an endless run, or an iterable dataset without max_steps
    epochs, batches = trainer.max_epochs, trainer.num_training_batches
    if not epochs or epochs <= 0 or not isinstance(batches, int):
        return total, None
    per_epoch = math.ceil(batches / trainer.accumulate_grad_batches)
    return total, epochs if per_epoch * epochs == total else None
