"""Many ranks in a few lines: above MANY_RANKS ranks, the headless printer's text
and `ddtrain status` say a job's ranks as counts by state, the distribution of
their global steps and step times, and the outliers by name (ranks dead, stalled,
silent or otherwise not running; the stragglers; the slowest few, with their node),
never a line per rank. Pure: RankSummary records in, lines or a JSON-able record
out, in a few milliseconds at 16,384 ranks (no sort of them all but the two
distributions)."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence, Sized
from typing import Any

import msgspec

from ddtop.core.summary import RankSummary
from ddtop.core.text import count_of

# Above this many ranks the text outputs summarise (docs/cli.md); at or below it
# they print a line per rank, as they always have.
MANY_RANKS = 64
# Named per kind of outlier at most; the rest are counted ("and 12 more").
NAMED_PER_KIND = 8
# The slowest ranks named, by their last window's time per step: at most this
# many, and only those at least SLOW_FACTOR times the median (no names in a job
# whose ranks step alike).
SLOWEST_NAMED = 3
SLOW_FACTOR = 1.2
# States that are no outliers: a rank in any other is named.
ORDINARY = ("running", "finished", "starting")


class Digest(msgspec.Struct, kw_only=True):
    """A job's ranks, summarised."""

    ranks: int
    counts: dict[str, int]  # by state, the most common first
    step_min: int
    step_p50: int
    step_max: int
    step_time_p50_s: float | None  # over ranks still stepping that sent a step time
    step_time_p90_s: float | None
    # Outliers by kind ("dead", "stalled", ..., "stragglers", "slowest"): their ranks.
    outliers: dict[str, list[RankSummary]]
    more: dict[str, int]  # outliers of a kind that were not named, by kind


def many(ranks: Sized) -> bool:
    """Whether a job has too many ranks for a line each."""
    return len(ranks) > MANY_RANKS


def _quantile(ordered: Sequence[float], q: float) -> float:
    """The nearest-rank quantile of sorted values (at least one)."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def digest(ranks: Sequence[RankSummary], stragglers: Iterable[int] = ()) -> Digest:
    """The counts, distributions and outliers of `ranks`; `stragglers` named by
    the run's fold (RunState.stragglers), kept in its order."""
    counts: dict[str, int] = {}
    odd: dict[str, list[RankSummary]] = {}
    for r in ranks:
        counts[r.state] = counts.get(r.state, 0) + 1
        if r.state not in ORDINARY:
            odd.setdefault(r.state, []).append(r)
    steps = sorted(r.global_step for r in ranks) or [0]
    stepping = [r for r in ranks if r.state in ("running", "stalled") and r.step_time_s]
    times = sorted(r.step_time_s or 0.0 for r in stepping)
    by_rank = {r.rank: r for r in ranks}
    straggling = [by_rank[k] for k in stragglers if k in by_rank]
    if straggling:
        odd["stragglers"] = straggling
    p50 = _quantile(times, 0.5) if times else None
    slowest = [r for r in heapq.nlargest(SLOWEST_NAMED, stepping,
                                         key=lambda r: (r.step_time_s, -r.rank))
               if p50 is not None and (r.step_time_s or 0.0) >= SLOW_FACTOR * p50]
    if slowest:
        odd["slowest"] = slowest
    return Digest(
        ranks=len(ranks),
        counts=dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))),
        step_min=steps[0], step_p50=int(_quantile(steps, 0.5)), step_max=steps[-1],
        step_time_p50_s=p50,
        step_time_p90_s=_quantile(times, 0.9) if times else None,
        outliers={kind: rs[:NAMED_PER_KIND] for kind, rs in odd.items()},
        more={kind: len(rs) - NAMED_PER_KIND for kind, rs in odd.items()
              if len(rs) > NAMED_PER_KIND})


def _where(r: RankSummary) -> str:
    return f"node {r.node}" if r.node is not None else r.host or "?"


def _named(kind: str, r: RankSummary) -> str:
    words = f"rank {r.rank} ({_where(r)}"
    if kind == "slowest" and r.step_time_s:
        words += f", {1000 * r.step_time_s:.0f} ms/step"
    elif r.signal or r.exit_code is not None:
        words += f", {r.signal or f'exit {r.exit_code}'}"
    elif kind not in ("stragglers", "slowest"):
        words += f", step {r.global_step}"
    return words + ")"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.0f} ms"


def lines(d: Digest, indent: str = "  ") -> list[str]:
    """The digest in a few lines: counts, distribution, then one line per kind
    of outlier (at most NAMED_PER_KIND ranks each)."""
    out = [f"{indent}{count_of(d.ranks, 'rank')}: "
           + ", ".join(f"{n} {state}" for state, n in d.counts.items()),
           f"{indent}global step min {d.step_min} / p50 {d.step_p50} / max {d.step_max}; "
           f"step time p50 {_ms(d.step_time_p50_s)}, p90 {_ms(d.step_time_p90_s)}"]
    for kind, rs in d.outliers.items():
        more = f" and {d.more[kind]} more" if kind in d.more else ""
        out.append(f"{indent}{kind}: " + ", ".join(_named(kind, r) for r in rs) + more)
    return out


def record(d: Digest) -> dict[str, Any]:
    """The digest for a JSON line: the outliers as rank numbers."""
    doc: dict[str, Any] = msgspec.to_builtins(d)
    doc["outliers"] = {kind: [r.rank for r in rs] for kind, rs in d.outliers.items()}
    return doc


def outlier_ranks(d: Digest) -> list[RankSummary]:
    """Every named outlier once, by rank."""
    seen = {r.rank: r for rs in d.outliers.values() for r in rs}
    return [seen[k] for k in sorted(seen)]
