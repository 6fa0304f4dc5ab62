"""Loss and accuracy, accumulated per rank and combined across ranks.

Each rank adds up `loss_sum` (per-sample loss summed), `correct` and `samples`.
At a sync point every rank sends its Counter through `all_gather_object` and
sums all of them, so every rank derives the same global mean, weighted by the
samples each rank actually saw. Every rank sends the same keys (a rank that
sent different keys, or skipped a sync, would leave the others waiting).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

KEYS = ("loss_sum", "correct", "samples")


class Totals:
    """Running sums for one rank. Kept as device tensors between syncs, so a
    step never waits for the GPU just to count."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.correct = torch.zeros((), dtype=torch.int64, device=device)
        self.samples = 0

    def add(self, mean_loss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        n = targets.shape[0]
        self.loss_sum += mean_loss.detach().double() * n
        self.correct += (logits.detach().argmax(dim=1) == targets).sum()
        self.samples += n

    def counter(self) -> Counter[str]:
        # Intentional sync point on CUDA: .item() waits for the queued steps.
        return Counter({
            "loss_sum": float(self.loss_sum.item()),
            "correct": int(self.correct.item()),
            "samples": self.samples,
        })


@dataclass(frozen=True)
class GlobalMetrics:
    loss: float
    accuracy: float
    samples: int

    @classmethod
    def from_counter(cls, total: Counter[str]) -> GlobalMetrics:
        n = total["samples"]
        return cls(
            loss=total["loss_sum"] / n if n else float("nan"),
            accuracy=total["correct"] / n if n else float("nan"),
            samples=n,
        )


def gather_counters(local: Counter[str]) -> Counter[str]:
    """Sum of every rank's counter. A collective: all ranks must call it."""
    gathered: list[Counter[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, Counter({k: local[k] for k in KEYS}))
    total: Counter[str] = Counter({k: 0 for k in KEYS})
    for c in gathered:
        assert c is not None
        for k in KEYS:
            total[k] += c[k]
    return total
