"""Why a straggler is slow: the cause its own readings show against its peers'.

A straggler is named by its compute per step (core/stragglers.py): the others
wait for it. What made its compute longer decides the fix (the data loader, the
node, the model), so each judged window of a named straggler is compared, part
by part, per step, with the median of the other ranks' fresh windows:

- **host**: the time its training thread waited on a run queue for a CPU
  (Step.runq_s, from schedstat: another process on its cores, a CPU quota);
- **memory**: major page faults (Step.major_faults: pages read back from disk,
  swapping, an evicted memory-mapped dataset), where they are at least
  MEMORY_FAULTS a step and MEMORY_FACTOR times the others';
- **input**: the data phase, waiting for the next batch (Step.data_s: the
  DataLoader's `__next__`, a framework's fetch, the built-in trainer's loading);
- **compute**: forward, backward and the optimizer, longer than the others'
  with the same input.

The first that explains at least HALF of the gap (its excess per step over the
others' median, against the straggler's excess compute per step) is the cause,
in that order: a rank starved of CPU or paging is slower in every phase, so
host and memory are asked before input and compute. None: **unknown**. The
words carry the figures: "input: 44 ms/step waiting for data vs 2 ms median".

Communication is not among them: the rule names a rank by its compute outside
the gradient all-reduce, so a rank whose collectives alone are slow is not
named a straggler. Pure: tested on synthetic windows in tests/test_causes.py.
"""

from __future__ import annotations

from typing import NamedTuple

HALF = 0.5  # of the gap a part's excess must explain
MEMORY_FAULTS = 5.0  # major faults per step, at least ...
MEMORY_FACTOR = 10.0  # ... and this many times the others' median
CAUSES = ("host", "memory", "input", "compute", "unknown")


class Parts(NamedTuple):
    """One rank's window, per step: where its compute went, and what the host did."""

    data_s: float  # the data phase
    work_s: float  # forward, backward and the optimizer
    runq_s: float | None  # waiting for a CPU (None: not read)
    faults: float | None  # major page faults (None: not read)


def choose(mine: Parts, others: Parts, gap_s: float) -> tuple[str, str]:
    """(the cause, its words with the figures) of a straggler whose compute per
    step stands `gap_s` above the others' median; `others`: their medians."""
    if gap_s <= 0:
        return "unknown", "unknown: no gap to explain"
    need = HALF * gap_s
    if mine.runq_s is not None and others.runq_s is not None \
            and mine.runq_s - others.runq_s >= need:
        return "host", (f"host: {_ms(mine.runq_s)}/step waiting for a CPU vs "
                        f"{_ms(others.runq_s)} median")
    if mine.faults is not None and others.faults is not None \
            and mine.faults >= MEMORY_FAULTS and mine.faults >= MEMORY_FACTOR * max(
                others.faults, 0.1):
        return "memory", (f"memory: {mine.faults:,.0f} major page faults/step vs "
                          f"{others.faults:,.0f} median")
    if mine.data_s - others.data_s >= need:
        return "input", (f"input: {_ms(mine.data_s)}/step waiting for data vs "
                         f"{_ms(others.data_s)} median")
    if mine.work_s - others.work_s >= need:
        return "compute", (f"compute: {_ms(mine.work_s)}/step in forward, backward and the "
                           f"optimizer vs {_ms(others.work_s)} median")
    return "unknown", (f"unknown: no reading explains half of the +{_ms(gap_s)}/step "
                       f"(data {_ms(mine.data_s)} vs {_ms(others.data_s)}, compute "
                       f"{_ms(mine.work_s)} vs {_ms(others.work_s)})")


def _ms(seconds: float) -> str:
    ms = 1000 * seconds
    return f"{ms:.1f} ms" if ms < 10 else f"{ms:,.0f} ms"
