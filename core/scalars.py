"""ddtop.log scalars across a run's ranks: kept, summarized, shown.

RunState keeps each rank's newest value of every key a script logs
(`ddtop.log(**scalars)`, wire.Scalars), up to MAX_RUN_SCALAR_KEYS keys (newer
keys beyond it are dropped and counted); `summaries` says each key across
ranks (mean, min and max of the finite values, and who holds the min and max)
for `ddtrain status`, run.json, the headless printer and the dashboard, and
`line` says the first few in one line. Pure functions over plain dicts.
"""

from __future__ import annotations

import math

from ddtop.core.summary import ScalarSummary

# Distinct ddtop.log keys the run keeps (each rank may send wire.MAX_SCALAR_KEYS
# per message); newer keys beyond it are dropped and counted.
MAX_RUN_SCALAR_KEYS = 256
SCALAR_WIDTH = 9  # compact() writes any number in this many cells
# ddtop.log key -> rank -> the rank's newest value.
Scalars = dict[str, dict[int, float]]


def keep_newest(scalars: Scalars, rank: int, values: dict[str, float]) -> int:
    """`rank`'s newest `values`, kept in `scalars`; the number of keys dropped
    (new keys the run has no room for)."""
    dropped = 0
    for key, value in values.items():
        by_rank = scalars.get(key)
        if by_rank is None:
            if len(scalars) >= MAX_RUN_SCALAR_KEYS:
                dropped += 1
                continue
            by_rank = scalars[key] = {}
        by_rank[rank] = value
    return dropped


def summaries(scalars: Scalars) -> list[ScalarSummary]:
    """Each logged key across ranks: mean, min and max of the finite newest
    values and which rank holds the min and max; by key."""
    found = []
    for key, by_rank in sorted(scalars.items()):
        finite = {r: v for r, v in by_rank.items() if math.isfinite(v)}
        if not finite:
            found.append(ScalarSummary(name=key, ranks=len(by_rank), nonfinite=len(by_rank)))
            continue
        low = min(finite, key=lambda r: (finite[r], r))
        high = max(finite, key=lambda r: (finite[r], -r))
        found.append(ScalarSummary(
            name=key, mean=math.fsum(finite.values()) / len(finite), min=finite[low],
            min_rank=low, max=finite[high], max_rank=high, ranks=len(by_rank),
            nonfinite=len(by_rank) - len(finite)))
    return found


def line(scalars: Scalars, limit: int = 6) -> str:
    """The logged keys across ranks, 'name mean (min..max)', as many as `limit`."""
    parts = []
    for s in summaries(scalars)[:limit]:
        if s.mean is None or s.min is None or s.max is None:
            parts.append(f"{s.name} not finite")
        elif s.min == s.max:
            parts.append(f"{s.name} {compact(s.mean)}")
        else:
            parts.append(f"{s.name} {compact(s.mean)} ({compact(s.min)}..{compact(s.max)})")
    more = len(scalars) - limit
    return " · ".join(parts) + (f" · +{more} more" if more > 0 else "")


def compact(value: float) -> str:
    """A number in at most SCALAR_WIDTH cells, four significant digits where they
    fit: 0.1235, 2.5, 1234, 12.35k, 3.2M, 1e-05, -0.000123, nan, inf."""
    if not math.isfinite(value):
        return str(value)
    magnitude = abs(value)
    if 9999.5 <= magnitude < 1e15:
        for unit, scale in (("k", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12)):
            if magnitude < 999.95 * scale or unit == "T":
                return f"{value / scale:.4g}{unit}"
    text = f"{value:.4g}"
    for digits in (3, 2, 1):
        if len(text) <= SCALAR_WIDTH:
            break
        text = f"{value:.{digits}g}"
    return text
