"""Counts, numbers and times as a person reads them, in ddtrain's lines, the
daemon's, the ranks' and ddtop's alike (the headless printer, the dashboard's
panels): written once."""

from __future__ import annotations

import math
import time


def count_of(n: int, noun: str) -> str:
    """'1 rank', '2 ranks': a count as a sentence says it (nouns with a plain plural)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def num(value: float | None, spec: str = ".3f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def seconds(s: float | None) -> str:
    """1.2 s, 3m05s, 2h01m."""
    if s is None or not math.isfinite(s):
        return "-"
    if s < 60:
        return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"
    m, sec = divmod(int(s), 60)
    if m < 60:
        return f"{m}m{sec:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


def lost_words(fraction: float) -> str:
    """'messages lost 0.00%': the share of telemetry messages that never arrived,
    worded so that beside a training loss it does not read as one."""
    return f"messages lost {100 * fraction:.2f}%"


def stamp(t: float) -> str:
    """The date and time of a line of a log: '2026-11-26 14:03:07'."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def traceback_tail(text: str | None, lines: int = 8) -> list[str]:
    """The last `lines` lines of a traceback (none for None)."""
    return (text or "").rstrip().splitlines()[-lines:]


def rank_list(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2, 5'; [3] -> 'rank 3'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    parts, start, prev = [], ranks[0], ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(f"{start}-{prev}" if prev > start else str(start))
        if r is not None:
            start = prev = r
    return "ranks " + ", ".join(parts)


def size(nbytes: float | None) -> str:
    """'512.0 MB', '1.2 GB', '-' where not known (decimal units, as the table shows)."""
    if nbytes is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(nbytes) < 1000 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return "-"  # unreachable: GB ends the loop


NATIVE_MARK = "--- native stacks"  # how py-spy's block begins after a rank's Python dump
THREAD_HEADS = ("Thread 0x", "Current thread 0x")  # faulthandler's head of each thread


def main_thread_first(dump: str) -> str:
    """A faulthandler dump of every thread, its last thread put first: faulthandler
    lists the newest thread first, so the main one (the training loop's) comes last.
    What follows the dump (py-spy's native block) stays as it was."""
    head, mark, rest = dump.partition(NATIVE_MARK)
    lines = head.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.startswith(THREAD_HEADS)]
    if len(starts) < 2:
        return dump
    blocks = [lines[a:b] for a, b in zip(starts, [*starts[1:], len(lines)], strict=True)]
    last = blocks[-1]
    if last and not last[-1].endswith("\n"):
        last = [*last[:-1], last[-1] + "\n"]
    return "".join(lines[: starts[0]] + last + [line for b in blocks[:-1] for line in b]
                   ) + mark + rest
