"""LiveTelemetry for a user's script (training/api.py): what differs from the trainer's.

- A step is counted on its own (`count_step`), and its loss and samples may
  come separately (`add_loss`): each loss weighs its samples if given, else 1,
  and the weights travel as the Step message's `loss_weight`.
- A loss tensor on a device is summed on that device (no synchronisation on
  the training thread); the sender thread reads the sum when it sends.
- Time in phases that are not step phases (evaluation, checkpoint, setup) is
  not step time.
- Custom scalars (`add_scalars`) are kept newest per key and sent as one
  Scalars message per send interval, bounded as the wire bounds them.
- Memory: the CUDA device the model is on, once CUDA is initialised (never
  initialising it from the sender thread), else the process's RSS.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from ddtop.daemon import wire
from ddtop.training.telemetry import LiveTelemetry, StepWindow

STEP_PHASES = frozenset({"data", "forward", "backward", "optimizer", "metric_sync"})


class ScriptTelemetry(LiveTelemetry):
    def __init__(self, endpoint: str, hello: wire.Hello) -> None:
        self._excluded = 0.0  # seconds in non-step phases since the last step
        self._scalars: dict[str, float | torch.Tensor] = {}
        self.memory_device: torch.device | None = None
        super().__init__(endpoint, hello, torch.device("cpu"))

    def _new_window(self) -> StepWindow:
        return StepWindow(loss_weight=0.0)

    @property
    def current_phase(self) -> str:
        return self._phase

    def send_hello(self, hello: wire.Hello) -> None:
        self._queue(hello)

    # -- the training thread ---------------------------------------------------------
    def phase(self, name: wire.Phase) -> None:
        now = time.perf_counter()
        spent = now - self._phase_since
        with self._lock:
            self._window.phase_s[self._phase] += spent
        if self._phase not in STEP_PHASES:
            self._excluded += spent
        self._phase, self._phase_since = name, now

    def count_step(self, epoch: int, step: int, steps_per_epoch: int, global_step: int,
                   lr: float) -> None:
        now = time.perf_counter()
        with self._lock:
            w = self._window
            self._take_comm(w)
            w.steps += 1
            w.step_s += max(0.0, now - self._step_start - self._excluded)
            w.epoch, w.step, w.steps_per_epoch = epoch, step, steps_per_epoch
            w.global_step, w.lr = global_step, lr
        self._step_start, self._excluded = now, 0.0
        self._epoch, self._global_step = epoch, global_step

    def add_loss(self, loss: Any, samples: int | None) -> None:
        """This step's loss (a number or a tensor, any device) and samples."""
        count = samples if isinstance(samples, int) and samples > 0 else 0
        value = _loss_value(loss)
        weight = count or 1
        with self._lock:
            w = self._window
            w.samples += count
            if value is not None:
                w.loss_sum = w.loss_sum + value * weight
                w.loss_weight = (w.loss_weight or 0.0) + weight

    def add_scalars(self, scalars: dict[str, Any]) -> list[str]:
        """Keep each scalar's newest value; what was dropped, in words."""
        problems = []
        for key, raw in scalars.items():
            if not 0 < len(key) <= wire.MAX_SCALAR_KEY_CHARS:
                problems.append(f"key {key[:wire.MAX_SCALAR_KEY_CHARS]!r}... is longer than "
                                f"{wire.MAX_SCALAR_KEY_CHARS} characters: dropped")
                continue
            if not _KEY.match(key):
                problems.append(f"key {key!r} may hold only letters, digits and _.:/@+-: "
                                "dropped")
                continue
            value = _scalar_value(raw)
            if value is None:
                problems.append(f"{key}={type(raw).__name__} is not a number: dropped")
                continue
            with self._lock:
                if key not in self._scalars and len(self._scalars) >= wire.MAX_SCALAR_KEYS:
                    problems.append(f"more than {wire.MAX_SCALAR_KEYS} keys at once: "
                                    f"{key} dropped")
                    continue
                self._scalars[key] = value
        if self._scalars:
            self._wake.set()
        return problems

    # -- the sender thread -------------------------------------------------------------
    def _send_window(self, sock: zmq.Socket[bytes]) -> None:
        super()._send_window(sock)
        with self._lock:
            pending, self._scalars = self._scalars, {}
        if pending:
            values = {key: float(value) for key, value in pending.items()}
            self._send(sock, wire.Scalars(run=self.run, rank=self.rank, values=values,
                                          global_step=self._global_step))

    def _memory(self) -> tuple[int | None, int | None, int | None]:
        device = self.memory_device
        # torch leaves is_initialized unannotated.
        if device is not None and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return (torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device),
                    None)
        return super()._memory()


_KEY = re.compile(wire.SCALAR_KEY_PATTERN)


def _loss_value(loss: Any) -> float | torch.Tensor | None:
    """A loss to sum: a float, or a detached one-element tensor left on its device."""
    if isinstance(loss, torch.Tensor):
        if loss.numel() == 0:
            return None
        value = loss.detach()
        value = value.float().mean() if value.numel() > 1 else value.reshape(())
        return float(value) if value.device.type == "cpu" else value
    if isinstance(loss, int | float) and not isinstance(loss, bool):
        return float(loss)
    return None


def _scalar_value(raw: Any) -> float | torch.Tensor | None:
    if isinstance(raw, torch.Tensor):
        if raw.numel() != 1 or raw.is_complex():
            return None
        value = raw.detach().reshape(())
        return float(value) if value.device.type == "cpu" else value
    if isinstance(raw, bool | int | float):
        try:
            return float(raw)
        except OverflowError:  # an int beyond any float
            return math.copysign(math.inf, raw)
    return None


def receiver_answers(endpoint: str, timeout_s: float) -> str | None:
    """None when a ZeroMQ PULL socket at `endpoint` completes a handshake with a
    PUSH within `timeout_s` (that is what "a daemon answers" means: no
    collective, no request); else why not, in one line."""
    context = zmq.Context()
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as e:
            return f"DDTOP_TELEMETRY={endpoint!r} is not a ZeroMQ endpoint ({e})"
        if monitor.poll(int(timeout_s * 1000)):
            event = recv_monitor_message(monitor)
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return None
        return f"no ddtop receiver answered at {endpoint} within {timeout_s:g} s"
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        context.term()
