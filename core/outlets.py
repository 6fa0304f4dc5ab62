"""What a run sends out beyond its own folder, checked before anything starts:
`--metrics` (Prometheus, daemon/exporter.py) and `--tensorboard` (TensorBoard
files, core/tbwriter.py). Each check raises ValueError with one line naming
the flag and the fix; config.py (and `ddtop export`) report it as a UsageError.
"""

from __future__ import annotations

import importlib.util

from ddtop.core.listen import parse_listen


def require_tensorboard(flag: str) -> None:
    """ValueError in one line when tensorboard (core/tbwriter.py) is not installed."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ValueError(f"{flag} writes TensorBoard files, which needs the tensorboard "
                         "package, not installed here: pip install 'ddtop[tensorboard]'")


def check_metrics(value: str, is_hub: bool, node_rank: int) -> None:
    """`--metrics [HOST:]PORT`: a valid address, and given on the hub only."""
    parse_listen("--metrics", value)
    if not is_hub:
        raise ValueError(f"--metrics is served by node 0 (the hub) for the whole job: "
                         f"leave it out on node {node_rank}")
