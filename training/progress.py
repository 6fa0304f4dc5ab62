"""What a run prints and records as it goes: its console lines (each rank's
log) and metrics.jsonl. The loop does not call this directly: it tells its
`Reporter` (reporting.py), which passes each fact on here and to the telemetry.

Only rank 0 tells the run's story (the others get the base class, so nobody
asks which rank it is). The one exception: every rank loads a checkpoint on
resume, so every rank's log says which.

A metrics.jsonl record the disk will not take (full) is dropped, counted and
warned about once (in the log and as a telemetry warning); training goes on,
and the file never holds half a record."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sized
from typing import Any

import torch
from torch import nn

from ddtop.core.config import TrainConfig
from ddtop.core.rundir import RunPaths
from ddtop.core.text import count_of
from ddtop.training import api
from ddtop.training.checkpoint import Position
from ddtop.training.distributed import RankEnv
from ddtop.training.metrics import GlobalMetrics


class Progress:
    """What every rank but rank 0 uses: silent, but for the line on resume."""

    @staticmethod
    def for_rank(config: TrainConfig, env: RankEnv, paths: RunPaths,
                 launch_time: float | None) -> Progress:
        return RankZeroProgress(config, env, paths, launch_time) if env.is_main else Progress()

    def resumed(self, checkpoint: str, position: Position) -> None:
        print(f"resumed from {checkpoint}: epoch {position.epoch + 1}, step {position.step}",
              flush=True)

    def started(self, backend: str, device: torch.device, model: nn.Module, train_set: Any,
                val_set: Any, steps_per_epoch: int) -> None:
        pass

    def epoch_started(self, epoch: int) -> None:
        pass

    def step(self, epoch: int, step: int, steps: int, loss: torch.Tensor,
             global_step: int) -> bool:
        """Count the step; True when a line was printed (its loss read from the device)."""
        return False

    def synced(self, epoch: int, step: int, global_step: int, metrics: GlobalMetrics) -> None:
        pass

    def epoch_done(self, epoch: int, global_step: int, train: GlobalMetrics,
                   val: GlobalMetrics) -> None:
        pass

    def stopped(self, message: str) -> None:
        pass

    def finished(self, global_step: int) -> None:
        pass


class RankZeroProgress(Progress):
    def __init__(self, config: TrainConfig, env: RankEnv, paths: RunPaths,
                 launch_time: float | None) -> None:
        self.config, self.env, self.paths = config, env, paths
        self.launch_time = launch_time
        self.start = time.monotonic()
        self.epoch_start = self.start
        self.last_print = self.start
        self.steps_since_print = 0
        self.loss_since_print: torch.Tensor | None = None
        self.first_step_reported = False
        self.metrics_dropped = 0  # metrics.jsonl records the disk did not take

    def _say(self, line: str) -> None:
        print(line, flush=True)

    def _record(self, record: dict[str, Any]) -> None:
        line = (json.dumps({**record, "time": time.time()}) + "\n").encode()
        try:
            append_whole(self.paths.metrics, line)
        except OSError as e:  # a full disk costs the record, never the run
            self.metrics_dropped += 1
            if self.metrics_dropped == 1:
                message = (f"{self.paths.metrics} is not written ({e.strerror or e}): its "
                           "records are dropped until there is room; training goes on")
                print(f"warning: {message}", file=sys.stderr, flush=True)
                live = api.running()
                if live is not None:
                    live.warn_once("metrics.jsonl", message)

    def started(self, backend: str, device: torch.device, model: nn.Module, train_set: Any,
                val_set: Any, steps_per_epoch: int) -> None:
        self.start = time.monotonic()  # "training done" counts from here
        cfg = self.config
        params = sum(p.numel() for p in model.parameters())
        sizes = (f"{len(train_set)} train / {len(val_set)} val"
                 if isinstance(train_set, Sized) and isinstance(val_set, Sized) else "")
        self._say(
            f"run {self.paths.run_id}: {count_of(cfg.world_size, 'rank')}, "
            f"backend {backend} on {device.type}, "
            f"model {cfg.model} ({params / 1e6:.2f}M params), dataset {cfg.dataset} ({sizes}), "
            f"global batch {cfg.batch_size} ({cfg.batch_per_rank} per rank), "
            f"{count_of(steps_per_epoch, 'step')} per epoch, {count_of(cfg.epochs, 'epoch')}"
        )

    def epoch_started(self, epoch: int) -> None:
        self.epoch_start = self.last_print = time.monotonic()
        self.steps_since_print = 0
        self.loss_since_print = None

    def step(self, epoch: int, step: int, steps: int, loss: torch.Tensor,
             global_step: int) -> bool:
        detached = loss.detach()
        self.loss_since_print = (detached if self.loss_since_print is None
                                 else self.loss_since_print + detached)
        self.steps_since_print += 1
        now = time.monotonic()
        if not self.first_step_reported:
            self.first_step_reported = True
            if self.launch_time is not None:
                # DDP's first backward all-reduces across all ranks, so when rank 0
                # is past it, every rank has started.
                self._say(f"first step done {time.time() - self.launch_time:.2f} s after launch")
        if now - self.last_print < self.config.progress_every and step != steps:
            return False
        # Intentional sync point (CUDA): .item() only when a line is printed.
        mean_loss = float(self.loss_since_print.item()) / self.steps_since_print
        rate = self.steps_since_print * self.config.batch_size / max(now - self.last_print, 1e-9)
        self._say(
            f"epoch {epoch + 1}/{self.config.epochs} step {step}/{steps} "
            f"({100 * step / steps:.0f}%) loss {mean_loss:.4f} (rank 0) "
            f"{rate:,.0f} samples/s"
        )
        self.last_print, self.steps_since_print, self.loss_since_print = now, 0, None
        return True

    def synced(self, epoch: int, step: int, global_step: int, metrics: GlobalMetrics) -> None:
        self._say(f"epoch {epoch + 1} step {step}: global train loss {metrics.loss:.4f} "
                  f"acc {100 * metrics.accuracy:.2f}% over {metrics.samples} samples")
        self._record({"kind": "sync", "epoch": epoch + 1, "step": step,
                      "global_step": global_step, "train_loss": metrics.loss,
                      "train_accuracy": metrics.accuracy, "train_samples": metrics.samples})

    def epoch_done(self, epoch: int, global_step: int, train: GlobalMetrics,
                   val: GlobalMetrics) -> None:
        seconds = time.monotonic() - self.epoch_start
        self._say(
            f"epoch {epoch + 1}/{self.config.epochs} done in {seconds:.1f} s: "
            f"train loss {train.loss:.4f} acc {100 * train.accuracy:.2f}% | "
            f"val loss {val.loss:.4f} acc {100 * val.accuracy:.2f}% "
            f"(global over {train.samples} + {val.samples} samples)"
        )
        self._record({"kind": "epoch", "epoch": epoch + 1, "global_step": global_step,
                      "train_loss": train.loss, "train_accuracy": train.accuracy,
                      "train_samples": train.samples, "val_loss": val.loss,
                      "val_accuracy": val.accuracy, "val_samples": val.samples,
                      "seconds": seconds})

    def stopped(self, message: str) -> None:
        self._say(message)

    def finished(self, global_step: int) -> None:
        self._say(f"training done: {global_step} steps in {time.monotonic() - self.start:.2f} s")


def append_whole(path: os.PathLike[str] | str, data: bytes) -> None:
    """Append `data` to `path`, all of it or nothing: a write that fails part way
    (the disk is full) is cut back off, and the OSError raised."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        size = os.fstat(fd).st_size
        written = 0
        try:
            while written < len(data):
                written += os.write(fd, data[written:])
        except OSError:
            if written:
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)
