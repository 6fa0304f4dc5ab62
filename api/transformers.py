"""ddtop's Hugging Face `TrainerCallback`: the loss, the learning rate and what
the Trainer logs, evaluation as evaluation and progress, per optimizer step.

    from transformers import Trainer
    from ddtop.transformers import DdtopCallback

    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=val,
                      callbacks=[DdtopCallback()])
    trainer.train()

    ddtrain start -n 8 train.py          # or: ddtrain watch -- accelerate launch train.py

What it adds to zero-code watching (docs/frameworks.md):

- one `ddtop.step(loss=..., samples=...)` per optimizer step (`on_step_end`,
  which the Trainer calls once per optimizer step, after its gradient
  accumulation). Its loss is the one the Trainer logs (`on_log`'s `loss`: the
  mean over the ranks and the steps since the last log, every `logging_steps`),
  carried by each step until the next log; a step whose log follows at once
  waits for it, so that the loss comes with the step it ends. Its samples:
  the step's batches times `per_device_train_batch_size`. Under zero-code the
  optimizer hook has counted the step already and this call only adds the loss
  and samples (docs/own-scripts.md, "Steps counted once"); without it
  (DDTOP_ZERO_CODE=off) this call counts it;
- the learning rate (the optimizer's, under Accelerate's wrapper);
- whatever the Trainer logs (`loss`, `learning_rate`, `grad_norm`, `epoch`,
  `eval_*`, ...), as `ddtop.log` scalars;
- evaluation and prediction as the `eval` phase: from the step whose flags
  ask for an evaluation (after its log), or from the first prediction step of
  an evaluation called by hand, to `on_evaluate` / `on_predict`;
- the totals for progress and ETA (`state.max_steps`, the epochs when the run
  is counted in epochs) and the steps done before a resume.

Without DDTOP_TELEMETRY (plain `python train.py`) every hook returns at once.
This module is `ddtop.transformers`; it imports the real `transformers` (an
absolute import: the package's own name does not hide it).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import ddtop
from ddtop.callbacks import EvalPhase, numbers, torch_optimizer

try:
    from transformers.trainer_callback import TrainerCallback, TrainerControl, TrainerState
    from transformers.training_args import TrainingArguments
except ImportError:
    if importlib.util.find_spec("transformers") is not None:
        raise  # transformers is there but broken: its own error says why
    raise ImportError("ddtop.transformers needs Hugging Face Transformers: "
                      "pip install transformers") from None

__all__ = ["DdtopCallback"]


class DdtopCallback(TrainerCallback):
    """Report a Hugging Face Trainer run to ddtop: loss, learning rate and logs per
    optimizer step, evaluation as evaluation, progress totals."""

    def __init__(self) -> None:
        self._live: bool | None = None  # telemetry on in this process (None: not asked yet)
        self._eval = EvalPhase()
        self._loss: float | None = None  # the Trainer's last logged training loss
        self._micro = 0  # micro-batches since the last optimizer step, but the last one
        self._waiting: int | None = None  # a step's samples, waiting for its log

    def _on(self) -> bool:
        if self._live is None:
            self._live = ddtop.init()
        return self._live

    # -- the run's start --------------------------------------------------------------
    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        self._micro, self._waiting = 0, None
        if not self._on():
            return
        epochs = state.num_train_epochs if args.max_steps <= 0 else 0
        ddtop.init(total_steps=state.max_steps or None, epochs=epochs or None,
                   start_step=state.global_step or None)
        optimizer = kwargs.get("optimizer")
        if optimizer is not None:
            ddtop.watch(torch_optimizer(optimizer))

    # -- each optimizer step ----------------------------------------------------------
    def on_step_begin(self, args: TrainingArguments, state: TrainerState,
                      control: TrainerControl, **kwargs: Any) -> None:
        if self._live:
            self._flush()
            self._eval.end()

    def on_substep_end(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        self._micro += 1  # a micro-batch whose gradients accumulate

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        if not self._live:
            return
        samples = (self._micro + 1) * args.per_device_train_batch_size
        self._micro = 0
        if control.should_log:  # the Trainer logs this step's loss next: on_log
            self._waiting = samples
            return
        ddtop.step(loss=self._loss, samples=samples or None)
        if control.should_evaluate:
            self._eval.begin()

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not self._live:
            return
        logs = logs or {}
        loss = logs.get("loss")
        if isinstance(loss, int | float) and not isinstance(loss, bool):
            self._loss = float(loss)
        scalars = numbers(logs)
        if scalars:
            ddtop.log(**scalars)
        self._flush()
        if control.should_evaluate:  # the Trainer evaluates next (during it: begun already)
            self._eval.begin()

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        if self._live:
            self._flush()
            if control.should_evaluate and not control.should_log:  # else after the log
                self._eval.begin()

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        if self._live:
            self._flush()
            self._eval.end()

    def _flush(self) -> None:
        """The step waiting for its log goes, with the loss known now (on_log, or
        the next hook if that log never came)."""
        samples, self._waiting = self._waiting, None
        if samples is not None:
            ddtop.step(loss=self._loss, samples=samples or None)

    # -- evaluation ------------------------------------------------------------------
    def on_prediction_step(self, args: TrainingArguments, state: TrainerState,
                           control: TrainerControl, **kwargs: Any) -> None:
        # An evaluation no flag announced (trainer.evaluate() by hand, eval_on_start).
        if not self._eval.active and self._on():
            self._flush()
            self._eval.begin()

    def on_evaluate(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        self._eval.end()

    def on_predict(self, args: TrainingArguments, state: TrainerState,
                   control: TrainerControl, metrics: Any = None, **kwargs: Any) -> None:
        self._eval.end()
