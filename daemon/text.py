"""Words for numbers, as ddtrain, the daemon, the ranks and ddtop all say them."""

from __future__ import annotations


def count_of(n: int, noun: str) -> str:
    """'1 rank', '2 ranks': a count as a sentence says it (nouns with a plain plural)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
