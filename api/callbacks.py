"""What ddtop's framework callbacks share (ddtop.lightning, ddtop.transformers):
an evaluation that begins in one hook and ends in another, the numbers of a
metrics dictionary, the optimizer under a framework's wrapper, a batch's size.

Light, as `import ddtop` is: no torch, no framework. Tensors are recognised by
what they do (`numel`, `shape`, `detach`), so this module works with whatever
torch the framework brought. Nothing here raises into the training program.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

import ddtop

# How deep a wrapped optimizer (Accelerate's AcceleratedOptimizer, Lightning's
# LightningOptimizer) or a nested batch is looked into.
MAX_DEPTH = 4
# Metrics read at each step are handed to ddtop.log at most this often (and once
# more after the last step): a person reads them no faster, and each ddtop.log
# wakes ddtop's sender thread, a GIL hand-off that took 0.1 to 2 ms on 2 busy
# cores (bench/frameworks.py), where the rest of a step's work takes tens of us.
LOG_EVERY_S = 1.0


class EvalPhase:
    """`ddtop.phase("eval")` begun in one framework hook and ended in another
    (on_validation_start ... on_validation_end). Begun twice, it is one phase;
    ended when not begun, nothing happens."""

    __slots__ = ("_block",)

    def __init__(self) -> None:
        self._block: AbstractContextManager[None] | None = None

    @property
    def active(self) -> bool:
        return self._block is not None

    def begin(self) -> None:
        if self._block is None:
            block = ddtop.phase("eval")
            block.__enter__()
            self._block = block

    def end(self) -> None:
        block, self._block = self._block, None
        if block is not None:
            block.__exit__(None, None, None)


def numbers(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of `metrics` that `ddtop.log` takes: numbers and one-element
    tensors (strings, lists, None and bigger tensors left out, so that a
    framework's own non-numeric entries raise no warning)."""
    kept: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, bool | int | float):
            kept[str(key)] = value
        elif _is_tensor(value):
            try:
                if value.numel() == 1:
                    kept[str(key)] = value
            except Exception:  # noqa: BLE001 - an odd object is not a number: left out
                continue
    return kept


def torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer under a framework's wrapper (Accelerate's
    AcceleratedOptimizer keeps it as `.optimizer`, Lightning's LightningOptimizer
    as `._optimizer`): the one whose `step` torch's optimizer hooks see."""
    for _ in range(MAX_DEPTH):
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is None or inner is optimizer or not hasattr(inner, "param_groups"):
            break
        optimizer = inner
    return optimizer


def batch_size(batch: Any) -> int | None:
    """The samples in a batch: the first dimension of its first tensor (a tensor,
    or the first one in a tuple, list or dict, nested a few deep); None when none
    is found."""
    for _ in range(MAX_DEPTH):
        if _is_tensor(batch):
            shape = batch.shape
            return int(shape[0]) if len(shape) else None
        if isinstance(batch, Mapping):
            batch = next(iter(batch.values()), None)
        elif isinstance(batch, list | tuple):
            batch = batch[0] if batch else None
        else:
            return None
    return None


def loss_of(outputs: Any) -> Any:
    """A training step's loss as a framework hands it on: the tensor itself, or a
    mapping's "loss" (detached: ddtop reads it later, on its own thread)."""
    loss: Any = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    if _is_tensor(loss):
        return loss.detach()
    return loss if isinstance(loss, int | float) and not isinstance(loss, bool) else None


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "numel") and hasattr(value, "shape") and hasattr(value, "detach")
