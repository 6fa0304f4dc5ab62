"""The built-in trainer's ways of averaging gradients (`--strategy`), named once.

`SyncStrategy` types `TrainConfig.strategy` (so the flag's choices come from
it); `STRATEGIES` lists them, in that order, with what the dashboard's comm
panel calls one step's collectives under each. The implementations are in
training/strategies.py (`BUILDERS`, keyed the same; tests/test_strategies.py
checks that the three agree). No torch here: `ddtrain` and `ddtop` read it.
"""

from __future__ import annotations

from typing import Literal

SyncStrategy = Literal["ddp", "allreduce", "hooks", "hooks-async", "ring", "fsdp"]

# Each strategy, and what its collectives of a step are, as the comm panel names them.
STRATEGIES: dict[SyncStrategy, str] = {
    "ddp": "all-reduce/step (DDP buckets, during backward)",
    "allreduce": "all-reduce/step (one per parameter, after backward)",
    "hooks": "all-reduce/step (one per parameter from its hook, blocking backward)",
    "hooks-async": "all-reduce/step (one per parameter from its hook, async)",
    "ring": "ring all-reduce/step (one per parameter, send/recv)",
    "fsdp": "collectives/step (all-gathers, reduce-scatters)",
}
# A run that names none of them (a user's own script): DDP's, or its own, all-reduces.
OTHER_COMM_OPS = "all-reduce/step"


def comm_ops(strategy: str) -> str:
    """What one step's collectives are under `strategy`, a hello's text (any)."""
    return next((ops for name, ops in STRATEGIES.items() if name == strategy), OTHER_COMM_OPS)
