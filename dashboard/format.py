"""Numbers as the dashboard shows them, and the rows of the ranks table, from a RunState.

Pure functions for the Textual app's panels and widgets: what each column means
is decided once, here. What ddtrain's lines show as well (seconds, a number or
none, a traceback's tail) is written once in core/text.py, a scalar's value
in core/scalars.py.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ddtop.core.rankview import (
    DEAD,
    FINISHED,
    RUNNING,
    SILENT,
    STALLED,
    STARTING,
    UNREACHED,
    RankState,
    RankView,
)
from ddtop.core.scalars import SCALAR_WIDTH, compact
from ddtop.core.state import RunState
from ddtop.core.text import num, size

PROBLEM_STATES: tuple[RankState, ...] = (STALLED, SILENT, UNREACHED, DEAD)

# ddtop.log scalars get a column each, keyed by this prefix and the scalar's name
# (no key of COLUMNS has a ':', so a scalar named "loss" is not the LOSS column).
SCALAR_PREFIX = "scalar:"
SCALAR_MAX_WIDTH = 14  # a longer name is cut, with "…", in the column's title


def millis(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{1000 * s:.1f}" if s < 0.1 else f"{1000 * s:.0f}"


def epoch_text(epoch: int | None) -> str:
    """An epoch as the wire and RunState count it (from 0) as a user reads it:
    from 1; "-" where not known (a script whose sampler was never set_epoch'd)."""
    return "-" if epoch is None else str(epoch + 1)


def clock(t: float | None) -> str:
    return "-" if t is None else time.strftime("%H:%M:%S", time.localtime(t))


def bar(fraction: float, width: int) -> str:
    """A text progress bar: '█████▌    '."""
    fraction = min(1.0, max(0.0, fraction))
    eighths = int(fraction * width * 8)
    full, part = divmod(eighths, 8)
    partial = " ▏▎▍▌▋▊▉"[part] if part and full < width else ""
    return ("█" * full + partial).ljust(width)


def nodes(state: RunState) -> int:
    """Machines of the run: the nodes of a multi-node job (two on one host count
    as two), else the hosts its ranks said hello from."""
    hosts = len({v.host for v in state.ranks.values() if v.host})
    return max(len(set(state.rank_nodes.values())), hosts) or 1


# -- the ranks table ---------------------------------------------------------------
@dataclass(frozen=True)
class Column:
    key: str
    title: str
    width: int
    right: bool = True


COLUMNS = (
    Column("rank", "RANK", 5),
    Column("host", "HOST", 12, right=False),
    Column("device", "DEVICE", 7, right=False),
    Column("state", "STATE", 9, right=False),
    Column("epoch", "EPOCH", 5),
    Column("step", "STEP", 11),
    Column("progress", "PROGRESS", 10, right=False),
    Column("loss", "LOSS", 7),
    Column("rate", "SAMPLES/S", 10),
    Column("step_ms", "STEP ms", 8),
    Column("comm_ms", "COMM ms", 7),
    Column("comm_share", "COMM%", 6),
    Column("busbw", "BUSBW", 6),
    Column("sync", "SYNC s", 6),
    Column("memory", "MEM", 8),
    Column("seen", "SEEN", 5),
)


def scalar_column(name: str) -> Column:
    """The column of ddtop.log scalar `name`: as wide as its name and a sort arrow
    (within bounds)."""
    width = min(SCALAR_MAX_WIDTH, max(SCALAR_WIDTH, len(name) + 1))
    title = name if len(name) <= width else name[: width - 1] + "…"
    return Column(SCALAR_PREFIX + name, title, width)


def scalar_name(key: str) -> str | None:
    """The scalar a column key shows, or None for the fixed columns."""
    return key[len(SCALAR_PREFIX):] if key.startswith(SCALAR_PREFIX) else None


# Every column sorts (`s` cycles through them in this order; a click on a title picks one).
SORT_KEYS = ("rank", "state", "step", "loss", "rate", "step_ms", "comm_share", "seen", "comm_ms",
             "busbw", "sync", "memory", "epoch", "progress", "host", "device")
STATE_ORDER: dict[RankState, int] = {DEAD: 0, STALLED: 1, SILENT: 2, UNREACHED: 3,
                                     STARTING: 4, RUNNING: 5, FINISHED: 6}


@dataclass
class Row:
    """One rank, every cell already text, plus what sorting and colour need."""

    rank: int
    state: RankState
    cells: dict[str, str]
    sort: dict[str, Any]
    slowest: bool = False
    straggler: bool = False
    progress: float = 0.0

    @property
    def problem(self) -> bool:
        return self.state in PROBLEM_STATES or self.straggler


def rank_rows(state: RunState, now: float, scalars: Sequence[str] = ()) -> list[Row]:
    """A row per rank of the world (ranks not heard from yet included), by rank;
    with a cell for each ddtop.log scalar named in `scalars` (the columns on
    screen: a thousand ranks times every key would cost a frame for nothing)."""
    states = state.rank_states(now)
    slowest, _, slow = state.stragglers()
    stragglers = set(slow)
    logged = [(SCALAR_PREFIX + name, state.scalars.get(name, {})) for name in scalars]
    rows = []
    for rank, st in states.items():
        v = state.ranks.get(rank) or RankView(rank=rank)
        seen = None if v.last_seen is None else max(0.0, now - v.last_seen)
        spe = v.steps_per_epoch
        fraction = (v.step / spe) if spe else 0.0
        sync_per_step = v.sync_wait_s / v.global_step if v.global_step else None
        cells = {
            # A multi-node job: the host cell says the node too ("n1" filters by node).
            "rank": str(rank), "device": v.device or "-",
            "host": (v.host or "-") + (f" n{state.rank_nodes[rank]}"
                                       if rank in state.rank_nodes else ""),
            "state": _state_text(v, st), "epoch": epoch_text(v.epoch),
            "step": f"{v.step}/{spe}" if spe else str(v.step),
            "progress": bar(fraction, 10), "loss": num(v.loss, ".4f"),
            "rate": num(v.samples_per_s, ",.0f"), "step_ms": millis(v.step_time_s),
            "comm_ms": millis(v.comm_s),
            "comm_share": num(None if v.comm_share is None else 100 * v.comm_share, ".0f"),
            "busbw": num(v.busbw_gbps, ".2f"), "sync": num(v.sync_wait_s, ".1f"),
            "memory": size(v.memory), "seen": "-" if seen is None else f"{seen:.0f}s",
        }
        sort = {
            "rank": rank, "state": STATE_ORDER.get(st, 9), "step": v.global_step,
            "loss": v.loss if v.loss is not None else float("inf"),
            "rate": v.samples_per_s or 0.0, "step_ms": v.step_time_s or 0.0,
            "comm_share": v.comm_share or 0.0, "seen": seen if seen is not None else 1e9,
            "sync": sync_per_step or 0.0, "comm_ms": v.comm_s or 0.0,
            "busbw": v.busbw_gbps or 0.0, "memory": v.memory or 0,
            "epoch": -1 if v.epoch is None else v.epoch,
            # by host, then node: a multi-node job's ranks grouped by node
            "progress": fraction, "host": (v.host, state.rank_nodes.get(rank, -1)),
            "device": v.device,
        }
        for key, by_rank in logged:
            value = by_rank.get(rank)
            cells[key] = "-" if value is None else compact(value)
            # Largest first; a rank that has not logged it last, NaN first (a problem).
            sort[key] = (-math.inf if value is None else math.inf if math.isnan(value)
                         else value)
        rows.append(Row(rank, st, cells, sort, slowest=rank == slowest,
                        straggler=rank in stragglers, progress=fraction))
    return rows


def _state_text(v: RankView, st: RankState) -> str:
    if st == DEAD:
        return v.signal or (f"exit {v.exit_code}" if v.exit_code is not None else DEAD)
    return st


def sort_rows(rows: list[Row], key: str, reverse: bool = False) -> list[Row]:
    # Descending where the worst is the largest: times, shares, loss, memory; and a
    # scalar's (which end is the worst, only its script knows: the largest on top).
    descending = key in ("step_ms", "comm_share", "seen", "loss", "comm_ms", "sync",
                         "memory") or scalar_name(key) is not None
    return sorted(rows, key=lambda r: (r.sort[key], r.rank), reverse=descending != reverse)


def filter_rows(rows: list[Row], text: str, problems_only: bool) -> list[Row]:
    if problems_only:
        rows = [r for r in rows if r.problem]
    text = text.strip().lower()
    if not text:
        return rows
    return [r for r in rows if text == r.cells["rank"] or text in r.cells["host"].lower()
            or text in r.state or (text == "straggler" and r.straggler)]


def format_line(row: Row) -> str:
    """The row as fixed-width text (the headless printer's and the tests' view)."""
    return " ".join(_cell(c, row.cells[c.key]) for c in COLUMNS)


def _cell(column: Column, text: str) -> str:
    text = text[: column.width]
    return text.rjust(column.width) if column.right else text.ljust(column.width)
